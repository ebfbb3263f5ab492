"""`refit_megatron.attach` on real megatron-core GPTModels (local spec, Float16Module-wrapped, bf16)
over a real gloo world of spawned ranks: Qwen3-MoE-like tp2 ep2 (SequentialMLP experts, dense and
MoE layers) under Megatron's DDP with the distributed optimizer (parameters served from DDP's
buffers), Qwen2-like (tied embeddings, qkv bias) pp2 vpp2, and a dense Llama-like under DDP dp2
(replicas: the plan reads each box from one of them).  Values are placed by Megatron's
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

    def handle(cmd: str, arg):
        if cmd == "shapes":
            return shapes
        if cmd == "fill":  # the trainer's parameters rewritten in place (as an optimizer step does)
            fill_by_placement(chunks, arg)
            return None
        if cmd == "views":  # served from the parameters' own storage: DDP's buffers when wrapped
            params = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
            served = {t.untyped_storage().data_ptr() for t in agent.tensors.values()}
            return served == params and (not ddp or served == buffers)
        if cmd == "layout":
            return agent.layout.describe()
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
    # Megatron's account_for_embedding_in_pipeline_split: (3 + 1) / 2 a stage, the first one layer fewer
    ("tiny-llama-3", dict(pp=2, config=dict(account_for_embedding_in_pipeline_split=True)),
     "megatron:tp1pp2dp1first1", "vllm:tp2"),
], ids=["qwen3-moe-tp2ep2-ddp", "qwen2-tied-pp2vpp2", "llama-dp2-ddp", "llama-tp2-plain-init",
        "llama3-pp2-embedding-in-split"])
def test_megatron_attach_refit_bit_exact(server, tmp_path, model, par, layout, engine_layout) -> None:
    srv, client = server
    group = f"megatron-{model}"
    trainers = Trainers(2, megatron_trainer, model, par, srv.address, group)
    engines = None
    try:
        answers = trainers.ready()
        assert all(a[0] == "ready" for a in answers), answers
        spec = answers[0][1]
        assert trainers.ask("layout") == [layout] * 2 and trainers.ask("views") == [True] * 2
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
                                        ("tiny-llama", "tiny-qwen2", {})):
        chunks = build_gpt(tiny_spec(model), **overrides)
        try:
            refit_megatron.attach(chunks[0], address, group="refused", spec=tiny_spec(spec_name))
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
        bias, expert_bias, other_model = trainers.ask("messages")[0]
        assert "parameter 'decoder.layers.0.self_attention.linear_proj.bias'" in bias and "add_bias_linear" in bias
        assert "moe_router_enable_expert_bias" in expert_bias and "is True" in expert_bias
        assert "megatron config" in other_model and "tiny-qwen2" in other_model
        assert client.list_workers(group="refused") == []
    finally:
        trainers.close()


@pytest.mark.parametrize("model", ["tiny-deepseek-v3", "tiny-glm4-moe"])
def test_family_models_are_refused_before_any_dimension_check(model) -> None:
    """A DeepSeek / GLM spec gets the reason (its Megatron names are not mapped), not the first
    dimension that happens to differ."""
    from types import SimpleNamespace

    from refit.errors import RefitError
    from refit.integrations.megatron import _check_config

    chunk = SimpleNamespace(config=SimpleNamespace())  # never read
    with pytest.raises(RefitError, match="Megatron-Core attach serves Llama and Qwen models; .* does not map yet"):
        _check_config([chunk], tiny_spec(model))
