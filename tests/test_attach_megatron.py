"""`refit_megatron.attach` on real megatron-core GPTModels (local spec, Float16Module-wrapped, bf16)
over a real gloo world of spawned ranks: Qwen3-MoE-like tp2 ep2 (SequentialMLP experts, dense and
MoE layers) under Megatron's DDP with the distributed optimizer (parameters served from DDP's
buffers), and Qwen2-like (tied embeddings, qkv bias) pp2 vpp2.  Values are placed by Megatron's
own ``sharded_state_dict`` (a function of checkpoint key and global index), so the reference HF
tensors are built without refit's megatron layout or the integration's name mapping; the engines
(vLLM layout, in this process) must equal refit's offline reshard of them bit for bit, before and
after the trainer rewrites its parameters in place."""

from __future__ import annotations

import pytest

from refit.control.client import Client
from refit.control.server import ThreadedServer
from tests.attach_cluster import Engines, Trainers, expected_engine_tensors, write_hf
from tests.tiny import tiny_spec

pytest.importorskip("megatron.core")


def megatron_trainer(rank: int, world: int, model: str, par: dict, address: str, group: str):
    from tests.megatron_models import build_gpt, fill_by_placement, init_parallel, install_cpu_shims

    install_cpu_shims()
    from refit.integrations import megatron as refit_megatron

    par = dict(par)
    ddp = par.pop("ddp", False)
    init_parallel(**par)
    spec = tiny_spec(model)
    chunks = build_gpt(spec, vpp=par.get("vpp"))
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
def server():
    s = ThreadedServer(default_timeout=60.0)
    client = Client(s.address)
    yield s, client
    client.close()
    s.stop()


@pytest.mark.parametrize("model,par,layout,engine_layout", [
    ("tiny-qwen3-moe", dict(tp=2, ep=2, etp=1, ddp=True), "megatron:tp2ep2etp1dp1", "vllm:tp2"),
    ("tiny-qwen2", dict(pp=2, vpp=2), "megatron:tp1pp2vpp2dp1", "vllm:tp2"),
], ids=["qwen3-moe-tp2ep2-ddp", "qwen2-tied-pp2vpp2"])
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
        from tests.megatron_models import megatron_to_hf

        for version in (1, 2):
            if version == 2:
                trainers.ask("fill", version)
            assert client.refit(plan, version=version, timeout=60).ok
            write_hf(str(tmp_path / f"v{version}"), megatron_to_hf(shapes, spec, version))
            bad = engines.mismatches(expected_engine_tensors(spec, engine_layout, str(tmp_path / f"v{version}")))
            assert not bad, bad[:5]
    finally:
        trainers.close()
        if engines is not None:
            engines.close()
