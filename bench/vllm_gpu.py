"""refit against vLLM's own weight transfer, into live vLLM engines on one GPU, same run.

    python bench/vllm_gpu.py --model qwen3-8b [--layers N] [--repeats 5] [--trace] [--json]

A trainer in this process holds a random bf16 model of the catalog's shape (HF layout, on the
GPU); two engines of the same model start from a checkpoint of it with vLLM's defaults on CUDA
(graphs and compile on): one with the ``refit`` backend, one with vLLM's ``ipc`` backend.  Timed,
each the RL loop's calls (``start_weight_update`` .. ``finish_weight_update``), median of
``--repeats`` (after one warm-up):

* refit: a coordinator and a `TrainerAgent` in this process, the engine's agent pulling through
  CUDA IPC into its live parameters (in place; MoE experts staged one layer at a time);
* vLLM ipc: ``IPCWeightTransferEngine.trainer_send_weights`` with vLLM's packed chunks (its
  bounded-memory mode) and unpacked (every tensor's handle in one call), into vLLM's layerwise
  reload — driven as vLLM's RLHF examples drive it, the handles passed pickled through
  ``update_weights`` (``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, as its HTTP mode does);
* vLLM reload: ``collective_rpc("reload_weights", weights_path=...)`` of a safetensors checkpoint
  of the same weights on local disk (page cache warm after the first);
* the floor: one device copy of the engine's bytes (``copy_`` of one buffer into another).

Every engine's greedy tokens and logprobs after each way (the prefix cache reset, as RL loops do)
are checked against that engine's own answers before any transfer (both engines start from the
checkpoint of the same weights); ``engines_agree`` says whether the two engines' first answers
agree.  vLLM's nccl backend needs a second GPU: not measured here yet.  The GPU machine has no Ray: vLLM 0.26's ipc module imports it at its top and uses it only for its "ray" send mode, so
bench/probes/no_ray stands in for it there (put it on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import pickle
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
log = logging.getLogger("vllm_gpu")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-8b", help="a catalog model (refit models)")
    p.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--out", default="", help="also write the JSON to this file (vLLM logs to stdout too)")
    p.add_argument("--trace", action="store_true",
                   help="trace refit's steps in every process (REFIT_CONTROL_TRACE) and report each step's median "
                        "offset from the loop's start_weight_update call: where the time beyond the copy goes")
    return p.parse_args(argv)


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    import torch

    fn()  # warm-up
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def copy_floor(nbytes: int, repeats: int) -> float:
    """Seconds of one device copy of ``nbytes`` (median)."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ts = timed(lambda: b.copy_(a), repeats)
    del a, b
    torch.cuda.empty_cache()
    return statistics.median(ts)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    trace = tempfile.mkdtemp(prefix="refit-vllm-gpu-trace-") if a.trace else ""
    if trace:  # before refit reads its settings, and inherited by vLLM's engine processes
        os.environ["REFIT_CONTROL_TRACE"] = os.path.join(trace, "steps")
    import torch
    from safetensors.torch import save_file
    from vllm import LLM

    from refit.catalog import CATALOG
    from refit.control.agent import TrainerAgent
    from refit.control.server import ThreadedServer
    from refit.control.client import Client
    from refit.integrations.vllm import compat
    from refit.layouts import HFLayout
    from refit.spec import ModelConfig, build_spec
    from refit.timeline import mark
    from tests.gpu.vllm_gpu import generate_alone as generate

    cfg = dict(CATALOG[a.model], architectures=[_arch(CATALOG[a.model])], max_position_embeddings=4096)
    if a.layers:
        cfg["num_hidden_layers"] = a.layers
    name = f"{a.model}{f'-{a.layers}l' if a.layers else ''}"
    tmp = tempfile.mkdtemp(prefix="refit-vllm-gpu-")
    model_dir = os.path.join(tmp, name)
    os.makedirs(model_dir)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    spec = build_spec(name, ModelConfig.from_hf(cfg))
    layout = HFLayout().resolve(spec)
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = {lt.name: (torch.randn(lt.shape, generator=gen, device="cuda", dtype=torch.float32) * 0.02)
               .to(getattr(torch, lt.dtype)) for lt in layout.local_tensors(spec, 0)}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    result: dict[str, Any] = {"model": name, "gpu": torch.cuda.get_device_name(), "vllm": _vllm_version(),
                              "bytes": nbytes, "tensors": len(tensors), "repeats": a.repeats}
    log.warning("%s: %d tensors, %.2f GB", name, len(tensors), nbytes / 1e9)

    t0 = time.perf_counter()
    save_file({n: t.cpu() for n, t in tensors.items()}, os.path.join(model_dir, "model.safetensors"),
              metadata={"format": "pt"})
    result["checkpoint_write_s"] = time.perf_counter() - t0
    result["copy_floor_ms"] = copy_floor(nbytes, a.repeats) * 1e3

    # no kernel chosen by timing in the engines' processes (they inherit it), as the GPU tests start
    # theirs: two engines of one model then answer alike
    from tests.gpu.vllm_gpu import SAME_KERNELS_ENV

    os.environ.update(SAME_KERNELS_ENV)
    kw: dict[str, Any] = {"skip_tokenizer_init": True, "dtype": "bfloat16", "max_model_len": 512, "max_num_seqs": 4,
                          "gpu_memory_utilization": 0.2, "kv_cache_memory_bytes": 1 << 30,
                          "seed": 0,
                          # vLLM's default times combo kernels against plain ones and keeps the faster:
                          # two engines of one model may then choose differently, and their logprobs
                          # differ in the 5th decimal (tests/gpu/vllm_gpu.py)
                          "compilation_config": {"inductor_compile_config": {
                              "combo_kernels": True, "benchmark_combo_kernel": False}}}
    server = ThreadedServer(default_timeout=300.0)
    client = Client(server.address)
    agent = TrainerAgent(server.address, group="trainer", rank=0, spec=spec, layout=layout, tensors=tensors,
                         gpu=0).start()
    answers: dict[str, Any] = {}

    llm = LLM(model=model_dir, weight_transfer_config={"backend": "refit"}, **kw)
    llm.init_weight_transfer_engine({"init_info": {"coordinator": server.address, "group": "engine"}})
    plan = client.create_plan("trainer", "engine")["plan_id"]
    answers["fresh"] = generate(llm)  # started from the checkpoint of these weights: the reference
    version = [0]

    def refit_once() -> None:
        version[0] += 1
        mark(TRACE_START)
        llm.start_weight_update()
        mark("loop: start_weight_update returned")
        llm.update_weights({"update_info": {"plan_id": plan, "version": version[0], "timeout": 300.0}})
        mark("loop: update_weights returned")
        compat.finish_weight_update(llm, version[0])
        mark("loop: finish_weight_update returned")

    result["refit_ms"] = [t * 1e3 for t in timed(refit_once, a.repeats)]
    if trace:
        result["refit_steps_us"] = _steps(os.environ["REFIT_CONTROL_TRACE"], a.repeats)
        log.warning("refit's steps (median microseconds after start_weight_update was called):\n%s",
                    "\n".join(f"{us:10.0f}  {step}" for step, us in result["refit_steps_us"].items()))
    log.warning("so far: %s", json.dumps(result))
    answers["refit"] = _answers(llm)
    result["reload_ms"] = [t * 1e3 for t in timed(
        lambda: llm.collective_rpc("reload_weights", kwargs={"weights_path": model_dir}), a.repeats)]
    answers["reload"] = _answers(llm)
    log.warning("so far: %s", json.dumps(result))
    llm.llm_engine.engine_core.shutdown()
    del llm
    torch.cuda.empty_cache()

    vllm_ipc = LLM(model=model_dir, weight_transfer_config={"backend": "ipc"}, **kw)
    vllm_ipc.init_weight_transfer_engine({"init_info": {}})
    answers["fresh_ipc_engine"] = generate(vllm_ipc)  # this second engine's own answers, before any transfer
    for packed in (True, False):
        result[f"vllm_ipc{'_packed' if packed else ''}_ms"] = [t * 1e3 for t in timed(
            lambda: _ipc_once(vllm_ipc, tensors, packed), a.repeats)]
        answers[f"vllm_ipc{'_packed' if packed else ''}"] = _answers(vllm_ipc)
    vllm_ipc.llm_engine.engine_core.shutdown()

    # each way against its own engine's answers before any transfer; the two engines against each other
    own = {k: answers["fresh_ipc_engine" if k.startswith("vllm_ipc") else "fresh"] for k in answers}
    result["answers_equal"] = {k: v == own[k] for k, v in answers.items() if not k.startswith("fresh")}
    result["engines_agree"] = answers["fresh_ipc_engine"] == answers["fresh"]
    fastest_vllm = min(statistics.median(result[k]) for k in ("vllm_ipc_packed_ms", "vllm_ipc_ms", "reload_ms"))
    refit_ms = statistics.median(result["refit_ms"])
    result["summary"] = {"refit_ms": refit_ms, "x_copy_floor": refit_ms / result["copy_floor_ms"],
                         "fastest_vllm_ms": fastest_vllm, "speedup_vs_fastest_vllm": fastest_vllm / refit_ms,
                         **{k: statistics.median(result[k]) for k in ("vllm_ipc_packed_ms", "vllm_ipc_ms", "reload_ms")}}
    steps = result.get("refit_steps_us")
    if steps:
        data_ms = _data_ms(steps)
        result["summary"].update(data_ms=data_ms, data_x_copy_floor=data_ms / result["copy_floor_ms"])
    agent.stop()
    client.close()
    server.stop()
    print(json.dumps(result, indent=None if a.json else 2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(result["answers_equal"].values()) else 1


TRACE_START = "loop: start_weight_update called"


def _answers(llm: Any) -> Any:
    """Greedy answers after a transfer, as an RL loop takes them: the prefix cache reset first (vLLM
    keeps KV blocks computed before the transfer, and reusing them changes the arithmetic)."""
    from tests.gpu.vllm_gpu import generate_alone

    llm.reset_prefix_cache()
    return generate_alone(llm)


def _steps(prefix: str, last: int) -> dict[str, float]:
    """Each traced step's median offset (microseconds) from the loop's call, over the last refits."""
    from refit.timeline import read_steps, timeline

    return dict(timeline(read_steps(prefix), last, start=TRACE_START))


def _data_ms(steps: dict[str, float]) -> float:
    """The bytes' own time: the engine member between its start and end barriers, summed over the
    phases of a phased refit (steps ``... #2``, ``#3``...); what lies between phases is the landing."""
    total, k = 0.0, 1
    while True:
        tag = "" if k == 1 else f" #{k}"
        start, end = steps.get(f"engine/0: past the start barrier{tag}"), steps.get(f"engine/0: at the end barrier{tag}")
        if start is None or end is None:
            return total / 1e3
        total, k = total + end - start, k + 1


def _ipc_once(llm: Any, tensors: dict[str, Any], packed: bool) -> None:
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    def send(info: Any) -> None:  # what vLLM's HTTP mode sends, through the offline LLM
        update = {"names": info.names, "dtype_names": info.dtype_names, "shapes": info.shapes, "packed": info.packed,
                  "ipc_handles_pickled": base64.b64encode(pickle.dumps(info.ipc_handles)).decode()}
        if info.tensor_sizes is not None:
            update["tensor_sizes"] = info.tensor_sizes
        llm.update_weights({"update_info": update})

    llm.start_weight_update()
    # packed chunks must hold the largest tensor (Qwen3's 151936-row embedding: 1.24 GB at 4096)
    biggest = max(t.numel() * t.element_size() for t in tensors.values())
    IPCWeightTransferEngine.trainer_send_weights(iter(tensors.items()), {
        "send_mode": send, "packed": packed, "packed_buffer_size_bytes": max(1 << 30, biggest)})
    llm.finish_weight_update()


def _arch(cfg: dict[str, Any]) -> str:
    return {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "llama": "LlamaForCausalLM"}[
        cfg["model_type"]]


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


if __name__ == "__main__":
    sys.exit(main())
