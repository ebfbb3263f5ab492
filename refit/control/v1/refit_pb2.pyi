from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_TRAINER: _ClassVar[Role]
    ROLE_ENGINE: _ClassVar[Role]

class Placement(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLACEMENT_UNSPECIFIED: _ClassVar[Placement]
    PLACEMENT_COLOCATED: _ClassVar[Placement]
    PLACEMENT_DISAGGREGATED: _ClassVar[Placement]

class RefitStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REFIT_STATUS_UNSPECIFIED: _ClassVar[RefitStatus]
    REFIT_STATUS_OK: _ClassVar[RefitStatus]
    REFIT_STATUS_FAILED: _ClassVar[RefitStatus]

class WorkerOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_OUTCOME_UNSPECIFIED: _ClassVar[WorkerOutcome]
    WORKER_OUTCOME_OK: _ClassVar[WorkerOutcome]
    WORKER_OUTCOME_ERROR: _ClassVar[WorkerOutcome]
    WORKER_OUTCOME_DISCONNECTED: _ClassVar[WorkerOutcome]
    WORKER_OUTCOME_TIMED_OUT: _ClassVar[WorkerOutcome]
    WORKER_OUTCOME_NOT_CONNECTED: _ClassVar[WorkerOutcome]
    WORKER_OUTCOME_BUSY: _ClassVar[WorkerOutcome]
ROLE_UNSPECIFIED: Role
ROLE_TRAINER: Role
ROLE_ENGINE: Role
PLACEMENT_UNSPECIFIED: Placement
PLACEMENT_COLOCATED: Placement
PLACEMENT_DISAGGREGATED: Placement
REFIT_STATUS_UNSPECIFIED: RefitStatus
REFIT_STATUS_OK: RefitStatus
REFIT_STATUS_FAILED: RefitStatus
WORKER_OUTCOME_UNSPECIFIED: WorkerOutcome
WORKER_OUTCOME_OK: WorkerOutcome
WORKER_OUTCOME_ERROR: WorkerOutcome
WORKER_OUTCOME_DISCONNECTED: WorkerOutcome
WORKER_OUTCOME_TIMED_OUT: WorkerOutcome
WORKER_OUTCOME_NOT_CONNECTED: WorkerOutcome
WORKER_OUTCOME_BUSY: WorkerOutcome

class WorkerInfo(_message.Message):
    __slots__ = ("role", "group", "rank", "host", "gpu", "layout", "model_name", "model_digest", "model_config_json", "version", "stale", "pid", "phase_layers", "stages", "takes_delta")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PHASE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    TAKES_DELTA_FIELD_NUMBER: _ClassVar[int]
    role: Role
    group: str
    rank: int
    host: str
    gpu: int
    layout: str
    model_name: str
    model_digest: str
    model_config_json: str
    version: int
    stale: bool
    pid: int
    phase_layers: int
    stages: bool
    takes_delta: bool
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., group: _Optional[str] = ..., rank: _Optional[int] = ..., host: _Optional[str] = ..., gpu: _Optional[int] = ..., layout: _Optional[str] = ..., model_name: _Optional[str] = ..., model_digest: _Optional[str] = ..., model_config_json: _Optional[str] = ..., version: _Optional[int] = ..., stale: bool = ..., pid: _Optional[int] = ..., phase_layers: _Optional[int] = ..., stages: bool = ..., takes_delta: bool = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: WorkerInfo
    def __init__(self, info: _Optional[_Union[WorkerInfo, _Mapping]] = ...) -> None: ...

class RunResult(_message.Message):
    __slots__ = ("refit_id", "ok", "error", "bytes", "seconds", "before_start", "checksums", "delta")
    class ChecksumsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    REFIT_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BEFORE_START_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    refit_id: str
    ok: bool
    error: str
    bytes: int
    seconds: float
    before_start: bool
    checksums: _containers.ScalarMap[int, int]
    delta: DeltaStats
    def __init__(self, refit_id: _Optional[str] = ..., ok: bool = ..., error: _Optional[str] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., before_start: bool = ..., checksums: _Optional[_Mapping[int, int]] = ..., delta: _Optional[_Union[DeltaStats, _Mapping]] = ...) -> None: ...

class DeltaStats(_message.Message):
    __slots__ = ("buckets", "delta_buckets", "words", "changed", "wire_bytes", "full_bytes", "fallback")
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    DELTA_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    WORDS_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FULL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    buckets: int
    delta_buckets: int
    words: int
    changed: int
    wire_bytes: int
    full_bytes: int
    fallback: str
    def __init__(self, buckets: _Optional[int] = ..., delta_buckets: _Optional[int] = ..., words: _Optional[int] = ..., changed: _Optional[int] = ..., wire_bytes: _Optional[int] = ..., full_bytes: _Optional[int] = ..., fallback: _Optional[str] = ...) -> None: ...

class Switched(_message.Message):
    __slots__ = ("refit_id", "ok", "error")
    REFIT_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    refit_id: str
    ok: bool
    error: str
    def __init__(self, refit_id: _Optional[str] = ..., ok: bool = ..., error: _Optional[str] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("register", "result", "switched")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    SWITCHED_FIELD_NUMBER: _ClassVar[int]
    register: Register
    result: RunResult
    switched: Switched
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., result: _Optional[_Union[RunResult, _Mapping]] = ..., switched: _Optional[_Union[Switched, _Mapping]] = ...) -> None: ...

class Registered(_message.Message):
    __slots__ = ("worker_id", "session")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    session: str
    def __init__(self, worker_id: _Optional[str] = ..., session: _Optional[str] = ...) -> None: ...

class Rendezvous(_message.Message):
    __slots__ = ("host", "port", "prefix", "world_size", "rank", "members")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    prefix: str
    world_size: int
    rank: int
    members: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., prefix: _Optional[str] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ...) -> None: ...

class RunRefit(_message.Message):
    __slots__ = ("refit_id", "plan_id", "plan_json", "version", "timeout_seconds", "rendezvous", "atomic", "verify", "check_only", "delta", "delta_base")
    REFIT_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    ATOMIC_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    CHECK_ONLY_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DELTA_BASE_FIELD_NUMBER: _ClassVar[int]
    refit_id: str
    plan_id: str
    plan_json: bytes
    version: int
    timeout_seconds: float
    rendezvous: Rendezvous
    atomic: bool
    verify: bool
    check_only: bool
    delta: bool
    delta_base: bool
    def __init__(self, refit_id: _Optional[str] = ..., plan_id: _Optional[str] = ..., plan_json: _Optional[bytes] = ..., version: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., rendezvous: _Optional[_Union[Rendezvous, _Mapping]] = ..., atomic: bool = ..., verify: bool = ..., check_only: bool = ..., delta: bool = ..., delta_base: bool = ...) -> None: ...

class Outcome(_message.Message):
    __slots__ = ("refit_id", "committed", "version", "error", "untouched")
    REFIT_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    UNTOUCHED_FIELD_NUMBER: _ClassVar[int]
    refit_id: str
    committed: bool
    version: int
    error: str
    untouched: bool
    def __init__(self, refit_id: _Optional[str] = ..., committed: bool = ..., version: _Optional[int] = ..., error: _Optional[str] = ..., untouched: bool = ...) -> None: ...

class CoordinatorMessage(_message.Message):
    __slots__ = ("registered", "run", "outcome")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    registered: Registered
    run: RunRefit
    outcome: Outcome
    def __init__(self, registered: _Optional[_Union[Registered, _Mapping]] = ..., run: _Optional[_Union[RunRefit, _Mapping]] = ..., outcome: _Optional[_Union[Outcome, _Mapping]] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "info", "session", "connected", "version", "stale", "busy_refit", "registered_unix")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    BUSY_REFIT_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_UNIX_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    info: WorkerInfo
    session: str
    connected: bool
    version: int
    stale: bool
    busy_refit: str
    registered_unix: float
    def __init__(self, worker_id: _Optional[str] = ..., info: _Optional[_Union[WorkerInfo, _Mapping]] = ..., session: _Optional[str] = ..., connected: bool = ..., version: _Optional[int] = ..., stale: bool = ..., busy_refit: _Optional[str] = ..., registered_unix: _Optional[float] = ...) -> None: ...

class StoreSetRequest(_message.Message):
    __slots__ = ("prefix", "keys", "values")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    values: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, prefix: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., values: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StoreSetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StoreGetRequest(_message.Message):
    __slots__ = ("prefix", "keys", "wait_seconds")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    wait_seconds: float
    def __init__(self, prefix: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class StoreGetResponse(_message.Message):
    __slots__ = ("found", "values")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    found: bool
    values: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, found: bool = ..., values: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StoreAddRequest(_message.Message):
    __slots__ = ("prefix", "key", "amount")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    key: str
    amount: int
    def __init__(self, prefix: _Optional[str] = ..., key: _Optional[str] = ..., amount: _Optional[int] = ...) -> None: ...

class StoreAddResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("group", "role")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    group: str
    role: Role
    def __init__(self, group: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ...) -> None: ...

class PlanOptions(_message.Message):
    __slots__ = ("placement", "planner", "bucket_bytes")
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    PLANNER_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    placement: Placement
    planner: str
    bucket_bytes: int
    def __init__(self, placement: _Optional[_Union[Placement, str]] = ..., planner: _Optional[str] = ..., bucket_bytes: _Optional[int] = ...) -> None: ...

class CreatePlanRequest(_message.Message):
    __slots__ = ("src_group", "dst_group", "options")
    SRC_GROUP_FIELD_NUMBER: _ClassVar[int]
    DST_GROUP_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    src_group: str
    dst_group: str
    options: PlanOptions
    def __init__(self, src_group: _Optional[str] = ..., dst_group: _Optional[str] = ..., options: _Optional[_Union[PlanOptions, _Mapping]] = ...) -> None: ...

class PlanSummary(_message.Message):
    __slots__ = ("plan_id", "plan_hash", "model", "model_digest", "src_group", "dst_group", "src_layout", "dst_layout", "placement", "planner", "num_gpus", "total_bytes", "local_bytes", "remote_bytes", "max_send_bytes", "max_recv_bytes", "num_transfers", "num_buckets", "bucket_bytes", "plan_seconds", "version", "num_phases")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_HASH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SRC_GROUP_FIELD_NUMBER: _ClassVar[int]
    DST_GROUP_FIELD_NUMBER: _ClassVar[int]
    SRC_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DST_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    PLANNER_FIELD_NUMBER: _ClassVar[int]
    NUM_GPUS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_SEND_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_RECV_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    NUM_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLAN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_PHASES_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    plan_hash: str
    model: str
    model_digest: str
    src_group: str
    dst_group: str
    src_layout: str
    dst_layout: str
    placement: str
    planner: str
    num_gpus: int
    total_bytes: int
    local_bytes: int
    remote_bytes: int
    max_send_bytes: int
    max_recv_bytes: int
    num_transfers: int
    num_buckets: int
    bucket_bytes: int
    plan_seconds: float
    version: int
    num_phases: int
    def __init__(self, plan_id: _Optional[str] = ..., plan_hash: _Optional[str] = ..., model: _Optional[str] = ..., model_digest: _Optional[str] = ..., src_group: _Optional[str] = ..., dst_group: _Optional[str] = ..., src_layout: _Optional[str] = ..., dst_layout: _Optional[str] = ..., placement: _Optional[str] = ..., planner: _Optional[str] = ..., num_gpus: _Optional[int] = ..., total_bytes: _Optional[int] = ..., local_bytes: _Optional[int] = ..., remote_bytes: _Optional[int] = ..., max_send_bytes: _Optional[int] = ..., max_recv_bytes: _Optional[int] = ..., num_transfers: _Optional[int] = ..., num_buckets: _Optional[int] = ..., bucket_bytes: _Optional[int] = ..., plan_seconds: _Optional[float] = ..., version: _Optional[int] = ..., num_phases: _Optional[int] = ...) -> None: ...

class CreatePlanResponse(_message.Message):
    __slots__ = ("summary", "cached")
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    summary: PlanSummary
    cached: bool
    def __init__(self, summary: _Optional[_Union[PlanSummary, _Mapping]] = ..., cached: bool = ...) -> None: ...

class GetPlanRequest(_message.Message):
    __slots__ = ("plan_id", "include_plan")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_PLAN_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    include_plan: bool
    def __init__(self, plan_id: _Optional[str] = ..., include_plan: bool = ...) -> None: ...

class GetPlanResponse(_message.Message):
    __slots__ = ("summary", "plan_json")
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    summary: PlanSummary
    plan_json: bytes
    def __init__(self, summary: _Optional[_Union[PlanSummary, _Mapping]] = ..., plan_json: _Optional[bytes] = ...) -> None: ...

class RefitRequest(_message.Message):
    __slots__ = ("plan_id", "version", "timeout_seconds", "atomic", "verify", "delta")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ATOMIC_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    version: int
    timeout_seconds: float
    atomic: bool
    verify: bool
    delta: bool
    def __init__(self, plan_id: _Optional[str] = ..., version: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., atomic: bool = ..., verify: bool = ..., delta: bool = ...) -> None: ...

class WorkerResult(_message.Message):
    __slots__ = ("worker_id", "role", "rank", "outcome", "bytes", "seconds", "error")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: Role
    rank: int
    outcome: WorkerOutcome
    bytes: int
    seconds: float
    error: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., rank: _Optional[int] = ..., outcome: _Optional[_Union[WorkerOutcome, str]] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class RefitResponse(_message.Message):
    __slots__ = ("refit_id", "plan_id", "version", "status", "error", "seconds", "total_bytes", "workers", "atomic", "verified_transfers", "delta", "delta_fallback")
    REFIT_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ATOMIC_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DELTA_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    refit_id: str
    plan_id: str
    version: int
    status: RefitStatus
    error: str
    seconds: float
    total_bytes: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerResult]
    atomic: bool
    verified_transfers: int
    delta: DeltaStats
    delta_fallback: str
    def __init__(self, refit_id: _Optional[str] = ..., plan_id: _Optional[str] = ..., version: _Optional[int] = ..., status: _Optional[_Union[RefitStatus, str]] = ..., error: _Optional[str] = ..., seconds: _Optional[float] = ..., total_bytes: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerResult, _Mapping]]] = ..., atomic: bool = ..., verified_transfers: _Optional[int] = ..., delta: _Optional[_Union[DeltaStats, _Mapping]] = ..., delta_fallback: _Optional[str] = ...) -> None: ...

class CheckRequest(_message.Message):
    __slots__ = ("plan_id", "timeout_seconds")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    timeout_seconds: float
    def __init__(self, plan_id: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class WatchRefitsRequest(_message.Message):
    __slots__ = ("plan_id",)
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    def __init__(self, plan_id: _Optional[str] = ...) -> None: ...

class RefitEvent(_message.Message):
    __slots__ = ("kind", "refit_id", "plan_id", "version", "unix_time", "done", "total", "worker", "result", "member")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[RefitEvent.Kind]
        KIND_STARTED: _ClassVar[RefitEvent.Kind]
        KIND_WORKER_DONE: _ClassVar[RefitEvent.Kind]
        KIND_FINISHED: _ClassVar[RefitEvent.Kind]
        KIND_WORKER_JOINED: _ClassVar[RefitEvent.Kind]
        KIND_WORKER_LEFT: _ClassVar[RefitEvent.Kind]
    KIND_UNSPECIFIED: RefitEvent.Kind
    KIND_STARTED: RefitEvent.Kind
    KIND_WORKER_DONE: RefitEvent.Kind
    KIND_FINISHED: RefitEvent.Kind
    KIND_WORKER_JOINED: RefitEvent.Kind
    KIND_WORKER_LEFT: RefitEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    REFIT_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    kind: RefitEvent.Kind
    refit_id: str
    plan_id: str
    version: int
    unix_time: float
    done: int
    total: int
    worker: WorkerResult
    result: RefitResponse
    member: WorkerStatus
    def __init__(self, kind: _Optional[_Union[RefitEvent.Kind, str]] = ..., refit_id: _Optional[str] = ..., plan_id: _Optional[str] = ..., version: _Optional[int] = ..., unix_time: _Optional[float] = ..., done: _Optional[int] = ..., total: _Optional[int] = ..., worker: _Optional[_Union[WorkerResult, _Mapping]] = ..., result: _Optional[_Union[RefitResponse, _Mapping]] = ..., member: _Optional[_Union[WorkerStatus, _Mapping]] = ...) -> None: ...
