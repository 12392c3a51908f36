from dsa_client.proto.dsa.common.v1 import lease_pb2 as _lease_pb2
from dsa_client.proto.dsa.common.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockPooling(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_POOLING_UNSPECIFIED: _ClassVar[BlockPooling]
    BLOCK_POOLING_MAX: _ClassVar[BlockPooling]
    BLOCK_POOLING_TOP4_MEAN: _ClassVar[BlockPooling]
    BLOCK_POOLING_MEAN: _ClassVar[BlockPooling]

class BlockReduction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_REDUCTION_UNSPECIFIED: _ClassVar[BlockReduction]
    BLOCK_REDUCTION_A1: _ClassVar[BlockReduction]
    BLOCK_REDUCTION_A0: _ClassVar[BlockReduction]
    BLOCK_REDUCTION_A2: _ClassVar[BlockReduction]

class ExplorationPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXPLORATION_POLICY_UNSPECIFIED: _ClassVar[ExplorationPolicy]
    EXPLORATION_POLICY_RANDOM: _ClassVar[ExplorationPolicy]
    EXPLORATION_POLICY_STALENESS_SCORE: _ClassVar[ExplorationPolicy]
    EXPLORATION_POLICY_BLOCK_AGE: _ClassVar[ExplorationPolicy]

class SpecMaskPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPEC_MASK_POLICY_UNSPECIFIED: _ClassVar[SpecMaskPolicy]
    SPEC_MASK_POLICY_ROW_LOCAL_UNION: _ClassVar[SpecMaskPolicy]
    SPEC_MASK_POLICY_ROW0_SHARING: _ClassVar[SpecMaskPolicy]

class SpecUpdatePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPEC_UPDATE_POLICY_UNSPECIFIED: _ClassVar[SpecUpdatePolicy]
    SPEC_UPDATE_POLICY_PREFIX_VALID: _ClassVar[SpecUpdatePolicy]
    SPEC_UPDATE_POLICY_ROW0: _ClassVar[SpecUpdatePolicy]
BLOCK_POOLING_UNSPECIFIED: BlockPooling
BLOCK_POOLING_MAX: BlockPooling
BLOCK_POOLING_TOP4_MEAN: BlockPooling
BLOCK_POOLING_MEAN: BlockPooling
BLOCK_REDUCTION_UNSPECIFIED: BlockReduction
BLOCK_REDUCTION_A1: BlockReduction
BLOCK_REDUCTION_A0: BlockReduction
BLOCK_REDUCTION_A2: BlockReduction
EXPLORATION_POLICY_UNSPECIFIED: ExplorationPolicy
EXPLORATION_POLICY_RANDOM: ExplorationPolicy
EXPLORATION_POLICY_STALENESS_SCORE: ExplorationPolicy
EXPLORATION_POLICY_BLOCK_AGE: ExplorationPolicy
SPEC_MASK_POLICY_UNSPECIFIED: SpecMaskPolicy
SPEC_MASK_POLICY_ROW_LOCAL_UNION: SpecMaskPolicy
SPEC_MASK_POLICY_ROW0_SHARING: SpecMaskPolicy
SPEC_UPDATE_POLICY_UNSPECIFIED: SpecUpdatePolicy
SPEC_UPDATE_POLICY_PREFIX_VALID: SpecUpdatePolicy
SPEC_UPDATE_POLICY_ROW0: SpecUpdatePolicy

class SpinSettings(_message.Message):
    __slots__ = ("all_keep", "target_block_sparsity", "ema_decay", "exploration_fraction", "pooling", "reduction", "exploration", "spec_mask", "spec_update", "seed", "miss_target")
    ALL_KEEP_FIELD_NUMBER: _ClassVar[int]
    TARGET_BLOCK_SPARSITY_FIELD_NUMBER: _ClassVar[int]
    EMA_DECAY_FIELD_NUMBER: _ClassVar[int]
    EXPLORATION_FRACTION_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    REDUCTION_FIELD_NUMBER: _ClassVar[int]
    EXPLORATION_FIELD_NUMBER: _ClassVar[int]
    SPEC_MASK_FIELD_NUMBER: _ClassVar[int]
    SPEC_UPDATE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MISS_TARGET_FIELD_NUMBER: _ClassVar[int]
    all_keep: bool
    target_block_sparsity: float
    ema_decay: float
    exploration_fraction: float
    pooling: BlockPooling
    reduction: BlockReduction
    exploration: ExplorationPolicy
    spec_mask: SpecMaskPolicy
    spec_update: SpecUpdatePolicy
    seed: int
    miss_target: float
    def __init__(self, all_keep: _Optional[bool] = ..., target_block_sparsity: _Optional[float] = ..., ema_decay: _Optional[float] = ..., exploration_fraction: _Optional[float] = ..., pooling: _Optional[_Union[BlockPooling, str]] = ..., reduction: _Optional[_Union[BlockReduction, str]] = ..., exploration: _Optional[_Union[ExplorationPolicy, str]] = ..., spec_mask: _Optional[_Union[SpecMaskPolicy, str]] = ..., spec_update: _Optional[_Union[SpecUpdatePolicy, str]] = ..., seed: _Optional[int] = ..., miss_target: _Optional[float] = ...) -> None: ...

class CreateSequenceRequest(_message.Message):
    __slots__ = ("sequence_id", "num_layers", "top_k", "spin", "prefix_source_id", "prefix_slots", "lease")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SPIN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    num_layers: int
    top_k: int
    spin: SpinSettings
    prefix_source_id: int
    prefix_slots: int
    lease: _lease_pb2.Lease
    def __init__(self, sequence_id: _Optional[int] = ..., num_layers: _Optional[int] = ..., top_k: _Optional[int] = ..., spin: _Optional[_Union[SpinSettings, _Mapping]] = ..., prefix_source_id: _Optional[int] = ..., prefix_slots: _Optional[int] = ..., lease: _Optional[_Union[_lease_pb2.Lease, _Mapping]] = ...) -> None: ...

class CreateSequenceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AppendIndexKeysRequest(_message.Message):
    __slots__ = ("sequence_id", "layer", "first_slot", "keys")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_SLOT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    layer: int
    first_slot: int
    keys: _tensor_pb2.Tensor
    def __init__(self, sequence_id: _Optional[int] = ..., layer: _Optional[int] = ..., first_slot: _Optional[int] = ..., keys: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class AppendIndexKeysResponse(_message.Message):
    __slots__ = ("keys_appended",)
    KEYS_APPENDED_FIELD_NUMBER: _ClassVar[int]
    keys_appended: int
    def __init__(self, keys_appended: _Optional[int] = ...) -> None: ...

class RowGroup(_message.Message):
    __slots__ = ("sequence_id", "layer", "first_position", "queries", "head_weights", "new_index_keys")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    HEAD_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    NEW_INDEX_KEYS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    layer: int
    first_position: int
    queries: _tensor_pb2.Tensor
    head_weights: _tensor_pb2.Tensor
    new_index_keys: _tensor_pb2.Tensor
    def __init__(self, sequence_id: _Optional[int] = ..., layer: _Optional[int] = ..., first_position: _Optional[int] = ..., queries: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., head_weights: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., new_index_keys: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class SelectRequest(_message.Message):
    __slots__ = ("groups", "request_id")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[RowGroup]
    request_id: int
    def __init__(self, groups: _Optional[_Iterable[_Union[RowGroup, _Mapping]]] = ..., request_id: _Optional[int] = ...) -> None: ...

class GroupSelection(_message.Message):
    __slots__ = ("selections", "blocks_scored", "blocks_visible", "all_blocks", "audit_miss_rates")
    SELECTIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SCORED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_VISIBLE_FIELD_NUMBER: _ClassVar[int]
    ALL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    AUDIT_MISS_RATES_FIELD_NUMBER: _ClassVar[int]
    selections: _tensor_pb2.Tensor
    blocks_scored: int
    blocks_visible: int
    all_blocks: bool
    audit_miss_rates: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, selections: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., blocks_scored: _Optional[int] = ..., blocks_visible: _Optional[int] = ..., all_blocks: _Optional[bool] = ..., audit_miss_rates: _Optional[_Iterable[float]] = ...) -> None: ...

class SelectError(_message.Message):
    __slots__ = ("code", "message", "groups_applied")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    groups_applied: int
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., groups_applied: _Optional[int] = ...) -> None: ...

class SelectResponse(_message.Message):
    __slots__ = ("request_id", "selections", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SELECTIONS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    selections: _containers.RepeatedCompositeFieldContainer[GroupSelection]
    error: SelectError
    def __init__(self, request_id: _Optional[int] = ..., selections: _Optional[_Iterable[_Union[GroupSelection, _Mapping]]] = ..., error: _Optional[_Union[SelectError, _Mapping]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("sequence_id", "accepted")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    accepted: int
    def __init__(self, sequence_id: _Optional[int] = ..., accepted: _Optional[int] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BeginTurnRequest(_message.Message):
    __slots__ = ("sequence_id",)
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    def __init__(self, sequence_id: _Optional[int] = ...) -> None: ...

class BeginTurnResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("sequence_id",)
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    def __init__(self, sequence_id: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("capacity_blocks", "used_blocks", "shared_blocks", "free_blocks", "sequences", "num_heads", "head_dim", "instance_id")
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    capacity_blocks: int
    used_blocks: int
    shared_blocks: int
    free_blocks: int
    sequences: int
    num_heads: int
    head_dim: int
    instance_id: str
    def __init__(self, capacity_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., shared_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., sequences: _Optional[int] = ..., num_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class OpenDataPlaneRequest(_message.Message):
    __slots__ = ("nccl_unique_id", "num_ranks", "indexer_rank", "attention_cuda_device", "num_heads", "head_dim", "max_top_k", "max_message_bytes", "attention_worker")
    NCCL_UNIQUE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    INDEXER_RANK_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_CUDA_DEVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_WORKER_FIELD_NUMBER: _ClassVar[int]
    nccl_unique_id: bytes
    num_ranks: int
    indexer_rank: int
    attention_cuda_device: int
    num_heads: int
    head_dim: int
    max_top_k: int
    max_message_bytes: int
    attention_worker: str
    def __init__(self, nccl_unique_id: _Optional[bytes] = ..., num_ranks: _Optional[int] = ..., indexer_rank: _Optional[int] = ..., attention_cuda_device: _Optional[int] = ..., num_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., max_top_k: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., attention_worker: _Optional[str] = ...) -> None: ...

class OpenDataPlaneResponse(_message.Message):
    __slots__ = ("indexer_cuda_device", "max_message_bytes", "data_plane_id")
    INDEXER_CUDA_DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_ID_FIELD_NUMBER: _ClassVar[int]
    indexer_cuda_device: int
    max_message_bytes: int
    data_plane_id: int
    def __init__(self, indexer_cuda_device: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., data_plane_id: _Optional[int] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: _lease_pb2.Lease
    def __init__(self, lease: _Optional[_Union[_lease_pb2.Lease, _Mapping]] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: _lease_pb2.LeaseState
    def __init__(self, state: _Optional[_Union[_lease_pb2.LeaseState, _Mapping]] = ...) -> None: ...
