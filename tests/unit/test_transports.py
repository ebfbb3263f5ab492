"""`refit.executor.transports` on CPU: shared-memory export and import through plain handles, the
gloo communicator's bounded waits naming the peer, a gloo group let go with a barrier still posted
(`retire`), and backend error trimming."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch
import torch.distributed as dist

from refit.executor.handles import HandleError
from refit.executor.shards import allocate, remove_file, views
from refit.executor.transports import GlooComm, PeerError, export_arena, first_line, gloo_group, import_share, retire
from refit.layouts.base import LocalTensor


def test_shm_arena_export_import_shares_memory() -> None:
    lts = [LocalTensor("a", (3, 5), "bfloat16", ()), LocalTensor("b", (7,), "float32", ())]
    path = f"/dev/shm/refit-test-{uuid.uuid4().hex[:8]}"
    try:
        mine = allocate(lts, torch.device("cpu"), path)
        peer = views(import_share(export_arena(mine)), lts)
        g = torch.Generator().manual_seed(1)
        mine.tensors["b"].copy_(torch.randn(7, generator=g))
        assert torch.equal(peer["b"], mine.tensors["b"])  # one memory, two mappings
        peer["a"].copy_(torch.randn(3, 5, generator=g).to(torch.bfloat16))
        assert torch.equal(mine.tensors["a"].view(torch.int16), peer["a"].view(torch.int16))
    finally:
        remove_file(path)
    with pytest.raises(RuntimeError, match="/dev/shm"):
        export_arena(allocate(lts, torch.device("cpu")))  # a private arena cannot be shared
    with pytest.raises(HandleError):
        import_share(b'{"kind": "shm", "path": "/tmp/x", "nbytes": 8}')


def _pair(timeout_s: float) -> list[GlooComm]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    comms: list = [None, None]

    def build(rank: int) -> None:  # a store client per thread: a client serialises its calls
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
        comms[rank] = GlooComm(dist.PrefixStore("t", client), rank, 2, timeout_s, ["trainer rank 0", "engine rank 0"])

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    comms.append(store)  # keep the store alive with the groups
    return comms


def test_gloo_send_recv_and_a_wait_bounded_by_the_caller() -> None:
    a, b, _store = _pair(60.0)
    data = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    got = torch.zeros(1000, dtype=torch.uint8)
    hs, hr = a.post([(1, 7, data)], []), b.post([], [(0, 7, got)])
    a.wait(hs, 5.0)
    b.wait(hr, 5.0)
    assert torch.equal(got, data)
    # Nobody sends tag 8: the group was built with 60 s, the wait gives up at the caller's 0.5 s
    # and names the peer it was waiting on.
    t0 = time.monotonic()
    with pytest.raises(PeerError, match=r"receiving bucket 8 with trainer rank 0 failed: Timed out"):
        b.wait(b.post([], [(0, 8, got)]), 0.5)
    assert time.monotonic() - t0 < 3.0


def _groups(n: int, timeout_s: float) -> list:
    """``n`` gloo groups of one run, built on threads (then the store, to keep it alive)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    groups: list = [None] * n

    def build(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
        groups[rank] = gloo_group(dist.PrefixStore("g", client), rank, n, timeout_s)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return groups + [store]


def _barrier(group: dist.ProcessGroupGloo, timeout_s: float) -> dist.Work:
    opts = dist.AllreduceOptions()
    opts.timeout = datetime.timedelta(seconds=timeout_s)
    return group.allreduce([torch.rand(3)], opts)


def test_retire_lets_a_group_go_without_waiting_for_its_abandoned_barrier() -> None:
    # Members 0 and 1 post a 60 s barrier that member 2 never reaches, then give it up.  Dropping
    # such a group waits ~60 s (gloo's destructor); retired, it goes to a daemon thread at once.
    *groups, _store = _groups(3, 60.0)
    barriers = [_barrier(groups[m], 60.0) for m in (0, 1)]
    t0 = time.monotonic()
    threads = [retire(groups[m], [barriers[m]], f"member {m}") for m in (0, 1)]
    groups[0] = groups[1] = None
    barriers.clear()
    assert time.monotonic() - t0 < 1.0
    time.sleep(0.3)
    assert all(t is not None and t.is_alive() and t.daemon for t in threads)  # the barrier cannot end yet
    # Nothing pending: nothing to hold, the group goes with the caller's reference.  Member 2's
    # group closing ends the others' barrier (a closed connection): their threads drop them and end.
    assert retire(groups[2], [], "member 2") is None
    groups[2] = None
    for t in threads:
        t.join(10.0)
    assert not any(t.is_alive() for t in threads) and time.monotonic() - t0 < 10.0


_EXIT_WHILE_RETIRING = """
import sys, threading, torch, torch.distributed as dist
from tests.unit.test_transports import _barrier, _groups
from refit.executor.transports import retire
groups = _groups(2, 60.0)  # member 1 never comes to member 0's barrier
retire(groups[0], [_barrier(groups[0], 60.0)], "member 0")
groups[0] = None
print("retired", flush=True)
"""


def test_a_process_exits_cleanly_while_a_retired_group_waits() -> None:
    # The thread waits in Python, not inside gloo's destructor (a process exiting while a thread
    # sits in it aborts: "terminate called without an active exception").
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", _EXIT_WHILE_RETIRING], cwd=root, env=env, capture_output=True,
                         text=True, timeout=50)
    assert out.returncode == 0 and "retired" in out.stdout and "terminate" not in out.stderr, out
    assert time.monotonic() - t0 < 40.0  # not the barrier's 60 s


def test_first_line_trims_backend_noise() -> None:
    e = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [1.2.3.4]:5"
                     ". This is typically caused by a peer crash\nmore")
    assert first_line(e) == "Connection closed by peer [1.2.3.4]:5"
    assert first_line(RuntimeError("")) == "RuntimeError"
