"""The coordinator's records — registered workers and cached plans — and the checks made on them.
Pure bookkeeping: no gRPC, no I/O; the coordinator (`refit.control.coordinator`) drives it."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from refit.control.membership import one_replica, replica_shape
from refit.control.common import (Conflict, Exhausted, Precondition, short, side_of_role, spec_from_registration,
                                  worker_id)
from refit.control.config_diff import config_differences
from refit.casts import casts_between
from refit.control.v1 import refit_pb2 as pb
from refit.dtypes import DTYPE_BYTES
from refit.errors import InvalidInput
from refit.layouts import Layout, resolve_layout
from refit.plan import Plan
from refit.sides import Side
from refit.spec import ModelSpec

Send = Callable[[pb.CoordinatorMessage], Awaitable[None]]


@dataclass(eq=False)
class Worker:
    """One registration.  A re-registration of the same group/rank makes a new `Worker`."""

    info: pb.WorkerInfo
    session: str
    spec: ModelSpec
    layout: Layout
    send: Send
    task: asyncio.Task | None  # the Connect handler; cancelled when the worker is replaced
    version: int = 0
    stale: bool = False
    connected: bool = True
    busy: str = ""  # refit id this worker has not answered yet
    sent_plans: dict[str, str] = field(default_factory=dict)  # plan id -> hash of the plan it was sent last
    sent_prefixes: set[str] = field(default_factory=set)
    registered_unix: float = field(default_factory=time.time)
    replaced: bool = False  # a newer registration of the same group/rank took over
    left_at: float = 0.0  # monotonic time its stream ended (an elastic plan drops it `drop_after` later)
    process_key: str = field(default="", repr=False)  # its process's proof of identity (`common.process_key`)
    worker_id: str = field(init=False)
    layout_str: str = field(init=False)  # resolved, as plans name layouts
    # what the ranks of its group must agree on: the layout, or, for an engine of an elastic group
    # (`refit.control.membership`), the layout of one replica
    shape: str = field(init=False)

    def __post_init__(self) -> None:
        self.worker_id = worker_id(self.info.group, self.info.rank)
        self.layout_str = self.layout.describe()
        self.shape = one_replica(self.layout) if self.elastic else self.layout_str

    @property
    def elastic(self) -> bool:
        return self.info.role == pb.ROLE_ENGINE and replica_shape(self.layout) is not None

    @property
    def role(self) -> Side:
        return side_of_role(self.info.role)

    def status(self) -> pb.WorkerStatus:
        return pb.WorkerStatus(worker_id=self.worker_id, info=self.info, session=self.session,
                               connected=self.connected, version=self.version, stale=self.stale,
                               busy_refit=self.busy, registered_unix=self.registered_unix)


@dataclass(eq=False)
class PlanEntry:
    plan_id: str
    plan: Plan
    summary: dict[str, Any]
    src_group: str
    dst_group: str
    plan_json: bytes
    members: tuple[str, ...]  # worker ids: source ranks, then destination ranks
    version: int = 0  # last committed
    generation: int = 0  # bumps when the data-plane communicator must be rebuilt
    sessions: tuple[str, ...] = ()
    broken: bool = False  # the last refit failed: rebuild before the next one
    prefix: str = ""  # rendezvous key prefix of this generation: a random secret (see refit.proto)
    running: Any = None  # the refits.Run under way (one per plan at a time), else None
    committed: pb.RefitResponse | None = None  # the response of the refit that committed `version`
    src_digest: str = ""  # the trainers' model digest, when it is not the plan's (`Plan.casts`)
    # An elastic engine group (`refit.control.membership`): the layout of one of its replicas, and
    # what re-plans it for another set of replicas: (key of `Coordinator._plan_keys` less the
    # destination layout, `make_plan`'s arguments less the destination layout).  `plan` and
    # `members` are then those of the replicas its last refit ran for.
    dst_shape: str = ""
    replan: tuple[tuple, tuple] | None = None
    # Delta refits: the version whose bytes the trainers last sent in a delta refit that committed
    # (0: none; -1: a refit failed since), and the generation of the members that keep them (`refit.executor.delta`).
    delta_version: int = 0
    delta_generation: int = -1

    @property
    def trainer_digest(self) -> str:
        return self.src_digest or self.plan.model_digest

    @property
    def num_src(self) -> int:
        return len(self.plan.placement.src_gpus)

    def to_pb(self) -> pb.PlanSummary:
        s = self.summary
        return pb.PlanSummary(
            plan_id=self.plan_id, plan_hash=s["plan_hash"], model=s["model"], model_digest=self.plan.model_digest,
            src_group=self.src_group, dst_group=self.dst_group, src_layout=s["src"], dst_layout=s["dst"],
            placement=s["placement"], planner=s["planner"], num_gpus=s["num_gpus"], total_bytes=s["total_bytes"],
            local_bytes=s["local_bytes"], remote_bytes=s["remote_bytes"], max_send_bytes=s["max_send_bytes"],
            max_recv_bytes=s["max_recv_bytes"], num_transfers=s["num_transfers"], num_buckets=s["num_buckets"],
            bucket_bytes=s["bucket_bytes"], plan_seconds=s.get("plan_seconds", 0.0), version=self.version,
            num_phases=s.get("num_phases", 0))


# Bounds on what a registration may ask of the coordinator, checked before anything is built: a
# few hundred bytes must not be able to make it build millions of tensors (or echo megabytes).
MAX_NAME = 128  # group, layout, model name, digest
MAX_HOST = 255
MAX_CONFIG_JSON = 64 * 2**10
MAX_WORLD_SIZE = 65_536  # ranks of one layout
MAX_VERSION = 2**53 - 1  # exact in JSON and float64; far beyond any RL loop's step count
MAX_VERSION_STEP = 2**32  # the most a version may jump past what the engines hold
# Model config fields: generous for today's largest models (Qwen3-235B: 94 layers, 128 experts).
CONFIG_BOUNDS = {"hidden_size": 2**17, "num_layers": 1024, "num_heads": 4096, "num_kv_heads": 4096,
                 "head_dim": 4096, "intermediate_size": 2**20, "vocab_size": 2**23, "num_experts": 4096,
                 "moe_intermediate_size": 2**20, "lora.rank": 2**14}  # lora.rank: the adapter's (or none)
MAX_SPEC_TENSORS = 2_000_000


def check_info(info: pb.WorkerInfo) -> None:
    """Cheap checks of a registration's fields: sizes, names, numbers (no spec built yet)."""
    if info.role not in (pb.ROLE_TRAINER, pb.ROLE_ENGINE):
        raise InvalidInput("register: role must be ROLE_TRAINER or ROLE_ENGINE")
    for name, limit in (("group", MAX_NAME), ("layout", MAX_NAME), ("model_name", MAX_NAME),
                        ("model_digest", MAX_NAME), ("host", MAX_HOST), ("model_config_json", MAX_CONFIG_JSON)):
        value = getattr(info, name)
        if len(value) > limit:
            raise InvalidInput(f"register: {name} has {len(value)} characters, at most {limit} allowed")
    if not info.group or "/" in info.group or not info.group.isprintable():
        raise InvalidInput(f"register: group must be a printable name without '/', got {short(info.group)}")
    if not info.layout:
        raise InvalidInput("register: layout is empty")
    if info.rank >= MAX_WORLD_SIZE:
        raise InvalidInput(f"register: rank {info.rank} is beyond {MAX_WORLD_SIZE} ranks")
    if info.version > MAX_VERSION:
        raise InvalidInput(f"register: version {info.version} is above {MAX_VERSION}")
    try:
        fields = json.loads(info.model_config_json)
    except ValueError as e:
        raise InvalidInput(f"register: model_config_json is not JSON: {short(str(e))}") from None
    if not isinstance(fields, dict):
        raise InvalidInput("register: model_config_json is not a JSON object")
    lora = fields.get("lora")
    if lora is not None and not isinstance(lora, dict):
        raise InvalidInput(f"register: model config lora = {short(lora)}; expected an object (rank, targets, scaling) "
                           f"or null")
    for key, limit in CONFIG_BOUNDS.items():
        outer, _, inner = key.partition(".")
        v = (fields.get(outer) or {}).get(inner, 0) if inner else fields.get(key, 0)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= limit:
            raise InvalidInput(f"register: model config {key} = {short(v)}; expected an integer in [0, {limit}]")
    dtype = fields.get("dtype", "bfloat16")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:  # planning sizes every tensor by it
        raise InvalidInput(f"register: model config dtype = {short(dtype)}; expected one of {', '.join(DTYPE_BYTES)}")
    for key in () if fields.get("kv_lora_rank") else ("num_heads", "num_kv_heads", "head_dim"):
        if fields.get(key, 0) < 1:  # layouts split attention rows by kv groups of heads of head_dim rows
            raise InvalidInput(f"register: model config {key} = {fields.get(key, 0)}; attention needs at least 1")
    moe = fields.get("moe_layers", [])
    if not isinstance(moe, list) or len(moe) > CONFIG_BOUNDS["num_layers"]:
        raise InvalidInput("register: model config moe_layers must be a list of layer indices")
    tensors = fields.get("num_layers", 0) * (3 * fields.get("num_experts", 0) + 16)
    if tensors > MAX_SPEC_TENSORS:
        raise InvalidInput(f"register: model config of about {tensors} tensors, at most {MAX_SPEC_TENSORS} allowed")


def build_registration(info: pb.WorkerInfo, specs: dict[tuple[str, str], ModelSpec]) -> tuple[ModelSpec, Layout]:
    """A checked registration's spec (cached in ``specs``) and resolved layout; refuses one that
    cannot take part in a plan.  The heavy part: run it off the event loop."""
    key = (info.model_name, info.model_config_json)  # the config decides the spec: build it once
    spec = specs.get(key)
    if spec is None:
        spec = spec_from_registration(info.model_name, info.model_config_json, info.model_digest)
        while len(specs) >= 64:  # a bounded cache: drop the oldest
            specs.pop(next(iter(specs)))
        specs[key] = spec
    elif spec.digest() != info.model_digest:
        raise InvalidInput(f"model {short(info.model_name)}: model_config_json gives digest {spec.digest()}, "
                         f"the worker reported {short(info.model_digest or '(none)')}")
    layout = resolve_layout(info.layout, spec, side_of_role(info.role))
    if layout.world_size > MAX_WORLD_SIZE:
        raise InvalidInput(f"register: {layout.describe()} has {layout.world_size} ranks, at most {MAX_WORLD_SIZE}")
    if info.rank >= layout.world_size:
        raise InvalidInput(f"register: rank {info.rank} is outside {layout.describe()} (world size {layout.world_size})")
    return spec, layout


def check_joinable(workers: dict[str, Worker], info: pb.WorkerInfo, max_workers: int, key: str = "") -> None:
    """A registration's group holds its role, and its slot is free (`check_slot`)."""
    check_group_role(workers, info)
    check_slot(workers, info, max_workers, key)


def prune_gone(workers: dict[str, Worker], gone: dict[str, None], limit: int) -> None:
    """Drop the oldest rows of workers that left (``gone``, oldest first) beyond ``limit``."""
    while len(gone) > limit:
        wid = next(iter(gone))
        del gone[wid]
        if wid in workers and not workers[wid].connected:
            del workers[wid]


def check_group_role(workers: dict[str, Worker], info: pb.WorkerInfo) -> None:
    for w in workers.values():
        if w.info.group == info.group and w.info.role != info.role and w.worker_id != worker_id(info.group, info.rank):
            raise InvalidInput(f"register: group {info.group!r} holds {w.role.plural} ({w.worker_id}); "
                             f"{side_of_role(info.role).with_article} cannot join it")


def group_members(workers: dict[str, Worker], group: str, side: Side) -> list[Worker]:
    """Every rank of ``group``, checked: right role, one layout, one model, no rank missing."""
    members = sorted((w for w in workers.values() if w.info.group == group), key=lambda w: w.info.rank)
    shape = lambda w: (w.shape, w.info.model_digest, w.info.phase_layers)  # noqa: E731
    live = [shape(w) for w in members if w.connected]
    if live:  # rows of workers gone before the group came back in another shape (tp2 -> tp1) are none of it
        members = [w for w in members if w.connected or shape(w) == live[0]]
    if not members:
        raise InvalidInput(f"no worker is registered in group {short(group)}")
    ref = members[0]
    if ref.role is not side:
        raise InvalidInput(f"group {short(group)} holds {ref.role.plural}; a plan's "
                           f"{'source' if side is Side.TRAINER else 'destination'} must be {side.with_article} group")
    for w in members[1:]:
        why = group_difference(ref, w)
        if why:
            raise InvalidInput(f"group {group!r}: {why}")
    if ref.elastic:  # replicas come and go: `refit.control.membership.engine_view` takes the whole ones
        return members
    ranks = {w.info.rank for w in members}
    for r in range(ref.layout.world_size):
        if r not in ranks:
            raise InvalidInput(f"group {group!r}: rank {r} of {ref.layout.describe()} is not registered "
                             f"(registered ranks: {sorted(ranks)})")
    return members


def check_same_model(src: Worker, dst: Worker) -> dict[str, str]:
    """Refuse groups of different models, naming every config field that differs and both values
    (digests alone tell a user nothing).  The same model in other dtypes (an fp32 trainer, a bf16
    engine) is one model, and so is an engine serving it quantized (FP8): the casts a plan between
    them makes (`refit.casts`) are returned."""
    a, b = src.info, dst.info
    diff = config_differences(a.model_config_json, b.model_config_json, a.group, b.group)
    other = config_differences(a.model_config_json, b.model_config_json, a.group, b.group,
                               ignore=("dtype", "quantization"))
    # what a plan would cast (dtype, quantization) is no difference to name; said apart at most
    cast = " (their dtypes differ too, which a plan casts)" if other and other != diff else ""
    if other and a.model_digest != b.model_digest:
        raise InvalidInput(f"groups {a.group!r} and {b.group!r} hold different models: {other}{cast}")
    if other:
        raise InvalidInput(f"groups {a.group!r} and {b.group!r} hold models of equal tensors but different configs: "
                           f"{other}{cast}")
    if a.model_digest == b.model_digest:
        return {}
    try:
        return casts_between(src.spec, dst.spec)
    except InvalidInput as e:
        raise InvalidInput(f"groups {a.group!r} and {b.group!r}: {e}") from None


def group_difference(ref: Worker, w: Worker) -> str:
    """What ``w`` holds otherwise than ``ref``, a worker of its group, that one plan cannot cover
    (empty: nothing): the layout (of one replica, in an elastic engine group), the model (every
    config field that differs with both values; the digests only when no field does), or
    ``phase_layers`` (phases are one plan's: every rank cuts alike)."""
    if w.shape != ref.shape:
        of = f" (one replica: {w.shape}, {ref.shape})" if w.elastic or ref.elastic else ""
        return f"{w.worker_id} registered layout {w.layout_str}, {ref.worker_id} {ref.layout_str}{of}"
    diff = config_differences(ref.info.model_config_json, w.info.model_config_json, ref.worker_id, w.worker_id)
    if diff:
        return f"{ref.worker_id} and {w.worker_id} hold different model configs: {diff}"
    if w.info.model_digest != ref.info.model_digest:
        return (f"{w.worker_id} holds {short(w.info.model_name)} (digest {w.info.model_digest}), {ref.worker_id} "
                f"{short(ref.info.model_name)} (digest {ref.info.model_digest})")
    if w.info.phase_layers != ref.info.phase_layers:
        return f"{w.worker_id} declares phase_layers {w.info.phase_layers}, {ref.worker_id} {ref.info.phase_layers}"
    return ""


def check_fits_group(workers: dict[str, Worker], w: Worker) -> None:
    """An engine joining an elastic group (`refit.control.membership`) must be a replica its plans
    can refit: the layout of one replica, the model and the phases of the group's connected
    engines.  Refused when it registers, naming the difference: otherwise one of another model
    would fail every refit of the group while connected, and one of another layout be left out
    of them silently.  (A rigid group's ranks are compared when a plan is made and at each refit.)"""
    peers = [p for p in workers.values() if p.info.group == w.info.group and p.connected
             and p.worker_id != w.worker_id and p.role is w.role]
    if not peers or not (w.elastic or peers[0].elastic):
        return
    why = group_difference(peers[0], w)
    if why:
        raise InvalidInput(f"register: {why}: the replicas of engine group {w.info.group!r} must agree on "
                           f"everything but their count")


def plan_json(plan: Plan) -> bytes:
    return json.dumps(plan.to_dict(), separators=(",", ":")).encode()


def check_plan_members(entry: PlanEntry, members: list[Worker]) -> None:
    """Workers re-registered since the plan was made must still hold what it was made for."""
    plan = entry.plan
    for i, w in enumerate(members):
        want = plan.src_layout if i < entry.num_src else entry.dst_shape or plan.dst_layout
        digest = entry.trainer_digest if i < entry.num_src else plan.model_digest
        if (w.shape if i >= entry.num_src else w.layout_str) != want or w.info.model_digest != digest:
            raise Precondition(f"plan {entry.plan_id} was made for {want} of model {digest}; "
                               f"{w.worker_id} now holds {w.layout_str} of {w.info.model_digest}: create a new plan")
        if i >= entry.num_src and w.info.phase_layers != plan.phase_layers:
            raise Precondition(f"plan {entry.plan_id} was made for phase_layers {plan.phase_layers}; {w.worker_id} "
                               f"now declares {w.info.phase_layers}: create a new plan")


def absent_members(workers: dict[str, Worker], entry: PlanEntry) -> dict[str, pb.WorkerResult]:
    return {m: pb.WorkerResult(outcome=pb.WORKER_OUTCOME_NOT_CONNECTED, error="not connected")
            for m in entry.members if m not in workers or not workers[m].connected}


def control_plan_id(plan_hash: str, src_group: str, dst_group: str) -> str:
    """Control-plane id of (plan, groups): two engine groups of one layout share a plan hash."""
    return hashlib.sha256(f"{plan_hash}:{src_group}:{dst_group}".encode()).hexdigest()[:16]


def check_slot(workers: dict[str, Worker], info: pb.WorkerInfo, max_workers: int, key: str = "") -> None:
    """A live worker's slot is only taken over by its own process (an agent reconnecting over a
    stream we have not yet seen die), proven by the process key it registered with (``key``, never
    shown; host and pid are the worker's word and public); anyone else is refused."""
    old = workers.get(f"{info.group}/{info.rank}")
    if old is not None and old.connected and not (old.process_key and hmac.compare_digest(old.process_key, key)):
        raise Conflict(f"{old.worker_id} is held by a live worker (pid {old.info.pid} on {short(old.info.host)}); "
                       f"it can register again once that one's stream has ended")
    if old is None and len(workers) >= max_workers:
        raise Exhausted(f"the coordinator holds {max_workers} workers, its limit")


def holds_version(workers: dict[str, Worker], entry: PlanEntry, version: int) -> bool:
    """Every engine of the plan holds ``version``, fresh."""
    engines = [workers.get(m) for m in entry.members[entry.num_src:]]
    return all(w is not None and w.version == version and not w.stale for w in engines)


def check_claimed_version(workers: dict[str, Worker], plans: dict[str, PlanEntry], info: pb.WorkerInfo) -> None:
    """An engine registers with the version it holds, and refits of its plans must go above it
    (an engine may outlive a coordinator).  So that one registration cannot block a fleet's refits
    (a replica claiming version 10^6 or 2^53-1), an engine may claim no version above every one
    this coordinator committed into its group (its plans' last).  Without a plan into the group
    (a coordinator restarted) the claims stand: engines torn by a commit that reached some of
    them hold two versions, and nothing here says which is right."""
    if info.role != pb.ROLE_ENGINE or info.version == 0:
        return
    held = [(e.version, f"plan {e.plan_id}") for e in plans.values() if e.dst_group == info.group]
    if held and info.version > max(held)[0]:
        top, who = max(held)
        raise InvalidInput(f"register: version {info.version} is above {top}, the most engine group {info.group!r} "
                           f"holds ({who}): an engine joining a group holds no version the group never had; "
                           f"register it with the version it was refitted to (0 if none)")


def check_version(workers: dict[str, Worker], entry: PlanEntry, version: int) -> None:
    """Refuse a version at or below what the plan or its connected engines hold, or one that jumps
    absurdly.  An engine gone no longer counts: its version comes back with it, and is checked then."""
    held = [(entry.version, f"plan {entry.plan_id}")]
    held += [(workers[m].version, m) for m in entry.members[entry.num_src:] if m in workers and workers[m].connected]
    top, who = max(held)
    if version <= top:
        raise Precondition(f"version {version} is not above {top}, the version {who} holds; versions must increase")
    if version - top > MAX_VERSION_STEP:
        raise InvalidInput(f"version {version} jumps more than {MAX_VERSION_STEP} past {top}, the version {who} "
                         f"holds: versions count refits, not random numbers")
