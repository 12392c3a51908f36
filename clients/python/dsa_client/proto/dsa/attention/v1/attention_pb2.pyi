from dsa_client.proto.dsa.common.v1 import lease_pb2 as _lease_pb2
from dsa_client.proto.dsa.indexer.v1 import indexer_pb2 as _indexer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("num_model_layers", "num_full_layers", "lag_depth", "num_heads", "head_dim", "kv_capacity_slots", "kv_used_slots", "sequences", "instance_id", "model", "vocab_size", "eos_token_id", "max_context")
    NUM_MODEL_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_FULL_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAG_DEPTH_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_SLOTS_FIELD_NUMBER: _ClassVar[int]
    KV_USED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    num_model_layers: int
    num_full_layers: int
    lag_depth: int
    num_heads: int
    head_dim: int
    kv_capacity_slots: int
    kv_used_slots: int
    sequences: int
    instance_id: str
    model: str
    vocab_size: int
    eos_token_id: int
    max_context: int
    def __init__(self, num_model_layers: _Optional[int] = ..., num_full_layers: _Optional[int] = ..., lag_depth: _Optional[int] = ..., num_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., kv_capacity_slots: _Optional[int] = ..., kv_used_slots: _Optional[int] = ..., sequences: _Optional[int] = ..., instance_id: _Optional[str] = ..., model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., max_context: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class SequenceSettings(_message.Message):
    __slots__ = ("top_k", "spin")
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SPIN_FIELD_NUMBER: _ClassVar[int]
    top_k: int
    spin: _indexer_pb2.SpinSettings
    def __init__(self, top_k: _Optional[int] = ..., spin: _Optional[_Union[_indexer_pb2.SpinSettings, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("sequence_id", "context_length", "prefix_block_ids", "indexer_worker", "settings", "prefix_source_id", "prefix_slots", "continue_sequence", "tokens", "sampling", "lease")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    INDEXER_WORKER_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    context_length: int
    prefix_block_ids: _containers.RepeatedScalarFieldContainer[int]
    indexer_worker: str
    settings: SequenceSettings
    prefix_source_id: int
    prefix_slots: int
    continue_sequence: bool
    tokens: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    lease: _lease_pb2.Lease
    def __init__(self, sequence_id: _Optional[int] = ..., context_length: _Optional[int] = ..., prefix_block_ids: _Optional[_Iterable[int]] = ..., indexer_worker: _Optional[str] = ..., settings: _Optional[_Union[SequenceSettings, _Mapping]] = ..., prefix_source_id: _Optional[int] = ..., prefix_slots: _Optional[int] = ..., continue_sequence: _Optional[bool] = ..., tokens: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., lease: _Optional[_Union[_lease_pb2.Lease, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("slots", "slots_appended", "seconds", "next_token")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_APPENDED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    slots: int
    slots_appended: int
    seconds: float
    next_token: int
    def __init__(self, slots: _Optional[int] = ..., slots_appended: _Optional[int] = ..., seconds: _Optional[float] = ..., next_token: _Optional[int] = ...) -> None: ...

class SequenceStep(_message.Message):
    __slots__ = ("sequence_id", "rows", "tokens")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    rows: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sequence_id: _Optional[int] = ..., rows: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeStepRequest(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceStep]
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceStep, _Mapping]]] = ...) -> None: ...

class SequenceStepResult(_message.Message):
    __slots__ = ("sequence_id", "first_position", "blocks_scored", "blocks_visible", "audited_rows", "audit_miss_rate_sum", "sampled_tokens")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SCORED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_VISIBLE_FIELD_NUMBER: _ClassVar[int]
    AUDITED_ROWS_FIELD_NUMBER: _ClassVar[int]
    AUDIT_MISS_RATE_SUM_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    first_position: int
    blocks_scored: int
    blocks_visible: int
    audited_rows: int
    audit_miss_rate_sum: float
    sampled_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sequence_id: _Optional[int] = ..., first_position: _Optional[int] = ..., blocks_scored: _Optional[int] = ..., blocks_visible: _Optional[int] = ..., audited_rows: _Optional[int] = ..., audit_miss_rate_sum: _Optional[float] = ..., sampled_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeStepResponse(_message.Message):
    __slots__ = ("sequences", "selection_wait_seconds", "seconds")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SELECTION_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceStepResult]
    selection_wait_seconds: _containers.RepeatedScalarFieldContainer[float]
    seconds: float
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceStepResult, _Mapping]]] = ..., selection_wait_seconds: _Optional[_Iterable[float]] = ..., seconds: _Optional[float] = ...) -> None: ...

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

class ReleaseRequest(_message.Message):
    __slots__ = ("sequence_id", "keep_indexer_sequence")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_INDEXER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    keep_indexer_sequence: bool
    def __init__(self, sequence_id: _Optional[int] = ..., keep_indexer_sequence: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

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
