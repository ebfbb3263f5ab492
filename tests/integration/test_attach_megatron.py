"""`refit_megatron.attach` on real megatron-core 0.16.1 GPTModels (local spec, Float16Module-wrapped, bf16)
over a real gloo world of spawned ranks: Qwen3-MoE-like tp2 ep2 (SequentialMLP experts, dense and
MoE layers) under Megatron's DDP with the distributed optimizer (parameters served from DDP's
buffers), Qwen2-like (tied embeddings, qkv bias) pp2 vpp2, a dense Llama-like under DDP dp2
(replicas: the plan reads each box from one of them), DeepSeek-V3-like MLA with q LoRA (a dense
first layer, shared experts, the router's float32 ``expert_bias`` buffer) at tp2 ep2 under DDP and
at pp2, Moonlight-like MLA without q LoRA at tp2 etp2, and GLM-4.5-like (qkv bias, qk-norm, partial
rotary, shared experts, expert bias) at tp2 ep2.  MLA is built with tests/harness/megatron_models.py's
stand-ins for what TE would provide on a GPU (a plain core attention; down-projections whole on
every tp rank as TE's duplicated TELinear holds them).  Values are placed by Megatron's
own ``sharded_state_dict`` (a function of checkpoint key and global index), so the reference HF
tensors are built without refit's megatron layout or the integration's name mapping; the engines
(vLLM layout, in this process) must equal refit's offline reshard of them bit for bit, before and
after the trainer rewrites its parameters in place."""

from __future__ import annotations

import pytest

from tests.harness.attach_cluster import Engines, Trainers, expected_engine_tensors, write_hf
from tests.harness.tiny import tiny_spec

pytest.importorskip("megatron.core")


def megatron_trainer(rank: int, world: int, model: str, par: dict, address: str, group: str):
    from tests.harness.megatron_models import build_gpt, fill_by_placement, init_parallel, install_cpu_shims

    install_cpu_shims()
    from refit.integrations import megatron as refit_megatron

    par = dict(par)
    ddp = par.pop("ddp", False)
    overrides = par.pop("config", {})  # TransformerConfig fields
    init_parallel(**par)
    spec = tiny_spec(model)
    chunks = build_gpt(spec, vpp=par.get("vpp"), **overrides)
    wrapped, buffers = chunks, set()
    if ddp:  # Megatron's DDP with the distributed optimizer: parameters become views of its buffers
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
        wrapped = [DistributedDataParallel(c.module.config, ddp_config, c) for c in chunks]
        buffers = {b.param_data.untyped_storage().data_ptr() for w in wrapped
                   for b in w.buffers + w.expert_parallel_buffers}
    shapes = fill_by_placement(chunks, 1)
    agent = refit_megatron.attach(wrapped if par.get("vpp") else wrapped[0], address, group=group, spec=spec)
    draft = None
    if overrides.get("mtp_num_layers"):  # its MTP layers too, as the drafter's group
        from tests.harness.tiny import TINY_CONFIGS

        draft = refit_megatron.attach_mtp(wrapped if par.get("vpp") else wrapped[0], address, group=f"{group}-mtp",
                                          spec=TINY_CONFIGS[model])

    def handle(cmd: str, arg):
        if cmd == "shapes":
            return shapes
        if cmd == "fill":  # the trainer's parameters rewritten in place (as an optimizer step does)
            fill_by_placement(chunks, arg)
            return None
        if cmd == "views":  # served from the parameters' own storage: DDP's buffers when wrapped
            params, biases = set(), set()
            for c in chunks:
                gpt = c.module
                for n, t in list(gpt.named_parameters()) + [(n + ".expert_bias", m.expert_bias) for n, m in
                                                            gpt.named_modules() if getattr(m, "expert_bias", None)
                                                            is not None]:  # routers' float32 buffers
                    if n.startswith("mtp.") or (n.startswith("embedding.") and not gpt.pre_process):
                        continue  # MTP layers and their embedding copy: not moved
                    (biases if n.endswith("expert_bias") else params).add(t.untyped_storage().data_ptr())
            served = {t.untyped_storage().data_ptr() for t in agent.tensors.values()}
            return served == params | biases and (not ddp or served == buffers | biases)
        if cmd == "layout":
            return agent.layout.describe()
        if cmd == "mtp":  # the drafter's rank and layout, and whether it serves the MTP layers' own storage
            if draft is None:
                return None
            mtp = {t.untyped_storage().data_ptr() for c in chunks for n, t in c.module.named_parameters()
                   if n.startswith("mtp.")}
            mtp |= {m.expert_bias.untyped_storage().data_ptr() for c in chunks for n, m in c.module.named_modules()
                    if n.startswith("mtp.") and getattr(m, "expert_bias", None) is not None}
            served = {t.untyped_storage().data_ptr() for t in draft.tensors.values()}
            return draft.rank, draft.layout.describe(), served == mtp
        if cmd == "stop_mtp":
            if draft is not None:
                draft.stop()
            return None
        raise ValueError(cmd)

    return agent, handle


@pytest.fixture(scope="module")
def coordinator_timeout() -> float:
    """The shared ``server`` (tests/conftest.py), with 60 s for refits: Megatron trainers are slow here."""
    return 60.0


@pytest.mark.parametrize("model,par,layout,engine_layout", [
    ("tiny-qwen3-moe", dict(tp=2, ep=2, etp=1, ddp=True), "megatron:tp2ep2etp1dp1", "vllm:tp2"),
    ("tiny-qwen2", dict(pp=2, vpp=2), "megatron:tp1pp2vpp2dp1", "vllm:tp2"),
    ("tiny-llama", dict(tp=1, ddp=True), "megatron:tp1dp2", "vllm:tp2"),
    # the plain call, initialize_model_parallel(tensor_model_parallel_size=2): Megatron sets etp = tp,
    # which a dense model's layout has no use for
    ("tiny-llama", dict(tp=2), "megatron:tp2dp1", "vllm:tp1"),
    # the embedding built unpadded, as mbridge / verl's Megatron bridge do (vocab 250: 125 rows a rank)
    ("tiny-qwen2", dict(tp=2, config=dict(vocab_divisor=1)), "megatron:tp2dp1vocabdiv1", "vllm:tp2"),
    # Megatron's account_for_embedding_in_pipeline_split: (3 + 1) / 2 a stage, the first one layer fewer
    ("tiny-llama-3", dict(pp=2, config=dict(account_for_embedding_in_pipeline_split=True)),
     "megatron:tp1pp2dp1first1", "vllm:tp2"),
    # DeepSeek-V3: MLA with q LoRA, dense layer 0, shared experts, expert_bias; etp2 with ep2 needs 4 ranks
    ("tiny-deepseek-v3", dict(tp=2, ep=2, etp=1, ddp=True), "megatron:tp2ep2etp1dp1", "vllm:tp2"),
    # ... with a multi-token-prediction layer on the last stage (mtp.*): not moved, the engine holds none
    ("tiny-deepseek-v3", dict(pp=2, config=dict(mtp_num_layers=1)), "megatron:tp1pp2dp1", "vllm:tp1"),
    # Moonlight: MLA without q LoRA (linear_q_proj split by heads), experts split over etp2
    ("tiny-moonlight", dict(tp=2, etp=2), "megatron:tp2etp2dp1", "vllm:tp2"),
    # GLM-4.5: qkv bias, qk-norm, partial rotary, dense layer 0, shared experts, expert_bias
    ("tiny-glm4-moe", dict(tp=2, ep=2, etp=1, ddp=True), "megatron:tp2ep2etp1dp1", "vllm:tp2"),
], ids=["qwen3-moe-tp2ep2-ddp", "qwen2-tied-pp2vpp2", "llama-dp2-ddp", "llama-tp2-plain-init", "qwen2-tp2-unpadded-vocab",
        "llama3-pp2-embedding-in-split", "deepseek-v3-tp2ep2-ddp", "deepseek-v3-pp2-mtp", "moonlight-tp2etp2",
        "glm4-moe-tp2ep2-ddp"])
def test_megatron_attach_refit_bit_exact(server, tmp_path, model, par, layout, engine_layout) -> None:
    refit_bit_exact(server, tmp_path, model, par, layout, engine_layout)


LOCAL = dict(duplicated_down_proj=False)  # the local spec's ColumnParallelLinear down-projections


@pytest.mark.parametrize("model,par,world,layout,engine_layout", [
    # DeepSeek-V3-like (q LoRA, dense layer 0, shared experts, float32 expert_bias) under DDP
    ("tiny-deepseek-v3", dict(tp=2, ep=2, etp=1, ddp=True, config=LOCAL), 2, "megatron:tp2ep2etp1dp1local1", "vllm:tp2"),
    # the plain call: Megatron's etp = tp, Float16Module only
    ("tiny-deepseek-v3", dict(tp=2, config=LOCAL), 2, "megatron:tp2etp2dp1local1", "vllm:tp1"),
    # Moonlight-like: no q LoRA (linear_q_proj split by heads), experts over etp2
    ("tiny-moonlight", dict(tp=2, etp=2, config=LOCAL), 2, "megatron:tp2etp2dp1local1", "vllm:tp2"),
    # two pipeline stages of tp2 ep2: four ranks
    ("tiny-deepseek-v3", dict(tp=2, pp=2, ep=2, etp=1, config=LOCAL), 4, "megatron:tp2pp2ep2etp1dp1local1",
     "vllm:tp2"),
], ids=["deepseek-v3-tp2ep2-ddp", "deepseek-v3-tp2", "moonlight-tp2etp2", "deepseek-v3-tp2pp2ep2"])
def test_megatron_local_spec_mla_refit_bit_exact(server, tmp_path, model, par, world, layout, engine_layout) -> None:
    """MLA built with Megatron-Core's local spec (no Transformer Engine): the down-projections are
    ColumnParallelLinear, their rows split over tp; attach reads that from the live modules
    (``local1``) and the refits land every element as vLLM's loader would, before and after an
    in-place update."""
    refit_bit_exact(server, tmp_path, model, par, layout, engine_layout, world=world)


def refit_bit_exact(server, tmp_path, model: str, par: dict, layout: str, engine_layout: str, world: int = 2) -> None:
    srv, client = server
    group = f"megatron-{model}-" + "".join(f"{k}{v}" for k, v in par.items() if k != "config") + \
        ("-local" if par.get("config", {}).get("duplicated_down_proj") is False else "")
    trainers = Trainers(world, megatron_trainer, model, par, srv.address, group)
    engines = None
    try:
        answers = trainers.ready()
        assert all(a[0] == "ready" for a in answers), answers
        spec = answers[0][1]
        assert trainers.ask("layout") == [layout] * world and trainers.ask("views") == [True] * world
        shapes = {}
        for s in trainers.ask("shapes"):
            shapes.update(s)
        engines = Engines(srv.address, spec, engine_layout, group=f"{group}-engine")
        plan = client.create_plan(group, f"{group}-engine")["plan_id"]
        from tests.harness.megatron_models import megatron_to_hf

        for version in (1, 2):
            if version == 2:
                trainers.ask("fill", version)
            assert client.refit(plan, version=version, timeout=180).ok
            write_hf(str(tmp_path / f"v{version}"), megatron_to_hf(shapes, spec, version))
            bad = engines.mismatches(expected_engine_tensors(spec, engine_layout, str(tmp_path / f"v{version}")))
            assert not bad, bad[:5]
    finally:
        trainers.close()
        if engines is not None:
            engines.close()


@pytest.mark.parametrize("model,par,ranks,engine_layout", [
    # the last of two pipeline stages holds the MTP layer: rank 1 is the drafter's rank 0
    ("tiny-deepseek-v3", dict(pp=2), [None, (0, "megatron:tp1dp1")], "vllm:tp2"),
    # ... of a virtual pipeline: in the last chunk of the last stage (chunk1.mtp.layers.0.*)
    ("tiny-deepseek-v3", dict(pp=2, vpp=2), [None, (0, "megatron:tp1dp1")], "vllm:tp1"),
    # eh_proj's rows over tp, the MTP layer's experts over ep, under Megatron's DDP
    ("tiny-deepseek-v3", dict(tp=2, ep=2, etp=1, ddp=True), [(0, "megatron:tp2ep2etp1dp1"),
                                                             (1, "megatron:tp2ep2etp1dp1")], "vllm:tp1"),
    # GQA with qkv bias: the local spec's norm names inside mtp.layers.0.transformer_layer; experts over etp2
    # (Megatron's default etp = tp)
    ("tiny-glm4-moe", dict(tp=2), [(0, "megatron:tp2etp2dp1"), (1, "megatron:tp2etp2dp1")], "vllm:tp2"),
], ids=["deepseek-v3-pp2", "deepseek-v3-pp2vpp2", "deepseek-v3-tp2ep2-ddp", "glm4-moe-tp2"])
def test_megatron_mtp_layers_refit_bit_exact_into_vllms_drafter(server, tmp_path, model, par, ranks,
                                                                engine_layout) -> None:
    """``attach_mtp`` beside ``attach``: the MTP layers (placed by Megatron's own
    ``sharded_state_dict``) land in vLLM's MTP drafter layout (``model.layers.{N}.mtp_block.*``)
    bit for bit, before and after the trainer rewrites its parameters in place."""
    from refit.drafters import mtp_config
    from refit.spec import build_spec
    from tests.harness.megatron_models import megatron_to_hf
    from tests.harness.tiny import TINY_CONFIGS

    srv, client = server
    group = f"megatron-{model}-" + "".join(f"{k}{v}" for k, v in par.items())
    trainers = Trainers(2, megatron_trainer, model, dict(par, config=dict(mtp_num_layers=1)), srv.address, group)
    engines = None
    try:
        answers = trainers.ready()
        assert all(a[0] == "ready" for a in answers), answers
        spec = answers[0][1]
        assert [m and m[:2] for m in trainers.ask("mtp")] == [r and tuple(r) for r in ranks]
        assert all(m[2] for m in trainers.ask("mtp") if m), "the MTP layers' own storage, every parameter"
        drafter = build_spec(f"{model}-mtp", mtp_config(TINY_CONFIGS[model]))
        engines = Engines(srv.address, drafter, engine_layout, group=f"{group}-engine")
        plan = client.create_plan(f"{group}-mtp", f"{group}-engine")["plan_id"]
        shapes = {}
        for s in trainers.ask("shapes"):
            shapes.update(s)
        mtp_prefix = f"model.layers.{spec.config.num_layers}."
        for version in (1, 2):
            if version == 2:
                trainers.ask("fill", version)
            assert client.refit(plan, version=version, timeout=180).ok
            hf = megatron_to_hf(shapes, spec, version)
            own = {k: v for k, v in hf.items() if k.startswith(mtp_prefix)}
            assert {k.removeprefix(mtp_prefix) for k in own} >= {"enorm.weight", "hnorm.weight", "eh_proj.weight",
                                                                 "shared_head.norm.weight"}
            write_hf(str(tmp_path / f"v{version}"), own)
            bad = engines.mismatches(expected_engine_tensors(drafter, engine_layout, str(tmp_path / f"v{version}")))
            assert not bad, bad[:5]
        trainers.ask("stop_mtp")
    finally:
        trainers.close()
        if engines is not None:
            engines.close()


def test_local_and_te_names() -> None:
    """Local-spec names map onto the TE names of refit's megatron layout; TE names map to themselves."""
    from refit.integrations.megatron import _local_name
    from refit.layouts import resolve_layout

    spec = tiny_spec("tiny-qwen3-moe")  # layer 1 dense, 0/2/3 MoE
    layout = resolve_layout("megatron:tp2ep2", spec)
    expected = {lt.name for lt in layout.local_tensors(spec, 0)}
    cases = {
        "decoder.layers.0.input_layernorm.weight": "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.1.pre_mlp_layernorm.weight": "decoder.layers.1.mlp.linear_fc1.layer_norm_weight",
        "decoder.layers.0.pre_mlp_layernorm.weight": "decoder.layers.0.pre_mlp_layernorm.weight",
        "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight": "decoder.layers.0.mlp.experts.linear_fc1.weight3",
        "decoder.layers.2.mlp.experts.local_experts.0.linear_fc2.weight": "decoder.layers.2.mlp.experts.linear_fc2.weight0",
        "decoder.layers.1.mlp.linear_fc1.weight": "decoder.layers.1.mlp.linear_fc1.weight",
    }
    for local, te in cases.items():
        assert _local_name("", local, expected) == te
    mla = tiny_spec("tiny-deepseek-v3")  # MLA keeps input_layernorm; its q/kv norms are the up-projections'
    expected = {lt.name for lt in resolve_layout("megatron:tp2ep2", mla).local_tensors(mla, 0)}
    for local, te in {"decoder.layers.0.input_layernorm.weight": "decoder.layers.0.input_layernorm.weight",
                      "decoder.layers.1.self_attention.q_layernorm.weight":
                          "decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight",
                      "decoder.layers.1.self_attention.kv_layernorm.weight":
                          "decoder.layers.1.self_attention.linear_kv_up_proj.layer_norm_weight",
                      "decoder.layers.0.pre_mlp_layernorm.weight": "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
                      "decoder.layers.1.mlp.shared_experts.linear_fc1.weight":
                          "decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
                      "decoder.layers.1.mlp.router.expert_bias": "decoder.layers.1.mlp.router.expert_bias",
                      "decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight":
                          "decoder.layers.2.mlp.experts.linear_fc2.weight3"}.items():
        assert _local_name("", local, expected) == te
    for te in expected:
        assert _local_name("", te, expected) == te
    for te in expected:  # TE-spec parameters (grouped GEMM weight{i} included) are refit's names already
        assert _local_name("", te, expected) == te
    assert _local_name("", "decoder.layers.0.mlp.experts.local_experts.4.linear_fc1.weight", expected) is None  # ep rank 1's
    assert _local_name("", "decoder.layers.0.self_attention.linear_proj.bias", expected) is None


def refusing_megatron_trainer(rank: int, world: int, address: str):
    from tests.harness.megatron_models import build_gpt, init_parallel, install_cpu_shims

    install_cpu_shims()
    from megatron.core import parallel_state as ps

    from refit.errors import RefitError
    from refit.integrations import megatron as refit_megatron

    init_parallel()
    messages = []
    for model, spec_name, overrides in (("tiny-llama", "tiny-llama", dict(add_bias_linear=True)),
                                        ("tiny-qwen3-moe", "tiny-qwen3-moe", dict(moe_router_enable_expert_bias=True,
                                                                                 moe_router_score_function="sigmoid")),
                                        ("tiny-llama", "tiny-qwen2", {}),
                                        ("tiny-deepseek-v3", "tiny-deepseek-v3", dict(kv_lora_rank=8, v_head_dim=4)),
                                        ("tiny-glm4-moe", "tiny-glm4-moe", dict(moe_shared_expert_gate=True)),
                                        ("tiny-deepseek-v3", "tiny-moonlight", {})):
        chunks = build_gpt(tiny_spec(model), **overrides)
        try:
            refit_megatron.attach(chunks[0], address, group="refused", spec=tiny_spec(spec_name))
            messages.append("attached")
        except RefitError as e:
            messages.append(str(e))
    from tests.harness.tiny import TINY_CONFIGS

    for model, config in (("tiny-deepseek-v3", TINY_CONFIGS["tiny-deepseek-v3"]),  # built without its MTP layer
                          ("tiny-llama", TINY_CONFIGS["tiny-llama"])):  # a model without MTP layers
        try:
            refit_megatron.attach_mtp(build_gpt(tiny_spec(model))[0], address, group="refused", spec=config)
            messages.append("attached")
        except RefitError as e:
            messages.append(str(e))
    ps.destroy_model_parallel()
    return None, lambda cmd, arg: messages


def test_megatron_attach_refusals(server) -> None:
    srv, client = server
    trainers = Trainers(1, refusing_megatron_trainer, srv.address)
    try:
        answers = trainers.ready()
        assert all(a[0] == "ready" for a in answers), answers
        bias, expert_bias, other_model, mla_dims, gate, other_mla, no_mtp, llama_mtp = trainers.ask("messages")[0]
        assert no_mtp == "megatron config mtp_num_layers is 0, deepseek_v3 has 1 MTP layer(s) " \
                         "(num_nextn_predict_layers)", no_mtp
        assert "MTP layers of model_type 'llama'" in llama_mtp, llama_mtp
        assert "parameter 'decoder.layers.0.self_attention.linear_proj.bias'" in bias and "add_bias_linear" in bias
        assert "moe_router_enable_expert_bias is True, tiny-qwen3-moe has False" in expert_bias
        assert "megatron config" in other_model and "tiny-qwen2" in other_model
        # every field that differs, both numbers each
        assert "kv_lora_rank is 8, tiny-deepseek-v3 has 16" in mla_dims and "v_head_dim is 4, tiny-deepseek-v3 has 8" \
            in mla_dims, mla_dims
        # the shared-expert gate of each of the 2 MoE layers: no place in refit's tensors, named and counted
        assert "'decoder.layers.1.mlp.shared_experts.gate_weight' (and 1 more: decoder.layers.2.mlp.shared_experts" \
               ".gate_weight)" in gate and "moe_shared_expert_gate" in gate, gate
        assert all(f in other_mla for f in ("num_layers is 4, tiny-moonlight has 3", "q_lora_rank is 16, tiny-moonlight "
                                             "has 0", "num_moe_experts is 8, tiny-moonlight has 4")), other_mla
        assert client.list_workers(group="refused") == []
    finally:
        trainers.close()


def _megatron_config(spec_name: str, **changes):
    """A stand-in for a megatron TransformerConfig that agrees with the spec (but ``changes``)."""
    from types import SimpleNamespace

    c = tiny_spec(spec_name).config
    cfg = dict(num_layers=c.num_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_heads,
               num_query_groups=c.num_kv_heads, kv_channels=c.head_dim, qk_layernorm=c.qk_norm or c.is_mla,
               add_qkv_bias=c.qkv_bias, gated_linear_unit=True, normalization="RMSNorm",
               multi_latent_attention=c.is_mla, q_lora_rank=c.q_lora_rank or None, kv_lora_rank=c.kv_lora_rank,
               qk_head_dim=c.qk_nope_head_dim, qk_pos_emb_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
               ffn_hidden_size=c.intermediate_size, num_moe_experts=c.num_experts,
               moe_ffn_hidden_size=c.moe_intermediate_size,
               moe_layer_freq=[int(l in c.moe_layers) for l in range(c.num_layers)],
               moe_shared_expert_intermediate_size=c.shared_intermediate_size or None,
               moe_router_enable_expert_bias=c.router_bias)
    cfg.update(changes)
    return SimpleNamespace(config=SimpleNamespace(**cfg), share_embeddings_and_output_weights=c.tie_embeddings)


@pytest.mark.parametrize("model", ["tiny-deepseek-v3", "tiny-moonlight", "tiny-glm4-moe"])
def test_family_configs_are_checked_not_refused(model) -> None:
    """DeepSeek-V3 / Moonlight / GLM-4.5 specs are no longer refused by family: a matching config
    passes, and each contradicting field is named with both values."""
    from refit.errors import RefitError
    from refit.integrations.megatron_checks import check_config

    check_config([_megatron_config(model)], tiny_spec(model))
    c = tiny_spec(model).config
    with pytest.raises(RefitError) as e:
        check_config([_megatron_config(model, moe_layer_freq=1, moe_shared_expert_intermediate_size=None,
                                       moe_router_enable_expert_bias=False)], tiny_spec(model))
    msg = str(e.value)
    assert f"MoE layers (moe_layer_freq) is {list(range(c.num_layers))}, {model} has {list(c.moe_layers)}" in msg
    assert f"moe_shared_expert_intermediate_size is 0, {model} has {c.shared_intermediate_size}" in msg
    assert f"moe_router_enable_expert_bias is False, {model} has True" in msg
    with pytest.raises(RefitError, match=f"multi_latent_attention is {not c.is_mla}, {model} has {c.is_mla}"):
        check_config([_megatron_config(model, multi_latent_attention=not c.is_mla)], tiny_spec(model))


def test_mtp_layers_built_otherwise_than_vllms_drafter_are_refused() -> None:
    """An MTP layer built dense where vLLM's drafter builds it MoE (Megatron takes the MTP layer's
    spec from the last decoder layer; vLLM applies the model's dense-layers rule at its index), or
    a last stage that built no MTP block, is named before anything registers."""
    from types import SimpleNamespace

    from refit.drafters import mtp_config
    from refit.errors import RefitError
    from refit.integrations.megatron_checks import check_mtp_layers
    from refit.spec import build_spec
    from tests.harness.tiny import TINY_CONFIGS

    drafter = build_spec("tiny-deepseek-v3-mtp", mtp_config(TINY_CONFIGS["tiny-deepseek-v3"]))
    layer = drafter.config.num_layers

    def stage(*mlps: object) -> SimpleNamespace:
        return SimpleNamespace(mtp=SimpleNamespace(layers=[SimpleNamespace(transformer_layer=SimpleNamespace(mlp=m))
                                                           for m in mlps]))

    check_mtp_layers(stage(SimpleNamespace(router=object())), drafter)
    with pytest.raises(RefitError, match=rf"MTP layer 0 is dense in the model, MoE in tiny-deepseek-v3-mtp \(its HF "
                                         rf"layer {layer}, as vLLM's drafter builds it\)"):
        check_mtp_layers(stage(SimpleNamespace()), drafter)
    with pytest.raises(RefitError, match=r"the last pipeline stage built 0 MTP layer\(s\), tiny-deepseek-v3-mtp has 1"):
        check_mtp_layers(SimpleNamespace(), drafter)
