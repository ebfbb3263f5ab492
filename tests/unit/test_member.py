"""`refit.executor.member`: the one set-up of a member, on CPU, two members in threads of this
process (a colocated source and destination on one "device": the passive source shares its
/dev/shm arena, the destination drives and copies out of it), real gloo groups and store."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from refit import settings
from refit.errors import RefitError
from refit.executor.member import Budget, Member, shares
from refit.executor.seating import connect, locate
from refit.executor.shards import allocate, fill_sentinel, fill_source, verify
from refit.executor.topology import Topology
from refit.planners import make_plan
from refit.sides import Side
from refit.spec import ModelConfig, build_spec
from tests.harness.procs import together

DENSE = build_spec("tiny-dense", ModelConfig(
    arch="qwen2", hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8,
    intermediate_size=64, vocab_size=250, qkv_bias=True, tie_embeddings=True, dtype="float32"))


def _together(fns: list[Callable[[], Any]], timeout: float = 60.0) -> list[Any]:
    return together(fns, timeout)


def test_colocated_pair_refits_bit_exact_and_names_the_absent() -> None:
    r = make_plan(DENSE, "tp1", "tp1", "colocated", "p2p", 4096)
    topo = Topology.one_per_rank(r.plan.placement)  # member 0: src 0 (passive), member 1: dst 0 (driver)
    assert shares(topo, 0, (Side.TRAINER, 0), ipc=False) and not shares(topo, 1, (Side.ENGINE, 0), ipc=False)
    # pushing on one device: the destination's own driver writes it, nobody maps it (vLLM's
    # sleep-mode memory cannot be exported through CUDA IPC)
    assert shares(topo, 0, (Side.TRAINER, 0), ipc=True, push=True) and not shares(topo, 1, (Side.ENGINE, 0), ipc=True, push=True)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    session = uuid.uuid4().hex[:8]
    src = allocate(list(r.src.local_tensors(DENSE, 0)), torch.device("cpu"), f"/dev/shm/refit-{session}-src0")
    dst = allocate(list(r.dst.local_tensors(DENSE, 0)), torch.device("cpu"))
    fill_sentinel(dst)
    names = ["trainer rank 0", "engine rank 0"]

    def member(m: int) -> Member:
        store = connect("127.0.0.1", master.port, session, 30.0)
        own = {(Side.TRAINER, 0): src} if m == 0 else {(Side.ENGINE, 0): dst}
        return Member(store, topo, m, "cpu", own, DENSE, r.src, r.dst, names, Budget(30.0)).prepare(r.plan)

    members = _together([lambda: member(0), lambda: member(1)])
    assert all(isinstance(m, Member) for m in members), members
    passive, driver = members
    assert not passive.bounds and driver.bounds and driver.comm is None  # one device: no wire
    for seed in (3, 4):
        fill_source(src, DENSE, seed)
        seconds = _together([lambda: passive.refit(Budget(10.0)), lambda: driver.refit(Budget(10.0))])
        assert all(isinstance(s, float) for s in seconds), seconds
        v = verify(dst, DENSE, seed)
        assert v.ok and v.checked == sum(t.numel for t in DENSE.tensors)
    # The passive member never comes to the next barrier.  An abandoned refit (``remaining``
    # raises something of the caller's) leaves at once, with the caller's error; a refit past its
    # budget gives up at the deadline and names the member that never came.

    class Abandoned(RuntimeError):
        pass

    flag = threading.Event()
    threading.Timer(0.2, flag.set).start()

    def remaining() -> float:
        if flag.is_set():
            raise Abandoned("the coordinator gave up")
        return 30.0

    t0 = time.monotonic()
    with pytest.raises(Abandoned):
        driver.barrier("refit start", remaining)
    assert time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"refit start barrier; waiting on trainer rank 0 \(never reached it\)"):
        driver.refit(Budget(0.5))
    assert time.monotonic() - t0 < 2.0
    for m in members:
        m.close()


def test_locate_and_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fake machine of 4 GPUs, all visible (no CUDA here): locate knows GPUs by UUID.
    monkeypatch.setattr("refit.executor.seating.visible_gpus", lambda: ("u0", "u1", "u2", "u3"))
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    eps = [(Side.TRAINER, 0), (Side.ENGINE, 0)]
    names = ["trainer/0", "engine/0"]

    def at(prefix: str, m: int, device: str, host: str = "h1") -> Callable[[], Any]:
        return lambda: locate(connect("127.0.0.1", master.port, prefix, 10.0), m, eps, device, host, names)

    topo, cuda, one_host = _together([at("a/", 0, "cpu"), at("a/", 1, "cpu")])[0]
    assert not cuda and one_host and topo.device_of == {(Side.TRAINER, 0): 0, (Side.ENGINE, 0): 1}  # CPU: own devices
    out = _together([at("b/", 0, "cuda:3"), at("b/", 1, "cpu")])
    assert all(isinstance(e, RefitError) and "mix CPU and GPU" in str(e) for e in out), out
    # Colocated on GPU 3 of one host: one device, the engine drives it; on two hosts, ids are arbitrary.
    topo, cuda, one_host = _together([at("c/", 0, "cuda:3"), at("c/", 1, "cuda:3")])[0]
    assert cuda and one_host and topo.device_of == {(Side.TRAINER, 0): 3, (Side.ENGINE, 0): 3} and topo.drivers == (1,)
    assert topo.torch_index(3) == 3
    topo, cuda, one_host = _together([at("d/", 0, "cuda:3", "h1"), at("d/", 1, "cuda:3", "h2")])[0]
    assert cuda and not one_host and topo.device_of == {(Side.TRAINER, 0): 0, (Side.ENGINE, 0): 1}
    assert topo.local == ((0, 3), (1, None))  # member 0's view: the other host's GPU is not local
    with pytest.raises(TimeoutError, match="within 0.01 s"):
        b = Budget(0.01, "refit")
        time.sleep(0.02)
        b()


def test_own_tensors_unlike_the_layout_are_refused_before_sharing() -> None:
    """Before: an int32 tensor in place of a float32 one took the refit's bits silently; a wrong
    shape failed mid-bind with a torch error."""
    r = make_plan(DENSE, "tp1", "tp1", "colocated", "p2p", 4096)
    topo = Topology.single(r.plan.placement)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    src = allocate(list(r.src.local_tensors(DENSE, 0)), torch.device("cpu"))
    good = allocate(list(r.dst.local_tensors(DENSE, 0)), torch.device("cpu")).tensors
    name = next(iter(good))
    cases = [({**good, name: good[name].view(torch.int32)}, f"{name!r} is int32, expected float32"),
             ({**good, name: good[name].view(-1)}, f"{name!r} has shape"),
             ({k: v for k, v in good.items() if k != name}, f"tensor {name!r} is missing")]
    for i, (dst, message) in enumerate(cases):
        store = connect("127.0.0.1", master.port, f"own{i}/", 10.0)
        with pytest.raises(RefitError, match=message):
            Member(store, topo, 0, "cpu", {(Side.TRAINER, 0): src, (Side.ENGINE, 0): dst}, DENSE, r.src, r.dst,
                   ["both"], Budget(10.0)).prepare(r.plan)


def test_a_communicator_that_fails_lets_the_control_group_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the control group built just before stayed referenced by nobody's close."""
    import refit.executor.member as member_mod
    import refit.executor.member_barriers as barriers_mod

    r = make_plan(DENSE, "tp1", "tp1", "disaggregated", "p2p", 4096)
    topo = Topology.one_per_rank(r.plan.placement)  # two devices, two drivers: a data communicator
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    retired: list[str] = []
    monkeypatch.setattr(member_mod, "make_comm", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no NCCL")))
    monkeypatch.setattr(barriers_mod, "retire", lambda pg, pending, what: retired.append(what))
    names = ["trainer rank 0", "engine rank 0"]

    def member(m: int) -> Any:
        store = connect("127.0.0.1", master.port, "comm/", 30.0)
        side = Side.TRAINER if m == 0 else Side.ENGINE
        own = {(side, 0): allocate(list((r.src if m == 0 else r.dst).local_tensors(DENSE, 0)), torch.device("cpu"))}
        return Member(store, topo, m, "cpu", own, DENSE, r.src, r.dst, names, Budget(30.0))

    out = _together([lambda: member(0), lambda: member(1)])
    assert all(isinstance(e, RuntimeError) and "no NCCL" in str(e) for e in out), out
    assert sorted(retired) == ["engine rank 0: control group", "trainer rank 0: control group"]


def test_a_shared_arena_too_small_for_its_layout_is_refused() -> None:
    """Before: a ValueError from the views, not a RefitError naming the peer."""
    from refit.executor.handles import shm_handle

    r = make_plan(DENSE, "tp1", "tp1", "colocated", "p2p", 4096)
    topo = Topology.one_per_rank(r.plan.placement)  # member 1 drives the device and maps trainer rank 0
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    session = uuid.uuid4().hex[:8]
    small = allocate(list(r.src.local_tensors(DENSE, 0))[:1], torch.device("cpu"), f"/dev/shm/refit-{session}-s")
    try:
        store = connect("127.0.0.1", master.port, session, 10.0)
        store.set("share/src0", shm_handle(small.path, small.arena.numel()))  # what member 0 would publish
        store.set("settings", json.dumps({**settings.current().run_values(), "direction": "pull"}))
        dst = allocate(list(r.dst.local_tensors(DENSE, 0)), torch.device("cpu"))
        with pytest.raises(RefitError, match=r"engine rank 0: trainer rank 0 of megatron:tp1dp1 shared by trainer rank 0: arena of"):
            Member(store, topo, 1, "cpu", {(Side.ENGINE, 0): dst}, DENSE, r.src, r.dst, ["trainer rank 0", "engine rank 0"],
                   Budget(10.0))
    finally:
        os.unlink(small.path)


def test_a_refit_after_a_failed_prepare_is_refused() -> None:
    """Before: prepare left every phase unbound when compiling failed, and the next refit passed
    its barriers and returned as if done, having moved nothing."""
    r = make_plan(DENSE, "tp1", "tp1", "colocated", "p2p", 4096)
    other = make_plan(build_spec("tiny-dense", ModelConfig(
        arch="qwen2", hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8,
        intermediate_size=64, vocab_size=252, qkv_bias=True, tie_embeddings=True, dtype="float32")),
        "tp1", "tp1", "colocated", "p2p", 4096)
    topo = Topology.single(r.plan.placement)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    own = {(Side.TRAINER, 0): allocate(list(r.src.local_tensors(DENSE, 0)), torch.device("cpu")),
           (Side.ENGINE, 0): allocate(list(r.dst.local_tensors(DENSE, 0)), torch.device("cpu"))}
    m = Member(connect("127.0.0.1", master.port, "prep/", 10.0), topo, 0, "cpu", own, DENSE, r.src, r.dst,
               ["both"], Budget(10.0))
    try:
        with pytest.raises(RefitError, match="plan is for model"):
            m.prepare(other.plan)
        with pytest.raises(RefitError, match="no plan prepared"):
            m.refit(Budget(10.0))
        fill_source(own[(Side.TRAINER, 0)], DENSE, 5)
        fill_sentinel(own[(Side.ENGINE, 0)])
        m.prepare(r.plan).refit(Budget(10.0))
        assert verify(own[(Side.ENGINE, 0)], DENSE, 5).ok
    finally:
        m.close()


def test_close_aborts_the_communicator_before_it_frees_the_buffers() -> None:
    r = make_plan(DENSE, "tp1", "tp1", "colocated", "p2p", 4096)
    topo = Topology.single(r.plan.placement)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    own = {(Side.TRAINER, 0): allocate(list(r.src.local_tensors(DENSE, 0)), torch.device("cpu")),
           (Side.ENGINE, 0): allocate(list(r.dst.local_tensors(DENSE, 0)), torch.device("cpu"))}
    m = Member(connect("127.0.0.1", master.port, "close/", 10.0), topo, 0, "cpu", own, DENSE, r.src, r.dst,
               ["both"], Budget(10.0)).prepare(r.plan)
    seen: list[int] = []

    class Comm:  # stands in for NCCL, whose abort ends receives still posted into staging buffers
        def close(self) -> None:
            seen.append(len(m.phases))

    m.comm = Comm()  # type: ignore[assignment]
    m.close()
    assert seen == [1] and m.phases == [] and m.comm is None


def test_every_name_the_executor_package_exports_resolves() -> None:
    """`refit.executor` loads its names lazily from a table of modules (so that importing it does
    not import torch): a name whose module does not define it fails only when first used."""
    import importlib

    import refit.executor as executor

    assert executor.__all__
    for name in executor.__all__:
        module = importlib.import_module(executor._EXPORTS[name])
        assert getattr(executor, name) is getattr(module, name), name
    assert (executor.connect, executor.locate) == (connect, locate)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        executor.no_such_name  # noqa: B018
