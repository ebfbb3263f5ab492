"""The executor on CPU: real processes, gloo and shared memory, real values, checked bit-exact.

Every multi-process case runs both planners in one launch, each with two refits into the same
destination buffers and a *different* source seed before the second, verifying after each — so
stale bytes from the first refit cannot pass the second check.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from refit.bench.launch import WorkerFailure, run_job
from tests.harness.executor_jobs import BUCKET, DENSE, MOE
from tests.harness.executor_jobs import check as _check, job as _job
from refit.executor.topology import Topology
from refit.executor.copies import CopyBatch, merge
from refit.executor.shards import allocate, fill_sentinel, fill_source, verify
from refit.executor.values import check_box, expected_bits, fill_box
from refit.layouts import resolve_layout
from refit.planners import make_plan
from refit.sides import Side

ROOT = Path(__file__).resolve().parents[2]



# ---------------------------------------------------------------------------------------------
# values


def test_values_are_pinned_and_width_exact() -> None:
    # Pinned bits: a change here would silently break comparisons across machines and versions.
    cpu = torch.device("cpu")
    assert expected_bits("t", (2, 3), (0, 0), (2, 3), 0, 2, cpu).flatten().tolist() == [
        -18146, -10691, 5462, 7840, 31093, -16118]
    # Indices past 2**32 (the high half enters the hash) and 32-bit values.
    assert expected_bits("t", (2**33,), (2**32 + 5,), (3,), 7, 4, cpu).tolist() == [
        183421194, 1654198195, -2107417156]
    for width, dtype in ((1, torch.int8), (2, torch.int16), (4, torch.int32)):
        v = expected_bits("t", (1000,), (0,), (1000,), 5, width, cpu)
        assert v.dtype == dtype and len(set(v.tolist())) > (200 if width == 1 else 990)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_fill_box_strided_chunked_and_checked(dtype: torch.dtype) -> None:
    shape = (3, 10, 12)
    full = torch.empty(shape, dtype=dtype)
    fill_box(full, "x", shape, (0, 0, 0), seed=3)
    # A strided view of a box, filled in tiny chunks, equals the same box of the full tensor.
    big = torch.zeros(5, 20, 30, dtype=dtype)
    view = big[1:3, 4:10:1, 7:12]
    fill_box(view, "x", shape, (1, 4, 7), seed=3, chunk=7)
    assert torch.equal(view.view(_int(dtype)), full[1:3, 4:10, 7:12].view(_int(dtype)))
    assert check_box(view, "x", shape, (1, 4, 7), seed=3, chunk=5) == (0, None)
    # One flipped bit is found and located in canonical coordinates; another seed differs.
    view.view(_int(dtype))[1, 2, 3] ^= 1
    bad, first = check_box(view, "x", shape, (1, 4, 7), seed=3)
    assert bad == 1 and first.startswith("x[2, 6, 10]")
    assert check_box(full, "x", shape, (0, 0, 0), seed=4)[0] > 0.9 * full.numel()


def _int(dtype: torch.dtype) -> torch.dtype:
    return {1: torch.int8, 2: torch.int16, 4: torch.int32}[torch.empty(0, dtype=dtype).element_size()]


def test_verify_counts_wrong_and_stray_elements() -> None:
    dst = resolve_layout("tp2", MOE, Side.ENGINE)
    s = allocate(dst.local_tensors(MOE, 1), torch.device("cpu"))  # rank 1 holds vocab padding rows
    fill_sentinel(s)
    v = verify(s, MOE, 1)
    assert v.mismatches == v.checked > 0 and v.stray == 0
    fill_source(s, MOE, seed=1)  # right values in every piece, but padding zeroed: stray writes
    v = verify(s, MOE, 1)
    assert v.mismatches == 0 and v.stray > 0 and "padding" in v.first
    assert verify(s, MOE, 2).mismatches > 0.99 * v.checked  # stale values fail (2**-16 coincide)


# ---------------------------------------------------------------------------------------------
# batched copies


def test_copy_batch_merges_grids_into_one_copy() -> None:
    # 4 layers x 6 experts of [5, 8] blocks, gathered column-slices into a row-major bucket.
    src = torch.arange(4 * 6 * 5 * 16, dtype=torch.int16).view(4, 6, 5, 16)
    buf = torch.zeros(4 * 6 * 5 * 8, dtype=torch.int16)
    region = buf.view(4, 6, 5, 8)
    pairs = [(region[l, e], src[l, e, :, 8:]) for l in range(4) for e in range(6)]
    batch = CopyBatch(pairs[::-1])  # order must not matter
    assert (batch.blocks, batch.copies) == (24, 1)
    batch.run()
    assert torch.equal(region, src[:, :, :, 8:])


def test_merge_is_exact_on_irregular_blocks() -> None:
    g = torch.Generator().manual_seed(0)
    src = torch.randint(-1000, 1000, (400,), generator=g, dtype=torch.int32)
    dst = torch.zeros(400, dtype=torch.int32)
    starts = sorted(torch.randperm(95, generator=g)[:40].tolist())
    pairs = [(dst[4 * s:4 * s + 3], src[(7 * s) % 390:(7 * s) % 390 + 3]) for s in starts]
    expect = dst.clone()
    for d, s in pairs:
        expect[d.storage_offset():d.storage_offset() + 3] = s
    for d, s in merge(pairs):
        d.copy_(s)
    assert torch.equal(dst, expect)


# ---------------------------------------------------------------------------------------------
# end to end


CASES = [
    # (spec, src, dst, placement): pp/vpp, ep, etp, fsdp (uneven), vllm with and without ep
    (MOE, "tp2ep2", "tp2", "colocated"),
    (MOE, "tp2pp2vpp2", "vllm:tp2ep2", "colocated"),
    (MOE, "tp2ep2etp2", "tp4", "disaggregated"),
    (MOE, "fsdp:dp3", "vllm:tp2ep2", "disaggregated"),
    (DENSE, "tp2pp2", "tp2", "colocated"),  # fp32, tied embeddings kept on the last stage, qkv bias
    (DENSE, "fsdp:dp2", "tp4", "colocated"),  # more destination devices than source ones
]


@pytest.mark.parametrize("spec,src,dst,placement", CASES, ids=[f"{c[1]}-{c[2]}-{c[3]}" for c in CASES])
def test_refit_bit_exact(spec, src: str, dst: str, placement: str) -> None:
    job, plans = _job(spec, src, dst, placement)
    results = run_job(job)
    _check(results, plans, spec)
    staging = max(w.runs[0].staging_bytes for w in results)
    assert 0 < staging <= 4 * BUCKET  # two send + two receive buffers at most


IPC_CASES = [CASES[0], CASES[1], CASES[3], CASES[5]]


@pytest.mark.parametrize("spec,src,dst,placement", IPC_CASES, ids=[f"{c[1]}-{c[2]}-{c[3]}" for c in IPC_CASES])
def test_refit_bit_exact_ipc(spec, src: str, dst: str, placement: str) -> None:
    # Three refits per planner, the source re-filled with a new seed before each, verified after
    # each: every driver reads all source shards directly (no staging, no wire for p2p).
    job, plans = _job(spec, src, dst, placement, refits=3, transport="ipc")
    results = run_job(job)
    _check(results, plans, spec, refits=3)
    p2p = [w.runs[0] for w in results]
    assert all(p.steps == 0 and p.staging_bytes == 0 for p in p2p)
    assert sum(p.blocks for p in p2p) > 0


PUSH_CASES = [CASES[0], CASES[3]]


@pytest.mark.parametrize("spec,src,dst,placement", PUSH_CASES, ids=[f"{c[1]}-{c[2]}-{c[3]}" for c in PUSH_CASES])
def test_refit_bit_exact_ipc_push(spec, src: str, dst: str, placement: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # REFIT_IPC=push: every driver maps every destination shard and writes its sources' boxes
    # into them (the broadcast plan, which gathers, still pulls); two refits, verified after each.
    monkeypatch.setenv("REFIT_IPC", "push")
    job, plans = _job(spec, src, dst, placement, refits=2, transport="ipc")
    results = run_job(job)
    _check(results, plans, spec, refits=2)
    p2p = [w.runs[0] for w in results]
    assert all(p.steps == 0 and p.staging_bytes == 0 for p in p2p)


def test_ipc_push_program_moves_what_the_pull_program_moves() -> None:
    """Push gives each bucket between devices to the source's driver instead of the
    destination's, and nothing else changes: the same moves, over all drivers."""
    from refit.executor.schedule import compile_program

    for src, dst, placement in (("tp2ep2", "tp2", "colocated"), ("fsdp:dp3", "vllm:tp2ep2", "disaggregated")):
        r = make_plan(MOE, src, dst, placement, "p2p", BUCKET)
        topo = Topology.one_per_rank(r.plan.placement)
        moves = {}
        for push in (False, True):
            got = []
            for m in topo.drivers:
                prog = compile_program(r.plan, MOE, r.src, r.dst, topo, m, ipc=True, push=push)
                mine = set(topo.driven_devices(m))
                for st in prog.stages:
                    for mv in st.pulls:
                        assert topo.device_of[mv.src_ep if push else mv.dst_ep] in mine
                        got.append(mv)
                    got.extend(st.moves)
            moves[push] = sorted(got, key=repr)
        assert moves[True] == moves[False] and moves[True]
        b = make_plan(MOE, src, dst, placement, "broadcast", BUCKET)  # gathers: always pulled
        for m in topo.drivers:
            assert compile_program(b.plan, MOE, b.src, b.dst, topo, m, ipc=True, push=True) == \
                compile_program(b.plan, MOE, b.src, b.dst, topo, m, ipc=True)


def test_ipc_program_pulls_instead_of_wires() -> None:
    from refit.executor.schedule import compile_program

    for planner in ("p2p", "broadcast"):
        r = make_plan(MOE, "tp2ep2", "tp2", "colocated", planner, BUCKET)
        topo = Topology.one_per_rank(r.plan.placement)
        for m in topo.drivers:
            wire = compile_program(r.plan, MOE, r.src, r.dst, topo, m)
            ipc = compile_program(r.plan, MOE, r.src, r.dst, topo, m, ipc=True)
            assert sum(len(st.pulls) for st in wire.stages) == 0
            assert sum(len(st.pulls) for st in ipc.stages) > 0
            assert all(not st.steps for st in ipc.stages if st.stage == 0)  # gathers are pulled
            if planner == "p2p":
                assert ipc.num_steps == 0 and ipc.staging_bytes == 0 < wire.staging_bytes
            else:  # broadcast stage 1 reads the root's gathered tensors: still on the wire
                assert 0 < ipc.num_steps < wire.num_steps


def test_single_process_local_copies() -> None:
    job, plans = _job(MOE, "tp2pp2", "tp4", "colocated", topology="single")
    results = run_job(job)
    _check(results, plans, MOE)
    assert results[0].runs[0].steps == 0 and results[0].runs[0].staging_bytes == 0


def test_one_device_shared_memory_only() -> None:
    job, plans = _job(DENSE, "tp1", "tp1", "colocated", planners=("p2p",))
    results = run_job(job)
    _check(results, plans, DENSE)
    assert all(p.steps == 0 for w in results for p in w.runs)  # no wire: copies out of the peer's shm


@pytest.mark.parametrize("transport", ["comm", "ipc"])
@pytest.mark.parametrize("victim", [(Side.ENGINE, 1), (Side.TRAINER, 0)], ids=["driver", "passive"])
def test_dead_worker_fails_fast_and_is_named(victim: tuple[str, int], transport: str) -> None:
    job, _ = _job(MOE, "tp2ep2", "tp2", "colocated", planners=("p2p",), kill=(victim[0], victim[1], 1), refits=3,
                  transport=transport)
    t0 = time.monotonic()
    with pytest.raises(WorkerFailure) as err:
        run_job(job)
    assert time.monotonic() - t0 < 15
    assert err.value.dead == [f"{victim[0]} rank {victim[1]}"]
    assert f"{victim[0]} rank {victim[1]} (pid" in str(err.value) and "exit code 17" in str(err.value)
    assert "refit 1 started" in str(err.value)


def test_hung_worker_is_named_by_its_peers() -> None:
    # engine rank 1 drives GPU 1 and stops itself (SIGSTOP) once its first transfer is posted: the
    # others give up at the refit's deadline, each naming whom it waited on; the parent names the
    # silent one and kills it (a stopped process too).
    job, _ = _job(MOE, "tp2ep2", "tp2", "colocated", planners=("p2p",), kill=(Side.ENGINE, 1, 1), refits=3)
    job = dataclasses.replace(job, hang=True, timeout_s=3)
    t0 = time.monotonic()
    with pytest.raises(WorkerFailure) as err:
        run_job(job)
    assert time.monotonic() - t0 < 15
    text = str(err.value)
    assert "with engine rank 1 failed: Timed out" in text  # engine rank 0 was receiving from it
    assert "Still running, no report: engine rank 1 (last: 'refit 1 started')" in text


def test_bench_cpu_json(capsys: pytest.CaptureFixture[str]) -> None:
    from refit.bench import main

    code = main(["--model", "qwen3-30b-moe", "--src", "tp2ep2", "--dst", "tp2", "--iters", "2",
                 "--vs", "broadcast", "--json", "--cpu", "--bucket-mb", "0.25"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["verified"] is True
    assert out["device"] == "cpu" and out["reduced"]["hidden_size"] == [2048, 128]
    assert [r["planner"] for r in out["runs"]] == ["p2p", "broadcast"] and out["speedup"] > 0
    p2p = out["runs"][0]
    assert p2p["checked_elements"] > 0 and p2p["seconds"]["median"] > 0
    assert out["link"]["gbps"] > 0 and p2p["floor_seconds"] > 0 and p2p["x_floor"] > 0
    assert out["transport"] == "gloo" and p2p["staging_bytes"] > 0  # auto on CPU: gloo
    assert p2p["direct_wire_bytes"] > 0  # buckets that are one region of a tensor skip staging (and verify)
    assert p2p["x_transport_floor"] is None  # CPU: no all-to-all primitive measured


def test_bench_transport_floor_is_its_own_primitive() -> None:
    """GPU runs print the ratio to the best primitive and to their own transport's (nccl: NCCL
    send/recv, ipc: copy engines in rounds), from the all-to-all measured before the workers."""
    from refit.bench.direct import transport_floor

    a2a = {"bytes_per_pair": 1 << 30, "gbps": {"ce_rounds": 380.0, "nccl": 300.0}}
    assert transport_floor(a2a, "nccl", 15_000_000_000) == pytest.approx(0.05)
    assert transport_floor(a2a, "ipc", 3_800_000_000) == pytest.approx(0.01)
    assert transport_floor(a2a, "gloo", 1) is None and transport_floor(None, "nccl", 1) is None


def test_bench_verifies_mixed_dtype_models(capsys: pytest.CaptureFixture[str]) -> None:
    """Moonlight keeps its router bias in float32: the bench counts elements, not bytes over one
    item size (which reported "verified: NO" with no mismatch on 2x H200)."""
    from refit.bench import main

    code = main(["--model", "moonlight-16b", "--src", "megatron:tp2ep2", "--dst", "vllm:tp2", "--iters", "1",
                 "--warmup", "0", "--json", "--cpu"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["verified"] is True and out["runs"][0]["mismatches"] == 0


def test_bench_first_layers_keep_every_width(capsys: pytest.CaptureFixture[str]) -> None:
    """``--layers N``: the model's first N decoder layers at full width (a big model's shapes on
    fewer GPUs); out of range is a clear error before anything starts."""
    from refit.bench import main
    from refit.bench.smaller_specs import first_layers
    from refit.errors import RefitError
    from refit.hf_checkpoint import load_spec

    full = load_spec("moonlight-16b")  # a dense first layer, then MoE layers
    cut = first_layers(full, 3)
    assert cut.config.num_layers == 3 and cut.config.moe_layers == (1, 2)
    assert cut.config.hidden_size == full.config.hidden_size and cut.name == "moonlight-16b[:3]"
    assert first_layers(full, full.config.num_layers).name == "moonlight-16b"
    for bad in (0, 99):
        with pytest.raises(RefitError, match=f"--layers {bad}: must be 1 to 27"):
            first_layers(full, bad)
    glm = load_spec("glm-4.5-air")  # one MTP layer after its 46: not part of a cut model
    assert glm.config.num_mtp_layers == 1 and first_layers(glm, 4).config.num_mtp_layers == 0
    code = main(["--model", "qwen3-30b-moe", "--layers", "2", "--src", "tp2ep2", "--dst", "tp2", "--iters", "1",
                 "--warmup", "0", "--json", "--cpu"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["verified"] is True and out["model"] == "qwen3-30b-moe[:2]"


def test_bench_cpu_ipc_json(capsys: pytest.CaptureFixture[str]) -> None:
    from refit.bench import main

    code = main(["--model", "qwen3-30b-moe", "--src", "tp2ep2", "--dst", "tp2", "--iters", "2",
                 "--vs", "broadcast", "--json", "--cpu", "--bucket-mb", "0.25", "--transport", "ipc"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["verified"] is True and out["transport"] == "ipc"
    p2p = out["runs"][0]
    assert p2p["staging_bytes"] == 0 and p2p["peak_extra_bytes"] == 0 and p2p["checked_elements"] > 0


def test_bench_via_grpc_cpu_json(capsys: pytest.CaptureFixture[str]) -> None:
    """refit-bench --via grpc: a loopback coordinator, one agent process per rank running the
    executor over gloo, repeated Refit calls from the client; the last version verified."""
    import logging

    from refit.bench import main

    coord_log = logging.getLogger("refit.control.coordinator")
    level = coord_log.level
    code = main(["--model", "qwen3-30b-moe", "--src", "tp2ep2", "--dst", "tp2", "--iters", "3", "--json",
                 "--cpu", "--bucket-mb", "0.25", "--via", "grpc", "--planner", "broadcast"])
    out = json.loads(capsys.readouterr().out)
    assert coord_log.level == level  # quieted while the ranks leave, then as the caller had it
    assert code == 0 and out["verified"] is True and out["via"] == "grpc" and out["transport"] == "gloo"
    assert out["checked_elements"] > 0 and out["mismatches"] == 0 and out["engine_bytes"] > 0
    assert len(out["round_trip"]["all"]) == 3
    assert out["round_trip"]["median"] >= out["data"]["median"] > 0
    # engines hold one allocation per parameter (as vLLM), written in place: none moved
    assert out["alloc"] == "framework" and out["moved_parameters"] == 0
    assert out["engine_allocation"].startswith("one allocation per parameter")


def test_bench_runs_from_a_folder_holding_another_refit(tmp_path: Path) -> None:
    """Issue 11 item 13: `refit-bench` started where a ``refit/`` folder shadows the installed
    package used to lose every worker to an ImportError ("rank 0 died")."""
    bogus = tmp_path / "refit"
    bogus.mkdir()
    (bogus / "__init__.py").write_text("raise ImportError('the wrong refit was imported')\n")
    script = Path(sys.executable).parent / "refit-bench"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(ROOT)}
    out = subprocess.run([str(script), "--model", "qwen3-8b", "--src", "tp1", "--dst", "tp2", "--iters", "1",
                          "--cpu", "--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["verified"] is True
