"""The executor on CUDA, bit-exact: `make test-gpu` on a GPU machine (pytest marker ``gpu``).

Without a CUDA device every test here skips with its reason (CI, `make test`).  On one GPU, the
paths one GPU can exercise, each in real worker processes with every destination element checked
after every refit (two refits, a new source seed each; the broadcast plan beside p2p):

* two processes on one GPU through CUDA IPC: the ipc transport pulling and pushing, the
  descriptor-table copy kernel on and off, CUDA 13's batched memcpy, packed (arena) shards;
  ``comm``, whose same-GPU boxes are IPC copies too; one process holding both sides (local copies);
* the phased path (a plan cut into one-layer phases, one staging set shared by the phases);
* `refit-bench` at full width on real shapes (qwen3-30b-moe and qwen3-8b, first 2 layers), direct
  and ``--via grpc`` (agents, a loopback coordinator, ``refit.Client``).

With 2+ GPUs: the ipc transport (pull, push, packed shards, phased) and NCCL between GPUs, and
`refit-bench --via grpc`; with 4+, colocated layouts of equal and unequal world sizes and
disaggregated placements.  Those skip, with the count they need, on fewer GPUs.  Knob variants
run in spawned workers so that each sees its own environment (`refit.settings`: member 0's run
knobs hold for all).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from refit.bench.launch import run_job
from tests.harness.executor_jobs import DENSE, MOE, check, job

ROOT = Path(__file__).resolve().parents[2]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="no CUDA device (make test-gpu runs these on a GPU machine)")]


def needs(gpus: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(GPUS < gpus, reason=f"needs {gpus} GPUs, this machine has {GPUS}")


def _run(spec, src: str, dst: str, placement: str, monkeypatch: pytest.MonkeyPatch, env: dict[str, str] | None = None,
         **kw) -> list:
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    j, plans = job(spec, src, dst, placement, device="cuda", **kw)
    results = run_job(j, start_method="spawn")  # each run's workers see this environment
    check(results, plans, spec)
    return results


ONE_GPU = {
    "ipc-pull": dict(transport="ipc", env={"REFIT_IPC": "pull"}),
    "ipc-push": dict(transport="ipc", env={"REFIT_IPC": "push"}),
    "ipc-table-copy-on": dict(transport="ipc", env={"REFIT_TABLE_COPY": "on"}),
    "ipc-table-copy-off": dict(transport="ipc", env={"REFIT_TABLE_COPY": "off"}),
    "ipc-batch-memcpy": dict(transport="ipc", env={"REFIT_BATCH_MEMCPY": "all"}),
    "ipc-arena": dict(transport="ipc", alloc="arena"),
    "comm": dict(transport="comm"),
    "one-process": dict(topology="single"),
    "phased": dict(transport="ipc", phase_layers=1, planners=("p2p",)),  # broadcast plans gather: no phases
}


def _run_case(case: dict, src: str, dst: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One of the knob cases above (``env``: the knobs; the rest: `job`'s arguments), colocated."""
    kw = dict(case)
    env = kw.pop("env", None)
    _run(MOE, src, dst, "colocated", monkeypatch, env, **kw)


@pytest.mark.parametrize("case", list(ONE_GPU), ids=list(ONE_GPU))
def test_one_gpu_two_processes_bit_exact(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _run_case(ONE_GPU[case], "megatron:tp1", "vllm:tp1", monkeypatch)


def test_one_gpu_float32_tied_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 values, tied embeddings, qkv bias; fsdp source rows into vLLM's layout."""
    _run(DENSE, "fsdp:dp1", "vllm:tp1", "colocated", monkeypatch, transport="ipc")


def _bench(*args: str) -> dict:
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-m", "refit.bench", *args, "--iters", "3", "--json"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("model", ["qwen3-30b-moe", "qwen3-8b"])
def test_bench_full_width_one_gpu(model: str) -> None:
    r = _bench("--model", model, "--layers", "2", "--src", "tp1", "--dst", "tp1")
    assert r["device"] == "cuda", r


def test_bench_via_grpc_one_gpu() -> None:
    r = _bench("--model", "qwen3-8b", "--layers", "2", "--src", "tp1", "--dst", "tp1", "--via", "grpc")
    assert r["device"] == "cuda", r


# Between GPUs: NVLink (or PCIe) peers under CUDA IPC and NCCL, each beside the refit's own same-GPU
# copies (a colocated rank's shard of its own tensors stays on its GPU).
TWO_GPUS = ("ipc-pull", "ipc-push", "ipc-arena", "comm", "phased")  # of ONE_GPU's cases


@needs(2)
@pytest.mark.parametrize("case", TWO_GPUS)
def test_two_gpus_bit_exact(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _run_case(ONE_GPU[case], "tp2ep2", "tp2", monkeypatch)


@needs(2)
@pytest.mark.parametrize("planner", ["p2p", "broadcast"])
def test_bench_via_grpc_two_gpus(planner: str) -> None:
    """Agents: trainer and engine ranks in processes of their own, two on each GPU."""
    r = _bench("--model", "qwen3-30b-moe", "--layers", "2", "--src", "megatron:tp2ep2", "--dst", "vllm:tp2",
               "--via", "grpc", "--planner", planner)
    assert r["device"] == "cuda" and r["planner"] == planner, r


@needs(4)
@pytest.mark.parametrize("transport", ["ipc", "comm"])
def test_four_gpus_disaggregated_bit_exact(transport: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(MOE, "fsdp:dp2", "vllm:tp2ep2", "disaggregated", monkeypatch, transport=transport)


@needs(4)
@pytest.mark.parametrize("src,dst", [("tp4ep4", "tp4"), ("tp2ep2", "tp4"), ("tp4ep4", "tp2ep2")])
@pytest.mark.parametrize("transport", ["ipc", "comm"])
def test_four_gpus_colocated_bit_exact(src: str, dst: str, transport: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainer and engine world sizes equal and not (an engine rank with no trainer rank on its GPU)."""
    _run(MOE, src, dst, "colocated", monkeypatch, transport=transport)
