"""`refit_hf.attach` with real transformers 5 models: attach, refit into engine agents in vLLM
layouts over the CPU gloo data plane, compare bit for bit with what refit's offline reshard makes
of the model's own ``save_pretrained`` checkpoint; then a real optimizer step and again (the agent
serves the live parameters).  The trainer is this process (one rank, no torch.distributed)."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch

from refit.errors import RefitError
from refit.integrations import hf as refit_hf
from refit.layouts import HFLayout
from refit.hf_checkpoint import load_spec
from tests.harness.attach_cluster import Engines, expected_engine_tensors, make_hf_model as make, train_step

transformers = pytest.importorskip("transformers")
warnings.filterwarnings("ignore", module="transformers")

QWEN3_MOE = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, vocab_size=300,
                 tie_word_embeddings=False, mlp_only_layers=[1], dtype="bfloat16")
QWEN2_TIED = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, vocab_size=250, tie_word_embeddings=True, dtype="bfloat16")
LLAMA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=96, vocab_size=129, tie_word_embeddings=False, dtype="bfloat16")
# MLA with q LoRA, a dense first layer, 2 shared experts, the float32 router bias (a buffer)
DEEPSEEK_V3 = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                   q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                   intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=2,
                   first_k_dense_replace=1, num_experts_per_tok=2, n_group=1, topk_group=1, vocab_size=260,
                   tie_word_embeddings=False, dtype="bfloat16")
GLM4_MOE = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5, intermediate_size=48,
                moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                num_experts_per_tok=2, n_group=1, topk_group=1, vocab_size=280, tie_word_embeddings=False,
                dtype="bfloat16")


def refit_and_check(client, model, agent, engines_by_layout, plans, version, tmp_path) -> None:
    for plan in plans:
        result = client.refit(plan, version=version, timeout=180)
        assert result.ok, result
    ckpt = tmp_path / f"v{version}"
    model.save_pretrained(ckpt)  # transformers' own (fused -> per-expert) checkpoint
    assert load_spec(str(ckpt)).digest() == agent.spec.digest()  # readable as `refit reshard --src hf` input
    for layout, engines in engines_by_layout.items():
        bad = engines.mismatches(expected_engine_tensors(agent.spec, layout, str(ckpt)))
        assert not bad, bad[:5]


@pytest.mark.parametrize("cls_name,cfg,layouts", [
    ("Qwen3MoeForCausalLM", QWEN3_MOE, ("vllm:tp2", "vllm:tp2ep2")),
    ("Qwen2ForCausalLM", QWEN2_TIED, ("vllm:tp2",)),
], ids=["qwen3-moe-fused", "qwen2-tied"])
def test_attach_refit_bit_exact_live(server, tmp_path, cls_name, cfg, layouts) -> None:
    srv, client = server
    model = make(cls_name, **cfg)
    group = f"trainer-{cls_name}"
    agent = refit_hf.attach(model, srv.address, group=group)
    engines = {}
    try:
        assert agent.connected and agent.rank == 0 and agent.layout.describe() == "hf"
        # Served tensors are views of the parameters' own storage: nothing copied aside.
        storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        assert {t.untyped_storage().data_ptr() for t in agent.tensors.values()} == storages
        plans = []
        for i, layout in enumerate(layouts):
            engines[layout] = Engines(srv.address, agent.spec, layout, group=f"{group}-engine{i}")
            plans.append(client.create_plan(group, f"{group}-engine{i}")["plan_id"])
        refit_and_check(client, model, agent, engines, plans, 1, tmp_path)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        train_step(model, seed=1)
        assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
        refit_and_check(client, model, agent, engines, plans, 2, tmp_path)
    finally:
        agent.stop()
        for e in engines.values():
            e.close()


def test_fused_experts_are_views() -> None:
    """transformers 5's gate_up_proj [E, 2I, H] is [gate; up] per expert, down_proj [E, H, I]."""
    model = make("Qwen3MoeForCausalLM", **QWEN3_MOE)
    named = list(model.named_parameters(remove_duplicate=False))
    agent_spec = load_spec_of(model)
    served = refit_hf.serve_hf_parameters(named, agent_spec, HFLayout(), 0, local=lambda p: p.detach())
    experts = model.model.layers[0].mlp.experts
    I = QWEN3_MOE["moe_intermediate_size"]
    for e in range(QWEN3_MOE["num_experts"]):
        gate = served[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"].view
        up = served[f"model.layers.0.mlp.experts.{e}.up_proj.weight"].view
        down = served[f"model.layers.0.mlp.experts.{e}.down_proj.weight"].view
        assert gate.data_ptr() == experts.gate_up_proj[e].data_ptr()
        assert up.data_ptr() == experts.gate_up_proj[e, I].data_ptr()
        assert down.data_ptr() == experts.down_proj[e].data_ptr()
        # The forward's own split: linear(x, gate_up_proj[e]).chunk(2) gives gate, up.
        x = torch.randn(3, QWEN3_MOE["hidden_size"]).to(torch.bfloat16)
        g, u = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
        assert torch.equal(g, torch.nn.functional.linear(x, gate)) and torch.equal(u, torch.nn.functional.linear(x, up))


def test_per_expert_form_served_as_is() -> None:
    """The per-expert form (transformers 4: experts as a ModuleList of MLPs) needs no mapping."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP

    model = make("Qwen3MoeForCausalLM", **QWEN3_MOE)
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts = torch.nn.ModuleList(
                Qwen3MoeMLP(model.config, intermediate_size=QWEN3_MOE["moe_intermediate_size"]).to(torch.bfloat16)
                for _ in range(QWEN3_MOE["num_experts"]))
    named = list(model.named_parameters(remove_duplicate=False))
    served = refit_hf.serve_hf_parameters(named, load_spec_of(model), HFLayout(), 0, local=lambda p: p.detach())
    params = dict(named)
    assert set(served) == set(params)
    assert all(s.view.data_ptr() == params[n].data_ptr() for n, s in served.items())


def load_spec_of(model):
    from refit.integrations._common import spec_of_hf_config

    return spec_of_hf_config(model.config, dict(model.named_parameters()))


@pytest.mark.parametrize("cls_name,cfg,change,message", [
    ("LlamaForCausalLM", dict(LLAMA, mlp_bias=True), None,
     "'model.layers.0.mlp.gate_proj.bias' (and 5 more"),
    ("LlamaForCausalLM", dict(LLAMA, attention_bias=True), None, "'model.layers.0.self_attn.o_proj.bias' (and 1 more"),
    ("LlamaForCausalLM", LLAMA, "untie", "lm_head.weight is a parameter of its own"),
    ("LlamaForCausalLM", LLAMA, "float32", "is float32, the model's config says bfloat16"),
], ids=["mlp_bias", "o_proj_bias", "lm_head-untied-but-config-tied", "one-fp32-param"])
def test_attach_refuses_before_registering(server, cls_name, cfg, change, message) -> None:
    srv, client = server
    model = make(cls_name, **cfg)
    if change == "untie":
        model.config.tie_word_embeddings = True
    elif change == "float32":  # one parameter in another dtype than the rest: not one model's dtype
        model.model.norm.float()
    with pytest.raises(RefitError, match=__import__("re").escape(message)):
        refit_hf.attach(model, srv.address, group="refused")
    assert client.list_workers(group="refused") == []


def test_attach_follows_parameters_that_moved(server, tmp_path) -> None:
    """A parameter re-pointed after attach (``p.data = ...``: an offload and reload between steps,
    ``model.to()``, a wrapper moving parameters into its buffers) is followed: the next refit sends
    what it holds now, with no call from the user; every member rebuilds its transfers in that
    refit.  One left on another device than at attach is refused, naming it (not testable on this
    CPU-only machine: every device is the CPU)."""
    srv, client = server
    model = make("LlamaForCausalLM", **LLAMA)
    agent = refit_hf.attach(model, srv.address, group="moved")
    engines = {"vllm:tp1": Engines(srv.address, agent.spec, "vllm:tp1", group="moved-engine")}
    try:
        plan = client.create_plan("moved", "moved-engine")["plan_id"]
        refit_and_check(client, model, agent, engines, [plan], 1, tmp_path)
        with torch.no_grad():  # "offload and reload": every parameter in new storage, new values in one
            for p in model.parameters():
                p.data = p.data.clone()
            model.model.norm.weight.data = torch.randn_like(model.model.norm.weight)
        refit_and_check(client, model, agent, engines, [plan], 2, tmp_path)
        assert agent.tensors["model.norm.weight"].data_ptr() == model.model.norm.weight.data_ptr()
    finally:
        agent.stop()
        engines["vllm:tp1"].close()


def test_attach_follows_replaced_parameters(server, tmp_path) -> None:
    """Parameter *objects* replaced after attach are followed by module path, and each refit sends
    the new values: a reload with ``load_state_dict(sd, assign=True)`` (every parameter a new object,
    after an offload or a meta init), one module's ``weight = nn.Parameter(...)``, the tied embedding
    replaced and ``lm_head`` tied to it again.  A tie broken since attach fails the refit, naming
    ``lm_head.weight``, and the engine keeps what it held."""
    srv, client = server
    model = make("Qwen2ForCausalLM", **QWEN2_TIED)
    agent = refit_hf.attach(model, srv.address, group="replaced")
    engines = {"vllm:tp2": Engines(srv.address, agent.spec, "vllm:tp2", group="replaced-engine")}
    try:
        plan = client.create_plan("replaced", "replaced-engine")["plan_id"]
        refit_and_check(client, model, agent, engines, [plan], 1, tmp_path)
        reloaded = make("Qwen2ForCausalLM", seed=1, **QWEN2_TIED).state_dict()
        model.load_state_dict(reloaded, assign=True)
        refit_and_check(client, model, agent, engines, [plan], 2, tmp_path)
        norm = model.model.norm.weight
        model.model.norm.weight = torch.nn.Parameter(torch.randn_like(norm))
        embed = torch.nn.Parameter(torch.randn_like(model.model.embed_tokens.weight))
        model.model.embed_tokens.weight = embed
        model.lm_head.weight = embed
        refit_and_check(client, model, agent, engines, [plan], 3, tmp_path)
        assert client.check(plan).ok
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(embed))  # untied: half of it would be left behind
        result = client.refit(plan, version=4, timeout=60, check=False)
        assert not result.ok and "'lm_head.weight' is no longer 'model.embed_tokens.weight'" in result.error, result
        model.lm_head.weight = embed
        bad = engines["vllm:tp2"].mismatches(expected_engine_tensors(agent.spec, "vllm:tp2", str(tmp_path / "v3")))
        assert not bad, bad[:5]
    finally:
        agent.stop()
        engines["vllm:tp2"].close()


def test_an_emptied_expert_parameter_fails_the_refit_naming_it(server) -> None:
    """A fused expert parameter emptied after attach (``.data`` of no rows): the refit fails naming
    it and the expert's tensor (it was an IndexError), before any byte moves."""
    srv, client = server
    model = make("Qwen3MoeForCausalLM", **QWEN3_MOE)
    agent = refit_hf.attach(model, srv.address, group="emptied")
    engines = Engines(srv.address, agent.spec, "vllm:tp1", group="emptied-engine")
    try:
        plan = client.create_plan("emptied", "emptied-engine")["plan_id"]
        experts = model.model.layers[0].mlp.experts
        experts.gate_up_proj.data = experts.gate_up_proj.data[:0]
        result = client.refit(plan, version=1, timeout=60, check=False)
        assert not result.ok and "parameter 'model.layers.0.mlp.experts.gate_up_proj' no longer holds refit's " \
            "'model.layers.0.mlp.experts.0.gate_proj.weight' (IndexError" in result.error, result.error
    finally:
        agent.stop()
        engines.close()


def with_float32_router_bias(model: torch.nn.Module) -> torch.nn.Module:
    """Random float32 ``e_score_correction_bias`` buffers, as from_pretrained keeps them
    (_keep_in_fp32_modules_strict; ``make``'s ``.to(bfloat16)`` had narrowed them)."""
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            gate.e_score_correction_bias = torch.randn(gate.e_score_correction_bias.shape[0])
    return model


@pytest.mark.parametrize("cls_name,cfg", [("DeepseekV3ForCausalLM", DEEPSEEK_V3), ("Glm4MoeForCausalLM", GLM4_MOE)],
                         ids=["deepseek-v3", "glm4-moe"])
def test_attach_serves_the_router_bias_buffer(server, tmp_path, cls_name, cfg) -> None:
    """transformers holds the router's float32 ``e_score_correction_bias`` as a buffer, not a
    parameter: attach serves it (a view of the buffer) and the engines get it bit for bit."""
    srv, client = server
    model = with_float32_router_bias(make(cls_name, **cfg))
    group = f"trainer-bias-{cls_name}"
    agent = refit_hf.attach(model, srv.address, group=group)
    engines = {}
    try:
        bias = model.model.layers[1].mlp.gate.e_score_correction_bias
        served = agent.tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
        assert served.dtype == torch.float32 and served.data_ptr() == bias.data_ptr()
        engines["vllm:tp2"] = Engines(srv.address, agent.spec, "vllm:tp2", group=f"{group}-engine")
        plan = client.create_plan(group, f"{group}-engine")["plan_id"]
        refit_and_check(client, model, agent, engines, [plan], 1, tmp_path)
    finally:
        agent.stop()
        for e in engines.values():
            e.close()


def test_fsdp_serves_its_rows_of_the_router_bias_buffer() -> None:
    """Under FSDP2 buffers stay whole on every rank: a rank serves its torch.chunk rows of the
    bias (serve_hf_parameters as refit_fsdp.attach calls it; parameters cut the same way stand in
    for to_local(), experts in the per-expert form refit's fsdp layout takes)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP

    from refit.layouts import FsdpLayout
    from refit.layouts.fsdp import chunk_rows

    model = with_float32_router_bias(make("DeepseekV3ForCausalLM", **DEEPSEEK_V3))
    for layer in model.model.layers[1:]:
        layer.mlp.experts = torch.nn.ModuleList(
            DeepseekV3MLP(model.config, intermediate_size=DEEPSEEK_V3["moe_intermediate_size"]).to(torch.bfloat16)
            for _ in range(DEEPSEEK_V3["n_routed_experts"]))
    named = list(model.named_parameters(remove_duplicate=False))
    spec = load_spec_of(model)
    for rank in range(3):
        def rows(t, rank=rank):
            return t.detach().narrow(0, *chunk_rows(t.shape[0], 3, rank))

        layout = FsdpLayout(dp=3).resolve(spec)
        served = refit_hf.serve_hf_parameters(named, spec, layout, rank, local=rows,
                                              buffer=model.get_buffer, buffer_local=rows)
        assert set(served) == {lt.name for lt in layout.local_tensors(spec, rank)}
        for layer in (1, 2):
            bias = model.model.layers[layer].mlp.gate.e_score_correction_bias
            got = served[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"].view
            want = list(bias.chunk(3)) + [bias[:0]]  # 4 rows: torch.chunk gives [2, 2], rank 2 nothing
            assert got.dtype == torch.float32 and torch.equal(got, want[rank])


@pytest.mark.parametrize("held,served", [(torch.float32, "bfloat16"), (torch.float16, "bfloat16"),
                                         (torch.bfloat16, "float32")],
                         ids=["fp32-to-bf16", "fp16-to-bf16", "bf16-to-fp32"])
def test_trainer_dtype_is_cast_on_the_way(server, tmp_path, held, served) -> None:
    """A trainer holding the model in one dtype (verl's FSDP2 keeps float32 masters) refits engines
    holding it in another: the plan records every cast, and the engines hold exactly what loading
    the trainer's weights would give them (``Tensor.to``: round to nearest even, the conversion of
    vLLM's loaders).  Then a real optimizer step in the trainer's dtype, and again."""
    from refit.spec import build_spec

    srv, client = server
    model = make("Qwen3MoeForCausalLM", **QWEN3_MOE).to(held)
    with torch.no_grad():  # values a narrowing cast must round (bf16 values would pass through exactly)
        for p in model.parameters():
            p.add_(torch.rand_like(p) * 1e-3)
    group = f"cast-{held}".replace("torch.", "")
    agent = refit_hf.attach(model, srv.address, group=group)
    engine_spec = build_spec(agent.spec.name, dataclasses.replace(agent.spec.config, dtype=served))
    engines = Engines(srv.address, engine_spec, "vllm:tp2", group=f"{group}-engine")
    try:
        assert agent.spec.config.dtype == str(held).removeprefix("torch.")
        created = client.create_plan(group, f"{group}-engine")
        casts = client.get_plan(created["plan_id"], include_plan=True)["plan"].casts
        wider = {t.name for t in engine_spec.tensors if t.dtype != served}  # float32 router biases: none here
        assert casts == {t.name: agent.spec[t.name].dtype for t in engine_spec.tensors if t.name not in wider}
        for version in (1, 2):
            if version == 2:
                train_step(model, seed=3)
            assert client.refit(created["plan_id"], version=version, timeout=120).ok
            ckpt = tmp_path / f"{group}-v{version}"
            copy.deepcopy(model).to(getattr(torch, served)).save_pretrained(ckpt)  # converted by torch
            bad = engines.mismatches(expected_engine_tensors(engine_spec, "vllm:tp2", str(ckpt)))
            assert not bad, bad[:5]
    finally:
        agent.stop()
        engines.close()
