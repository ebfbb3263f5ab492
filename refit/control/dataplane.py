"""The contract between a worker agent and the data plane that moves its share of a refit.

A data plane serves one agent, bound to it once, then told each plan once and run per refit::

    plane.open(seat)                          # when the agent is built: who it moves bytes for
    plane.prepare(plan)                       # the first time the agent is told to run ``plan``
    bytes_moved, seconds = plane.run(plan, tensors, ctx)   # every refit of it
    plane.close()                             # when the agent stops

* ``seat`` (`Seat`) — the agent's side (`refit.sides.Side`: a trainer sends its boxes,
  an engine receives into its tensors), its rank in its own layout, the model, and its host;
* ``plan`` — the `refit.plan.Plan`, parsed once per plan and cached by the agent; ``prepare``
  may refuse it (`InvalidInput`) before any byte of it moves;
* ``tensors`` — the agent's local tensors by local name, read afresh at every refit;
* ``ctx`` (`RunContext`) — what the control plane adds per refit: its id and version, the
  rendezvous to build a communicator on (its store: ``ctx.open_store(seconds)``, the
  coordinator's own, under its token), the deadline, and a cancel flag set when the coordinator
  abandons the refit.

A data plane must return by ``ctx.deadline`` (raise `TimeoutError` past it; bound every wait by
``ctx.remaining()``, never by a timeout fixed when a communicator was built), must raise rather
than return on any failure (the agent reports the message, and the coordinator names the worker),
and must not write into an engine's tensors once ``ctx.cancelled`` is set.  It may cache
communicators per ``(plan_id, rendezvous.prefix)``: the prefix changes whenever they must be
rebuilt.  A data plane that sets ``reports_start = True`` calls ``ctx.starting()`` right before
its first wait on every member of the refit (the start barrier): a failure before that proves
nothing moved, and the engines keep reporting what they held (without it, any failure marks
them stale).  With ``ctx.phase_hook`` set, it calls ``ctx.phase_hook.landed(plan, key)`` as each
phase of the plan has landed on every member (`PhaseHook`).  A data plane whose call never blocks may set ``inline = True``: the agent then calls it
on its event loop instead of a thread (saves a thread hop; the no-op plane of the overhead bench).
`BaseDataPlane` holds the defaults.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Protocol, Union

from refit.sides import Side
from refit.errors import InvalidInput, RefitFailed
from refit.protocols import missing
from refit.spec import check_tensor_table

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from refit.executor.delta import DeltaStats
    from refit.layouts import Layout
    from refit.plan import Plan
    from refit.spec import ModelSpec


Tensors = Mapping[str, "torch.Tensor"]
# An agent's tensors.  A callable is read at every refit: the agent follows the model through casts,
# offload and reload (a member whose tensors moved is built again within the refit, see
# `refit.control.dataplane_executor`).  A plain mapping means *these exact tensors* for as long as
# the agent runs: a parameter re-pointed afterwards (``model.float(); model.bfloat16()``) is not
# followed, and the agent goes on sending the memory it was given.
TensorSource = Union[Tensors, Callable[[], Tensors]]


def check_tensors(spec: "ModelSpec", layout: "Layout", rank: int, tensors: Tensors) -> None:
    """Refuse local tensors that are not the ones ``layout`` gives ``rank``: name the first
    difference (a missing tensor, a wrong shape or dtype).  Extra tensors are ignored."""
    found = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in tensors.items()}
    expected = {lt.name: (lt.shape, lt.dtype) for lt in layout.local_tensors(spec, rank)}
    check_tensor_table(found, expected, f"rank {rank} of {layout.describe()}", extra_ok=True)


class Cancelled(RefitFailed):
    """The coordinator abandoned this refit (another member failed)."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the members of a plan meet: keys under ``prefix`` in the coordinator's store (an
    agent's `RunContext.open_store`), or in a ``TCPStore`` at ``host:port`` for data planes driven
    without a coordinator (tests).  Members are ordered source ranks, then destination ranks;
    ``members`` names them."""

    host: str
    port: int
    prefix: str
    world_size: int
    rank: int
    members: tuple[str, ...] = ()

    def member(self, group_rank: int) -> str:
        if 0 <= group_rank < len(self.members):
            return self.members[group_rank]
        return f"member {group_rank}"


@dataclass(frozen=True)
class Seat:
    """Whom a data plane moves bytes for: rank ``rank`` of ``layout`` on ``side``, holding
    ``spec``; ``host`` is the address its sockets bind to."""

    side: Side
    rank: int
    spec: "ModelSpec"
    layout: "Layout"
    host: str = "127.0.0.1"

    @property
    def endpoint(self) -> tuple[Side, int]:
        """This seat as the executor names it (`refit.executor.topology.Endpoint`): (side, rank)."""
        return self.side, self.rank


@dataclass
class RunContext:
    """One refit, as one agent runs its share of it."""

    plan_id: str
    refit_id: str
    version: int
    rendezvous: Rendezvous
    deadline: float  # time.monotonic() on this worker
    cancelled: threading.Event = field(default_factory=threading.Event)
    phase_hook: "PhaseHook | None" = None  # an engine's: told as each phase of the plan lands
    # The rendezvous store, its waits bounded by the seconds given; default: a TCPStore client
    # at rendezvous.host:port.  Agents meet in the coordinator's store instead (authenticated).
    store: "Callable[[float], dist.Store] | None" = None
    reached_start: threading.Event = field(default_factory=threading.Event)  # see `starting`
    atomic: bool = False  # all or none: an engine's tensors here are its staging (`AgentShare._staging`)
    verify: bool = False  # the data plane is asked for its transfers' checksums after the run
    check_only: bool = False  # a Check: nothing moves, the agent reads checksums of its tensors
    delta: bool = False  # a delta refit (`refit.executor.delta`): trainers send what changed, keep what they send
    delta_base: bool = False  # every engine holds what the trainers last sent: they may start from it

    def open_store(self, timeout_s: float) -> "dist.Store":
        """The rendezvous store (keys under the rendezvous prefix)."""
        if self.store is not None:
            return self.store(timeout_s)
        from refit.executor.seating import connect

        return connect(self.rendezvous.host, self.rendezvous.port, self.rendezvous.prefix, timeout_s)

    def starting(self) -> None:
        """The data plane is about to wait on the other members at the start barrier: from
        here on, bytes may move."""
        self.reached_start.set()

    def remaining(self) -> float:
        """Seconds left; raises once the refit is cancelled or past its deadline, so that every
        blocking step can be bounded by it."""
        if self.cancelled.is_set():
            raise Cancelled(f"refit {self.refit_id} was abandoned by the coordinator")
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"refit {self.refit_id} is past its deadline")
        return left


class PhaseHook(Protocol):
    """What an engine does around a refit of a phased plan (`refit.phases`).  A data plane calls
    ``landed`` on every member holding a hook, after each phase's end barrier (for an unphased
    plan once, with the key `refit.phases.WHOLE`); an exception from either method fails the
    refit, naming this worker."""

    def check(self, plan: "Plan") -> None:
        """Raise (RefitError) to refuse a plan before any byte of it moves."""

    def landed(self, plan: "Plan", phase: int) -> None:
        """Every member finished writing phase ``phase`` (its key); the next phase has not started."""


class DataPlane(Protocol):
    """What an agent calls of its data plane, capabilities included: declared here, given defaults
    by `BaseDataPlane`, and checked once when an agent takes one (`check_data_plane`), so that the
    agent reads them rather than guessing."""

    inline: bool  # runs a refit on the agent's event loop (it moves nothing that takes time)
    reports_start: bool  # calls ``ctx.starting()`` before its start barrier
    verifies: bool  # ``checksums`` gives the transfers' checksums of a refit
    last_delta: "DeltaStats | None"  # what the last delta refit sent over wires, if it was one
    delta_fallback: str  # why the last delta refit went in full here, if it did

    def open(self, seat: Seat) -> None: ...

    def prepare(self, plan: "Plan", rank: int | None = None) -> None: ...

    def run(self, plan: "Plan", tensors: Tensors, ctx: RunContext) -> tuple[int, float]: ...

    def checksums(self, plan: "Plan", tensors: "Tensors | None" = None) -> dict[int, int]: ...

    def close(self) -> None: ...


def check_data_plane(data_plane: object) -> None:
    """Refuse, naming them, a data plane without every member `DataPlane` declares (subclass
    `BaseDataPlane` for the defaults)."""
    lacking = missing(data_plane, DataPlane)
    if lacking:
        raise InvalidInput(f"data_plane {type(data_plane).__name__} lacks {', '.join(lacking)} "
                           "(refit.control.dataplane.DataPlane; subclass BaseDataPlane for the defaults)")


class BaseDataPlane:
    """The defaults of a `DataPlane`: remembers its seat, accepts every plan, holds nothing."""

    inline = False
    reports_start = False
    verifies = False
    last_delta: "DeltaStats | None" = None
    delta_fallback = ""
    _seat: Seat | None = None

    def open(self, seat: Seat) -> None:
        if self._seat is not None and self._seat != seat:
            raise RefitFailed(f"this data plane already serves {self._seat.side.value} rank {self._seat.rank}; "
                              "one data plane per agent")
        self._seat = seat

    @property
    def seat(self) -> Seat:
        if self._seat is None:
            raise RefitFailed("the data plane was not opened: an agent opens it (`open(seat)`) before any refit")
        return self._seat

    def prepare(self, plan: "Plan", rank: int | None = None) -> None:
        """Get ready to run ``plan`` as this seat's rank, or as ``rank`` of the plan's layout."""

    def run(self, plan: "Plan", tensors: Tensors, ctx: RunContext) -> tuple[int, float]:
        raise NotImplementedError

    def checksums(self, plan: "Plan", tensors: "Tensors | None" = None) -> dict[int, int]:
        """This seat's checksum of each stage-1 transfer of ``plan`` it sends or receives, by
        transfer index (`refit.executor.checksum`): after ``run`` (a verified refit), or of
        ``tensors`` as they are (a Check, nothing moved)."""
        raise InvalidInput("this data plane cannot verify refits")

    def close(self) -> None:
        pass


class NoopDataPlane(BaseDataPlane):
    """Moves nothing: for control-plane tests and the coordination-overhead bench."""

    inline = True

    def run(self, plan: "Plan", tensors: Tensors, ctx: RunContext) -> tuple[int, float]:
        return 0, 0.0
