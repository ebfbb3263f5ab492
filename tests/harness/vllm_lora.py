"""vLLM engines with LoRA for the adapter-only refit tests (`refit.integrations.vllm.lora_slot`).

* `LoraEngine`: a spawned ``vllm.LLM(..., enable_lora=True)`` with the refit backend, driven
  through a pipe: ``init`` (init_info with an ``adapter``), ``refit`` (the RL-loop calls),
  ``generate`` with or without a ``LoRARequest``, ``pin`` (load an adapter from a path and pin it:
  a slot taken by someone else), ``loras`` / ``remove`` (vLLM's list_loras / remove_lora).
* `fresh_lora_outputs`: what a fresh engine answers for adapters loaded from disk by vLLM's own
  path (``LoRARequest(name, id, path)``), one after the other.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

from tests.harness.marks import require_vllm_mark
from tests.harness.procs import recv_answer, spawn_logged
from tests.harness.vllm_rl import CTX, EngineProcess, PROMPTS, MAX_TOKENS, _setup_process, _shutdown, make_llm, stop_engine

Answers = list[tuple[list[int], list[float]]]


def lora_generate(llm: Any, lora: tuple[str, int, str] | None) -> Answers:
    """Greedy tokens and logprobs of `tests.harness.vllm_rl.PROMPTS`, through adapter ``lora``
    (name, int id, path) — exactly the RL loop's call."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    request = LoRARequest(*lora) if lora is not None else None
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, lora_request=request, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [o.outputs[0].logprobs[i][t].logprob
                                            for i, t in enumerate(o.outputs[0].token_ids)]) for o in outs]


def _engine_main(conn: Any, model_dir: str, tp: int, llm_kwargs: dict[str, Any]) -> None:
    _setup_process(tp)
    try:
        llm = make_llm(model_dir, tp, False, True, llm_kwargs)
    except Exception as e:  # noqa: BLE001 - the test reads it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "init":
                llm.init_weight_transfer_engine({"init_info": arg})
                conn.send(("ok", None))
            elif cmd == "refit":  # the RL loop's calls; answers the seconds update_weights took
                plan_id, version = arg
                llm.start_weight_update()
                t0 = time.perf_counter()
                llm.update_weights({"update_info": {"plan_id": plan_id, "version": version, "timeout": 60.0}})
                seconds = time.perf_counter() - t0
                llm.finish_weight_update(weight_version=str(version))
                conn.send(("ok", seconds))
            elif cmd == "generate":
                conn.send(("ok", lora_generate(llm, arg)))
            elif cmd == "pin":  # load (name, id, path) through vLLM's own path, and pin it
                from vllm.lora.request import LoRARequest

                llm.llm_engine.add_lora(LoRARequest(*arg))
                conn.send(("ok", llm.llm_engine.pin_lora(arg[1])))
            elif cmd == "loras":  # the adapter ids the engine holds
                conn.send(("ok", sorted(llm.llm_engine.list_loras())))
            elif cmd == "remove":  # llm.llm_engine.remove_lora(id)
                conn.send(("ok", llm.llm_engine.remove_lora(arg)))
            elif cmd == "stop":
                stop_engine(conn, llm)
                return
        except Exception as e:  # noqa: BLE001 - the test reads it
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"))


class LoraEngine(EngineProcess):
    def __init__(self, model_dir: str, tp: int = 1, **llm_kwargs: Any) -> None:
        self._spawn(_engine_main, model_dir, tp, {"enable_lora": True, **llm_kwargs})

    def generate(self, lora: tuple[str, int, str] | None) -> Answers:
        status, value = self.ask("generate", lora)
        assert status == "ok", value
        return value


def _references_main(conn: Any, model_dir: str, tp: int, llm_kwargs: dict[str, Any],
                     adapters: list[tuple[str, int, str]]) -> None:
    _setup_process(tp)
    try:
        llm = make_llm(model_dir, tp, False, False, {"enable_lora": True, **llm_kwargs})
        out = [lora_generate(llm, a) for a in adapters]
        _shutdown(llm)
    except Exception as e:  # noqa: BLE001 - the test reads it
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"))
        return
    conn.send(("ok", out))


def fresh_lora_outputs(model_dir: str, adapters: list[tuple[str, int, str]], tp: int = 1,
                       **llm_kwargs: Any) -> list[Answers]:
    """A fresh engine of ``model_dir`` (no refit backend) answering through each adapter in turn,
    loaded from its path by vLLM (``LoRARequest(name, id, path)``; None: the base model)."""
    require_vllm_mark()
    conn, child = CTX.Pipe()
    proc, log = spawn_logged(CTX, _references_main, (child, model_dir, tp, llm_kwargs, adapters), "lora-reference")
    try:
        status, value = recv_answer(conn, proc, 600, "reference LoRA engine", log)
        assert status == "ok", value
        return value
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()


def peft_trainer(rank: int, world: int, address: str, group: str, config: dict[str, Any], lora: dict[str, Any],
                 attach: dict[str, Any]) -> tuple[Any, Any]:
    """A `tests.harness.attach_cluster.Trainers` builder: a random Qwen3 (``config``, seed 7, as
    `make_hf_model`) with PEFT adapter "policy" (``lora``: LoraConfig fields), attached with
    ``attach`` (``{"adapter": "policy"}`` or ``{"lora": "merge"}``); commands ``save`` (PEFT's
    save_pretrained; answers the adapter's directory) and ``train`` (one optimizer step)."""
    import peft

    from refit.integrations import hf as refit_hf
    from tests.harness.attach_cluster import make_hf_model, train_step

    base = make_hf_model("Qwen3ForCausalLM", seed=7, **config)
    torch_seed(3)
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **lora), adapter_name="policy")
    agent = refit_hf.attach(model, address, group=group, **attach)

    def handle(cmd: str, arg: Any) -> Any:
        if cmd == "save":
            model.save_pretrained(arg)
            return os.path.join(arg, "policy")
        if cmd == "train":
            return train_step(model, seed=arg)
        raise ValueError(cmd)

    return agent, handle


def torch_seed(seed: int) -> None:
    import torch

    torch.manual_seed(seed)
