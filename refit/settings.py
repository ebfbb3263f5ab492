"""Every ``REFIT_*`` environment variable refit reads, declared once: name, type, default, why.

The environment is read once per process (`current`), and a bad value is refused then, naming
the variable.  Knobs come in three scopes:

* ``run``: how the executor moves bytes.  A run's members must move bytes the same way (two
  NCCL bootstraps never meet; a push needs every peer's destinations mapped), so member 0
  publishes its values when a run opens and every member uses them (`adopt`); a member whose own
  environment says otherwise logs a warning.  A mismatch no longer hangs until the deadline.
* ``process``: this process only (the coordinator's token, its event loop, tracing).
* ``bench``: read by ``refit-bench`` alone.

``refit settings`` prints each knob with its value here; docs/performance.md's table is
`markdown_table`'s output (tests/unit/test_settings.py holds the two equal).  Any other
``REFIT_*`` variable is named in a warning and changes nothing.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import re
import threading
from dataclasses import dataclass
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Literal, Mapping

from refit.errors import InvalidInput

log = logging.getLogger(__name__)

Scope = Literal["run", "process", "bench"]


_DEFAULT_BESIDE = "33"  # REFIT_TABLE_BLOCKS' third value when only two are given


MAX_BLOCKS = 65_535  # thread blocks of one table kernel: far beyond any GPU's SMs, within CUDA's grid


def _blocks(value: str) -> tuple[int, int, int]:
    parts = [int(v) for v in value.split(",")]  # ValueError: refused by `Knob.parse`
    if len(parts) == 2:
        parts.append(int(_DEFAULT_BESIDE))
    if len(parts) != 3 or min(parts) < 1 or max(parts) > MAX_BLOCKS:
        raise ValueError
    return parts[0], parts[1], parts[2]


def _flag(value: str) -> bool:
    """1 or 0, as the knobs say (unset: 0)."""
    if value not in ("", "0", "1"):
        raise ValueError
    return value == "1"


def _trace_prefix(value: str) -> str:
    """A path prefix whose folder exists and this process may write in (unset: ""): a diagnostic
    that cannot write is refused at start, not found out at the first refit."""
    if not value:
        return ""
    folder = os.path.dirname(os.path.abspath(value))
    if value.endswith(os.sep) or not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError
    return value


def _address(value: str) -> str:
    """HOST:PORT (a bracketed IPv6 host too), port in 1..65535 (unset: "")."""
    m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})", value)
    if value and (m is None or not 0 < int(m[2]) < 65536):
        raise ValueError
    return value


def _kill(value: str) -> str:
    """``src2@1`` or ``dst2@1:stop`` (unset: "")."""
    if value and not re.fullmatch(r"(src|dst)\d+@\d+(:stop)?", value):
        raise ValueError
    return value


@dataclass(frozen=True)
class Knob:
    """One environment variable: ``default`` and ``choices`` as written in the environment;
    ``convert`` turns the text into the `Settings` field's value (ValueError: refused)."""

    name: str
    default: str
    scope: Scope
    what: str
    choices: tuple[str, ...] = ()
    convert: Callable[[str], Any] = str
    form: str = ""  # how to write a value, where ``choices`` does not say it
    see: str = ""  # where the docs explain it
    secret: bool = False  # never printed or logged

    @property
    def field(self) -> str:
        return self.name.removeprefix("REFIT_").lower()

    def parse(self, value: str) -> Any:
        if self.choices and value not in self.choices:
            raise InvalidInput(f"{self.name}={value!r}: must be one of {', '.join(self.choices)}")
        try:
            return self.convert(value)
        except ValueError:
            raise InvalidInput(f"{self.name}={value!r}: must be {self.form or 'valid'}") from None


PERF = "docs/performance.md#the-executor-and-its-transports"

KNOBS: tuple[Knob, ...] = (
    Knob("REFIT_IPC", "auto", "run", choices=("auto", "push", "pull"), see=PERF,
         what="with the ipc transport, who copies a bucket between two GPUs: `push` (the source's GPU "
              "writes with SM stores, posted over NVLink) or `pull` (the destination's reads); `auto`: "
              "push on GPUs, pull between the bench's packed arenas and on CPU"),
    Knob("REFIT_NCCL", "cupy", "run", choices=("cupy", "torch"), see=PERF,
         what="the NCCL communicator of the nccl transport: cupy's (bootstrapped through the coordinator) "
              "or torch.distributed's ProcessGroupNCCL"),
    Knob("REFIT_TABLE_COPY", "auto", "run", choices=("auto", "on", "off"), see=PERF,
         what="many small block copies as one descriptor-table kernel: `auto` when more than 64 copies "
              "average under 8 MiB, beside other work, or within one GPU alone; `off`: one memcpy call each"),
    Knob("REFIT_TABLE_BLOCKS", f"528,132,{_DEFAULT_BESIDE}", "run", convert=_blocks,
         form=f"PEER,LOCAL[,BESIDE] thread block counts, each in [1, {MAX_BLOCKS}]", see=PERF,
         what="thread blocks of the table kernels: peer copies, same-GPU copies, same-GPU copies beside an "
              "NCCL pipeline (a smaller grid leaves SMs to the work beside it)"),
    Knob("REFIT_BATCH_MEMCPY", "off", "run", choices=("off", "flat", "all"), see=PERF,
         what="CUDA 13's batched memcpy beside the table kernel: `flat` sends 1-D runs to the copy engines "
              "in one call, `all` pitched blocks too (a gain on 2 GPUs, a loss on 4: opt-in)"),
    Knob("REFIT_QUANTIZE_ON_LANDING", "1", "run", convert=_flag, form="1 or 0", see=PERF,
         what="FP8 engines sharing a GPU with their trainer: the driver quantizes the trainer's unquantized "
              "weights straight into the engine's (0: the trainer quantizes into wire shards, which are copied)"),
    Knob("REFIT_TRACE", "0", "process", convert=_flag, form="1 or 0", see=PERF,
         what="log each GPU's timeline after every refit (CUDA events around each copy batch and NCCL step)"),
    Knob("REFIT_CONTROL_TRACE", "", "process", convert=_trace_prefix,
         form="a path prefix in a folder this process may write in",
         see="docs/control-plane.md#where-the-control-time-goes",
         what="append each refit's control-plane steps (client, coordinator, agents, barriers) with their "
              "monotonic clock to the file PREFIX.PID; `bench/probes/control_breakdown.py` reads them"),
    Knob("REFIT_ADDRESS", "", "process", convert=_address, form="HOST:PORT", see="docs/control-plane.md",
         what="the coordinator that clients, agents, `attach` and the vLLM backend reach when the code names "
              "none (else 127.0.0.1:50051)"),
    Knob("REFIT_TOKEN", "", "process", form="a secret", see="docs/faults-and-security.md", secret=True,
         what="the bearer token: `refit serve` requires it on every call (`--token-file` wins over it, it "
              "wins over `--token`); clients, agents, `attach` and the vLLM backend send it when the code "
              "names none"),
    Knob("REFIT_UVLOOP", "1", "process", convert=_flag, form="1 or 0", see="docs/control-plane.md",
         what="run the agents' and coordinator's event loops on uvloop when installed (0: asyncio's own)"),
    Knob("REFIT_START_METHOD", "forkserver", "bench", choices=("forkserver", "spawn", "fork"),
         see="docs/performance.md#refit-bench-the-main-job",
         what="how `refit-bench` starts its worker processes"),
    Knob("REFIT_TEST_KILL", "", "bench", convert=_kill, form="`src2@1` or `dst2@1:stop`", see="docs/testing.md",
         what="fault injection for tests: that rank of `refit-bench` dies (`:stop`: hangs) during that refit"),
)

# REFIT_* variables that refit's own tests and their harness read (docs/testing.md), not refit:
# neither knobs nor misspellings of one.
TEST_VARIABLES = frozenset({"REFIT_VLLM_FULL", "REFIT_VLLM_DP_MOE", "REFIT_ALLOW_MISSING_DEPS", "REFIT_OLD_GRPC_PYTHON",
                            "REFIT_OLD_GRPC_EXTRA_PATH", "REFIT_MLA_RESULT", "REFIT_CAPTURE_DONE",
                            "REFIT_VLLM_CAPTURE_DIR", "REFIT_VLLM_GPU_ENGINES"})

RUN_KNOBS: Mapping[str, Knob] = {k.field: k for k in KNOBS if k.scope == "run"}  # by field name


@dataclass(frozen=True)
class Settings:
    """The knobs' values in one process; fields are the knobs' names without ``REFIT_``, lower case."""

    ipc: str
    nccl: str
    table_copy: str
    table_blocks: tuple[int, int, int]
    batch_memcpy: str
    quantize_on_landing: bool
    trace: bool
    control_trace: str
    address: str
    token: str = dataclasses.field(repr=False)  # "" when unset
    uvloop: bool
    start_method: str
    test_kill: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """The settings ``environ`` (default: this process's environment) asks for; InvalidInput
        names a knob whose value is wrong."""
        env = os.environ if environ is None else environ
        known = {k.name for k in KNOBS} | TEST_VARIABLES
        for name in sorted(n for n in env if n.startswith("REFIT_") and n not in known):
            near = difflib.get_close_matches(name, [k.name for k in KNOBS], n=1)
            log.warning("%s is not a refit setting and is ignored%s (`refit settings` lists them)", name,
                        f"; did you mean {near[0]}?" if near else "")
        return cls(**{k.field: k.parse(env.get(k.name, k.default)) for k in KNOBS})

    def run_values(self) -> dict[str, Any]:
        """The values a run's members must share (scope ``run``), as JSON-able data."""
        return {f: getattr(self, f) for f in RUN_KNOBS}

    def with_run_values(self, values: Mapping[str, Any], who: str = "") -> "Settings":
        """These settings with a run's shared values (member 0's `run_values`); a value that
        differs from ours is logged, since this process's environment is then not what runs."""
        if set(values) != set(RUN_KNOBS):
            raise InvalidInput(f"run settings name {sorted(values)}, not the run knobs {sorted(RUN_KNOBS)}")
        theirs = {f: tuple(v) if isinstance(v, list) else v for f, v in values.items()}
        for f, v in theirs.items():
            if getattr(self, f) != v:
                log.warning("%s%s: this process says %r, the run's member 0 says %r; using member 0's",
                            f"{who}: " if who else "", RUN_KNOBS[f].name, getattr(self, f), v)
        return dataclasses.replace(self, **theirs)


_lock = threading.Lock()
_from_env: Settings | None = None
_in_use: Settings | None = None  # a run's settings (`adopt`) or a test's (`using`)


def current() -> Settings:
    """The settings in force in this process: the run's adopted ones, else the environment's
    (read on the first call)."""
    return _in_use if _in_use is not None else from_environment()


def adopt(run_values: Mapping[str, Any], who: str = "") -> Settings:
    """Use a run's shared values in this process from now on (a process drives one member at a
    time; its next run adopts that run's values)."""
    global _in_use
    settings = from_environment().with_run_values(run_values, who)
    _in_use = settings
    return settings


def from_environment() -> Settings:
    """This process's own settings, whatever a run adopted."""
    global _from_env
    with _lock:
        if _from_env is None:
            _from_env = Settings.from_env()
        return _from_env


@contextmanager
def using(**fields: Any) -> Iterator[Settings]:
    """Settings with ``fields`` changed, in force in this process for the ``with`` block (tests)."""
    global _in_use
    before = _in_use
    _in_use = dataclasses.replace(current(), **fields)
    try:
        yield _in_use
    finally:
        _in_use = before


def reload() -> Settings:
    """Read the environment again and drop any adopted run values (tests that change it)."""
    global _from_env, _in_use
    with _lock:
        _from_env, _in_use = None, None
    return current()


def token_set_empty() -> bool:
    """Whether ``REFIT_TOKEN`` is set, to nothing: a coordinator then starts open, which it says."""
    return os.environ.get("REFIT_TOKEN") == ""


def json_schema() -> dict[str, Any]:
    """The knobs as a JSON schema (``refit settings --json-schema``): a pydantic model over `KNOBS`,
    each variable a string with its choices, default and words."""
    from pydantic import ConfigDict, Field, create_model

    fields: dict[str, Any] = {}
    for k in KNOBS:
        kind = Literal[k.choices] if k.choices else str  # type: ignore[valid-type]
        words = k.what + (f" (form: {k.form})" if k.form and not k.choices else "")
        fields[k.name] = (kind, Field(default=k.default, description=words))
    model = create_model("RefitSettings", __config__=ConfigDict(extra="forbid"), **fields)
    return model.model_json_schema()


def markdown_table() -> str:
    """The knobs as docs/performance.md shows them."""
    rows = ["| variable | scope | values | default | what it does |", "|---|---|---|---|---|"]
    for k in KNOBS:
        values = " / ".join(f"`{c}`" for c in k.choices) if k.choices else k.form
        default = f"`{k.default}`" if k.default else "unset"
        what = f"{k.what} ([more]({k.see.removeprefix('docs/')}))" if k.see else k.what
        rows.append(f"| `{k.name}` | {k.scope} | {values} | {default} | {what} |")
    return "\n".join(rows)
