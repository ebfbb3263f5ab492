"""``refit-bench --delta --step-lr LR``: the synthetic Adam-like steps (`refit.bench.steps`) that
sources and destinations compute apart yet agree on bit for bit, the command-line refusals, the
report's per-run ``delta``, and one delta refit run end to end on CPU."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from refit.bench import cli, steps
from refit.bench.direct import delta_report, table
from refit.bench.smaller_specs import reduce_spec
from refit.bench.steps import Masters
from refit.errors import InvalidInput
from refit.executor.delta import DeltaStats
from refit.executor.shards import Shards, allocate, fill_sentinel
from refit.executor.values import int_view
from refit.hf_checkpoint import load_spec
from refit.layouts import resolve_layout
from refit.regions import slices
from refit.sides import Side
from refit.spec import ModelSpec, quantize_spec

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    small, _ = reduce_spec(load_spec("qwen3-8b"), "tp2", "tp1")  # 1.4M parameters, bfloat16
    return small


def _shards(spec: ModelSpec, layout: str, side: Side) -> list[Shards]:
    lay = resolve_layout(layout, spec, side)
    return [allocate(lay.local_tensors(spec, r), CPU, scattered=True) for r in range(lay.world_size)]


def _canonical(spec: ModelSpec, shards: Shards) -> list[tuple[torch.Tensor, Any]]:
    """Every piece of ``shards`` as (its view in canonical ndim, the piece)."""
    out = []
    for lt in shards.locals:
        ndim = len(spec[lt.pieces[0].tensor].shape) if lt.pieces else len(lt.shape)
        local = shards.tensors[lt.name].view(lt.view_shape(ndim))
        out += [(local[slices(p.local_start, p.size)], p) for p in lt.pieces]
    return out


def _overlap(p: Any, q: Any) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """Where pieces ``p`` and ``q`` share canonical elements: (within p's box, within q's), or None."""
    if p.tensor != q.tensor:
        return None
    lo = [max(a, b) for a, b in zip(p.start, q.start)]
    hi = [min(a + n, b + m) for a, n, b, m in zip(p.start, p.size, q.start, q.size)]
    if not all(h > l for l, h in zip(lo, hi)):
        return None
    size = tuple(h - l for l, h in zip(lo, hi))
    return (slices(tuple(l - a for l, a in zip(lo, p.start)), size),
            slices(tuple(l - b for l, b in zip(lo, q.start)), size))


def _reshard(spec: ModelSpec, srcs: list[Shards], dst: Shards) -> None:
    """Copy every overlap of a source piece and a destination piece (what a refit moves)."""
    held = [x for s in srcs for x in _canonical(spec, s)]
    for view, q in _canonical(spec, dst):
        for sview, p in held:
            both = _overlap(p, q)
            if both:
                view[both[1]].copy_(sview[both[0]])


# ------------------------------------------------------------------ the steps


def test_box_values_are_exact_and_in_range() -> None:
    shape = (64, 48)
    init = steps.initial("w", shape, (0, 0), shape, CPU)
    u = steps.update("w", shape, (0, 0), shape, 1, CPU)
    assert init.dtype == u.dtype == torch.float32
    assert init.abs().max() <= 1 / 16 and init.std() > 0.02  # a weight's magnitude, not a constant
    assert u.abs().min() >= 0.5 and u.abs().max() < 1.5 and (u > 0).any() and (u < 0).any()
    assert not torch.equal(u, steps.update("w", shape, (0, 0), shape, 2, CPU))  # each step its own
    # a box's values do not depend on how it is cut: sub-boxes give the same bits
    part = steps.update("w", shape, (10, 5), (20, 30), 1, CPU)
    assert torch.equal(part, u[10:30, 5:35])
    assert steps.float32_lr(1e-6) == float(torch.tensor(1e-6, dtype=torch.float32))


def test_source_and_destination_masters_agree_after_steps(spec: ModelSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainers (tp2, Megatron) and an engine (tp1, vLLM's fused tensors) each keep masters over
    their own pieces; after N lockstep steps the engine's pieces, moved from the trainers' casts,
    verify bit-exact against its own masters.  The engine's masters are built in small chunks (a
    box cut anywhere gives the same bits)."""
    srcs, (dst,) = _shards(spec, "tp2", Side.TRAINER), _shards(spec, "tp1", Side.ENGINE)
    src_masters = [Masters(s, spec) for s in srcs]
    monkeypatch.setattr(steps, "DEFAULT_CHUNK", 4096)
    dst_masters = Masters(dst, spec)
    for _ in range(3):
        for m in [*src_masters, dst_masters]:
            m.step(1e-4)
    for m, s in zip(src_masters, srcs):
        m.cast_into(s)
    fill_sentinel(dst)
    _reshard(spec, srcs, dst)

    verdict = dst_masters.verify(dst)
    elements = sum(math.prod(p.size) for lt in dst.locals for p in lt.pieces)
    assert verdict.ok and verdict.checked == elements == spec.num_params, verdict.first

    # float32 masters agree on every overlap, not only after the cast
    for sm in src_masters:
        for box in sm.boxes.values():
            compared = 0
            for twin in dst_masters.boxes.values():
                both = _overlap(box.piece, twin.piece)
                if both:
                    assert torch.equal(box.master[both[0]], twin.master[both[1]]), box.piece
                    compared += box.master[both[0]].numel()
            assert compared == box.master.numel()  # the engine (tp1) holds every element once

    dst_masters.step(1e-4)  # one step ahead of what landed: caught, and said where
    verdict = dst_masters.verify(dst)
    assert 0 < verdict.mismatches < verdict.checked and "after step 4" in verdict.first


def _changed(spec: ModelSpec, lr: float) -> float:
    (shards,) = _shards(spec, "tp1", Side.TRAINER)
    masters = Masters(shards, spec)
    masters.cast_into(shards)
    before = int_view(shards.arena.view(torch.bfloat16)).clone()
    masters.step(lr)
    masters.cast_into(shards)
    return (int_view(shards.arena.view(torch.bfloat16)) != before).sum().item() / spec.num_params


def test_changed_fraction_follows_the_learning_rate(spec: ModelSpec) -> None:
    """At an RL learning rate few bfloat16 values cross a rounding boundary; at 1e-3 most do."""
    small, large = _changed(spec, 1e-6), _changed(spec, 1e-3)
    assert 0 < small < 0.10, small
    assert large > 0.5, large


def test_quantized_spec_is_refused() -> None:
    empty = Shards([], torch.empty(0, dtype=torch.uint8), {})
    with pytest.raises(InvalidInput, match="--step-lr with a quantized destination .* not supported yet"):
        Masters(empty, quantize_spec(load_spec("qwen3-30b-moe"), "fp8"))


# ------------------------------------------------------------------ the command line

BASE = ["--model", "qwen3-8b", "--src", "tp1", "--dst", "tp2"]


@pytest.mark.parametrize("argv,msg", [
    (["--step-lr", "0"], "--step-lr must be more than 0, got 0"),
    (["--step-lr=-1e-6"], "--step-lr must be more than 0, got -1e-06"),
    (["--step-lr", "1e-6", "--dst-dtype", "fp8"], "--step-lr with --dst-dtype is not supported yet"),
    (["--delta", "--via", "grpc"], "--delta: not supported with --via grpc yet"),
    (["--step-lr", "1e-6", "--via", "grpc"], "--step-lr: not supported with --via grpc yet"),
    (["--delta", "--step-lr", "1e-6", "--ray", "auto"], "--delta and --step-lr: not supported with --ray yet"),
    (["--wire-gbps", "0"], "--wire-gbps must be more than 0, got 0"),
    (["--wire-gbps", "1", "--transport", "ipc"], "--wire-gbps emulates the communicator of the direct bench"),
])
def test_refusals(capsys: pytest.CaptureFixture[str], argv: list[str], msg: str) -> None:
    with pytest.raises(SystemExit) as e:
        cli.parse_args(BASE + argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--delta"], ["--step-lr", "1e-6", "--vs", "broadcast"],
                                  ["--delta", "--step-lr", "1e-7"]])
def test_accepted(argv: list[str]) -> None:
    a = cli.parse_args(BASE + argv)
    assert a.delta == ("--delta" in argv) and (a.step_lr is None) == ("--step-lr" not in argv)


# ------------------------------------------------------------------ the report


def test_delta_report_sums_workers_and_takes_medians() -> None:
    refit = lambda changed, wire: [DeltaStats(2, 1, 100, changed, wire, 400),  # noqa: E731
                                   DeltaStats(1, 1, 50, 0, 24, 200)]
    d = delta_report([refit(10, 100), refit(3, 50), refit(30, 300)])
    assert d["per_refit"][0] == {"changed_fraction": round(10 / 150, 6), "wire_bytes": 124, "full_bytes": 600,
                                 "delta_buckets": 2, "buckets": 3}
    assert d["changed_fraction"] == round(10 / 150, 6) and d["wire_bytes"] == 124 and d["full_bytes"] == 600
    assert d["buckets"] == 3 and d["delta_buckets"] == 2


# ------------------------------------------------------------------ end to end


def test_delta_refits_on_cpu_verify_every_run(capsys: pytest.CaptureFixture[str]) -> None:
    """Trainer tp1, engines tp2 (engine 1 on another device: its buckets cross gloo): the warm-up
    refit is full, the timed ones send deltas; each is verified against the masters."""
    code = cli.main(BASE + ["--cpu", "--iters", "2", "--warmup", "1", "--bucket-mb", "0.25",
                            "--delta", "--step-lr", "1e-6", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["verified"] is True, out["runs"][0]["first_mismatch"]
    assert out["delta_mode"] is True and out["step_lr"] == 1e-6
    (run,) = out["runs"]
    assert run["verified"] is True and run["verified_refits"] == 2
    d = run["delta"]
    assert len(d["per_refit"]) == 2 and d["delta_buckets"] > 0 and d["buckets"] >= d["delta_buckets"]
    assert 0 < d["changed_fraction"] < 0.1 and 0 < d["wire_bytes"] < d["full_bytes"] / 2
    assert "of words changed, wire" in table(out)


def test_an_emulated_wire_holds_each_step_to_its_rate(capsys: pytest.CaptureFixture[str]) -> None:
    """``--wire-gbps``: a full refit takes at least its wire bytes over the rate (each step is held
    to it, `refit.bench.throttle`), and the report says the wire was emulated."""
    code = cli.main(BASE + ["--cpu", "--iters", "1", "--warmup", "0", "--step-lr", "1e-6", "--wire-gbps", "0.1",
                            "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["verified"] is True and out["wire_gbps_emulated"] == 0.1
    (run,) = out["runs"]
    assert run["seconds"]["min"] >= run["delta"]["full_bytes"] / 2 / 0.1e9  # two senders at most share the bytes
