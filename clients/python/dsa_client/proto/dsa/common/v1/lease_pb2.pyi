from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Lease(_message.Message):
    __slots__ = ("owner", "instance_id", "ttl_ms")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    owner: str
    instance_id: str
    ttl_ms: int
    def __init__(self, owner: _Optional[str] = ..., instance_id: _Optional[str] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class LeaseState(_message.Message):
    __slots__ = ("renewed", "sequences", "superseded_released")
    RENEWED_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDED_RELEASED_FIELD_NUMBER: _ClassVar[int]
    renewed: bool
    sequences: int
    superseded_released: int
    def __init__(self, renewed: _Optional[bool] = ..., sequences: _Optional[int] = ..., superseded_released: _Optional[int] = ...) -> None: ...
