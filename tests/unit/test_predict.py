"""refit.predict: per-GPU bytes by term, the max that picks the bottleneck, presets and overrides,
`refit plan --predict`."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict

import pytest

from refit.cli import main
from refit.errors import InvalidInput
from refit.plan import Bucket, Placement
from refit.planners import make_plan
from refit.predict import GB, H100_NVL8, H200_NVL8, HARDWARE, Hardware, gpu_bytes, hardware, predict
from tests.harness.tiny import tiny_spec


def tiny_plan(src: str = "megatron:tp2ep2", dst: str = "vllm:tp2", placement: str = "colocated", **kw):
    return make_plan(tiny_spec("tiny-qwen3-moe"), src, dst, placement, bucket_bytes=4096, **kw).plan


def pair_bytes(plan) -> dict[tuple[int, int], int]:
    """(source GPU, destination GPU) -> bytes, summed over the transfers (not the buckets)."""
    out: dict[tuple[int, int], int] = defaultdict(int)
    for t in plan.transfers:
        if t.stage == 1:
            out[plan.src_gpu(t), plan.dst_gpu(t)] += plan.transfer_bytes(t)
    return out


def hand_plan(kind: str, num_src: int, num_dst: int, buckets: list[tuple[int, int, int, int]]):
    """A plan whose buckets are (stage, src rank, dst rank, bytes), written by hand."""
    base = tiny_plan()
    return dataclasses.replace(base, placement=Placement.make(kind, num_src, num_dst),
                               buckets=tuple(Bucket(st, s, d, 0, 0, n) for st, s, d, n in buckets))


def test_colocated_tiny_plan_splits_same_gpu_and_nvlink():
    plan = tiny_plan()
    pairs = pair_bytes(plan)
    per = gpu_bytes(plan, gpus_per_host=8)
    assert len(per) == 2
    for g in (0, 1):
        other = 1 - g
        assert per[g].same_gpu == pairs[g, g] > 0
        assert per[g].peer_in == pairs[other, g] > 0
        assert per[g].peer_out == pairs[g, other] > 0
        assert per[g].nic_in == per[g].nic_out == 0
    total = sum(p.same_gpu + p.peer_in for p in per)
    assert total == sum(pairs.values()) == sum(b.nbytes for b in plan.buckets)


def test_disaggregated_tiny_plan_has_no_same_gpu_bytes():
    plan = tiny_plan(placement="disaggregated")
    pairs = pair_bytes(plan)
    per = gpu_bytes(plan, gpus_per_host=8)
    assert [p.same_gpu for p in per] == [0, 0, 0, 0]
    for s in (0, 1):  # sources send only, destinations (GPUs 2, 3) receive only
        assert per[s].peer_out == pairs[s, 2] + pairs[s, 3] and per[s].peer_in == 0
    for d in (2, 3):
        assert per[d].peer_in == pairs[0, d] + pairs[1, d] and per[d].peer_out == 0
    # one GPU per host: every byte crosses a NIC instead
    nic = gpu_bytes(plan, gpus_per_host=1)
    assert [(p.nic_in, p.nic_out) for p in nic] == [(p.peer_in, p.peer_out) for p in per]
    assert all(p.peer_in == p.peer_out == 0 for p in nic)


def test_sixteen_gpus_over_two_hosts_cross_the_nics():
    plan = tiny_plan("megatron:dp8", "vllm:tp2dp4", "disaggregated")
    assert plan.placement.num_gpus == 16
    per = gpu_bytes(plan, gpus_per_host=8)
    pairs = pair_bytes(plan)
    assert all(p.peer_in == p.peer_out == p.same_gpu == 0 for p in per)
    for g in range(8):
        assert per[g].nic_out == sum(n for (s, _), n in pairs.items() if s == g) and per[g].nic_in == 0
    for g in range(8, 16):
        assert per[g].nic_in == sum(n for (_, d), n in pairs.items() if d == g) and per[g].nic_out == 0
    assert sum(p.nic_in for p in per) == sum(p.nic_out for p in per) == sum(b.nbytes for b in plan.buckets)
    # hosts of 4: sources 0-3 and 4-7 and destinations 8-11, 12-15 on four hosts, still all NIC;
    # one host of 16: all NVLink
    assert all(p.nic_in == p.nic_out == 0 for p in gpu_bytes(plan, gpus_per_host=16))
    p = predict(plan, H200_NVL8)
    assert p.num_hosts == 2 and p.transport == "nccl" and "NIC" in p.bottleneck


def test_hand_plan_bytes_and_the_max():
    # 8 sources on host 0, 8 destinations on host 1 (GPUs 8-15); source 0 -> destination 0 crosses
    plan = hand_plan("disaggregated", 8, 8, [(1, 0, 0, 90 * 10**9), (1, 1, 1, 10 * 10**9)])
    per = gpu_bytes(plan, 8)
    assert per[0].nic_out == 90 * 10**9 and per[8].nic_in == 90 * 10**9 and per[9].nic_in == 10 * 10**9
    hw = dataclasses.replace(H200_NVL8, nic_gbs=45.0, overhead_s=0.0)
    p = predict(plan, hw)
    assert p.seconds == pytest.approx(2.0)
    assert p.bottleneck == "gpu 8: NIC in, 90.0 GB at 45 GB/s"  # ties GPU 0's NIC out: in comes first
    d = p.to_dict()
    assert d["predicted_seconds"] == pytest.approx(2.0)
    terms = d["phases"][0]["terms"]
    assert terms["NIC in"]["gpu"] == 8 and terms["NIC out"]["gpu"] == 0


def test_the_max_picks_the_slowest_term_and_gpu():
    # colocated on 4 GPUs: GPU 2 copies 2000 GB within itself, GPU 3 receives 400 GB from GPU 1
    plan = hand_plan("colocated", 4, 4, [(1, 2, 2, 2000 * 10**9), (1, 1, 3, 400 * 10**9)])
    hw = Hardware("t", 8, ipc_link_gbs=100.0, nccl_link_gbs=50.0, nic_gbs=10.0, same_gpu_gbs=1000.0,
                  overhead_s=0.5)
    p = predict(plan, hw)
    assert p.transport == "ipc"
    assert p.bottleneck == "gpu 3: NVLink in, 400.0 GB at 100 GB/s"
    assert p.seconds == pytest.approx(4.5)
    faster = dataclasses.replace(hw, ipc_link_gbs=1000.0)  # now the same-GPU copy is the slowest
    assert predict(plan, faster).bottleneck == "gpu 2: same-GPU, 2000.0 GB at 1000 GB/s"
    assert predict(plan, faster).seconds == pytest.approx(2.5)
    nccl = predict(plan, hw, "nccl")  # the transport picks the link rate
    assert nccl.seconds == pytest.approx(8.5) and "at 50 GB/s" in nccl.bottleneck


def test_stage0_gathers_are_an_earlier_phase_whose_time_adds():
    plan = hand_plan("colocated", 2, 2, [(0, 1, 0, 100 * 10**9), (1, 0, 1, 300 * 10**9)])
    hw = Hardware("t", 8, 100.0, 100.0, 10.0, 1000.0, 0.0)
    p = predict(plan, hw)
    assert [ph.name for ph in p.phases] == ["gather (stage 0)", "refit (stage 1)"]
    assert [ph.seconds for ph in p.phases] == pytest.approx([1.0, 3.0])
    assert p.seconds == pytest.approx(4.0)
    assert p.bottleneck == "gpu 1: NVLink in, 300.0 GB at 100 GB/s (refit (stage 1))"
    assert gpu_bytes(plan, 8, stage=0)[1].peer_out == 100 * 10**9
    # the broadcast planner's plans have such gathers
    bplan = tiny_plan(planner="broadcast")
    if any(b.stage == 0 for b in bplan.buckets):
        assert len(predict(bplan).phases) == 2


def test_presets_and_overrides():
    assert set(HARDWARE) == {"h200-nvl8", "h100-nvl8"}
    assert hardware("h200-nvl8") is H200_NVL8
    for hw in (H200_NVL8, H100_NVL8):
        assert hw.gpus_per_host == 8 and hw.nic_gbs <= 50.0  # one 400 Gb/s NIC per GPU
    assert H100_NVL8.same_gpu_gbs < H200_NVL8.same_gpu_gbs
    hw = hardware("h100-nvl8", link_gbs=200, nic_gbs=25)
    assert (hw.ipc_link_gbs, hw.nccl_link_gbs, hw.nic_gbs) == (200, 200, 25)
    plan = tiny_plan()
    slow = predict(plan, hardware("h200-nvl8", link_gbs=1e-6))
    assert slow.seconds > predict(plan).seconds and "NVLink" in slow.bottleneck and "at 0 GB/s" in slow.bottleneck


@pytest.mark.parametrize("call, words", [
    (lambda: hardware("b200-nvl72"), "unknown hardware 'b200-nvl72'"),
    (lambda: hardware("h200-nvl8", link_gbs=0), "--link-gbps must be a positive"),
    (lambda: hardware("h200-nvl8", nic_gbs=-5), "--nic-gbps must be a positive"),
    (lambda: Hardware("x", 8, 1.0, 1.0, 1.0, 0.0, 0.0), "same_gpu rate must be a positive"),
    (lambda: Hardware("x", 0, 1.0, 1.0, 1.0, 1.0, 0.0), "gpus per host"),
    (lambda: predict(tiny_plan(), H200_NVL8, "rdma"), "unknown transport"),
    (lambda: predict(tiny_plan("megatron:dp8", "vllm:tp2dp4", "disaggregated"), H200_NVL8, "ipc"),
     "one host only"),
])
def test_bad_input_is_refused(call, words):
    with pytest.raises(InvalidInput, match=words):
        call()


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_predict_json(capsys):
    rc, out, _ = run(capsys, "plan", "--model", "qwen3-30b-moe", "--src", "megatron:tp2ep2", "--dst", "vllm:tp2",
                     "--predict", "--json")
    assert rc == 0
    s = json.loads(out)["summary"]
    assert s["predicted_seconds"] > 0 and s["bottleneck"].startswith("gpu ")
    assert s["plan_hash"]  # the plan's summary is still there
    assert s["transport"] == "ipc" and s["hardware"]["name"] == "h200-nvl8"
    terms = s["phases"][-1]["terms"]
    assert {"same-GPU", "NVLink in", "NVLink out"} <= set(terms)
    # 14.5 GB into each GPU at 360 GB/s, plus 0.3 ms
    assert s["predicted_seconds"] == pytest.approx(s["max_recv_bytes"] / (360 * GB) + 0.3e-3)
    rc, out, _ = run(capsys, "plan", "--model", "qwen3-30b-moe", "--src", "megatron:tp2ep2", "--dst", "vllm:tp2",
                     "--predict", "--json", "--transport", "nccl", "--link-gbps", "100", "--hardware", "h100-nvl8")
    s = json.loads(out)["summary"]
    assert s["bottleneck"].endswith("at 100 GB/s") and s["hardware"]["name"] == "h100-nvl8"


def test_cli_predict_text_and_plain_plan_unchanged(capsys):
    argv = ["plan", "--model", "qwen3-30b-moe", "--src", "tp2ep2", "--dst", "tp2"]
    rc, plain, _ = run(capsys, *argv)
    rc2, out, _ = run(capsys, *argv, "--predict")
    assert rc == rc2 == 0
    assert "predicted" not in plain
    assert out.startswith(plain.rstrip("\n").split("plan_hash")[0])
    assert "\npredicted " in out and "bottleneck  gpu" in out and "NVLink in" in out


def test_cli_predict_engine_adds_the_loop_and_each_phases_landing(capsys):
    """--engine vllm: the loop's calls and control once, and the landing once per phase."""
    from refit.predict import ENGINES

    vllm = ENGINES["vllm"]
    argv = ["plan", "--model", "qwen3-30b-moe", "--src", "hf", "--dst", "vllm:tp1", "--predict", "--json"]
    bare = json.loads(run(capsys, *argv)[1])["summary"]
    plain = json.loads(run(capsys, *argv, "--engine", "vllm")[1])["summary"]
    phased = json.loads(run(capsys, *argv, "--engine", "vllm", "--phase-layers", "1")[1])["summary"]
    assert bare["engine"] is None
    assert plain["predicted_seconds"] == pytest.approx(bare["predicted_seconds"] + vllm.loop_s)
    assert plain["engine"]["seconds"] == pytest.approx(vllm.loop_s)
    # 48 layers a phase each, plus the embedding, the final norm and the LM head
    assert phased["num_phases"] == 51
    assert phased["engine"]["seconds"] == pytest.approx(vllm.loop_s + 51 * vllm.phase_s)
    rc, out, _ = run(capsys, *argv[:-1], "--engine", "vllm", "--phase-layers", "1")
    assert rc == 0 and "+ engine vllm" in out and "per phase" in out


@pytest.mark.parametrize("extra, words", [
    (["--engine", "vllm"], "add --predict"),
    (["--predict", "--link-gbps", "0"], "--link-gbps must be a positive"),
    (["--predict", "--nic-gbps", "-1"], "--nic-gbps must be a positive"),
    (["--link-gbps", "300"], "add --predict"),
])
def test_cli_bad_prediction_input_exits_2(capsys, extra, words):
    rc, out, err = run(capsys, "plan", "--model", "qwen3-30b-moe", "--src", "tp2ep2", "--dst", "tp2", *extra)
    assert rc == 2 and words in err and not out


def test_cli_unknown_hardware_exits_2(capsys):
    with pytest.raises(SystemExit) as e:  # argparse's choices
        main(["plan", "--model", "qwen3-30b-moe", "--src", "tp2ep2", "--dst", "tp2", "--predict",
              "--hardware", "b200"])
    assert e.value.code == 2
    assert "h200-nvl8" in capsys.readouterr().err


def test_same_gpu_float8_weights_count_as_quantized_on_landing():
    """A colocated FP8 plan: the engine's driver reads each quantized weight's bfloat16 (2 bytes
    an element) and writes its float8 (1): a same-GPU copy of 1.5 bytes an element, the rest of
    the bucket as it is; across GPUs the wire's bytes alone."""
    from refit.quantization import is_quantized
    from refit.spec import quantize_spec

    spec = quantize_spec(tiny_spec("tiny-qwen3-moe-fp8"), "fp8")
    plan = make_plan(spec, "megatron:tp2", "vllm:tp2", "colocated", bucket_bytes=4096).plan
    assert plan.quantization == ("fp8", "bfloat16")
    by_gpu = gpu_bytes(plan, 8)
    for g in by_gpu:
        same = [b for b in plan.buckets if plan.placement.src_gpus[b.sender] == plan.placement.dst_gpus[b.receiver] == g.gpu]
        values = sum(t.numel for b in same for t in plan.transfers[b.first:b.first + b.count] if is_quantized(t.tensor))
        assert values and g.same_gpu == sum(b.nbytes for b in same) + values // 2
        assert g.peer_in == sum(b.nbytes for b in plan.buckets if plan.placement.dst_gpus[b.receiver] == g.gpu) - \
            sum(b.nbytes for b in same)
