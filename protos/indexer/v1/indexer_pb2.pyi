from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WarmupState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WARMUP_STATE_UNSPECIFIED: _ClassVar[WarmupState]
    WARMUP_STATE_RUNNING: _ClassVar[WarmupState]
    WARMUP_STATE_READY: _ClassVar[WarmupState]
    WARMUP_STATE_FAILED: _ClassVar[WarmupState]
    WARMUP_STATE_SKIPPED: _ClassVar[WarmupState]

class KeyState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KEY_STATE_UNSPECIFIED: _ClassVar[KeyState]
    KEY_STATE_PENDING: _ClassVar[KeyState]
    KEY_STATE_COMPILED: _ClassVar[KeyState]
    KEY_STATE_FAILED: _ClassVar[KeyState]
    KEY_STATE_SKIPPED: _ClassVar[KeyState]
    KEY_STATE_CACHED: _ClassVar[KeyState]
WARMUP_STATE_UNSPECIFIED: WarmupState
WARMUP_STATE_RUNNING: WarmupState
WARMUP_STATE_READY: WarmupState
WARMUP_STATE_FAILED: WarmupState
WARMUP_STATE_SKIPPED: WarmupState
KEY_STATE_UNSPECIFIED: KeyState
KEY_STATE_PENDING: KeyState
KEY_STATE_COMPILED: KeyState
KEY_STATE_FAILED: KeyState
KEY_STATE_SKIPPED: KeyState
KEY_STATE_CACHED: KeyState

class QuerySlice(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class BuildChunkRequest(_message.Message):
    __slots__ = ("query_start_loc", "seq_lens", "compress_ratio", "req_start", "req_end", "query_slice", "skip_kv_gather", "dcp_rank", "dcp_world_size", "dcp_interleave", "omit_token_to_seq")
    QUERY_START_LOC_FIELD_NUMBER: _ClassVar[int]
    SEQ_LENS_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_RATIO_FIELD_NUMBER: _ClassVar[int]
    REQ_START_FIELD_NUMBER: _ClassVar[int]
    REQ_END_FIELD_NUMBER: _ClassVar[int]
    QUERY_SLICE_FIELD_NUMBER: _ClassVar[int]
    SKIP_KV_GATHER_FIELD_NUMBER: _ClassVar[int]
    DCP_RANK_FIELD_NUMBER: _ClassVar[int]
    DCP_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DCP_INTERLEAVE_FIELD_NUMBER: _ClassVar[int]
    OMIT_TOKEN_TO_SEQ_FIELD_NUMBER: _ClassVar[int]
    query_start_loc: bytes
    seq_lens: bytes
    compress_ratio: int
    req_start: int
    req_end: int
    query_slice: QuerySlice
    skip_kv_gather: bool
    dcp_rank: int
    dcp_world_size: int
    dcp_interleave: int
    omit_token_to_seq: bool
    def __init__(self, query_start_loc: _Optional[bytes] = ..., seq_lens: _Optional[bytes] = ..., compress_ratio: _Optional[int] = ..., req_start: _Optional[int] = ..., req_end: _Optional[int] = ..., query_slice: _Optional[_Union[QuerySlice, _Mapping]] = ..., skip_kv_gather: _Optional[bool] = ..., dcp_rank: _Optional[int] = ..., dcp_world_size: _Optional[int] = ..., dcp_interleave: _Optional[int] = ..., omit_token_to_seq: _Optional[bool] = ...) -> None: ...

class ChunkMetadata(_message.Message):
    __slots__ = ("cu_seq_lens", "token_to_seq", "cu_seqlen_ks", "cu_seqlen_ke", "total_seq_lens", "token_start", "token_end", "num_reqs", "skip_kv_gather", "local_cu_seq_lens", "local_total_seq_lens", "max_local_total_seq_lens", "req_start", "req_end", "query_slice", "token_to_seq_omitted")
    CU_SEQ_LENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TO_SEQ_FIELD_NUMBER: _ClassVar[int]
    CU_SEQLEN_KS_FIELD_NUMBER: _ClassVar[int]
    CU_SEQLEN_KE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SEQ_LENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    NUM_REQS_FIELD_NUMBER: _ClassVar[int]
    SKIP_KV_GATHER_FIELD_NUMBER: _ClassVar[int]
    LOCAL_CU_SEQ_LENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_TOTAL_SEQ_LENS_FIELD_NUMBER: _ClassVar[int]
    MAX_LOCAL_TOTAL_SEQ_LENS_FIELD_NUMBER: _ClassVar[int]
    REQ_START_FIELD_NUMBER: _ClassVar[int]
    REQ_END_FIELD_NUMBER: _ClassVar[int]
    QUERY_SLICE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TO_SEQ_OMITTED_FIELD_NUMBER: _ClassVar[int]
    cu_seq_lens: bytes
    token_to_seq: bytes
    cu_seqlen_ks: bytes
    cu_seqlen_ke: bytes
    total_seq_lens: int
    token_start: int
    token_end: int
    num_reqs: int
    skip_kv_gather: bool
    local_cu_seq_lens: bytes
    local_total_seq_lens: int
    max_local_total_seq_lens: int
    req_start: int
    req_end: int
    query_slice: QuerySlice
    token_to_seq_omitted: bool
    def __init__(self, cu_seq_lens: _Optional[bytes] = ..., token_to_seq: _Optional[bytes] = ..., cu_seqlen_ks: _Optional[bytes] = ..., cu_seqlen_ke: _Optional[bytes] = ..., total_seq_lens: _Optional[int] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., num_reqs: _Optional[int] = ..., skip_kv_gather: _Optional[bool] = ..., local_cu_seq_lens: _Optional[bytes] = ..., local_total_seq_lens: _Optional[int] = ..., max_local_total_seq_lens: _Optional[int] = ..., req_start: _Optional[int] = ..., req_end: _Optional[int] = ..., query_slice: _Optional[_Union[QuerySlice, _Mapping]] = ..., token_to_seq_omitted: _Optional[bool] = ...) -> None: ...

class BuildChunkResponse(_message.Message):
    __slots__ = ("metadata",)
    METADATA_FIELD_NUMBER: _ClassVar[int]
    metadata: ChunkMetadata
    def __init__(self, metadata: _Optional[_Union[ChunkMetadata, _Mapping]] = ...) -> None: ...

class PlanBatchRequest(_message.Message):
    __slots__ = ("query_start_loc", "seq_lens", "compress_ratio", "num_decodes", "max_model_len", "max_logits_bytes", "dcp_rank", "dcp_world_size", "dcp_interleave", "omit_token_to_seq")
    QUERY_START_LOC_FIELD_NUMBER: _ClassVar[int]
    SEQ_LENS_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_RATIO_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODES_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGITS_BYTES_FIELD_NUMBER: _ClassVar[int]
    DCP_RANK_FIELD_NUMBER: _ClassVar[int]
    DCP_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DCP_INTERLEAVE_FIELD_NUMBER: _ClassVar[int]
    OMIT_TOKEN_TO_SEQ_FIELD_NUMBER: _ClassVar[int]
    query_start_loc: bytes
    seq_lens: bytes
    compress_ratio: int
    num_decodes: int
    max_model_len: int
    max_logits_bytes: int
    dcp_rank: int
    dcp_world_size: int
    dcp_interleave: int
    omit_token_to_seq: bool
    def __init__(self, query_start_loc: _Optional[bytes] = ..., seq_lens: _Optional[bytes] = ..., compress_ratio: _Optional[int] = ..., num_decodes: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_logits_bytes: _Optional[int] = ..., dcp_rank: _Optional[int] = ..., dcp_world_size: _Optional[int] = ..., dcp_interleave: _Optional[int] = ..., omit_token_to_seq: _Optional[bool] = ...) -> None: ...

class ChunkSpec(_message.Message):
    __slots__ = ("req_start", "req_end", "query_start", "query_stop")
    REQ_START_FIELD_NUMBER: _ClassVar[int]
    REQ_END_FIELD_NUMBER: _ClassVar[int]
    QUERY_START_FIELD_NUMBER: _ClassVar[int]
    QUERY_STOP_FIELD_NUMBER: _ClassVar[int]
    req_start: int
    req_end: int
    query_start: int
    query_stop: int
    def __init__(self, req_start: _Optional[int] = ..., req_end: _Optional[int] = ..., query_start: _Optional[int] = ..., query_stop: _Optional[int] = ...) -> None: ...

class PlanBatchResponse(_message.Message):
    __slots__ = ("chunks", "metadata", "max_prefill_seq_len")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    MAX_PREFILL_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkSpec]
    metadata: _containers.RepeatedCompositeFieldContainer[ChunkMetadata]
    max_prefill_seq_len: int
    def __init__(self, chunks: _Optional[_Iterable[_Union[ChunkSpec, _Mapping]]] = ..., metadata: _Optional[_Iterable[_Union[ChunkMetadata, _Mapping]]] = ..., max_prefill_seq_len: _Optional[int] = ...) -> None: ...

class GetWarmupStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KeyStatus(_message.Message):
    __slots__ = ("label", "key_json", "state", "compile_seconds", "error")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    KEY_JSON_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    COMPILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    label: str
    key_json: str
    state: KeyState
    compile_seconds: float
    error: str
    def __init__(self, label: _Optional[str] = ..., key_json: _Optional[str] = ..., state: _Optional[_Union[KeyState, str]] = ..., compile_seconds: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class GetWarmupStatusResponse(_message.Message):
    __slots__ = ("state", "backend", "target", "strict", "keys", "warmup_seconds", "compiles_after_ready", "ready", "auto_crossover_elements", "server_version", "dependency_fallbacks")
    STATE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPILES_AFTER_READY_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    AUTO_CROSSOVER_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEPENDENCY_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    state: WarmupState
    backend: str
    target: str
    strict: bool
    keys: _containers.RepeatedCompositeFieldContainer[KeyStatus]
    warmup_seconds: float
    compiles_after_ready: int
    ready: bool
    auto_crossover_elements: int
    server_version: str
    dependency_fallbacks: _containers.RepeatedCompositeFieldContainer[DependencyFallback]
    def __init__(self, state: _Optional[_Union[WarmupState, str]] = ..., backend: _Optional[str] = ..., target: _Optional[str] = ..., strict: _Optional[bool] = ..., keys: _Optional[_Iterable[_Union[KeyStatus, _Mapping]]] = ..., warmup_seconds: _Optional[float] = ..., compiles_after_ready: _Optional[int] = ..., ready: _Optional[bool] = ..., auto_crossover_elements: _Optional[int] = ..., server_version: _Optional[str] = ..., dependency_fallbacks: _Optional[_Iterable[_Union[DependencyFallback, _Mapping]]] = ...) -> None: ...

class DependencyFallback(_message.Message):
    __slots__ = ("library", "feature", "detail")
    LIBRARY_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    library: str
    feature: str
    detail: str
    def __init__(self, library: _Optional[str] = ..., feature: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...
