"""The barriers of a plan's members: how each `Member` waits for all the others.

A barrier is an all-reduce of one flag over the control group (gloo), its waits bounded by the
caller's ``remaining`` and given up as soon as the refit is abandoned; a member still waiting marks
its arrival in the store, so that a timeout names the members that never came.  Members with GPUs
on one host meet in shared memory instead (`refit.executor.shm_barrier`): offered at set-up, kept
only where every member mapped it.  A barrier given up stays posted in gloo until its own timeout,
so the control group is let go without waiting for it (`refit.executor.transports.retire`).

Apart from `refit.executor.member` because this protocol does not depend on what a member sets
up, prepares and replays: `Member` inherits it (`MemberBarriers`) and sets the attributes it reads.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from refit.errors import RefitFailed
from refit.executor.bound import Remaining
from refit.executor.shm_barrier import ShmBarrier
from refit.executor.topology import Topology
from refit.executor.transports import PeerError, ended, first_line, retire

log = logging.getLogger("refit.executor")


class MemberBarriers:
    """`Member`'s barriers, all-reduces over every member and the control group's teardown."""

    # Set by `Member.__init__`.
    store: dist.Store
    topo: Topology
    member: int
    names: list[str]
    name: str
    rounds: int  # barriers passed, in lockstep on every member
    ctl: dist.ProcessGroupGloo | None
    shm_barrier: ShmBarrier | None
    abandoned: list[dist.Work]  # barriers left unfinished: the control group still runs them

    def barrier(self, what: str, remaining: Remaining, flag: float = 0.0) -> float:
        """Wait for every member, at most ``remaining()``, giving up as soon as ``remaining``
        raises (the refit was abandoned); returns the sum of the members' ``flag``.  A member
        still waiting after its first 50 ms marks its arrival in the store, so that a timeout
        names the members that never came (a barrier over within 50 ms, the usual case of a
        refit, costs no store call).  A barrier given up stays posted in the control group until
        its own timeout (the refit's deadline): it is kept in ``self.abandoned`` so that `close`
        does not wait for it.  Members on one host with GPUs meet in shared memory instead
        (`refit.executor.shm_barrier`), whose slots say who never came; nothing stays posted."""
        if self.shm_barrier is not None:
            if self.ctl is None:
                raise RefitFailed(f"{self.name}: {what} barrier after close")
            self.rounds += 1
            return float(self.shm_barrier.wait(self.rounds, bool(flag), lambda: self._left(what, remaining)))
        flags = torch.full((1,), flag)
        self._reduce(what, flags, dist.ReduceOp.SUM, remaining)
        return float(flags.item())

    def _reduce(self, what: str, values: torch.Tensor, op: dist.ReduceOp, remaining: Remaining) -> None:
        """All-reduce the CPU tensor ``values`` in place over every member (`barrier`'s waits)."""
        if self.ctl is None:
            raise RefitFailed(f"{self.name}: {what} barrier after close")
        self.rounds += 1
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        opts.timeout = datetime.timedelta(seconds=max(remaining(), 0.001))
        try:
            work = self.ctl.allreduce([values], opts)
        except RuntimeError as e:
            raise PeerError(f"lost contact with another member at the {what} barrier: {first_line(e)}") from None
        try:
            # Wakes at once when every member arrived.  (Not a callback on the work's future: gloo
            # running it as the interpreter exits, a barrier abandoned, aborts the process.)
            marked = False
            while not ended(work, 0.05):
                if not marked:
                    mark = getattr(self.store, "set_async", self.store.set)  # no round trip where the store can
                    mark(f"arrived/{self.rounds % 3}/{self.member}", str(self.rounds))
                    marked = True
                self._left(what, remaining)  # raises when the refit is abandoned: give up now
        except BaseException:
            self.abandoned.append(work)  # still pending in gloo until its timeout
            raise
        try:
            work.wait()
        except RuntimeError as e:
            self._left(what, remaining)  # the group's own timeout (the same deadline) fired first
            raise PeerError(f"lost contact with another member at the {what} barrier (a worker died?): "
                            f"{first_line(e)}; {self._absent()}") from None

    def _left(self, what: str, remaining: Remaining) -> None:
        try:
            remaining()
        except TimeoutError:
            raise TimeoutError(f"timed out at the {what} barrier; {self._absent()}") from None

    def _absent(self) -> str:
        """Which members have not reached the current barrier (asked of the shared barrier or
        of the store)."""
        try:
            if self.shm_barrier is not None:
                missing = [self.names[m] for m in self.shm_barrier.absent(self.rounds)]
            else:
                missing = [self.names[m] for m in range(len(self.topo.members)) if not self._arrived(m)]
        except Exception as e:  # the store itself is gone: say so rather than guess
            return f"could not ask the store who is missing ({first_line(e)})"
        return f"waiting on {', '.join(missing)} (never reached it)" if missing else "every member reached it"

    def _arrived(self, m: int) -> bool:
        key = f"arrived/{self.rounds % 3}/{m}"
        return self.store.check([key]) and self.store.get(key).decode() == str(self.rounds)

    # ------------------------------------------------------------------ set-up: the shared barrier
    def _offer_shm_barrier(self) -> ShmBarrier | None:
        """Map the members' shared barrier (member 0 creates it) and say in the store whether
        this member could; `_agree_shm_barrier` decides, after the setup barrier."""
        barrier = None
        try:
            if self.member == 0:
                barrier = ShmBarrier(ShmBarrier.new_path(), 0, len(self.topo.members), create=True)
                self.store.set("barrier/shm", barrier.path)
            else:
                path = self.store.get("barrier/shm").decode()
                barrier = ShmBarrier(path, self.member, len(self.topo.members), create=False) if path else None
        except OSError as e:  # another host (the name is only in member 0's /dev/shm), another container: gloo
            log.info("%s: refit barriers over gloo: the shared barrier cannot be mapped here (%s)", self.name, e)
            if self.member == 0:
                self.store.set("barrier/shm", "")
        self.store.set(f"barrier/ok/{self.member}", "1" if barrier is not None else "0")
        return barrier

    def _agree_shm_barrier(self) -> None:
        """Keep the shared barrier only if every member mapped it (each said so before the setup
        barrier); member 0 then removes its name, so nothing is left behind however the run ends."""
        keys = [f"barrier/ok/{m}" for m in range(len(self.topo.members))]
        multi_get = getattr(self.store, "multi_get", None)
        oks = multi_get(keys) if multi_get is not None else [self.store.get(k) for k in keys]
        if self.member == 0 and self.shm_barrier is not None:
            self.shm_barrier.unlink()
        if not all(v == b"1" for v in oks):
            self._drop_shm_barrier()

    def _drop_shm_barrier(self) -> None:
        barrier, self.shm_barrier = self.shm_barrier, None
        if barrier is not None:
            if self.member == 0:
                barrier.unlink()
            barrier.close()

    # ------------------------------------------------------------------ teardown
    def _retire_ctl(self) -> None:
        """Drop the control group; with abandoned barriers in it, through `retire` (no wait)."""
        ctl, self.ctl = self.ctl, None
        if ctl is not None:
            retire(ctl, self.abandoned, f"{self.name}: control group")
        self.abandoned = []
        self._drop_shm_barrier()
