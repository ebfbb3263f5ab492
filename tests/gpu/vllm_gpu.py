"""Live vLLM engines on a GPU, and the trainers that refit them, for tests/gpu/test_gpu_vllm.py.

Everything runs in spawned processes driven over pipes (`PipedProcess`):

* `GpuTrainer`: a transformers model in float32 on the GPU, attached with `refit_hf.attach`
  (its live parameters served through CUDA IPC), stepped by a real AdamW step on random tokens;
  after each step it writes what it serves as an HF checkpoint (float32 safetensors under HF
  names), from which a fresh engine is the reference.
* `GpuEngine`: ``vllm.LLM`` with vLLM's defaults on CUDA (CUDA graphs and torch.compile on), with
  the ``refit`` backend, or without it (a fresh engine, the reference).  Engines start side by side:
  each takes a fixed KV cache (``kv_cache_memory_bytes``) and a small share of the GPU, and a cache
  directory of its own (two engines compiling the same model at once would race in one).  A fresh
  engine started to be compared with a refitted one reuses that engine's compile cache
  (``compiled_by``), so that both run the very kernels the refitted one compiled and tuned: which
  Triton configuration a compile keeps is no property of the weights.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import traceback
from typing import Any

import torch

from tests.harness.procs import PipedProcess, await_answer
from tests.harness.tiny import _VLLM_COMMON

CTX = mp.get_context("spawn")

# Shapes vLLM's CUDA kernels take (FlashAttention head sizes, FlashMLA's 512 + 64 latent, FP8
# GEMMs in whole 128-blocks), small enough to start in seconds.
CONFIGS: dict[str, dict[str, Any]] = {
    "gpu-qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                  "intermediate_size": 512, "vocab_size": 1024, "max_position_embeddings": 256,
                  "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "gpu-qwen3-moe": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 256,
                      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                      "intermediate_size": 512, "moe_intermediate_size": 128, "num_experts": 8,
                      "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "norm_topk_prob": True, "vocab_size": 1024, "max_position_embeddings": 256,
                      "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    # DeepSeek-V3: MLA with q LoRA, a dense first layer, a shared expert, the float32 router bias
    "gpu-deepseek-v3": {**_VLLM_COMMON, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                        "hidden_size": 256, "num_attention_heads": 16, "num_key_value_heads": 16,
                        "q_lora_rank": 128, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                        "v_head_dim": 128, "intermediate_size": 512, "moe_intermediate_size": 128,
                        "n_routed_experts": 8, "n_shared_experts": 1, "topk_method": "noaux_tc",
                        "vocab_size": 1024},
}
# No kernel chosen by timing it on the device.  vLLM compiles each CUDA-graph batch size with
# Inductor's max-autotune and coordinate-descent tuning on: engines compiling one model side by side
# on a busy GPU time candidate kernels and may keep different ones.  Every engine here, refitted or
# fresh, compiles without it.
SAME_KERNELS_ENV = {"VLLM_ENABLE_INDUCTOR_MAX_AUTOTUNE": "0", "VLLM_ENABLE_INDUCTOR_COORDINATE_DESCENT_TUNING": "0",
                    "TORCHINDUCTOR_DETERMINISTIC": "1"}
SCALE = 0.1  # random weights: standard normal times this
LR = 1e-3  # large enough that every step changes many bf16 values


def write_checkpoint(directory: str, name: str, seed: int = 0) -> str:
    from tests.harness.tiny import write_hf_checkpoint

    write_hf_checkpoint(directory, name, seed=seed, files=1, scale=SCALE, config=CONFIGS[name])
    # transformers reads one unindexed file only under this name
    os.replace(os.path.join(directory, "model-00001-of-00001.safetensors"), os.path.join(directory, "model.safetensors"))
    return directory


def fp8_checkpoint(src: str, out: str) -> str:
    """The FP8 block checkpoint (float8 weights, 128x128 ``weight_scale_inv``) that ``refit reshard
    --dst-dtype fp8`` writes of the HF checkpoint ``src``, cast to bfloat16 first: the engine's
    dtype, which a refit from float32 masters casts to before quantizing on the wire."""
    from safetensors.torch import load_file, save_file

    from refit.cli import main as refit_main

    bf16 = out + "-bf16"
    os.makedirs(bf16, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), bf16)
    state = load_file(os.path.join(src, "model.safetensors"))
    save_file({n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in state.items()},
              os.path.join(bf16, "model.safetensors"), metadata={"format": "pt"})
    code = refit_main(["reshard", "--model", bf16, "--src", "hf", "--dst", "hf", "--dst-dtype", "fp8", "--in", bf16,
                       "--out", out])
    assert code == 0, f"refit reshard --dst-dtype fp8 of {bf16} exited {code}"
    return out


# ------------------------------------------------------------------------------------ trainer
def _trainer_main(conn: Any, entered: Any, address: str, group: str, model_dir: str, out_dir: str) -> None:
    logging.basicConfig(level=logging.INFO)
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from refit.integrations import hf as refit_hf

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    agent = refit_hf.attach(model, address, group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    vocab = model.config.vocab_size
    conn.send(("ready", os.getpid()))
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "step":  # a real optimizer step, then the weights it serves as an HF checkpoint
                gen = torch.Generator(device="cuda").manual_seed(1000 + arg)
                ids = torch.randint(0, vocab, (4, 32), device="cuda", generator=gen)
                model.train()
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                out = os.path.join(out_dir, f"{group}-v{arg}")
                os.makedirs(out, exist_ok=True)
                shutil.copy(os.path.join(model_dir, "config.json"), out)
                save_file({n: t.detach().contiguous().cpu() for n, t in agent.tensors.items()},
                          os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
                conn.send(("ok", (out, float(loss))))
            elif cmd == "die_after_share":  # the next share runs whole, then this process dies unreported
                plane, inner = agent.data_plane, agent.data_plane.run

                def die(plan: Any, tensors: Any, ctx: Any, _inner: Any = inner) -> Any:
                    _inner(plan, tensors, ctx)
                    torch.cuda.synchronize()
                    entered.set()
                    os._exit(17)
                plane.run = die  # type: ignore[method-assign]
                conn.send(("ok", None))
            elif cmd == "stop":
                agent.stop()
                conn.send(("ok", None))
                return
        except Exception as e:  # noqa: BLE001 - the test reads it
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


class GpuTrainer(PipedProcess):
    """One trainer rank (layout ``hf``) in a process of its own, on GPU 0."""

    def __init__(self, address: str, group: str, model_dir: str, out_dir: str) -> None:
        self.entered = CTX.Event()
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=_trainer_main, args=(child, self.entered, address, group, model_dir, out_dir))
        self.proc.start()
        self.group = group
        _expect_ready(self, 300.0)

    def ask(self, cmd: str, arg: Any = None, timeout: float = 120.0) -> Any:
        return _ask(self, cmd, arg, timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)


# ------------------------------------------------------------------------------------ engine
def _addresses(model: torch.nn.Module) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in model.named_parameters()}


def _digests(model: torch.nn.Module) -> dict[str, str]:
    """A digest of every parameter's and buffer's bytes as the engine holds them (after its
    post-load processing): two engines that hold the same weights give equal dicts."""
    import hashlib
    import itertools

    return {n: hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            .hexdigest()[:16] for n, t in itertools.chain(model.named_parameters(), model.named_buffers())}


def generate_alone(llm: Any) -> list[tuple[list[int], list[float]]]:
    """`generate` of each prompt on its own.  The engine core schedules requests as they arrive, so
    prompts handed over in one call may share a first step or not depending on timing, and the
    batch's shape changes the GEMMs' summation order: two engines holding equal weights bit for bit
    then differ in the 5th decimal of a logprob (seen 2026-11-29, one time in two, their weights'
    digests equal).  One prompt at a time, every step's batch is the same on every engine."""
    from tests.harness.vllm_rl import PROMPTS, generate

    return [generate(llm, [p])[0] for p in PROMPTS]


def _engine_main(conn: Any, cache: str, model_dir: str, coordinator: str | None, group: str,
                 llm_kwargs: dict[str, Any]) -> None:
    # engines compiling the same model side by side would race in one cache: one each, shared only
    # with engines started once its engine has compiled (`GpuEngine`'s ``compiled_by``)
    os.environ["VLLM_CACHE_ROOT"] = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"vllm-cache-{cache}")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model across processes
    os.environ.update(SAME_KERNELS_ENV)
    logging.basicConfig(level=logging.INFO)
    try:
        from vllm import LLM

        from refit.integrations.vllm import compat
        from tests.harness.vllm_rl import probe

        kw: dict[str, Any] = {"skip_tokenizer_init": True, "dtype": "bfloat16", "max_model_len": 128,
                              "max_num_seqs": 4, "gpu_memory_utilization": 0.05,
                              "kv_cache_memory_bytes": 256 << 20, "seed": 0,
                              # vLLM's default times combo kernels against plain ones and keeps the
                              # faster: two engines compiling side by side on one GPU may choose
                              # differently, and their logprobs then differ in the 5th decimal
                              "compilation_config": {"inductor_compile_config": {
                                  "combo_kernels": True, "benchmark_combo_kernel": False}}}
        if coordinator:
            kw["weight_transfer_config"] = {"backend": "refit"}
        kw.update(llm_kwargs)
        llm = LLM(model=model_dir, **kw)
        if coordinator:
            llm.init_weight_transfer_engine({"init_info": {"coordinator": coordinator, "group": group}})
    except Exception as e:  # noqa: BLE001 - the test reads it rather than waiting out its timeout
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "generate":
                conn.send(("ok", generate_alone(llm)))
            elif cmd == "refit":  # the RL loop's calls
                plan_id, version = arg
                llm.start_weight_update()
                llm.update_weights({"update_info": {"plan_id": plan_id, "version": version}})
                compat.finish_weight_update(llm, version)
                conn.send(("ok", None))
            elif cmd == "addresses":
                conn.send(("ok", llm.apply_model(_addresses)[0]))
            elif cmd == "digests":
                conn.send(("ok", llm.apply_model(_digests)[0]))
            elif cmd == "probe":
                conn.send(("ok", probe(llm, arg)))
            elif cmd == "reload":  # vLLM's own loader, from a checkpoint directory, in this engine
                llm.collective_rpc("reload_weights", kwargs={"weights_path": arg})
                conn.send(("ok", None))
            elif cmd == "sleep":
                llm.sleep(level=arg)
                conn.send(("ok", None))
            elif cmd == "wake_up":
                llm.wake_up(tags=arg)
                conn.send(("ok", None))
            elif cmd == "stop":
                conn.send(("ok", None))
                return
        except Exception as e:  # noqa: BLE001 - the test reads it
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


class GpuEngine(PipedProcess):
    """A vLLM engine in a process of its own; ``start`` returns at once, ``ready`` waits for it."""

    stop_timeout, join_timeout = 30.0, 30.0

    def __init__(self, name: str, model_dir: str, coordinator: str | None = None, group: str = "",
                 compiled_by: str = "", **llm_kwargs: Any) -> None:
        self.name = name
        self.conn, child = CTX.Pipe()
        cache = compiled_by or name  # the engine whose compile cache this one uses (it has compiled: ready)
        self.proc = CTX.Process(target=_engine_main, args=(child, cache, model_dir, coordinator, group, llm_kwargs))
        self.proc.start()
        self._ready = False

    def ready(self, timeout: float = 600.0) -> "GpuEngine":
        if not self._ready:
            _expect_ready(self, timeout)
            self._ready = True
        return self

    def ask(self, cmd: str, arg: Any = None, timeout: float = 300.0) -> Any:
        self.ready()
        return _ask(self, cmd, arg, timeout)

    def try_ask(self, cmd: str, arg: Any = None, timeout: float = 300.0) -> tuple[str, Any]:
        """(status, value): an error the engine answered, not raised."""
        self.ready()
        self.conn.send((cmd, arg))
        _wait(self, timeout, cmd)
        return self.conn.recv()


def _wait(p: Any, timeout: float, what: str) -> None:
    """Wait for ``p``'s answer; fail at once, naming it, if its process died (`await_answer`)."""
    await_answer(p.conn, p.proc, timeout, f"{getattr(p, 'name', type(p).__name__)}: {what}")


def _expect_ready(p: Any, timeout: float) -> None:
    _wait(p, timeout, "start")
    status, value = p.conn.recv()
    assert status == "ready", f"{getattr(p, 'name', type(p).__name__)} did not start: {value}"


def _ask(p: Any, cmd: str, arg: Any, timeout: float) -> Any:
    p.conn.send((cmd, arg))
    _wait(p, timeout, cmd)
    status, value = p.conn.recv()
    assert status == "ok", f"{getattr(p, 'name', type(p).__name__)}: {cmd} failed: {value}"
    return value
