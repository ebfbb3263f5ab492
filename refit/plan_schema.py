"""The plan as a file and the plan's summary, declared once: what ``refit plan --out`` writes and
`load_plan` reads back (`PlanFile`), and what ``refit plan --json`` prints under ``summary``
(`PlanSummary`).

A plan file is checked against `PlanFile` as JSON, strictly and whole, before a `Plan` is built:
a wrong type, an out-of-range number, a missing or unknown key is refused as one `InvalidInput`
naming where it is (``plan.placement.kind``, ``plan.transfers[12][4][0]``), the value and what is
allowed.  What no row can say alone — buckets that tile the transfers, boxes inside their
tensors, phases in order — `Plan.check` refuses next.  ``refit settings --json-schema plan`` and
``summary`` print the schemas; docs/layouts.md's summary table is generated from `PlanSummary`.

pydantic is imported here, on a user's file: the planner and the executor never import this module
(plans travelling between the coordinator and its agents were built by refit and are checked by
`Plan.check` alone).
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, with_config
from typing_extensions import NotRequired, TypedDict

from refit.casts import CASTABLE
from refit.dtypes import DTYPE_BYTES
from refit.errors import InvalidInput
from refit.plan import PLAN_FORMAT, Plan
from refit.quantization import FORMATS

Count = Annotated[int, Field(ge=0)]
Dtype = Literal[tuple(sorted(DTYPE_BYTES))]  # type: ignore[valid-type]
Castable = Literal[tuple(sorted(CASTABLE))]  # type: ignore[valid-type]
Format = Literal[tuple(sorted(FORMATS))]  # type: ignore[valid-type]
Stage = Annotated[int, Field(ge=0, le=1)]  # (not Literal[0, 1]: a JSON `true` equals 1 there)
Coords = list[Count]


@with_config(ConfigDict(extra="forbid"))
class PlacementFile(TypedDict):
    kind: Annotated[Literal["colocated", "disaggregated"], Field(description=(
        "colocated: source rank i and destination rank i share GPU i; disaggregated: sources on GPUs "
        "[0, S), destinations on [S, S + D)"))]
    src_gpus: Annotated[list[Count], Field(min_length=1, description="the GPU of each source rank")]
    dst_gpus: Annotated[list[Count], Field(min_length=1, description="the GPU of each destination rank")]


@with_config(ConfigDict(extra="forbid"))
class PlanFile(TypedDict):
    format: Annotated[int, Field(ge=PLAN_FORMAT, le=PLAN_FORMAT, description="the plan format's version")]
    model: Annotated[str, Field(min_length=1, description="the model's name")]
    model_digest: Annotated[str, Field(min_length=1, description=(
        "the digest of the model's tensors (names, dtypes, shapes): both sides must hold this model"))]
    src_layout: Annotated[str, Field(min_length=1, description="the trainers' layout, e.g. `megatron:tp4ep8`")]
    dst_layout: Annotated[str, Field(min_length=1, description="the engines' layout, e.g. `vllm:tp8`")]
    placement: PlacementFile
    planner: Annotated[str, Field(min_length=1, description="the planner that made it (`refit plan --planner`)")]
    bucket_bytes: Annotated[int, Field(ge=1, description="the largest bucket, bytes")]
    tensors: Annotated[list[tuple[str, Dtype, Coords]], Field(description=(
        "[name, dtype, shape] of every canonical tensor the plan moves, in the engines' dtype"))]
    transfers: Annotated[list[tuple[Stage, Count, Count, Count, Coords, Coords]], Field(description=(
        "[stage, sender (a source rank), receiver (a destination rank; a source rank at stage 0), tensor index, "
        "start, size]: one box each (`refit.plan.Transfer`)"))]
    buckets: Annotated[list[tuple[Stage, Count, Count, Count, Annotated[int, Field(ge=1)], Count]], Field(
        description="[stage, sender, receiver, first transfer, transfers, bytes]: one message each (`refit.plan.Bucket`)")]
    phase_layers: NotRequired[Annotated[int, Field(ge=1, description="a phased plan: layers per phase")]]
    phases: NotRequired[Annotated[list[tuple[int, Count]], Field(description=(
        "a phased plan: [phase key, first bucket] in run order (key -1: tensors of no layer)"))]]
    casts: NotRequired[Annotated[list[tuple[str, Castable]], Field(description=(
        "[tensor, the trainers' dtype] where the trainers cast to the engines' dtype on the way"))]]
    quantization: NotRequired[Annotated[tuple[Format, Castable], Field(description=(
        "[format, the dtype quantized from]: the trainers quantize on the way"))]]


@with_config(ConfigDict(extra="forbid"))
class PlanSummary(TypedDict):
    plan_hash: Annotated[str, Field(description=(
        "the plan's content hash (equal plans, equal hashes); not the control plane's `plan_id`"))]
    model: Annotated[str, Field(description="the model's name")]
    src: Annotated[str, Field(description="the trainers' layout")]
    dst: Annotated[str, Field(description="the engines' layout")]
    placement: Annotated[Literal["colocated", "disaggregated"], Field(description="how ranks share GPUs")]
    planner: Annotated[str, Field(description="the planner")]
    num_gpus: Annotated[int, Field(ge=1, description="GPUs the placement spans")]
    total_bytes: Annotated[int, Field(ge=0, description="the engines' weights, bytes (every replica)")]
    local_bytes: Annotated[int, Field(ge=0, description="bytes moved within a GPU")]
    remote_bytes: Annotated[int, Field(ge=0, description="bytes moved between GPUs")]
    max_send_bytes: Annotated[int, Field(ge=0, description="the most one GPU sends to others")]
    max_recv_bytes: Annotated[int, Field(ge=0, description="the most one GPU receives from others")]
    num_transfers: Annotated[int, Field(ge=0, description="boxes moved")]
    num_buckets: Annotated[int, Field(ge=0, description="messages (buckets) sent")]
    plan_json_bytes: Annotated[int, Field(ge=0, description="the plan file's size (`refit plan --out`)")]
    bucket_bytes: Annotated[int, Field(ge=1, description="the largest bucket, bytes")]
    num_phases: NotRequired[Annotated[int, Field(ge=1, description="a phased plan's phases")]]
    plan_seconds: NotRequired[Annotated[float, Field(ge=0, description="seconds the planner took")]]
    casts: NotRequired[Annotated[dict[str, int], Field(description=(
        "tensors cast on the trainers, counted by kind (`float32->bfloat16`)"))]]
    quantization: NotRequired[Annotated[dict[str, Any], Field(description=(
        "quantized on the trainers: `format`, `from`, `tensors`, `bytes`, `unquantized_bytes`"))]]
    not_moved: NotRequired[Annotated[list[str], Field(description=(
        "what the engines hold that no refit moves, and why (e.g. MTP layers of a model served without them)"))]]
    # with --predict (`refit.predict.Prediction.to_dict`)
    predicted_seconds: NotRequired[Annotated[float, Field(description="the predicted refit time (a model)")]]
    bottleneck: NotRequired[Annotated[str, Field(description="what bounds the prediction")]]
    hardware: NotRequired[Annotated[dict[str, Any], Field(description="the hardware preset predicted on")]]
    transport: NotRequired[Annotated[str, Field(description="the transport predicted")]]
    num_hosts: NotRequired[Annotated[int, Field(description="hosts the placement spans")]]
    overhead_seconds: NotRequired[Annotated[float, Field(description="the fixed overhead added")]]
    engine: NotRequired[Annotated[Optional[dict[str, Any]], Field(description=(
        "a live engine's cost around the bytes (`--engine`), or null"))]]
    phases: NotRequired[Annotated[list[dict[str, Any]], Field(description="each phase's prediction, term by term")]]


SCHEMAS: dict[str, Any] = {"plan": PlanFile, "summary": PlanSummary}


def check_plan_file(text: Union[str, bytes], what: str = "plan") -> None:
    """Refuse plan-file JSON ``text`` unlike `PlanFile`, naming the first wrong place."""
    try:
        _adapter().validate_json(text, strict=True)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        where = what + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
        if err["type"] == "json_invalid":
            raise InvalidInput(f"{what} is not JSON: {err['msg']}") from None
        given = "" if err["type"] == "missing" else f"{_short(err.get('input'))} is refused: "
        raise InvalidInput(f"{where}: {given}{err['msg']}") from None


def load_plan(path: str) -> Plan:
    """The plan file ``path`` (``refit plan --out``): checked whole against `PlanFile`, then for
    consistency (`Plan.check`); refused with `InvalidInput` naming the file and the place."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as e:
        raise InvalidInput(f"plan file {path}: {e.strerror or e}") from None
    try:
        check_plan_file(text)
        return Plan.from_dict(json.loads(text))
    except InvalidInput as e:
        raise InvalidInput(f"plan file {path}: {e.args[0] if e.args else e}") from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@functools.lru_cache(maxsize=1)
def _adapter() -> TypeAdapter[Any]:
    return TypeAdapter(PlanFile)
