"""The agents' data plane (`refit.control.dataplane_executor`) under deadlines, cancellation and a
hung peer: four real member processes (spawn), gloo on CPU, a real ``TCPStore`` rendezvous in
the test process, tiny Qwen3-MoE megatron:tp2ep2 -> vllm:tp2 — no coordinator, the test plays it.

Reproduces issue 11 item 5: the data communicator was built with the first refit's timeout (60 s
here), and a later 5 s refit whose trainer hangs mid-transfer (SIGSTOP) left its peers waiting
~60 s; now every wait is bounded by the refit's own deadline and the error names the hung peer.

Reproduces a teardown stall found on 2026-11-22: after a 60 s refit was abandoned at a barrier one
member never reached, closing the data plane waited ~58 s (gloo's destructor waits for the barrier
still posted in the control group); now the group is handed to a daemon thread that lets it go once
that barrier times out, and closing takes a fraction of a second.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import torch.distributed as dist

from refit.planners import make_plan
from tests.harness.control_cluster import DST, MODEL, SRC
from tests.harness.procs import warm_context
from tests.harness.tiny import tiny_spec

CTX = warm_context()  # its processes fork from a server that imported torch once
NAMES = ("trainer/0", "trainer/1", "engine/0", "engine/1")


def _member_main(conn: Any, port: int, index: int, plan_dict: dict) -> None:
    """One member: its tensors, an `ExecutorDataPlane`, refits run on a thread as an agent would."""
    import torch

    from refit.sides import Side
    from refit.control.dataplane import Rendezvous, RunContext, Seat
    from refit.control.dataplane_executor import ExecutorDataPlane
    from refit.layouts import resolve_layout
    from refit.plan import Plan
    from tests.harness.control_cluster import fill
    from tests.harness.procs import strike_self, warm_context

    class Watched(RunContext):
        """The refit's context, counting how often the data plane asks for the time left once it
        reached the start barrier (`RunContext.starting`): a member waiting in a barrier asks every
        50 ms (`Member.barrier`), so a few asks mean it is waiting there."""

        polls = 0

        def remaining(self) -> float:
            if self.reached_start.is_set():
                self.polls += 1
            return super().remaining()

    torch.set_num_threads(1)
    spec = tiny_spec(MODEL)
    side, rank = (Side.TRAINER, index) if index < 2 else (Side.ENGINE, index - 2)
    layout = resolve_layout(SRC if side is Side.TRAINER else DST, spec, side)
    tensors = fill(spec, layout, rank, 1 if side is Side.TRAINER else 0)
    plan = Plan.from_dict(plan_dict)
    dp = ExecutorDataPlane("comm")
    dp.open(Seat(side, rank, spec, layout))
    ctx: RunContext | None = None

    def run(prefix: str, timeout: float, version: int) -> None:
        t0 = time.monotonic()
        try:
            dp.run(plan, tensors, ctx)
            conn.send(("done", True, "", time.monotonic() - t0))
        except Exception as e:
            conn.send(("done", False, f"{type(e).__name__}: {e}", time.monotonic() - t0))

    def retiring() -> list[str]:  # the daemon threads still holding an abandoned control group
        return [t.name for t in threading.enumerate() if t.name.startswith("refit-retire")]

    conn.send(("ready", os.getpid()))
    while True:
        cmd, *args = conn.recv()
        if cmd == "refit":
            prefix, timeout, version, hang = args
            dp.refit_hook = (lambda: strike_self(signal.SIGSTOP)) if hang else None
            ctx = Watched(plan.plan_hash, f"r{version}", version,
                          Rendezvous("127.0.0.1", port, prefix, 4, index, NAMES), time.monotonic() + timeout)
            threading.Thread(target=run, args=(prefix, timeout, version), daemon=True).start()
        elif cmd == "cancel":
            ctx.cancelled.set()
        elif cmd == "fill":
            fill(spec, layout, rank, args[0], tensors)
            conn.send(("ok", None))
        elif cmd == "close":  # tear the data plane down: how long it took, which releases still run
            t0 = time.monotonic()
            dp.close()
            conn.send(("ok", (time.monotonic() - t0, retiring())))
        elif cmd == "polls":
            conn.send(("ok", ctx.polls))
        elif cmd == "retiring":
            conn.send(("ok", retiring()))
        elif cmd == "check":
            want = fill(spec, layout, rank, args[0])
            conn.send(("ok", [n for n in want if not torch.equal(want[n].view(torch.int16), tensors[n].view(torch.int16))]))
        else:
            os._exit(0)


class Members:
    def __init__(self) -> None:
        spec = tiny_spec(MODEL)
        self.plan = make_plan(spec, SRC, DST, "colocated", "p2p", 4096).plan
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.conns, self.procs = [], []
        for i in range(4):
            parent, child = CTX.Pipe()
            p = CTX.Process(target=_member_main, args=(child, self.store.port, i, self.plan.to_dict()), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            assert c.poll(120) and c.recv()[0] == "ready"

    def refit(self, which: list[int], prefix: str, timeout: float, version: int, hang: int | None = None) -> None:
        for i in which:
            self.conns[i].send(("refit", prefix, timeout, version, i == hang))

    def results(self, which: list[int], wait: float) -> dict[int, tuple[bool, str, float]]:
        out = {}
        for i in which:
            assert self.conns[i].poll(wait), f"{NAMES[i]} did not return within {wait} s"
            _, ok, err, seconds = self.conns[i].recv()
            out[i] = (ok, err, seconds)
        return out

    def ask(self, i: int, *cmd: Any) -> Any:
        self.conns[i].send(cmd)
        assert self.conns[i].poll(30), f"{NAMES[i]} did not answer {cmd[0]} within 30 s"
        return self.conns[i].recv()[1]

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(5)


@pytest.fixture(scope="module")
def members():
    m = Members()
    yield m
    m.close()


def _ok_refit(m: Members, prefix: str, version: int) -> None:
    for i in (0, 1):
        m.ask(i, "fill", version)
    m.refit([0, 1, 2, 3], prefix, 60.0, version)
    res = m.results([0, 1, 2, 3], 60)
    assert all(ok for ok, _, _ in res.values()), res
    assert m.ask(2, "check", version) == [] and m.ask(3, "check", version) == []


def _waiting_in_barrier(m: Members, which: list[int], timeout: float = 30.0) -> None:
    """Return once each member of ``which`` waits in its start barrier: past `RunContext.starting`
    and asking for the time left again and again (once for the barrier's timeout, then every
    50 ms while it waits), not merely told to refit."""
    end = time.monotonic() + timeout
    for i in which:
        while m.ask(i, "polls") < 3:
            assert time.monotonic() < end, f"{NAMES[i]} never waited in its start barrier"
            time.sleep(0.02)


def test_cancelled_refit_leaves_the_barrier_at_once(members: Members) -> None:
    _ok_refit(members, "p/1/", 1)
    # trainer/1 never comes; the others wait at the start barrier of a 30 s refit until the
    # coordinator abandons it (ctx.cancelled): they must leave within a fraction of a second.
    members.refit([0, 2, 3], "p/1/", 30.0, 2)
    _waiting_in_barrier(members, [0, 2, 3])
    t0 = time.monotonic()
    for i in (0, 2, 3):
        members.conns[i].send(("cancel",))
    res = members.results([0, 2, 3], 5)
    assert time.monotonic() - t0 < 1.0, res
    assert all(not ok and err.startswith("Cancelled") for ok, err, _ in res.values()), res


def test_teardown_after_an_abandoned_barrier_does_not_wait_for_its_deadline(members: Members) -> None:
    _ok_refit(members, "p/t/", 10)
    # trainer/1 never comes to a 60 s refit; the coordinator abandons it; the others leave at once
    # but their barrier stays posted in gloo until that deadline.
    members.refit([0, 2, 3], "p/t/", 60.0, 11)
    _waiting_in_barrier(members, [0, 2, 3])
    for i in (0, 2, 3):
        members.conns[i].send(("cancel",))
    res = members.results([0, 2, 3], 5)
    assert all(not ok and err.startswith("Cancelled") for ok, err, _ in res.values()), res
    # Tearing every data plane down takes a fraction of a second (it took ~58 s): the members that
    # gave up a barrier hand their control group to a daemon thread each.  trainer/1 closes last:
    # until then their barrier cannot end (as with a peer dead or stuck).
    closed = {i: members.ask(i, "close") for i in (0, 2, 3, 1)}
    assert all(seconds < 5.0 for seconds, _ in closed.values()), closed
    assert {i: len(threads) for i, (_, threads) in closed.items()} == {0: 1, 1: 0, 2: 1, 3: 1}, closed
    # trainer/1's group is gone, which ends the barrier in the others' (a closed connection):
    # their threads let the groups go and end, long before the deadline.
    t0 = time.monotonic()
    while any(members.ask(i, "retiring") for i in (0, 2, 3)):
        assert time.monotonic() - t0 < 10.0, "the abandoned control groups were never released"
        time.sleep(0.1)
    # A later refit, of a new generation, moves every byte.
    _ok_refit(members, "p/u/", 12)


def test_deadline_bounds_waits_and_names_the_hung_peer(members: Members) -> None:
    # A new generation (as the coordinator makes after a failure), built during a 60 s refit.
    _ok_refit(members, "p/2/", 3)
    for i in (0, 1):
        members.ask(i, "fill", 4)
    # Then a 5 s refit in which trainer/1 stops itself (SIGSTOP) right after posting its first send.
    members.refit([0, 1, 2, 3], "p/2/", 5.0, 4, hang=1)
    res = members.results([0, 2, 3], 20)
    assert all(not ok for ok, _, _ in res.values()), res
    assert all(seconds < 6.5 for _, _, seconds in res.values()), res  # was ~60 s: the group's timeout
    # Each names the peer it was waiting on: an engine waits on trainer/1 (the hung one), others
    # may wait on that engine in turn (trainer/0 sending to it) or list who never reached a barrier.
    assert any("with trainer/1 failed: Timed out" in res[i][1] for i in (2, 3)), res
    assert all(any(f"{n} " in err for n in NAMES if n != NAMES[i]) for i, (_, err, _) in res.items()), res
    os.kill(members.procs[1].pid, signal.SIGKILL)


def test_a_member_whose_prepare_fails_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """`prepare` refusing the plan (say, one for other layouts) left a built `Member` nobody held:
    its control group and communicator were never closed.  The store, the rendezvous and the
    Member are stand-ins here: only the data plane's own handling is under test."""
    import refit.control.dataplane_executor as dpe
    from refit.sides import Side
    from refit.control.dataplane import Rendezvous, RunContext, Seat
    from refit.errors import RefitError
    from refit.layouts import resolve_layout
    from tests.harness.control_cluster import fill

    closed: list[bool] = []

    class RefusingMember:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def prepare(self, plan: Any) -> None:
            raise RefitError("plan is for another layout")

        def close(self) -> None:
            closed.append(True)

    monkeypatch.setattr(dpe, "Member", RefusingMember)
    monkeypatch.setattr(dpe, "locate", lambda *a: (None, False, True))
    spec = tiny_spec(MODEL)
    plan = make_plan(spec, SRC, DST).plan
    layout = resolve_layout(SRC, spec, Side.TRAINER)
    ctx = RunContext(plan.plan_hash, "r1", 1, Rendezvous("127.0.0.1", 1, "p/", 4, 0, NAMES),
                     time.monotonic() + 10, store=lambda timeout_s: None)
    dp = dpe.ExecutorDataPlane("comm")
    dp.open(Seat(Side.TRAINER, 0, spec, layout))
    with pytest.raises(RefitError, match="another layout"):
        dp.run(plan, fill(spec, layout, 0, 1), ctx)
    assert closed == [True]
