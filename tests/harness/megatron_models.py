"""Real megatron-core GPTModels on CPU for the attach tests, over *real* gloo process groups
(unlike tests/harness/megatron/, whose fake groups cannot move data).

CPU shims (see tests/harness/megatron/FACTS.md): Megatron allocates some buffers on
``torch.cuda.current_device()`` and calls ``Tensor.cuda()`` in the tied-embedding setup when
pp > 1; both are redirected to the CPU in the spawned test processes only.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from refit.layouts.base import pad_to
from refit.layouts.megatron import VOCAB_DIVISIBLE_BY
from refit.spec import ModelSpec


def install_cpu_shims() -> None:
    warnings.filterwarnings("ignore")
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[assignment]


def init_parallel(tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1, etp: int | None = None) -> None:
    """initialize_model_parallel on the (already initialized, gloo) default process group."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp, create_gloo_process_groups=False)
    try:
        model_parallel_cuda_manual_seed(1234)
    except Exception:  # needs CUDA's RNG tracker on some versions; CPU init does not use it
        pass


def build_gpt(spec: ModelSpec, *, te_names: bool = False, vpp: int | None = None, seed: int = 0,
              duplicated_down_proj: bool = True, vocab_divisor: int = VOCAB_DIVISIBLE_BY,
              **overrides: Any) -> list[torch.nn.Module]:
    """This rank's model chunks of a GPTModel shaped like ``spec`` (local spec; bf16 parameters with
    random, never-zero values), after `init_parallel`.

    DeepSeek-V3 family (MLA): an ``MLATransformerConfig`` with qk_layernorm (the q_a / kv_a norms),
    built with `install_mla_stand_ins`: the local spec's core attention cannot build MLA and TE is
    not installed, so a plain softmax attention stands in for it and, with ``duplicated_down_proj``,
    a whole (tp-duplicated) linear for the down-projections as TE's ``TELinear(parallel_mode=
    'duplicated')`` holds them (the local spec's ColumnParallelLinear splits them over tp).  Family
    MoE layers get Megatron's shared experts and the router's float32 ``expert_bias`` as the spec says.
    ``vocab_divisor``: the vocab padded to a multiple of it * tp (Megatron-LM's default 128; 1 as
    mbridge / verl's Megatron bridge build the embedding, unpadded)."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    c = spec.config
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    kw: dict[str, Any] = dict(
        num_layers=c.num_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_heads,
        num_query_groups=c.num_kv_heads, kv_channels=c.head_dim, ffn_hidden_size=c.intermediate_size,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        pipeline_dtype=torch.bfloat16, params_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=True,
        qk_layernorm=c.qk_norm, add_qkv_bias=c.qkv_bias, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, bias_activation_fusion=False, bias_dropout_fusion=False, add_bias_linear=False,
        init_method_std=0.02)
    if c.is_mla:
        kw.pop("kv_channels")
        kw.update(multi_latent_attention=True, q_lora_rank=c.q_lora_rank or None, kv_lora_rank=c.kv_lora_rank,
                  qk_head_dim=c.qk_nope_head_dim, qk_pos_emb_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
                  qk_layernorm=True, rope_type="rope", apply_rope_fusion=False)
    if c.is_moe:
        kw.update(num_moe_experts=c.num_experts, moe_ffn_hidden_size=c.moe_intermediate_size, moe_router_topk=2,
                  moe_layer_freq=[1 if layer in c.moe_layers else 0 for layer in range(c.num_layers)],
                  moe_grouped_gemm=False)
        if c.num_shared_experts:
            kw["moe_shared_expert_intermediate_size"] = c.shared_intermediate_size
        if c.router_bias:
            kw.update(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
    kw.update(overrides)
    config = (MLATransformerConfig if kw.get("multi_latent_attention") else TransformerConfig)(**kw)
    torch.manual_seed(seed + 1000 * torch.distributed.get_rank())
    chunks = []
    for v in range(vpp or 1):
        stage = v if vpp else None
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                           vp_stage=stage, pp_rank=ps.get_pipeline_model_parallel_rank())
        if config.multi_latent_attention:
            install_mla_stand_ins(block, duplicated_down_proj)
        pp_rank = ps.get_pipeline_model_parallel_rank()
        mtp = None
        if config.mtp_num_layers and pp_rank == pp - 1 and v == (vpp or 1) - 1:  # MTP layers: after the last stage
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

            mtp = get_gpt_mtp_block_spec(config, block, use_transformer_engine=False, vp_stage=stage, pp_rank=pp_rank)
        model = GPTModel(config, block, vocab_size=pad_to(c.vocab_size, vocab_divisor * tp), mtp_block_spec=mtp,
                         max_sequence_length=64, pre_process=pp_rank == 0 and v == 0,
                         post_process=pp_rank == pp - 1 and v == (vpp or 1) - 1,
                         share_embeddings_and_output_weights=c.tie_embeddings, position_embedding_type="rope",
                         rotary_percent=0.5 if c.arch == "glm4_moe" else 1.0, vp_stage=stage)
        chunks.append(Float16Module(config, model))  # as Megatron-LM trains in bf16: norms cast too
    return chunks


class DuplicatedLinear(torch.nn.Module):
    """Stands in for TE's ``TELinear(parallel_mode="duplicated")`` (MLA's down-projections under the
    TE spec): the whole weight on every tp rank, ``weight`` [out, in]; replicated in the
    checkpoint (``sharded_state_dict_default``'s rule for a module without its own)."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Any, bias: bool = False,
                 parallel_mode: str | None = None, **_: Any) -> None:
        super().__init__()
        assert parallel_mode == "duplicated" and not bias
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        init_method(self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(x, self.weight), None


def install_mla_stand_ins(block: Any, duplicated_down_proj: bool = True) -> None:
    """Megatron's MLA layer specs of ``block`` made buildable on this CPU machine: the plain core
    attention of tests/harness/megatron_mla_check.py and (``duplicated_down_proj``) `DuplicatedLinear`
    down-projections, which MLASelfAttention accepts as its ``TELinear`` (duplicated) case."""
    from megatron.core.transformer import multi_latent_attention as mla_mod

    from tests.harness.megatron_mla_check import _plain_core_attention

    mla_mod.HAVE_TE = False
    if duplicated_down_proj:
        mla_mod.TELinear = DuplicatedLinear
    for layer in block.layer_specs:
        sub = layer.submodules.self_attention.submodules
        sub.core_attention = _plain_core_attention()
        if duplicated_down_proj:
            sub.linear_q_down_proj = sub.linear_kv_down_proj = DuplicatedLinear


# ------------------------------------------------------------------------------------------------
# Values placed by Megatron's own sharded_state_dict, and the HF tensors they make


def _values(key: str, global_shape: tuple[int, ...], offset: tuple[int, ...], shape: tuple[int, ...],
            version: int) -> torch.Tensor:
    """Pseudo-random bf16 values of the box ``offset/shape`` of global checkpoint tensor ``key``:
    a function of (key, global element index, version) only, so replicas agree."""
    flat = torch.zeros(shape, dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(global_shape))):
        idx = torch.arange(offset[d], offset[d] + shape[d], dtype=torch.int64) * stride
        flat = flat + idx.view([-1 if i == d else 1 for i in range(len(shape))])
        stride *= global_shape[d]
    salt = sum(ord(ch) * 131 ** i for i, ch in enumerate(key)) % (1 << 31)
    x = (flat * 2654435761 + salt * 97 + version * 40503 + 12345) % (1 << 31)
    x = (x ^ (x >> 15)) * 2246822519 % (1 << 31)
    return ((x >> 7).to(torch.float32) / float(1 << 24) - 0.5).to(torch.bfloat16)


def sharded_tensors(chunks: list[torch.nn.Module]) -> list[Any]:
    """Every ShardedTensor of the chunks' ``sharded_state_dict`` (factories such as SwiGLU's built)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from megatron.core import parallel_state as ps

    out = []
    for chunk in chunks:  # (GPTModel with MTP off the first stage reads metadata['dp_cp_group'] itself)
        metadata = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
        for obj in chunk.sharded_state_dict(metadata=metadata).values():
            if isinstance(obj, ShardedTensorFactory):
                built = obj.build()
                out.extend(built if isinstance(built, list) else [built])
            elif isinstance(obj, ShardedTensor):
                out.append(obj)
    return out


def _place(chunks: list[torch.nn.Module], values: Any) -> dict[str, tuple[int, ...]]:
    """Write every parameter (and the routers' ``expert_bias`` buffers) in place with
    ``values(key, global_shape, global_offset, box)`` at the global position Megatron's own
    ``sharded_state_dict`` gives it; assert every parameter was wholly written; returns checkpoint
    key -> global shape."""
    params = [p for chunk in chunks for p in chunk.parameters()]
    shapes: dict[str, tuple[int, ...]] = {}
    with torch.no_grad():
        for p in params:
            p.fill_(float("nan"))
        for sh in sharded_tensors(chunks):
            assert sh.flattened_range is None
            lead = len(sh.global_shape) - len(sh.local_shape)  # prepended axes (layer, expert)
            box = (1,) * lead + tuple(sh.local_shape)
            sh.data.copy_(values(sh.key, tuple(sh.global_shape), tuple(sh.global_offset), box).reshape(sh.data.shape))
            shapes[sh.key] = tuple(sh.global_shape)
        unfilled = [i for i, p in enumerate(params) if torch.isnan(p.float()).any()]
        assert not unfilled, f"{len(unfilled)} parameters are not (wholly) in sharded_state_dict"
    return shapes


def fill_by_placement(chunks: list[torch.nn.Module], version: int) -> dict[str, tuple[int, ...]]:
    """Write every parameter in place with `_values` at the global position Megatron's own
    ``sharded_state_dict`` gives it; returns checkpoint key -> global shape."""
    return _place(chunks, lambda key, shape, offset, box: _values(key, shape, offset, box, version))


def load_hf_by_placement(chunks: list[torch.nn.Module], hf: dict[str, torch.Tensor], spec: ModelSpec
                         ) -> dict[str, tuple[int, ...]]:
    """Write every parameter (and the routers' ``expert_bias`` buffers) in place from HF tensors
    ``hf`` (the target's, and its MTP layers' when the chunks have them): the boxes Megatron's own
    ``sharded_state_dict`` places, cut from `hf_to_global`'s tensors; returns key -> global shape."""
    embedding = [sh for sh in sharded_tensors(chunks) if sh.key in ("embedding.word_embeddings.weight",
                                                                      "output_layer.weight")]
    padded = embedding[0].global_shape[0] if embedding else spec.config.vocab_size
    g = hf_to_global(hf, spec, padded)

    def values(key: str, shape: tuple[int, ...], offset: tuple[int, ...], box: tuple[int, ...]) -> torch.Tensor:
        t = g[key]
        assert tuple(t.shape) == shape, (key, tuple(t.shape), shape)
        return t[tuple(slice(o, o + n) for o, n in zip(offset, box))]

    return _place(chunks, values)


def optimizer_step(chunks: list[torch.nn.Module], optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One real ``optimizer.step()`` with gradients placed like `fill_by_placement`'s values (a
    function of checkpoint key and global index): replicas of a tensor (tp-duplicated down
    projections, norms) get the same gradient and stay equal, as Megatron's all-reduced gradients
    keep them."""
    params = [p for chunk in chunks for p in chunk.parameters()]
    by_storage = {p.untyped_storage().data_ptr(): p for p in params}
    for p in params:
        p.grad = torch.zeros_like(p)
    for sh in sharded_tensors(chunks):
        p = by_storage.get(sh.data.untyped_storage().data_ptr())
        if p is None:  # a buffer (the router's expert_bias): not trained by the optimizer
            continue
        lead = len(sh.global_shape) - len(sh.local_shape)
        box = (1,) * lead + tuple(sh.local_shape)
        grad = p.grad.as_strided(sh.data.shape, sh.data.stride(), sh.data.storage_offset() - p.storage_offset()
                                 + p.grad.storage_offset())
        grad.copy_(_values(sh.key, tuple(sh.global_shape), tuple(sh.global_offset), box, 1000 + seed).view(grad.shape))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def local_boxes(chunks: list[torch.nn.Module]) -> list[tuple[str, tuple[int, ...], tuple[int, ...], torch.Tensor]]:
    """This rank's boxes of the global checkpoint tensors as Megatron's ``sharded_state_dict`` places
    them: (key, global shape, global offset, values); `assemble` joins every rank's."""
    out = []
    for sh in sharded_tensors(chunks):
        lead = len(sh.global_shape) - len(sh.local_shape)
        box = (1,) * lead + tuple(sh.local_shape)
        out.append((sh.key, tuple(sh.global_shape), tuple(sh.global_offset), sh.data.detach().clone().view(box)))
    return out


def assemble(boxes_of_ranks: list[list[tuple[str, tuple[int, ...], tuple[int, ...], torch.Tensor]]]
             ) -> dict[str, torch.Tensor]:
    """The global checkpoint tensors from every rank's `local_boxes` (replicas overwrite alike)."""
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for boxes in boxes_of_ranks:
        for key, shape, offset, values in boxes:
            where = tuple(slice(o, o + n) for o, n in zip(offset, values.shape))
            out.setdefault(key, torch.empty(shape, dtype=values.dtype))[where] = values
            covered.setdefault(key, torch.zeros(shape, dtype=torch.bool))[where] = True
    missing = [k for k, c in covered.items() if not bool(c.all())]
    assert not missing, f"no rank holds part of {missing[:3]}"
    return out


def megatron_to_hf(shapes: dict[str, tuple[int, ...]], spec: ModelSpec, version: int) -> dict[str, torch.Tensor]:
    """`global_to_hf` of the global tensors `fill_by_placement` wrote for ``version``."""
    return global_to_hf({k: _values(k, s, (0,) * len(s), s, version) for k, s in shapes.items()}, spec)


def global_to_hf(g: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The HF tensors of the global checkpoint tensors ``g`` (key -> tensor), converted by hand after
    tests/harness/megatron/FACTS.md (fused QKV per query group, fc1 = [gate; up], experts on a global
    axis) and, for MLA, tests/integration/test_megatron_mla.py (one Megatron tensor per HF tensor, no
    row reordering).  The local spec's checkpoint keys: GQA layers map their norms to TE's keys
    (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``), MLA layers keep the module
    names (``input_layernorm``, ``q_layernorm``, ``kv_layernorm``, ``pre_mlp_layernorm``).

    MTP layers (``mtp.layers.{i}.*``, present with ``mtp_num_layers``) become HF layer
    ``N = num_layers + i`` as DeepSeek-V3 / GLM-4.5 checkpoints hold it: ``enorm``, ``hnorm``,
    ``eh_proj`` (both concatenate [embedding; hidden]), ``shared_head.norm`` (Megatron's
    ``final_layernorm``) and the decoder layer of ``transformer_layer`` (MoE where it has a router).
    The ``embed_tokens`` / ``shared_head.head`` copies of HF's MTP layers: `with_mtp_copies`."""
    c = spec.config
    V = c.vocab_size
    out = {"model.embed_tokens.weight": g["embedding.word_embeddings.weight"][:V],
           "model.norm.weight": g["decoder.final_layernorm.weight"]}
    if not c.tie_embeddings:
        out["lm_head.weight"] = g["output_layer.weight"][:V]

    def decoder_get(layer: int) -> Any:
        def get(*names: str) -> torch.Tensor:
            for name in names:  # per-layer or stacked keys, under the first of the names that exists
                key = f"decoder.layers.{layer}.{name}"
                if key in g:
                    return g[key]
                if f"decoder.layers.{name}" in g:
                    return g[f"decoder.layers.{name}"][layer]
            raise KeyError(f"layer {layer}: none of {names}")
        return get

    for layer in range(c.num_layers):
        _layer_to_hf(out, f"model.layers.{layer}.", decoder_get(layer), c, layer in c.moe_layers)
    for i in mtp_indices(g):
        m, p = f"mtp.layers.{i}.", f"model.layers.{c.num_layers + i}."
        for hf_name, meg in MTP_OWN.items():
            out[p + hf_name] = g[m + meg]
        t = m + "transformer_layer."

        def mtp_get(*names: str, t: str = t) -> torch.Tensor:
            for name in names:
                if t + name in g:
                    return g[t + name]
            raise KeyError(f"{t}: none of {names}")

        _layer_to_hf(out, p, mtp_get, c, t + "mlp.router.weight" in g)
    return {k: v.contiguous() for k, v in out.items()}


# HF name in MTP layer N -> Megatron key under mtp.layers.{i}. (besides its transformer_layer)
MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
           "shared_head.norm.weight": "final_layernorm.weight"}


def mtp_indices(g: dict[str, torch.Tensor]) -> list[int]:
    """The MTP layers ``i`` of the global checkpoint tensors ``g`` (keys ``mtp.layers.{i}.*``)."""
    return sorted({int(k.split(".")[2]) for k in g if k.startswith("mtp.layers.")})


def with_mtp_copies(hf: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """``hf`` with the copies of the embedding and LM head that HF checkpoints of DeepSeek-V3 / GLM-4.5
    keep in every MTP layer ``N`` (``embed_tokens``, ``shared_head.head``) and a fresh vLLM engine
    loads; Megatron's MTP layers use the model's own."""
    c = spec.config
    out = dict(hf)
    for n in range(c.num_layers, c.num_layers + c.num_mtp_layers):
        if f"model.layers.{n}.eh_proj.weight" in hf:
            out[f"model.layers.{n}.embed_tokens.weight"] = hf["model.embed_tokens.weight"].clone()
            head = hf["model.embed_tokens.weight" if c.tie_embeddings else "lm_head.weight"]
            out[f"model.layers.{n}.shared_head.head.weight"] = head.clone()
    return out


def _layer_to_hf(out: dict[str, torch.Tensor], p: str, get: Any, c: Any, moe: bool) -> None:
    """One decoder layer's HF tensors (names ``p`` + ...) from its Megatron tensors ``get(*names)``
    (the first of the names it holds)."""
    if c.is_mla:
        _mla_to_hf(out, p, get, c.q_lora_rank)
    else:
        _gqa_to_hf(out, p, get, c)
    out[p + "post_attention_layernorm.weight"] = get("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")

    def mlp(q: str, fc1: torch.Tensor, fc2: torch.Tensor) -> None:  # q: "...mlp." or "...mlp.experts.{e}."
        n = fc1.shape[0] // 2
        out[q + "gate_proj.weight"], out[q + "up_proj.weight"], out[q + "down_proj.weight"] = fc1[:n], fc1[n:], fc2

    if moe:
        out[p + "mlp.gate.weight"] = get("mlp.router.weight")
        if c.router_bias:
            out[p + "mlp.gate.e_score_correction_bias"] = get("mlp.router.expert_bias").float()
        fc1, fc2 = get("mlp.experts.experts.linear_fc1.weight"), get("mlp.experts.experts.linear_fc2.weight")
        for e in range(c.num_experts):
            mlp(p + f"mlp.experts.{e}.", fc1[e], fc2[e])
        if c.num_shared_experts:
            mlp(p + "mlp.shared_experts.", get("mlp.shared_experts.linear_fc1.weight"),
                get("mlp.shared_experts.linear_fc2.weight"))
    else:
        mlp(p + "mlp.", get("mlp.linear_fc1.weight"), get("mlp.linear_fc2.weight"))


def hf_to_global(hf: dict[str, torch.Tensor], spec: ModelSpec, padded_vocab: int) -> dict[str, torch.Tensor]:
    """The inverse of `global_to_hf`: Megatron's global checkpoint tensors (the keys
    `sharded_tensors` gives, per layer) of HF tensors ``hf``, the embedding and output layer padded
    to ``padded_vocab`` rows (zeros).  HF MTP layers ``N >= num_layers`` (where ``hf`` has their
    ``eh_proj``) become ``mtp.layers.{N - num_layers}.*``; their ``embed_tokens`` /
    ``shared_head.head`` copies are not Megatron's and are ignored."""
    c = spec.config
    V = c.vocab_size

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(padded_vocab - V, *t.shape[1:])])

    g = {"embedding.word_embeddings.weight": padded(hf["model.embed_tokens.weight"]),
         "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not c.tie_embeddings:
        g["output_layer.weight"] = padded(hf["lm_head.weight"])
    for layer in range(c.num_layers):
        _layer_to_global(g, f"decoder.layers.{layer}.", hf, f"model.layers.{layer}.", c, layer in c.moe_layers)
    for n in range(c.num_layers, c.num_layers + c.num_mtp_layers):
        p, m = f"model.layers.{n}.", f"mtp.layers.{n - c.num_layers}."
        if p + "eh_proj.weight" not in hf:
            continue
        for hf_name, meg in MTP_OWN.items():
            g[m + meg] = hf[p + hf_name]
        _layer_to_global(g, m + "transformer_layer.", hf, p, c, p + "mlp.gate.weight" in hf)
    return {k: v.contiguous() for k, v in g.items()}


def _layer_to_global(g: dict[str, torch.Tensor], m: str, hf: dict[str, torch.Tensor], p: str, c: Any,
                     moe: bool) -> None:
    """One decoder layer's Megatron tensors (keys ``m`` + ...) from HF layer ``p``."""
    if c.is_mla:
        for hf_name, meg in _mla_pairs(c.q_lora_rank).items():
            g[m + meg] = hf[p + hf_name]
        g[m + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
    else:
        G, hd = c.num_kv_heads, c.head_dim
        qg = c.num_heads // G
        g[m + "self_attention.linear_qkv.layer_norm_weight"] = hf[p + "input_layernorm.weight"]
        for kind in ("weight", "bias") if c.qkv_bias else ("weight",):
            q, k, v = (hf[p + f"self_attn.{proj}_proj.{kind}"] for proj in "qkv")
            rest = q.shape[1:]
            g[m + f"self_attention.linear_qkv.{kind}"] = torch.cat(
                [q.reshape(G, qg * hd, *rest), k.reshape(G, hd, *rest), v.reshape(G, hd, *rest)], 1
            ).reshape(G * (qg + 2) * hd, *rest)
        g[m + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        if c.qk_norm:
            g[m + "self_attention.q_layernorm.weight"] = hf[p + "self_attn.q_norm.weight"]
            g[m + "self_attention.k_layernorm.weight"] = hf[p + "self_attn.k_norm.weight"]
        g[m + "mlp.linear_fc1.layer_norm_weight"] = hf[p + "post_attention_layernorm.weight"]

    def fc1(q: str) -> torch.Tensor:
        return torch.cat([hf[q + "gate_proj.weight"], hf[q + "up_proj.weight"]])

    if moe:
        g[m + "mlp.router.weight"] = hf[p + "mlp.gate.weight"]
        if c.router_bias:
            g[m + "mlp.router.expert_bias"] = hf[p + "mlp.gate.e_score_correction_bias"].float()
        experts = [f"{p}mlp.experts.{e}." for e in range(c.num_experts)]
        g[m + "mlp.experts.experts.linear_fc1.weight"] = torch.stack([fc1(q) for q in experts])
        g[m + "mlp.experts.experts.linear_fc2.weight"] = torch.stack([hf[q + "down_proj.weight"] for q in experts])
        if c.num_shared_experts:
            g[m + "mlp.shared_experts.linear_fc1.weight"] = fc1(p + "mlp.shared_experts.")
            g[m + "mlp.shared_experts.linear_fc2.weight"] = hf[p + "mlp.shared_experts.down_proj.weight"]
    else:
        g[m + "mlp.linear_fc1.weight"] = fc1(p + "mlp.")
        g[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]


def _gqa_to_hf(out: dict[str, torch.Tensor], p: str, get: Any, c: Any) -> None:
    G, hd = c.num_kv_heads, c.head_dim
    qg = c.num_heads // G
    out[p + "input_layernorm.weight"] = get("self_attention.linear_qkv.layer_norm_weight")
    for kind in ("weight", "bias") if c.qkv_bias else ("weight",):
        w = get(f"self_attention.linear_qkv.{kind}")
        w = w.reshape(G, (qg + 2) * hd, *w.shape[1:])
        for proj, lo, n in (("q", 0, qg * hd), ("k", qg * hd, hd), ("v", (qg + 1) * hd, hd)):
            out[p + f"self_attn.{proj}_proj.{kind}"] = w[:, lo:lo + n].reshape(G * n, *w.shape[2:])
    out[p + "self_attn.o_proj.weight"] = get("self_attention.linear_proj.weight")
    if c.qk_norm:
        out[p + "self_attn.q_norm.weight"] = get("self_attention.q_layernorm.weight")
        out[p + "self_attn.k_norm.weight"] = get("self_attention.k_layernorm.weight")


def _mla_pairs(q_lora_rank: int) -> dict[str, str]:
    """MLA's HF names -> Megatron names within a layer (one tensor each, no reordering)."""
    pairs = {"input_layernorm.weight": "input_layernorm.weight",
             "self_attn.kv_a_proj_with_mqa.weight": "self_attention.linear_kv_down_proj.weight",
             "self_attn.kv_a_layernorm.weight": "self_attention.kv_layernorm.weight",
             "self_attn.kv_b_proj.weight": "self_attention.linear_kv_up_proj.weight",
             "self_attn.o_proj.weight": "self_attention.linear_proj.weight"}
    if q_lora_rank:
        pairs.update({"self_attn.q_a_proj.weight": "self_attention.linear_q_down_proj.weight",
                      "self_attn.q_a_layernorm.weight": "self_attention.q_layernorm.weight",
                      "self_attn.q_b_proj.weight": "self_attention.linear_q_up_proj.weight"})
    else:
        pairs["self_attn.q_proj.weight"] = "self_attention.linear_q_proj.weight"
    return pairs


def _mla_to_hf(out: dict[str, torch.Tensor], p: str, get: Any, q_lora_rank: int) -> None:
    for hf, meg in _mla_pairs(q_lora_rank).items():
        out[p + hf] = get(meg)
