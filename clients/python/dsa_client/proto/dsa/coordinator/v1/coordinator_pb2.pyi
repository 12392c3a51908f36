from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP_TOKEN: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "context_length", "context_tokens", "prefix_block_ids", "max_new_tokens", "draft_length", "overrides", "session_id", "sampling", "stop_token_ids", "ignore_eos")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    context_length: int
    context_tokens: ContextTokens
    prefix_block_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    draft_length: int
    overrides: Overrides
    session_id: str
    sampling: SamplingParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, request_id: _Optional[str] = ..., context_length: _Optional[int] = ..., context_tokens: _Optional[_Union[ContextTokens, _Mapping]] = ..., prefix_block_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., draft_length: _Optional[int] = ..., overrides: _Optional[_Union[Overrides, _Mapping]] = ..., session_id: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class ContextTokens(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class Overrides(_message.Message):
    __slots__ = ("target_block_sparsity", "exploration_fraction", "top_k", "all_keep", "acceptance_rate", "miss_target")
    TARGET_BLOCK_SPARSITY_FIELD_NUMBER: _ClassVar[int]
    EXPLORATION_FRACTION_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    ALL_KEEP_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MISS_TARGET_FIELD_NUMBER: _ClassVar[int]
    target_block_sparsity: float
    exploration_fraction: float
    top_k: int
    all_keep: bool
    acceptance_rate: float
    miss_target: float
    def __init__(self, target_block_sparsity: _Optional[float] = ..., exploration_fraction: _Optional[float] = ..., top_k: _Optional[int] = ..., all_keep: _Optional[bool] = ..., acceptance_rate: _Optional[float] = ..., miss_target: _Optional[float] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("admitted", "tokens", "finished")
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    admitted: Admitted
    tokens: Tokens
    finished: Finished
    def __init__(self, admitted: _Optional[_Union[Admitted, _Mapping]] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ...) -> None: ...

class Admitted(_message.Message):
    __slots__ = ("queue_seconds", "indexer_worker", "attention_worker", "prefix_slots_reused", "prefill_seconds")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INDEXER_WORKER_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_WORKER_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SLOTS_REUSED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    indexer_worker: str
    attention_worker: str
    prefix_slots_reused: int
    prefill_seconds: float
    def __init__(self, queue_seconds: _Optional[float] = ..., indexer_worker: _Optional[str] = ..., attention_worker: _Optional[str] = ..., prefix_slots_reused: _Optional[int] = ..., prefill_seconds: _Optional[float] = ...) -> None: ...

class Tokens(_message.Message):
    __slots__ = ("first_position", "count", "drafted", "accepted", "step_seconds", "blocks_scored", "blocks_visible", "audited_rows", "audit_miss_rate_sum", "selection_wait_seconds", "token_ids")
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SCORED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_VISIBLE_FIELD_NUMBER: _ClassVar[int]
    AUDITED_ROWS_FIELD_NUMBER: _ClassVar[int]
    AUDIT_MISS_RATE_SUM_FIELD_NUMBER: _ClassVar[int]
    SELECTION_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    first_position: int
    count: int
    drafted: int
    accepted: int
    step_seconds: float
    blocks_scored: int
    blocks_visible: int
    audited_rows: int
    audit_miss_rate_sum: float
    selection_wait_seconds: _containers.RepeatedScalarFieldContainer[float]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, first_position: _Optional[int] = ..., count: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., step_seconds: _Optional[float] = ..., blocks_scored: _Optional[int] = ..., blocks_visible: _Optional[int] = ..., audited_rows: _Optional[int] = ..., audit_miss_rate_sum: _Optional[float] = ..., selection_wait_seconds: _Optional[_Iterable[float]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("generated_tokens", "time_to_first_token_seconds", "mean_inter_token_latency_seconds", "migrations", "finish_reason", "stop_token_id")
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_INTER_TOKEN_LATENCY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    generated_tokens: int
    time_to_first_token_seconds: float
    mean_inter_token_latency_seconds: float
    migrations: int
    finish_reason: FinishReason
    stop_token_id: int
    def __init__(self, generated_tokens: _Optional[int] = ..., time_to_first_token_seconds: _Optional[float] = ..., mean_inter_token_latency_seconds: _Optional[float] = ..., migrations: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("address", "cache_blocks_used", "cache_blocks_capacity", "sequences", "ready", "reachable", "unreached_for_ms")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    CACHE_BLOCKS_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    UNREACHED_FOR_MS_FIELD_NUMBER: _ClassVar[int]
    address: str
    cache_blocks_used: int
    cache_blocks_capacity: int
    sequences: int
    ready: bool
    reachable: bool
    unreached_for_ms: int
    def __init__(self, address: _Optional[str] = ..., cache_blocks_used: _Optional[int] = ..., cache_blocks_capacity: _Optional[int] = ..., sequences: _Optional[int] = ..., ready: _Optional[bool] = ..., reachable: _Optional[bool] = ..., unreached_for_ms: _Optional[int] = ...) -> None: ...

class AttentionWorkerLoad(_message.Message):
    __slots__ = ("address", "ready", "decoding", "reachable", "unreached_for_ms")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    DECODING_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    UNREACHED_FOR_MS_FIELD_NUMBER: _ClassVar[int]
    address: str
    ready: bool
    decoding: int
    reachable: bool
    unreached_for_ms: int
    def __init__(self, address: _Optional[str] = ..., ready: _Optional[bool] = ..., decoding: _Optional[int] = ..., reachable: _Optional[bool] = ..., unreached_for_ms: _Optional[int] = ...) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("queued", "running", "cache_blocks_used", "cache_blocks_capacity", "retained_sequences", "indexer_workers", "attention_workers", "model")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    CACHE_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    CACHE_BLOCKS_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    RETAINED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    INDEXER_WORKERS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    queued: int
    running: int
    cache_blocks_used: int
    cache_blocks_capacity: int
    retained_sequences: int
    indexer_workers: _containers.RepeatedCompositeFieldContainer[WorkerLoad]
    attention_workers: _containers.RepeatedCompositeFieldContainer[AttentionWorkerLoad]
    model: Model
    def __init__(self, queued: _Optional[int] = ..., running: _Optional[int] = ..., cache_blocks_used: _Optional[int] = ..., cache_blocks_capacity: _Optional[int] = ..., retained_sequences: _Optional[int] = ..., indexer_workers: _Optional[_Iterable[_Union[WorkerLoad, _Mapping]]] = ..., attention_workers: _Optional[_Iterable[_Union[AttentionWorkerLoad, _Mapping]]] = ..., model: _Optional[_Union[Model, _Mapping]] = ...) -> None: ...

class Model(_message.Message):
    __slots__ = ("name", "vocab_size", "eos_token_id", "max_context")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    name: str
    vocab_size: int
    eos_token_id: int
    max_context: int
    def __init__(self, name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., max_context: _Optional[int] = ...) -> None: ...
