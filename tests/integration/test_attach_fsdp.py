"""`refit_fsdp.attach` on transformers models sharded by torch FSDP2 ``fully_shard`` over a real
gloo world of spawned ranks (dp2 and dp3, uneven shards; a transformers 5 Qwen3-MoE whose fused
experts FSDP splits on the expert dimension, 4 experts over 3 ranks: 2, 2 and none): refit into
engine agents (vLLM layout, in this process), bit-exact against refit's offline reshard of the full
tensors the trainer holds (``DTensor.full_tensor()``, gathered for the check only); then a real
FSDP2 training step and again; the same on a 2x2 HSDP mesh, every replica group serving.  And the
refusals: a placement other than Shard(0), a module left unsharded."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.harness.attach_cluster import Engines, Trainers, expected_engine_tensors, make_hf_model, train_step

pytest.importorskip("transformers")

LLAMA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, vocab_size=129, tie_word_embeddings=False, dtype="bfloat16")
QWEN2_TIED = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=80, vocab_size=250, tie_word_embeddings=True, dtype="bfloat16")
QWEN3_MOE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, vocab_size=301,
                 mlp_only_layers=[1], dtype="bfloat16")


def shard(model: torch.nn.Module, world: int, mesh_shape: tuple[int, ...] | None = None, root: bool = True,
          placement: Any = None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    names = ("replicate", "shard") if mesh_shape and len(mesh_shape) == 2 else None  # 2-D: HSDP
    mesh = init_device_mesh("cpu", mesh_shape or (world,), mesh_dim_names=names)
    # (matrices only: a norm's weight has no dim 1)
    place = {"shard_placement_fn": lambda p: placement if p.ndim > 1 else None} if placement is not None else {}
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **place)
    if root:
        fully_shard(model, mesh=mesh)
    return model


def shard_tp(model: torch.nn.Module, dp: int, tp: int, changes: dict[str, Any] | None = None) -> torch.nn.Module:
    """FSDP x TP as torchtitan builds it: torch's tensor parallelism on the tp sub-mesh of a (dp, tp)
    mesh (ColwiseParallel on q/k/v, gate/up and the LM head, gathering the logits; RowwiseParallel on
    the embedding, o_proj and down_proj; ``changes`` replace some), then ``fully_shard`` on the dp
    sub-mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    plan = {"model.embed_tokens": RowwiseParallel(), "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        plan.update({p + f"self_attn.{x}_proj": ColwiseParallel() for x in "qkv"})
        plan.update({p + f"mlp.{x}_proj": ColwiseParallel() for x in ("gate", "up")})
        plan.update({p + "self_attn.o_proj": RowwiseParallel(), p + "mlp.down_proj": RowwiseParallel()})
    parallelize_module(model, mesh["tp"], {**plan, **(changes or {})})
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def fsdp_trainer(rank: int, world: int, cls_name: str, cfg: dict, address: str, group: str,
                 mesh_shape: tuple[int, ...] | None = None, tp: int = 1):
    from refit.integrations import fsdp as refit_fsdp

    model = make_hf_model(cls_name, **cfg)
    model = shard_tp(model, world // tp, tp) if tp > 1 else shard(model, world, mesh_shape)
    agent = refit_fsdp.attach(model, address, group=group)

    def handle(cmd: str, arg):
        if cmd == "save":  # collective: every rank gathers, rank 0 writes the HF checkpoint
            full = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
            if rank == 0:  # transformers writes fused experts per expert, as checkpoints hold them
                model.save_pretrained(arg, state_dict=full)
            return None
        if cmd == "views":  # every served tensor a view of FSDP's own local shard storage
            local = {p.to_local().untyped_storage().data_ptr() for p in model.parameters()}
            return {t.untyped_storage().data_ptr() for t in agent.tensors.values()} == local
        if cmd == "shapes":
            return {n: tuple(t.shape) for n, t in agent.tensors.items()}
        if cmd == "step":
            train_step(model, seed=arg)
            return None
        if cmd == "reload":  # every parameter a new DTensor of new random values (load_state_dict assign=True)
            from torch.distributed.tensor import DTensor

            torch.manual_seed(100 + rank)
            new = {n: DTensor.from_local(torch.randn_like(p.to_local()), p.device_mesh, p.placements, shape=p.shape,
                                         stride=p.stride()) for n, p in model.named_parameters()}
            model.load_state_dict(new, assign=True)
            return None
        if cmd in ("unshard", "reshard"):  # collective: FSDP2 registers the gathered parameters meanwhile
            getattr(model, cmd)()
            return sorted({type(p).__name__ for p in model.parameters()})
        if cmd == "refusals":
            return refusals(world, address)
        if cmd == "tp_refusal":  # o_proj split on its rows by TP: not the plan the layout describes
            from torch.distributed.tensor.parallel import ColwiseParallel

            from refit.errors import RefitError

            other = make_hf_model(cls_name, **cfg)
            plan = {f"model.layers.{i}.self_attn.o_proj": ColwiseParallel() for i in range(len(other.model.layers))}
            try:
                refit_fsdp.attach(shard_tp(other, world // tp, tp, plan), address, group="refused")
                return "attached"
            except RefitError as e:
                return str(e)
        raise ValueError(cmd)

    return agent, handle


def refusals(world: int, address: str) -> list[str]:
    """What attach says to models it must refuse (each built and sharded on this world)."""
    from refit.errors import RefitError
    from refit.integrations import fsdp as refit_fsdp

    from torch.distributed.tensor import Shard

    messages = []
    for cls_name, cfg, placement, root in (("LlamaForCausalLM", LLAMA, Shard(1), True),
                                           ("LlamaForCausalLM", LLAMA, None, False)):
        model = shard(make_hf_model(cls_name, **cfg), world, None, root, placement)
        try:
            refit_fsdp.attach(model, address, group="refused")
            messages.append("attached")
        except RefitError as e:
            messages.append(str(e))
    return messages


@pytest.mark.parametrize("dp,cls_name,cfg", [(2, "LlamaForCausalLM", LLAMA), (3, "Qwen2ForCausalLM", QWEN2_TIED),
                                             (3, "Qwen3MoeForCausalLM", QWEN3_MOE)],
                         ids=["dp2-llama", "dp3-qwen2-tied", "dp3-qwen3-moe-fused-experts"])
def test_fsdp_attach_refit_bit_exact_live(server, tmp_path, dp, cls_name, cfg) -> None:
    srv, client = server
    group = f"fsdp{dp}"
    trainers = Trainers(dp, fsdp_trainer, cls_name, cfg, srv.address, group)
    engines = None
    try:
        answers = trainers.ready()
        assert all(a[0] == "ready" for a in answers), answers
        spec = answers[0][1]
        assert trainers.ask("views") == [True] * dp
        rows = {w["worker_id"]: w for w in client.list_workers(group=group)}
        assert sorted(rows) == [f"{group}/{r}" for r in range(dp)]
        moe = "num_experts" in cfg
        assert {w["info"]["layout"] for w in rows.values()} == {f"fsdp:dp{dp}" + ("fused1" if moe else "")}
        # Uneven shards: the vocab rows split as torch.chunk does.
        V = cfg["vocab_size"]
        chunk = -(-V // dp)
        shapes = trainers.ask("shapes")
        got = [s["model.embed_tokens.weight"][0] for s in shapes]
        assert got == [max(0, min(V, (r + 1) * chunk) - r * chunk) for r in range(dp)] and len(set(got)) > 1
        if moe:  # fused experts: 4 over 3 ranks as torch.chunk splits them, each expert whole
            gate = "model.layers.0.mlp.experts.{}.gate_proj.weight"
            held = [[e for e in range(4) if s[gate.format(e)][0]] for s in shapes]
            assert held == [[0, 1], [2, 3], []], held
        engines = Engines(srv.address, spec, "vllm:tp2", group=f"{group}-engine")
        plan = client.create_plan(group, f"{group}-engine")["plan_id"]
        refit_step_refit(client, trainers, engines, spec, plan, tmp_path)
        if dp == 2:  # the refusals and replaced parameters, in the same processes (a spawn costs seconds)
            check_refusals(client, trainers.ask("refusals")[0])
            check_replaced(client, trainers, engines, spec, plan, tmp_path)
    finally:
        trainers.close()
        if engines is not None:
            engines.close()


def refit_step_refit(client, trainers, engines, spec, plan_id: str, tmp_path) -> None:
    """Refit, a real FSDP2 training step, refit: each time the engines bit-exact against refit's
    offline reshard of the full tensors the trainer holds."""
    for version in (1, 2):
        if version == 2:
            trainers.ask("step", version)
        assert client.refit(plan_id, version=version, timeout=180).ok
        trainers.ask("save", str(tmp_path / f"v{version}"))
        bad = engines.mismatches(expected_engine_tensors(spec, "vllm:tp2", str(tmp_path / f"v{version}")))
        assert not bad, bad[:5]


def check_replaced(client, trainers, engines, spec, plan_id: str, tmp_path) -> None:
    """Parameter objects replaced after attach (``load_state_dict(assign=True)``) are followed: the
    refit sends the new shards.  While FSDP2 holds the parameters gathered (``unshard()``), the
    sharded ones it keeps are served."""
    trainers.ask("reload")
    trainers.ask("save", str(tmp_path / "v3"))
    expected = expected_engine_tensors(spec, "vllm:tp2", str(tmp_path / "v3"))
    assert client.refit(plan_id, version=3, timeout=180).ok
    assert not engines.mismatches(expected)
    for t in engines.tensors:
        for x in t.values():
            x.zero_()
    assert "Parameter" in trainers.ask("unshard")[0]  # gathered parameters (not DTensors) at their paths
    try:
        assert client.refit(plan_id, version=4, timeout=180).ok
    finally:
        trainers.ask("reshard")
    assert not engines.mismatches(expected)


def check_refusals(client, messages: list[str]) -> None:
    dim1, unsharded = messages
    assert "is placed (Shard(dim=1),), refit's fsdp layout needs (Shard(dim=0),)" in dim1
    assert "is not a DTensor: fully_shard every module" in unsharded
    assert client.list_workers(group="refused") == []


def test_hsdp_every_replica_group_serves(server, tmp_path) -> None:
    """HSDP: ``fully_shard`` on a 2x2 (replicate, shard) mesh, layout ``fsdp:dp2rep2``.  The plan
    reads from both replica groups (not all from one), and the engines are bit-exact before and
    after a training step (each replica group steps alike: HSDP all-reduces the gradients)."""
    srv, client = server
    group = "hsdp"
    trainers = Trainers(4, fsdp_trainer, "LlamaForCausalLM", LLAMA, srv.address, group, (2, 2))
    engines = None
    try:
        answers = trainers.ready()
        assert all(a[0] == "ready" for a in answers), answers
        spec = answers[0][1]
        assert {w["info"]["layout"] for w in client.list_workers(group=group)} == {"fsdp:dp2rep2"}
        engines = Engines(srv.address, spec, "vllm:tp2", group=f"{group}-engine")
        plan_id = client.create_plan(group, f"{group}-engine")["plan_id"]
        plan = client.get_plan(plan_id, include_plan=True)["plan"]
        senders = {t.sender for t in plan.transfers if t.stage == 1}
        assert senders & {0, 1} and senders & {2, 3}, senders
        refit_step_refit(client, trainers, engines, spec, plan_id, tmp_path)
    finally:
        trainers.close()
        if engines is not None:
            engines.close()


def test_fsdp_x_tp_bit_exact(server, tmp_path) -> None:
    """FSDP x TP: torch's tensor parallelism over tp2, then ``fully_shard`` over dp2 (a 2x2 (dp, tp)
    mesh), layout ``fsdp:dp2tp2``: each rank serves its local shard of the 2-D placements, and the
    engines are bit-exact before and after a training step through the TP + FSDP model.  A TP plan
    other than the layout's is refused, naming the parameter and the placement it needs."""
    srv, client = server
    group = "fsdp-tp"
    trainers = Trainers(4, fsdp_trainer, "LlamaForCausalLM", LLAMA, srv.address, group, None, 2)
    engines = None
    try:
        answers = trainers.ready()
        assert all(a[0] == "ready" for a in answers), answers
        spec = answers[0][1]
        assert {w["info"]["layout"] for w in client.list_workers(group=group)} == {"fsdp:dp2tp2"}
        assert trainers.ask("views") == [True] * 4
        engines = Engines(srv.address, spec, "vllm:tp2", group=f"{group}-engine")
        plan_id = client.create_plan(group, f"{group}-engine")["plan_id"]
        refit_step_refit(client, trainers, engines, spec, plan_id, tmp_path)
        refused = trainers.ask("tp_refusal")[0]
        assert "'model.layers.0.self_attn.o_proj.weight' is placed (_StridedShard" in refused, refused
        assert "needs (Shard(dim=0), Shard(dim=1))" in refused, refused
        assert client.list_workers(group="refused") == []
    finally:
        trainers.close()
        if engines is not None:
            engines.close()
