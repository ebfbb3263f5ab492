"""Pipeline layer assignment:

* ``megatron_layer_ids``              -> ``get_num_layers_to_build`` + ``get_transformer_layer_offset``
  (pure, in process; the flexible ``pipeline_model_parallel_layout`` path needs parallel_state's
  pp-rank setter, which is set and restored around the call)
"""

from __future__ import annotations

from typing import Optional


def _layer_config(
    num_layers, pp, vpp, first, last, account_for_embedding, account_for_loss, layout=None
):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=8,
        num_attention_heads=1,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        account_for_embedding_in_pipeline_split=account_for_embedding,
        account_for_loss_in_pipeline_split=account_for_loss,
        pipeline_model_parallel_layout=layout,
        pipeline_dtype=torch.float32,
    )


def megatron_layer_ids(
    num_layers: int,
    pp: int,
    vpp: Optional[int],
    first: Optional[int] = None,
    last: Optional[int] = None,
    account_for_embedding: bool = False,
    account_for_loss: bool = False,
    layout: Optional[str | list] = None,
) -> dict[tuple[int, int], list[int]]:
    """(pp_rank, vp_chunk) -> global 0-based decoder layer indices that model chunk builds.

    Runs ``TransformerConfig(...)`` (its ``__post_init__`` validation), then for every
    (pp_rank, vp_stage) ``transformer_block.get_num_layers_to_build(config, vp_stage, pp_rank)``
    and ``transformer_layer.get_transformer_layer_offset(config, vp_stage, pp_rank)``; the chunk
    builds layers ``offset .. offset+num-1`` (TransformerBlock._build_layers / TransformerLayer
    use ``layer_number = local_1_based + offset``).  vp_chunk is 0 when vpp is None.

    ``first``/``last`` are ``num_layers_in_first/last_pipeline_stage`` (training flags
    --decoder-first/last-pipeline-num-layers).  ``layout`` is the optional
    ``pipeline_model_parallel_layout`` (e.g. "Et|tt|tt|tL"); that code path reads
    parallel_state's pp rank / vpp world size, which are set and restored around the call.

    Megatron's own exceptions propagate unchanged (ValueError from TransformerConfig,
    AssertionError from the two functions) -- see tests/harness/megatron/FACTS.md for the list.
    Note: the result is returned raw; Megatron does not itself check that the chunks partition
    range(num_layers).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    cfg = _layer_config(
        num_layers, pp, vpp, first, last, account_for_embedding, account_for_loss, layout
    )
    eff_vpp = cfg.virtual_pipeline_model_parallel_size  # layout may set it
    chunks = eff_vpp if eff_vpp is not None else 1
    out: dict[tuple[int, int], list[int]] = {}

    saved_pp_rank = ps._MPU_PIPELINE_MODEL_PARALLEL_RANK
    saved_vpp_ws = ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    try:
        if layout is not None:
            ps.set_virtual_pipeline_model_parallel_world_size(eff_vpp)
        for pp_rank in range(pp):
            if layout is not None:
                ps.set_pipeline_model_parallel_rank(pp_rank)
            for v in range(chunks):
                vp_stage = v if eff_vpp is not None else None
                n = get_num_layers_to_build(cfg, vp_stage=vp_stage, pp_rank=pp_rank)
                off = get_transformer_layer_offset(cfg, vp_stage=vp_stage, pp_rank=pp_rank)
                out[(pp_rank, v)] = list(range(off, off + n))
    finally:
        ps.set_pipeline_model_parallel_rank(saved_pp_rank)
        ps.set_virtual_pipeline_model_parallel_world_size(saved_vpp_ws)
    return out
