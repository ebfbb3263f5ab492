"""`refit.executor.bound`: when a wire is one contiguous region of a tensor (`_direct_region`),
and in which order `run_refit` issues a stage's work to the device (what GPU traces showed
matters: the same-GPU table kernel before the peer kernels, the moves beside an NCCL pipeline)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from refit.executor import bound
from refit.executor.bound import Bound, BoundStage, BoundStep, _direct_region, run_refit


def _wire_and_tensor() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(64, dtype=torch.uint8), torch.randint(0, 256, (256,), dtype=torch.uint8)


def test_adjacent_blocks_in_wire_order_are_direct() -> None:
    buf, t = _wire_and_tensor()
    pairs = [(buf[0:16], t[100:116]), (buf[16:64], t[116:164])]
    region = _direct_region(pairs, buf, 64)
    assert region is not None and region.data_ptr() == t[100:].data_ptr() and region.numel() == 64
    region.fill_(7)  # it is the tensor's own memory
    assert bool((t[100:164] == 7).all())


def test_gaps_swaps_strides_and_partial_cover_are_staged() -> None:
    buf, t = _wire_and_tensor()
    other = torch.zeros(64, dtype=torch.uint8)
    assert _direct_region([(buf[0:16], t[0:16]), (buf[16:64], t[20:68])], buf, 64) is None  # gap
    assert _direct_region([(buf[0:16], t[48:64]), (buf[16:64], t[0:48])], buf, 64) is None  # other order
    assert _direct_region([(buf[0:32], t[0:64:2])], buf, 32) is None  # strided local block
    assert _direct_region([(buf[0:16], t[0:16]), (buf[16:64], other[16:64])], buf, 64) is None  # two tensors
    assert _direct_region([(buf[0:32], t[0:32])], buf, 64) is None  # a receiver keeping part of the box
    assert _direct_region([], buf, 64) is None


@dataclass
class _Batch:
    """Stands for a `CopyBatch`: ``table`` says whether its memcpys run as one SM kernel."""

    name: str
    table: bool = False


class _Recorder:
    """A `Device` that records what it is asked to issue, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def begin(self) -> None:
        self.calls.append(("begin",))

    def copy(self, batch: _Batch, part: str = "all") -> None:
        self.calls.append(("copy", batch.name, part))

    def beside(self, batch: _Batch, part: str = "all") -> None:
        self.calls.append(("beside", batch.name, part))

    def pull(self, batch: _Batch) -> None:
        self.calls.append(("pull", batch.name))

    def join(self) -> None:
        self.calls.append(("join",))

    def finish(self, deadline: float, check: Any, stuck: Any) -> None:
        self.calls.append(("finish",))


class _Comm:
    def __init__(self, device: _Recorder) -> None:
        self.device = device

    def post(self, sends: Any, recvs: Any) -> str:
        self.device.calls.append(("post", sends))
        return sends

    def wait(self, handle: Any, timeout_s: float) -> None:
        self.device.calls.append(("wait", handle))

    def check(self) -> None:
        pass

    def stuck(self) -> str:
        return ""


def _refit(stage: BoundStage) -> list[tuple[str, ...]]:
    device = _Recorder()
    run_refit(Bound(None, [stage], []), _Comm(device), device, lambda: 60.0)  # type: ignore[arg-type]
    return device.calls


def test_ipc_stage_launches_the_same_gpu_kernel_then_peer_copies_then_the_rest_beside() -> None:
    """A same-GPU table kernel launched after a peer kernel (whose blocks fill every SM) ran in its
    gaps, 5 ms longer; torch's small copies issued before the peer copies delayed them 0.9 ms."""
    stage = BoundStage(0, _Batch("moves", table=True), [], [_Batch("from 1"), _Batch("from 2")])
    assert _refit(stage) == [("begin",), ("copy", "moves", "launch"), ("pull", "from 1"), ("pull", "from 2"),
                             ("beside", "moves", "rest"), ("join",), ("finish",)]
    # moves on the copy engines (packed arenas): after the peer copies, all of them beside
    stage = BoundStage(0, _Batch("moves"), [], [_Batch("from 1")])
    assert _refit(stage) == [("begin",), ("pull", "from 1"), ("beside", "moves", "all"), ("join",), ("finish",)]


def test_nccl_stage_runs_the_moves_beside_the_pipeline() -> None:
    """On the copy stream, the moves sat between the first pack and the second, and every later
    step waited for all of them."""
    steps = [BoundStep((1, 1, i), _Batch(f"pack {i}"), _Batch(f"unpack {i}"), [f"send {i}"], []) for i in range(3)]
    calls = _refit(BoundStage(1, _Batch("moves", table=True), steps))  # type: ignore[arg-type]
    assert calls == [("begin",), ("copy", "pack 0", "all"), ("post", ["send 0"]), ("beside", "moves", "all"),
                     ("copy", "pack 1", "all"), ("post", ["send 1"]),
                     ("wait", ["send 0"]), ("copy", "unpack 0", "all"), ("copy", "pack 2", "all"), ("post", ["send 2"]),
                     ("wait", ["send 1"]), ("copy", "unpack 1", "all"), ("wait", ["send 2"]), ("copy", "unpack 2", "all"),
                     ("join",), ("finish",)]


def test_moves_are_told_what_they_run_beside(monkeypatch) -> None:
    """`_bind_stages` hands the same-GPU moves the flags `table_copy.enabled` decides on: beside
    the NCCL steps when the stage has any, beside a kernel when any peer batch is a table kernel."""
    made: list[dict[str, Any]] = []
    monkeypatch.setattr(bound, "CopyBatch", lambda pairs, **kw: made.append(kw))
    bound._moves([], [_Batch("pull 1"), _Batch("pull 2", table=True)], pipelined=False, dma=True)
    bound._moves([], [_Batch("pull 1")], pipelined=False, dma=True)
    bound._moves([], [], pipelined=True, dma=True)
    assert [(m["beside"], m["beside_kernel"]) for m in made] == [(False, True), (False, False), (True, False)]


def test_the_hook_runs_once_per_refit_also_with_two_wire_stages() -> None:
    """A gathering plan has steps in stage 0 and stage 1: the hook (a test that kills a peer once
    the first transfer is posted) ran at the first step of each."""
    calls: list[str] = []

    def stage(n: int) -> BoundStage:
        steps = [BoundStep((n, 1, 0), _Batch(f"pack {n}"), _Batch(f"unpack {n}"), [f"send {n}"], [])]
        return BoundStage(n, _Batch(f"moves {n}"), steps)  # type: ignore[arg-type]

    device = _Recorder()
    run_refit(Bound(None, [stage(0), stage(1)], []), _Comm(device), device, lambda: 60.0,  # type: ignore[arg-type]
              hook=lambda: calls.append("hook"))
    assert calls == ["hook"]
