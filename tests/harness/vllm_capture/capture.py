"""Capture what vLLM's own weight loaders put into every TP rank's parameters.

Usage (from tests)::

    from tests.harness.vllm_capture.capture import capture_vllm_loaded_params
    files = capture_vllm_loaded_params(model_dir, out_dir, tensor_parallel_size=2)

or from the command line (repo root as cwd)::

    python -m tests.harness.vllm_capture.capture MODEL_DIR OUT_DIR --tp 2 [--ep]

Layouts a live engine is too slow for here (tp 8, dp > 1) are captured by ``direct.py``: vLLM's
own model construction and loaders run per rank in one process, with stand-in TP/DP/EP groups;
the two agree bit for bit wherever both run (tests/integration/test_vllm_conventions.py).

How it works
------------
* ``capture_vllm_loaded_params`` runs a fresh ``python -m
  tests.harness.vllm_capture.capture`` subprocess (own process group) so each engine
  starts from a clean interpreter; nothing of vLLM is imported in the caller.
* The subprocess sets the CPU env vars, then builds ``vllm.LLM(...,
  worker_extension_cls="tests.harness.vllm_capture.capture.CaptureWorkerExtension")``.
* vLLM imports the worker extension class in every worker process inside
  ``WorkerWrapperBase.init_worker`` (vllm/v1/worker/worker_base.py), i.e.
  *before* the worker is constructed and the model is loaded.  Importing this
  module in a process where ``REFIT_VLLM_CAPTURE_DIR`` is set patches
  ``vllm.model_executor.model_loader.base_loader.process_weights_after_loading``
  (the name ``BaseModelLoader.load_model`` calls right after
  ``self.load_weights(model, model_config)``).  The wrapper saves
  ``model.named_parameters()`` (clone + contiguous) and then calls the original.
* Output: ``{out_dir}/rank-{tp_rank:05d}.safetensors`` (if data-parallel or
  pipeline-parallel size > 1: ``dp-{dp:03d}-pp-{pp:03d}-rank-{tp:05d}``).
  The safetensors metadata key ``"refit_capture"`` (read it with
  ``read_capture_meta(path)``) holds JSON: tp/pp/dp rank+size, world rank/size,
  ep_group_rank/size (the EP *process group*, exists for any MoE model),
  ``param_names`` in named_parameters() order, and ``moe``: per
  ``...mlp.experts.routed_experts`` module its FusedMoEParallelConfig
  (moe_tp_*, moe_ep_*, moe_use_ep), intermediate_size_per_partition and the
  ``local_to_global`` expert ids held by that rank.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

ENV_OUT_DIR = "REFIT_VLLM_CAPTURE_DIR"
WORKER_EXTENSION = "tests.harness.vllm_capture.capture.CaptureWorkerExtension"
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/harness/vllm_capture/ -> repo


# --------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------
def _rank_info() -> dict:
    from vllm.distributed import parallel_state as ps

    info = {
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "tp_size": ps.get_tensor_model_parallel_world_size(),
        "pp_rank": ps.get_pp_group().rank_in_group,
        "pp_size": ps.get_pp_group().world_size,
        "dp_rank": ps.get_dp_group().rank_in_group,
        "dp_size": ps.get_dp_group().world_size,
        "world_rank": ps.get_world_group().rank,
        "world_size": ps.get_world_group().world_size,
    }
    # The EP *process group* only exists for MoE models
    # (parallel_state.initialize_model_parallel) and spans dp*pcp*tp ranks even
    # when expert parallelism is off; whether experts are actually EP-placed is
    # in meta["moe"][layer]["moe_use_ep"/"moe_ep_size"/"moe_ep_rank"].
    try:
        ep = ps.get_ep_group()
        info["ep_group_rank"], info["ep_group_size"] = ep.rank_in_group, ep.world_size
    except AssertionError:
        info["ep_group_rank"], info["ep_group_size"] = None, None
    # CPU worker: basename of the file:// init method; names this engine's
    # /dev/shm segments (v1/worker/cpu_worker.py, cpu_communicator.py).
    info["vllm_dist_ident"] = os.environ.get("VLLM_DIST_IDENT")
    return info


def _file_name(info: dict) -> str:
    if info["dp_size"] > 1 or info["pp_size"] > 1:
        return f"dp-{info['dp_rank']:03d}-pp-{info['pp_rank']:03d}-rank-{info['tp_rank']:05d}.safetensors"
    return f"rank-{info['tp_rank']:05d}.safetensors"


def _moe_info(model) -> dict:
    """Per routed-experts module: parallel config and local->global expert ids.

    In vLLM 0.32 the expert weights live in a ``RoutedExperts`` module
    (``...mlp.experts.routed_experts``), owned by the ``MoERunner`` returned by
    ``FusedMoEFactory`` (vllm/model_executor/layers/fused_moe/layer.py).
    """
    out = {}
    for name, mod in model.named_modules():
        emm = getattr(mod, "expert_map_manager", None)
        if emm is None or not hasattr(mod, "moe_config") or hasattr(mod, "routed_experts"):
            continue
        pc = mod.moe_config.moe_parallel_config
        out[name] = {
            "global_num_experts": int(mod.global_num_experts),
            "local_num_experts": int(mod.local_num_experts),
            "local_to_global": [int(x) for x in emm.get_local_expert_ids()],
            "placement_strategy": str(emm.placement_strategy),
            "intermediate_size_per_partition": int(mod.moe_config.intermediate_size_per_partition),
            "moe_tp_size": int(pc.tp_size), "moe_tp_rank": int(pc.tp_rank),
            "moe_dp_size": int(pc.dp_size), "moe_dp_rank": int(pc.dp_rank),
            "moe_ep_size": int(pc.ep_size), "moe_ep_rank": int(pc.ep_rank),
            "moe_use_ep": bool(pc.use_ep),
        }
    return out


def _snapshot(model) -> str:
    from safetensors.torch import save_file

    out_dir = os.environ[ENV_OUT_DIR]
    os.makedirs(out_dir, exist_ok=True)
    info = _rank_info()
    tensors = {}
    for name, p in model.named_parameters():
        tensors[name] = p.detach().to("cpu").clone().contiguous()
    meta = dict(info)
    meta["moe"] = _moe_info(model)
    meta["param_names"] = list(tensors)
    path = os.path.join(out_dir, _file_name(info))
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={"refit_capture": json.dumps(meta)})
    os.replace(tmp, path)
    return path


def _install_patch() -> None:
    from vllm.model_executor.model_loader import base_loader

    orig = base_loader.process_weights_after_loading
    if getattr(orig, "_refit_capture_patched", False):
        # Already patched, possibly by this file imported under another module
        # name (``__mp_main__`` in a spawned/forked process); state lives on the
        # patched function, so nothing to do.
        return

    files: list[str] = []

    def process_weights_after_loading(model, model_config, target_device):
        files.append(_snapshot(model))
        return orig(model, model_config, target_device)

    process_weights_after_loading._refit_capture_patched = True  # type: ignore[attr-defined]
    process_weights_after_loading._refit_orig = orig  # type: ignore[attr-defined]
    process_weights_after_loading._refit_files = files  # type: ignore[attr-defined]
    base_loader.process_weights_after_loading = process_weights_after_loading


class CaptureWorkerExtension:
    """Mixed into vLLM's worker class; its import installs the capture patch."""

    def refit_capture_files(self) -> list[str]:
        from vllm.model_executor.model_loader import base_loader

        return list(getattr(base_loader.process_weights_after_loading, "_refit_files", []))


if os.environ.get(ENV_OUT_DIR):
    # Only in processes of a capture run (engine core + workers); importing this
    # module elsewhere (e.g. from pytest) must not import vLLM.
    _install_patch()


# --------------------------------------------------------------------------
# Driver side
# --------------------------------------------------------------------------
def _cpu_env(world_size: int) -> dict:
    ncpu = os.cpu_count() or 1
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % ncpu) for i in range(world_size)),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    return env


def _engine_main(model_dir: str, out_dir: str, tp: int, ep: bool) -> list[str]:
    """Runs inside the capture subprocess: start engine, collect, shut down."""
    os.environ[ENV_OUT_DIR] = os.path.abspath(out_dir)
    for k, v in _cpu_env(tp).items():
        os.environ.setdefault(k, v)
    # the engine core in this process (tp>1: the workers are processes either way, and the capture
    # patch runs in them): one interpreter start of vLLM less per capture
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.makedirs(out_dir, exist_ok=True)

    import gc

    from vllm import LLM

    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        tensor_parallel_size=tp,
        enable_expert_parallel=ep,
        worker_extension_cls=WORKER_EXTENSION,
        max_model_len=128,
        max_num_seqs=4,
    )
    per_worker = llm.collective_rpc("refit_capture_files")
    files = sorted(f for fs in per_worker for f in fs)
    # Clean shutdown of engine core + workers.
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()
    return files


def _cleanup_engine_leftovers(out_dir: str) -> None:
    """Remove /dev/shm segments and the /tmp init file that vLLM's CPU TP
    communicator sometimes leaks (4 MiB per rank) -- only those of THIS run,
    identified by the unique VLLM_DIST_IDENT recorded in the rank files."""
    import glob
    import re
    import tempfile

    idents = set()
    for f in glob.glob(os.path.join(out_dir, "*rank-*.safetensors")):
        try:
            ident = read_capture_meta(f).get("vllm_dist_ident")
        except Exception:
            continue
        if ident and re.fullmatch(r"vllm_dist_[0-9a-f]{32}", ident):
            idents.add(ident)
    for ident in idents:
        for p in glob.glob(f"/dev/shm/{glob.escape(ident)}-*") + [os.path.join(tempfile.gettempdir(), ident)]:
            try:
                os.remove(p)
            except OSError:
                pass


def capture_vllm_loaded_params(
    model_dir: str,
    out_dir: str,
    tensor_parallel_size: int = 2,
    enable_expert_parallel: bool = False,
    timeout: float = 900.0,
) -> list[str]:
    """Start a real vLLM engine on ``model_dir`` in a subprocess and write each
    TP rank's parameters, as left by vLLM's weight loaders (before
    ``process_weights_after_loading``), to ``out_dir``.

    Returns the sorted list of written ``.safetensors`` paths (one per rank).
    Stale ``*rank-*.safetensors`` files in ``out_dir`` are deleted first; the
    engine log is kept in ``{out_dir}/capture.log``.
    Raises ``RuntimeError`` (with the subprocess log tail) on failure/timeout.
    """
    from tests.harness.marks import require_vllm_mark
    from tests.harness.run_cache import checkpoint_digest, vllm_environment, vllm_version

    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    # Remove stale capture files of an earlier run (only our own file names).
    for f in os.listdir(out_dir):
        if f.endswith((".safetensors", ".safetensors.tmp")) and "rank-" in f:
            os.remove(os.path.join(out_dir, f))
    # One engine per (checkpoint content, tp, ep, vLLM, environment) in a test run: a capture made
    # before (by this test module or another) is copied into out_dir.
    key = (checkpoint_digest(model_dir), tensor_parallel_size, enable_expert_parallel, vllm_version(),
           vllm_environment(_cpu_env(tensor_parallel_size), {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}))
    earlier = _CAPTURES.get(key)
    if earlier and all(os.path.exists(f) for f in earlier):
        import shutil

        CAPTURE_STATS["reused"] += 1
        shutil.copy(os.path.join(os.path.dirname(earlier[0]), "capture.log"), os.path.join(out_dir, "capture.log"))
        return [shutil.copy(f, os.path.join(out_dir, os.path.basename(f))) for f in earlier]
    require_vllm_mark("captures what a vLLM engine loads")
    CAPTURE_STATS["computed"] += 1
    env = dict(os.environ)
    env.update(_cpu_env(tensor_parallel_size))
    env.pop(ENV_OUT_DIR, None)  # the subprocess sets it itself
    env["PYTHONPATH"] = _REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "tests.harness.vllm_capture.capture",
           os.path.abspath(model_dir), out_dir, "--tp", str(tensor_parallel_size)]
    if enable_expert_parallel:
        cmd.append("--ep")
    log_path = os.path.join(out_dir, "capture.log")
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=_REPO_ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            # Reap anything left in the subprocess' own process group (engine
            # core / workers), but only that group.
            try:
                os.killpg(proc.pid, signal.SIGKILL if rc is None else signal.SIGTERM)
            except ProcessLookupError:
                pass
            if rc is None:
                proc.wait()
    with open(log_path) as f:
        tail = f.read()[-6000:]
    _cleanup_engine_leftovers(out_dir)
    if rc != 0:
        raise RuntimeError(f"vLLM capture failed (rc={rc}, {time.time() - t0:.0f}s); log {log_path}:\n{tail}")
    files = sorted(
        os.path.join(out_dir, f) for f in os.listdir(out_dir)
        if f.endswith(".safetensors") and "rank-" in f
    )
    if len(files) != tensor_parallel_size:
        raise RuntimeError(f"expected {tensor_parallel_size} rank files in {out_dir}, got {files}\n{tail}")
    _CAPTURES[key] = files
    return files


# This run's engine captures (`capture_vllm_loaded_params`): key -> rank files (in a test's tmp_path,
# which pytest keeps for the run).
_CAPTURES: dict[tuple, list[str]] = {}
CAPTURE_STATS = {"computed": 0, "reused": 0}


def read_capture_meta(path: str) -> dict:
    """The JSON metadata (rank info, MoE expert placement) of a capture file."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return json.loads(f.metadata()["refit_capture"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", action="store_true")
    a = ap.parse_args(argv)
    t0 = time.time()
    files = _engine_main(a.model_dir, a.out_dir, a.tp, a.ep)
    print(f"REFIT_CAPTURE_DONE {time.time() - t0:.1f}s files={files}", flush=True)
    if len(files) != a.tp:
        print(f"expected {a.tp} files, got {len(files)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(rc)
