from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_MISS: _ClassVar[Tier]
    TIER_DEVICE: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]
TIER_MISS: Tier
TIER_DEVICE: Tier
TIER_HOST: Tier
TIER_DISK: Tier
TIER_REMOTE: Tier

class EntryInfo(_message.Message):
    __slots__ = ("key", "tier", "size", "recompute_cost_s", "token_count", "model_fingerprint", "checksum", "pinned")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_COST_S_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    key: str
    tier: Tier
    size: int
    recompute_cost_s: float
    token_count: int
    model_fingerprint: str
    checksum: bytes
    pinned: bool
    def __init__(self, key: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., size: _Optional[int] = ..., recompute_cost_s: _Optional[float] = ..., token_count: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., checksum: _Optional[bytes] = ..., pinned: _Optional[bool] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[EntryInfo]
    def __init__(self, entries: _Optional[_Iterable[_Union[EntryInfo, _Mapping]]] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("key", "size", "recompute_cost_s", "token_count", "model_fingerprint", "pin", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_COST_S_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: str
    size: int
    recompute_cost_s: float
    token_count: int
    model_fingerprint: str
    pin: bool
    checksum: bytes
    def __init__(self, key: _Optional[str] = ..., size: _Optional[int] = ..., recompute_cost_s: _Optional[float] = ..., token_count: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., pin: _Optional[bool] = ..., checksum: _Optional[bytes] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("entry", "created")
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    entry: EntryInfo
    created: bool
    def __init__(self, entry: _Optional[_Union[EntryInfo, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class ReaderPlace(_message.Message):
    __slots__ = ("box_id", "gpu_uuid", "device_index", "cuda_ipc", "requires_sealed")
    BOX_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_SEALED_FIELD_NUMBER: _ClassVar[int]
    box_id: str
    gpu_uuid: str
    device_index: int
    cuda_ipc: bool
    requires_sealed: bool
    def __init__(self, box_id: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., device_index: _Optional[int] = ..., cuda_ipc: _Optional[bool] = ..., requires_sealed: _Optional[bool] = ...) -> None: ...

class IpcHandle(_message.Message):
    __slots__ = ("device", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "tensor_offset", "nbytes")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offset: int
    nbytes: int
    def __init__(self, device: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., tensor_offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class DeviceLease(_message.Message):
    __slots__ = ("lease_id", "ipc", "ttl_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    IPC_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ipc: IpcHandle
    ttl_s: float
    def __init__(self, lease_id: _Optional[str] = ..., ipc: _Optional[_Union[IpcHandle, _Mapping]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("key", "chunk_bytes", "reader")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    READER_FIELD_NUMBER: _ClassVar[int]
    key: str
    chunk_bytes: int
    reader: ReaderPlace
    def __init__(self, key: _Optional[str] = ..., chunk_bytes: _Optional[int] = ..., reader: _Optional[_Union[ReaderPlace, _Mapping]] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("entry", "data", "device")
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    entry: EntryInfo
    data: bytes
    device: DeviceLease
    def __init__(self, entry: _Optional[_Union[EntryInfo, _Mapping]] = ..., data: _Optional[bytes] = ..., device: _Optional[_Union[DeviceLease, _Mapping]] = ...) -> None: ...

class ReleaseDeviceLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseDeviceLeaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("keys", "pinned")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    pinned: bool
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., pinned: _Optional[bool] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("updated", "missing")
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    updated: int
    missing: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, updated: _Optional[int] = ..., missing: _Optional[_Iterable[str]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "enabled", "budget_bytes", "bytes", "peak_bytes", "entries", "hits", "misses", "evictions", "promotions", "formats")
    TIER_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    FORMATS_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    enabled: bool
    budget_bytes: int
    bytes: int
    peak_bytes: int
    entries: int
    hits: int
    misses: int
    evictions: int
    promotions: int
    formats: _containers.RepeatedCompositeFieldContainer[FormatStats]
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., enabled: _Optional[bool] = ..., budget_bytes: _Optional[int] = ..., bytes: _Optional[int] = ..., peak_bytes: _Optional[int] = ..., entries: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., promotions: _Optional[int] = ..., formats: _Optional[_Iterable[_Union[FormatStats, _Mapping]]] = ...) -> None: ...

class FormatStats(_message.Message):
    __slots__ = ("format", "bytes", "entries")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    format: str
    bytes: int
    entries: int
    def __init__(self, format: _Optional[str] = ..., bytes: _Optional[int] = ..., entries: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "entries", "pinned", "corrupt_dropped", "policy", "nixl_available", "nixl_reason", "leases_active")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_DROPPED_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    NIXL_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    NIXL_REASON_FIELD_NUMBER: _ClassVar[int]
    LEASES_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    entries: int
    pinned: int
    corrupt_dropped: int
    policy: str
    nixl_available: bool
    nixl_reason: str
    leases_active: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., entries: _Optional[int] = ..., pinned: _Optional[int] = ..., corrupt_dropped: _Optional[int] = ..., policy: _Optional[str] = ..., nixl_available: _Optional[bool] = ..., nixl_reason: _Optional[str] = ..., leases_active: _Optional[int] = ...) -> None: ...

class NixlInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NixlInfoResponse(_message.Message):
    __slots__ = ("available", "reason", "agent_name", "agent_metadata", "backend")
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    available: bool
    reason: str
    agent_name: str
    agent_metadata: bytes
    backend: str
    def __init__(self, available: _Optional[bool] = ..., reason: _Optional[str] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., backend: _Optional[str] = ...) -> None: ...

class OpenNixlLeaseRequest(_message.Message):
    __slots__ = ("key", "reader_agent_name")
    KEY_FIELD_NUMBER: _ClassVar[int]
    READER_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    key: str
    reader_agent_name: str
    def __init__(self, key: _Optional[str] = ..., reader_agent_name: _Optional[str] = ...) -> None: ...

class NixlDescriptor(_message.Message):
    __slots__ = ("addr", "length", "device_id")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    addr: int
    length: int
    device_id: int
    def __init__(self, addr: _Optional[int] = ..., length: _Optional[int] = ..., device_id: _Optional[int] = ...) -> None: ...

class OpenNixlLeaseResponse(_message.Message):
    __slots__ = ("lease_id", "entry", "agent_name", "mem_type", "descriptors", "ttl_s", "region_metadata")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    REGION_METADATA_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    entry: EntryInfo
    agent_name: str
    mem_type: str
    descriptors: _containers.RepeatedCompositeFieldContainer[NixlDescriptor]
    ttl_s: float
    region_metadata: bytes
    def __init__(self, lease_id: _Optional[str] = ..., entry: _Optional[_Union[EntryInfo, _Mapping]] = ..., agent_name: _Optional[str] = ..., mem_type: _Optional[str] = ..., descriptors: _Optional[_Iterable[_Union[NixlDescriptor, _Mapping]]] = ..., ttl_s: _Optional[float] = ..., region_metadata: _Optional[bytes] = ...) -> None: ...

class ReleaseNixlLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseNixlLeaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("keys", "holder", "lease_s")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    holder: str
    lease_s: float
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., holder: _Optional[str] = ..., lease_s: _Optional[float] = ...) -> None: ...

class ClaimResult(_message.Message):
    __slots__ = ("key", "granted", "cached", "holder", "expires_in_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    key: str
    granted: bool
    cached: bool
    holder: str
    expires_in_s: float
    def __init__(self, key: _Optional[str] = ..., granted: _Optional[bool] = ..., cached: _Optional[bool] = ..., holder: _Optional[str] = ..., expires_in_s: _Optional[float] = ...) -> None: ...

class ClaimResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ClaimResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ClaimResult, _Mapping]]] = ...) -> None: ...
