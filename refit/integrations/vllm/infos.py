"""The refit backend's two inputs from the RL loop, declared once: ``init_info`` (given to
``init_weight_transfer_engine``) and ``update_info`` (to ``update_weights``).

vLLM builds them from the loop's dicts (`RefitWeightTransferEngine.parse_init_info`); refit
refuses, before anything registers or moves, a key it does not know (naming the nearest known
one) and a value of the wrong type or range (naming the field, the value and what is allowed):
`refit.validation`.  docs/rl-loop-and-vllm.md's tables and ``refit settings --json-schema
init_info`` / ``update_info`` come from these declarations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional

from pydantic import ConfigDict, Field
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from refit.validation import check_fields

MAX_VERSION = 2 ** 53 - 1  # versions travel as JSON numbers (refit.proto)


@dataclass
class RefitInitInfo(WeightTransferInitInfo):
    __pydantic_config__ = ConfigDict(extra="forbid")  # the schema says it: unknown keys are refused
    coordinator: Annotated[str, Field(description=(
        "the coordinator, HOST:PORT; empty: `$REFIT_ADDRESS`, else 127.0.0.1:50051 (served by the "
        "first piece of the job that finds none there)"))] = ""
    group: Annotated[str, Field(min_length=1, description="the engine group this engine registers in")] = "engine"
    token: Annotated[Optional[str], Field(description="the coordinator's bearer token; default `$REFIT_TOKEN`")] = None
    host: Annotated[str, Field(min_length=1, description=(
        "the address this engine's node is reached at (members that publish the same host share one)"))] = "127.0.0.1"
    staging: Annotated[Literal["bounded", "atomic"], Field(description=(
        "`bounded`: parameters re-processed after loading are staged a window at a time; `atomic`: every "
        "parameter staged, so an atomic refit switches whole versions"))] = "bounded"
    window_layers: Annotated[int, Field(ge=0, description=(
        "bounded staging: layers staged at a time (0: the whole shard)"))] = 1
    replica: Annotated[Optional[int], Field(ge=0, description=(
        "a server serving one replica of an elastic engine group on its own: its index"))] = None
    adapter: Annotated[Optional[dict[str, Any]], Field(description=(
        "an adapter-only engine: `name`, `id`, `r`, `lora_alpha`, `target_modules` (`use_rslora`): the refits "
        "move that LoRA adapter alone, into its pinned slot (docs/lora.md)"))] = None
    draft_group: Annotated[Optional[str], Field(description=(
        "a speculative engine's draft model: its agent's group (default `<group>-draft`; empty: the trainer "
        "trains no drafter, which is kept as loaded)"))] = None

    def __post_init__(self) -> None:
        check_fields(self, "init_info")


@dataclass
class RefitUpdateInfo(WeightTransferUpdateInfo):
    __pydantic_config__ = ConfigDict(extra="forbid")
    plan_id: Annotated[str, Field(min_length=1, description="the plan to run (`refit.Client.create_plan`)")]
    version: Annotated[int, Field(ge=1, le=MAX_VERSION, description=(
        "the weight version this refit installs, above every version the engines hold"))]
    timeout: Annotated[float, Field(gt=0, description="seconds the refit may take")] = 60.0
    atomic: Annotated[bool, Field(description=(
        "all or none across the plan's engines (needs init_info staging `atomic`)"))] = False
    verify: Annotated[bool, Field(description="both ends checksum every transfer")] = False
    delta: Annotated[bool, Field(description=(
        "send only what changed since the version the engines hold (docs/delta-refits.md); in full, logged "
        "with the reason, where an engine re-processes what it receives"))] = False

    def __post_init__(self) -> None:
        check_fields(self, "update_info")
