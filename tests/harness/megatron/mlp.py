"""Gated MLP fc1 row layout:

* ``megatron_fc1_rows``               -> a real gated ``MLP`` per TP rank, forward through
  ``MLP.forward`` (subprocess)
* ``megatron_fc1_checkpoint_offsets`` -> ``MLP.sharded_state_dict`` / ``apply_swiglu_sharded_factory``
  (where each local fc1 half lands in the dist checkpoint) (subprocess)
"""

from __future__ import annotations

from tests.harness.megatron.cpu import fake_world, install_cpu_shims, teardown_world
from tests.harness.megatron.worker import register, run_subprocess


def megatron_fc1_rows(ffn_hidden: int, tp: int) -> list[list[tuple[str, int, int]]]:
    """For each TP rank, for each row of the local (gated / SwiGLU) ``linear_fc1.weight``:
    ``(kind, canonical_row, global_megatron_row)``; kind is 'gate' (goes through the activation,
    HF gate_proj) or 'up' (the linear factor, HF up_proj); canonical_row is the global ffn index;
    global_megatron_row is the row of the unsharded master weight Megatron's CPU init splits.

    Runs a real ``MLP`` (local spec, gated_linear_unit=True, TP group of size tp, fake process
    groups) per rank: fc1 master rows are encoded, ``MLP.forward`` is executed with an
    activation that records its input and returns ones, and a forward pre-hook on ``linear_fc2``
    records its input (= the 'up' half); fc2's master columns are encoded, giving the global ffn
    index of each local intermediate slot.  Applies equally to expert MLPs (SequentialMLP uses the
    same MLP class with the expert-TP group, tp=etp).
    Also returns the same for the dist-checkpoint view via ``apply_swiglu_sharded_factory`` in
    ``megatron_fc1_checkpoint_offsets``.
    """
    res = run_subprocess("fc1_rows", ffn_hidden=ffn_hidden, tp=tp)
    return [[tuple(x) for x in r] for r in res["rows"]]


def megatron_fc1_checkpoint_offsets(ffn_hidden: int, tp: int) -> list[list[tuple[int, int, int]]]:
    """For each TP rank: the ShardedTensors ``MLP.sharded_state_dict`` (via
    ``apply_swiglu_sharded_factory``) builds for the local fc1 weight, as
    (local_row_start, local_row_stop, global_row_offset) in the checkpoint tensor of shape
    [2*ffn, hidden] -- i.e. where each local half lands in the checkpoint."""
    res = run_subprocess("fc1_rows", ffn_hidden=ffn_hidden, tp=tp)
    return [[tuple(x) for x in r] for r in res["ckpt"]]


@register("fc1_rows")
def _impl_fc1_rows(ffn_hidden, tp):
    install_cpu_shims()
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    hidden = 4
    recorded = {}

    def act(x_):
        recorded["gate"] = x_.detach().clone()
        return torch.ones_like(x_)

    def enc_rows(w):
        with torch.no_grad():
            w.zero_()
            w[:, 0] = torch.arange(w.shape[0], dtype=w.dtype)

    def enc_cols(w):
        with torch.no_grad():
            w.zero_()
            w[0, :] = torch.arange(w.shape[1], dtype=w.dtype)

    mlp_spec = get_gpt_layer_local_spec().submodules.mlp
    x = torch.zeros(1, 1, hidden, dtype=torch.float64)
    x[..., 0] = 1.0
    rows, ckpt = [], []
    for t in range(tp):
        fake_world(t, tp)
        try:
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp, create_gloo_process_groups=False
            )
            cfg = TransformerConfig(
                num_layers=1,
                hidden_size=hidden,
                num_attention_heads=tp,
                kv_channels=1,
                ffn_hidden_size=ffn_hidden,
                tensor_model_parallel_size=tp,
                gated_linear_unit=True,
                activation_func=act,
                bias_activation_fusion=False,
                add_bias_linear=False,
                use_cpu_initialization=True,
                init_method=enc_rows,
                output_layer_init_method=enc_cols,
                params_dtype=torch.float64,
            )
            mlp = build_module(mlp_spec, config=cfg)
            fc2_in = {}
            mlp.linear_fc2.register_forward_pre_hook(
                lambda m, args: fc2_in.setdefault("up", args[0].detach().clone())
            )
            with torch.no_grad():
                mlp(x)
            local_codes = [int(v) for v in mlp.linear_fc1.weight[:, 0].tolist()]
            ffn_idx = [int(v) for v in mlp.linear_fc2.weight[0, :].tolist()]
            gate = [int(v) for v in recorded["gate"].reshape(-1).tolist()]
            up = [int(v) for v in fc2_in["up"].reshape(-1).tolist()]
            assert len(gate) == len(up) == len(ffn_idx)
            code_to = {}
            for m, c in enumerate(gate):
                code_to[c] = ("gate", ffn_idx[m])
            for m, c in enumerate(up):
                code_to[c] = ("up", ffn_idx[m])
            rows.append([[*code_to[c], c] for c in local_codes])

            sd = mlp.sharded_state_dict(
                prefix="", sharded_offsets=(), metadata=ensure_metadata_has_dp_cp_group(None)
            )
            fac = sd["linear_fc1.weight"]
            assert isinstance(fac, ShardedTensorFactory)
            built = fac.build()
            built = built if isinstance(built, list) else [built]
            start, spans = 0, []
            for sh in built:
                n = sh.local_shape[0]
                assert tuple(sh.global_shape) == (2 * ffn_hidden, hidden)
                spans.append([start, start + n, int(sh.global_offset[0])])
                start += n
            ckpt.append(spans)
        finally:
            teardown_world()
    return {"rows": rows, "ckpt": ckpt}
