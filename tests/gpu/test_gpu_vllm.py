"""refit's vLLM backend in real vLLM engines on a GPU, against fresh engines (`make test-gpu`).

Every engine runs with vLLM's defaults on CUDA — CUDA graphs and torch.compile on, not
``enforce_eager`` — and is refitted from a float32 transformers trainer on the same GPU (CUDA
IPC) by the RL loop's calls.  After refits with real AdamW steps between them, each answers
exactly (greedy tokens and logprobs, bit for bit) as a fresh engine of the same settings loaded
from the trainer's weights:

* dense Qwen3 and Qwen3-MoE at TP 1; the addresses of every parameter unchanged across refits
  (captured CUDA graphs read them);
* sleep mode as verl's colocated loop drives it: ``sleep(level=1)`` + ``wake_up()`` between two
  refits, then ``sleep(level=2)``, ``wake_up(["weights"])``, a refit, ``wake_up(["kv_cache"])``
  (its references are fresh engines in sleep mode too);
* an online-FP8 engine (``quantization="fp8"``): the refit lands bf16 and vLLM's FP8 processing
  re-runs, as on first load;
* engines serving an FP8 block checkpoint that ``refit reshard --dst-dtype fp8`` wrote (dense and
  MoE): the trainer quantizes on the wire, float8 weights and 128x128 scales land, vLLM's FP8
  processing re-runs; the references are fresh engines loading the FP8 checkpoint of the trainer's
  weights;
* a DeepSeek-V3-style MLA model on vLLM's GPU MLA backend, its derived ``W_UK_T`` / ``W_UV``
  re-derived (equal to the fresh engine's);
* a refit whose trainer dies after its bytes moved, before the commit: the engine keeps serving,
  is listed stale, and the next refit (from a new trainer process) is exact.

Two engine instances of one checkpoint, started alike, can differ in a logprob's 5th decimal with
their weights equal bit for bit (vLLM 0.26 on an H200; bench/vllm_gpu.py's ``engines_agree``, two
fresh engines and no refit): each comparison therefore checks the weights apart (digests of every
parameter and buffer against the fresh engine's), and where the answers differ, the refitted engine
must answer exactly as itself once vLLM's own loader has loaded the fresh engine's checkpoint
(`_instance_checks`), with the fresh engine's tokens.

The engines start side by side, once for the module (`fleet`), and the stages run in order; each
test reads its stage's result.  Without CUDA, vLLM or transformers every test skips with the reason.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
_missing = [m for m in ("vllm", "transformers") if importlib.util.find_spec(m) is None]
pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(GPUS == 0, reason="no CUDA device (make test-gpu runs these on a GPU machine)"),
              pytest.mark.skipif(bool(_missing), reason=f"not installed here: {', '.join(_missing)}")]

MLA_DERIVED = ("W_UK_T", "W_UV")


@dataclass
class Fleet:
    client: Any
    tmp: str
    engines: dict[str, Any] = field(default_factory=dict)
    trainers: dict[str, Any] = field(default_factory=dict)
    plans: dict[str, str] = field(default_factory=dict)
    checkpoints: dict[str, str] = field(default_factory=dict)
    answers: dict[str, Any] = field(default_factory=dict)  # "<engine>@<stage>" -> generate()
    probes: dict[str, Any] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)
    digests: dict[str, dict[str, str]] = field(default_factory=dict)  # "<engine>@<stage>" -> weights' digests
    errors: dict[str, str] = field(default_factory=dict)

    def stage(self, name: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the stage's test reports it; independent stages go on
            import traceback

            self.errors[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"

    def ok(self, *stages: str) -> None:
        for s in stages:
            assert s not in self.errors, f"stage {s} failed: {self.errors[s]}"


# engine -> (trainer, vLLM keyword arguments)
REFITTED = {
    "dense": ("gpu-qwen3", {}),
    "sleepy": ("gpu-qwen3", {"enable_sleep_mode": True}),
    "fp8": ("gpu-qwen3", {"quantization": "fp8"}),
    "fp8ckpt": ("gpu-qwen3", {}),  # started from an FP8 checkpoint (FP8_CHECKPOINT)
    "fp8ckpt-moe": ("gpu-qwen3-moe", {}),
    "moe": ("gpu-qwen3-moe", {}),
    "mla": ("gpu-deepseek-v3", {}),
}


FP8_CHECKPOINT = ("fp8ckpt", "fp8ckpt-moe")  # engines that load refit's FP8 block checkpoint of the weights
# REFIT_VLLM_GPU_ENGINES=fp8ckpt,fp8ckpt-moe starts those engines alone (a shorter run on a GPU
# machine's budget); the tests of the others skip
SELECTED = [e for e in os.environ.get("REFIT_VLLM_GPU_ENGINES", "").split(",") if e] or list(REFITTED)


def _selected(*engines: str) -> None:
    left = [e for e in engines if e not in SELECTED]
    if left:
        pytest.skip(f"REFIT_VLLM_GPU_ENGINES leaves out {', '.join(left)}")


def _refit(f: Fleet, engine: str, version: int) -> None:
    f.engines[engine].ask("refit", (f.plans[engine], version))


def _step(f: Fleet, model: str, version: int) -> str:
    out, _ = f.trainers[model].ask("step", version)
    f.checkpoints[f"{model}@v{version}"] = out
    return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from tests.gpu.vllm_gpu import CONFIGS, GpuEngine, GpuTrainer, write_checkpoint
    from tests.harness.loopback import loopback
    from tests.harness.procs import together

    tmp = str(tmp_path_factory.mktemp("vllm-gpu"))
    with loopback(default_timeout=120.0) as (server, client):
        f = Fleet(client, tmp)
        refs: dict[str, Any] = {}
        try:
            _run(f, server.address, CONFIGS, GpuEngine, GpuTrainer, write_checkpoint, refs)
            yield f
        finally:  # every process at once: each engine takes seconds to shut vLLM down
            together([p.close for p in [*f.engines.values(), *refs.values(), *f.trainers.values()]], timeout=90.0)


def _run(f: Fleet, address: str, configs: dict, GpuEngine: Any, GpuTrainer: Any, write_checkpoint: Any,
         refs: dict[str, Any]) -> None:

    from tests.gpu.vllm_gpu import fp8_checkpoint

    v0 = {m: write_checkpoint(os.path.join(f.tmp, f"{m}-v0"), m, seed=i) for i, m in enumerate(configs)}
    fp8_v0 = {m: fp8_checkpoint(v0[m], v0[m] + "-fp8") for m in {REFITTED[e][0] for e in FP8_CHECKPOINT}}
    for e, (m, kw) in REFITTED.items():  # every engine starts at once, while the trainers start
        if e not in SELECTED:
            continue
        f.engines[e] = GpuEngine(e, fp8_v0[m] if e in FP8_CHECKPOINT else v0[m], address, group=f"engine-{e}", **kw)
    for m in configs:
        f.trainers[m] = GpuTrainer(address, m, v0[m], f.tmp)
    for m in configs:
        _step(f, m, 1)
    for e, (m, _) in REFITTED.items():
        if e not in SELECTED:
            continue
        f.stage(f"start {e}", lambda e=e: f.engines[e].ready())
        if f"start {e}" not in f.errors:
            f.plans[e] = f.client.create_plan(m, f"engine-{e}")["plan_id"]
    f.stage("addresses before", lambda: f.facts.__setitem__("addresses0", f.engines["dense"].ask("addresses")))
    for e in f.plans:
        f.stage(f"{e} v1", lambda e=e: _refit(f, e, 1))
    for m in configs:
        _step(f, m, 2)

    def reference(name: str, model: str, version: int, fp8: bool = False, **kw: Any) -> None:
        if name.split("@")[0] not in SELECTED:
            return
        path = f.checkpoints[f"{model}@v{version}"]
        # the compile cache of the engine it is compared with, which has compiled (it is ready)
        refs[name] = GpuEngine(f"fresh-{name}", fp8_checkpoint(path, path + "-fp8") if fp8 else path,
                               compiled_by=name.split("@")[0], **kw)

    reference("dense@v2", "gpu-qwen3", 2)
    reference("sleepy@v2", "gpu-qwen3", 2, enable_sleep_mode=True)  # the same settings as the engine
    reference("fp8@v2", "gpu-qwen3", 2, quantization="fp8")
    reference("fp8ckpt@v2", "gpu-qwen3", 2, fp8=True)
    reference("fp8ckpt-moe@v2", "gpu-qwen3-moe", 2, fp8=True)
    reference("moe@v2", "gpu-qwen3-moe", 2)
    reference("mla@v2", "gpu-deepseek-v3", 2)
    # sleep level 1 between the two refits (weights offloaded to the host and back)
    f.stage("sleepy sleep 1", lambda: (f.engines["sleepy"].ask("sleep", 1), f.engines["sleepy"].ask("wake_up", None)))
    for e in f.plans:
        f.stage(f"{e} v2", lambda e=e: _refit(f, e, 2))
        f.stage(f"{e} answers v2", lambda e=e: f.answers.__setitem__(f"{e}@v2", f.engines[e].ask("generate")))
        f.stage(f"{e} digests v2", lambda e=e: f.digests.__setitem__(f"{e}@v2", f.engines[e].ask("digests")))
    f.stage("addresses after", lambda: f.facts.__setitem__("addresses2", f.engines["dense"].ask("addresses")))
    f.stage("mla probe", lambda: f.probes.__setitem__("mla@v2", f.engines["mla"].ask("probe", MLA_DERIVED)))
    # sleep level 2: the weights are dropped; woken (garbage), refitted, then the KV cache woken
    _step(f, "gpu-qwen3", 3)
    reference("dense@v3", "gpu-qwen3", 3)
    reference("sleepy@v3", "gpu-qwen3", 3, enable_sleep_mode=True)

    def level2() -> None:
        sleepy = f.engines["sleepy"]
        sleepy.ask("sleep", 2)
        sleepy.ask("wake_up", ["weights"])
        f.facts["stale after sleep 2"] = _listed(f, "engine-sleepy")
        _refit(f, "sleepy", 3)
        sleepy.ask("wake_up", ["kv_cache"])  # the weights are awake already: vLLM refuses to map them twice
        f.answers["sleepy@v3"] = sleepy.ask("generate")
    f.stage("sleepy sleep 2", level2)
    f.stage("dense v3", lambda: (_refit(f, "dense", 3), f.answers.__setitem__("dense@v3", f.engines["dense"].ask("generate"))))
    for name, ref in refs.items():
        f.stage(f"fresh {name}", lambda name=name, ref=ref: f.answers.__setitem__(f"fresh@{name}", ref.ask("generate")))
        f.stage(f"fresh {name} digests", lambda name=name, ref=ref: f.digests.__setitem__(f"fresh@{name}", ref.ask("digests")))
    f.stage("fresh mla probe", lambda: f.probes.__setitem__("fresh@mla@v2", refs["mla@v2"].ask("probe", MLA_DERIVED)))
    if "dense" in SELECTED:  # (its trainer dies)
        f.stage("failed refit", lambda: _failed_refit(f, address, GpuTrainer))
    f.stage("instance checks", lambda: _instance_checks(f))


# Each comparison of a refitted engine's answers ("<engine>@<version>") with a fresh engine's
# ("fresh@<engine>@<version of the checkpoint it loaded>").
COMPARED = [("dense@v2", "fresh@dense@v2"), ("moe@v2", "fresh@moe@v2"), ("sleepy@v2", "fresh@sleepy@v2"),
            ("sleepy@v3", "fresh@sleepy@v3"), ("dense@v3", "fresh@dense@v3"), ("fp8@v2", "fresh@fp8@v2"),
            ("fp8ckpt@v2", "fresh@fp8ckpt@v2"), ("fp8ckpt-moe@v2", "fresh@fp8ckpt-moe@v2"), ("mla@v2", "fresh@mla@v2"),
            ("dense@v5", "fresh@dense@v3")]


def _fresh_checkpoint(f: Fleet, want: str) -> str:
    """The checkpoint the fresh engine ``want`` loaded: its engine's model at its version, as the
    FP8 checkpoint of it for the engines that serve one (`reference` in `_run`)."""
    from tests.gpu.vllm_gpu import fp8_checkpoint

    _, engine, version = want.split("@")
    path = f.checkpoints[f"{REFITTED[engine][0]}@{version}"]
    return fp8_checkpoint(path, path + "-fp8") if engine in FP8_CHECKPOINT else path


def _instance_checks(f: Fleet) -> None:
    """Where a refitted engine's answers differ from its fresh engine's, the same engine loads the
    fresh engine's checkpoint through vLLM's own loader (``reload_weights``) and answers again
    (``<answers>#reloaded``): two engine instances of one checkpoint, started alike, can differ in a
    logprob's 5th decimal (bench/vllm_gpu.py's ``engines_agree``: two fresh engines in one process,
    no refit), so the instance's own answers for those weights are what refit's must equal then."""
    differ = f.facts["instances differ"] = []
    for got, want in COMPARED:
        if got in f.answers and want in f.answers and f.answers[got] != f.answers[want]:
            engine = f.engines[got.split("@")[0]]
            engine.ask("reload", _fresh_checkpoint(f, want))
            f.answers[f"{got}#reloaded"] = engine.ask("generate")
            differ.append({"answers": got, "fresh": want, "reloaded_equal": f.answers[got] == f.answers[f"{got}#reloaded"]})
    if os.environ.get("OUT"):  # the GPU machine's run folder: which comparisons needed the instance check
        with open(os.path.join(os.environ["OUT"], "instance-checks.json"), "w") as out:
            json.dump(differ, out)


def _as_fresh(f: Fleet, got: str, want: str) -> None:
    """The refitted engine answers exactly as the fresh engine, or — where the two instances differ
    (`_instance_checks`) — exactly as itself once vLLM's own loader has loaded the fresh engine's
    checkpoint, with the fresh engine's tokens; its weights are compared bit for bit apart."""
    answers, fresh = f.answers[got], f.answers[want]
    if answers == fresh:
        return
    f.ok("instance checks")
    reloaded = f.answers[f"{got}#reloaded"]
    assert [t for t, _ in answers] == [t for t, _ in fresh], f"{got}: tokens differ from the fresh engine's"
    assert answers == reloaded, (f"{got} differs from the fresh engine's answers and from its own after vLLM "
                                 f"reloaded the fresh engine's checkpoint: {answers} / {reloaded} / {fresh}")


def _listed(f: Fleet, group: str) -> dict[str, Any]:
    (w,) = [w for w in f.client.list_workers(group) if w.get("connected")]
    return w


def _failed_refit(f: Fleet, address: str, GpuTrainer: Any) -> None:
    """The dense trainer dies once its share of refit v4 ran (its bytes moved, no commit); a new
    trainer process holding v3's weights takes its place, and refit v5 lands v3's weights."""
    _step(f, "gpu-qwen3", 4)  # the engine receives these bytes, uncommitted
    trainer = f.trainers["gpu-qwen3"]
    trainer.ask("die_after_share")
    f.facts["failed refit answer"] = f.engines["dense"].try_ask("refit", (f.plans["dense"], 4))
    assert trainer.entered.is_set(), "the trainer died before its share of refit v4 ran"
    trainer.proc.join(30)
    f.facts["serving after failure"] = f.engines["dense"].ask("generate")
    f.facts["listed after failure"] = _listed(f, "engine-dense")
    f.trainers["gpu-qwen3"] = GpuTrainer(address, "gpu-qwen3", f.checkpoints["gpu-qwen3@v3"], f.tmp)
    _refit(f, "dense", 5)
    f.answers["dense@v5"] = f.engines["dense"].ask("generate")
    f.facts["listed after v5"] = _listed(f, "engine-dense")


def _same_weights(f: Fleet, engine: str, stage: str) -> None:
    """The refitted engine holds, bit for bit, every parameter and buffer the fresh engine holds."""
    got, want = f.digests.get(f"{engine}@{stage}"), f.digests.get(f"fresh@{engine}@{stage}")
    assert got is not None and want is not None, f"no digests of {engine}@{stage}: {sorted(f.digests)}"
    differ = sorted(n for n in set(got) | set(want) if got.get(n) != want.get(n))
    assert not differ, f"{engine}@{stage}: {len(differ)} of {len(want)} tensors differ from a fresh engine's: {differ[:8]}"


# ------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("engine", ["dense", "moe"])
def test_tp1_exact_after_two_refits(fleet: Fleet, engine: str) -> None:
    _selected(engine)
    fleet.ok(f"start {engine}", f"{engine} v1", f"{engine} v2", f"{engine} answers v2", f"fresh {engine}@v2")
    _same_weights(fleet, engine, "v2")
    _as_fresh(fleet, f"{engine}@v2", f"fresh@{engine}@v2")


def test_inplace_parameters_keep_their_addresses(fleet: Fleet) -> None:
    _selected("dense")
    fleet.ok("addresses before", "addresses after", "dense v2")
    before, after = fleet.facts["addresses0"], fleet.facts["addresses2"]
    assert before == after, [n for n in before if before[n] != after.get(n)]


def test_sleep_level_1_between_refits(fleet: Fleet) -> None:
    _selected("sleepy")
    fleet.ok("start sleepy", "sleepy sleep 1", "sleepy v2", "sleepy answers v2", "fresh sleepy@v2")
    _same_weights(fleet, "sleepy", "v2")
    _as_fresh(fleet, "sleepy@v2", "fresh@sleepy@v2")


def test_sleep_level_2_then_refit(fleet: Fleet) -> None:
    _selected("sleepy", "dense")
    fleet.ok("sleepy sleep 2", "fresh sleepy@v3", "fresh dense@v3", "dense v3")
    assert fleet.facts["stale after sleep 2"]["stale"], "a level-2 sleep dropped the weights: the engine is stale"
    _as_fresh(fleet, "sleepy@v3", "fresh@sleepy@v3")
    _as_fresh(fleet, "dense@v3", "fresh@dense@v3")


def test_online_fp8_engine(fleet: Fleet) -> None:
    _selected("fp8")
    fleet.ok("start fp8", "fp8 v1", "fp8 v2", "fp8 answers v2", "fresh fp8@v2")
    _same_weights(fleet, "fp8", "v2")
    _as_fresh(fleet, "fp8@v2", "fresh@fp8@v2")


@pytest.mark.parametrize("engine", FP8_CHECKPOINT)
def test_fp8_checkpoint_engine_quantized_on_the_wire(fleet: Fleet, engine: str) -> None:
    _selected(engine)
    fleet.ok(f"start {engine}", f"{engine} v1", f"{engine} v2", f"{engine} answers v2", f"fresh {engine}@v2")
    _same_weights(fleet, engine, "v2")
    _as_fresh(fleet, f"{engine}@v2", f"fresh@{engine}@v2")


def test_mla_exact_and_derived_tensors_rederived(fleet: Fleet) -> None:
    _selected("mla")
    fleet.ok("start mla", "mla v1", "mla v2", "mla answers v2", "fresh mla@v2", "mla probe", "fresh mla probe")
    _same_weights(fleet, "mla", "v2")
    _as_fresh(fleet, "mla@v2", "fresh@mla@v2")
    from tests.harness.vllm_rl import unprobe

    got, want = unprobe(fleet.probes["mla@v2"]), unprobe(fleet.probes["fresh@mla@v2"])
    assert sorted(got) == sorted(want) and any(n.endswith("W_UV") for n in got), sorted(got)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_failed_refit_keeps_serving_stale_then_exact(fleet: Fleet) -> None:
    _selected("dense")
    fleet.ok("failed refit")
    status, error = fleet.facts["failed refit answer"]
    assert status == "error" and "v" in error, error
    assert fleet.facts["serving after failure"], "the engine answers after the failed refit"
    listed = fleet.facts["listed after failure"]
    assert listed["stale"], listed
    _as_fresh(fleet, "dense@v5", "fresh@dense@v3")
    after = fleet.facts["listed after v5"]
    assert not after["stale"] and after["version"] == 5, after
