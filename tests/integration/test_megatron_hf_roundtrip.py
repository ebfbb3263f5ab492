"""tests/harness/megatron_models.py's HF <-> Megatron conversions, through a real model: random HF
tensors of a tiny DeepSeek-V3 (MLA with q LoRA, a dense first layer, shared experts, the float32
router bias) and a tiny GLM-4.5 (GQA with qkv bias and qk-norm), each with its MTP layer
(``model.layers.{num_layers}.*``), are written into real megatron-core GPTModels built with
``mtp_num_layers=1`` over a real gloo world of two spawned ranks (DeepSeek-V3 at tp2 ep2 etp1,
GLM-4.5 at tp2 etp2) by `load_hf_by_placement` (Megatron's own ``sharded_state_dict`` places
every box); gathered back with `local_boxes` + `assemble` + `global_to_hf`, every HF tensor
(the MTP layer's included) must come back bit for bit.  About 30 s on 2 cores."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")


def random_hf(name: str, seed: int) -> dict[str, torch.Tensor]:
    """Random HF tensors (standard normal, bf16; the router bias float32) of tiny model ``name`` and
    its MTP layers, named and shaped as refit's specs of the target and of its drafter say."""
    from refit.drafters import mtp_config
    from refit.spec import build_spec
    from tests.harness.tiny import TINY_CONFIGS, tiny_spec

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for spec in (tiny_spec(name), build_spec(f"{name}-mtp", mtp_config(TINY_CONFIGS[name]))):
        for t in spec.hf_tensors():
            out[t.name] = torch.randn(t.shape, generator=gen).to(getattr(torch, spec[t.tensor].dtype))
    return out


class _NoAgent:  # `Trainers` stops a rank's agent: this test attaches none
    spec = None

    def stop(self) -> None:
        pass


def roundtrip_rank(rank: int, world: int, name: str, par: dict, seed: int) -> tuple[Any, Any]:
    from tests.harness.megatron_models import (build_gpt, init_parallel, install_cpu_shims, load_hf_by_placement,
                                               local_boxes)
    from tests.harness.tiny import tiny_spec

    install_cpu_shims()
    init_parallel(**par)
    spec = tiny_spec(name)
    chunks = build_gpt(spec, mtp_num_layers=1)
    load_hf_by_placement(chunks, random_hf(name, seed), spec)

    def handle(cmd: str, arg: Any) -> Any:
        if cmd == "boxes":
            return local_boxes(chunks)
        raise ValueError(cmd)

    return _NoAgent(), handle


@pytest.mark.parametrize("name,par", [
    ("tiny-deepseek-v3", dict(tp=2, ep=2, etp=1)),
    ("tiny-glm4-moe", dict(tp=2)),  # experts split over etp = tp = 2
], ids=["deepseek-v3-tp2ep2", "glm4-moe-tp2etp2"])
def test_hf_megatron_hf_roundtrip_is_bit_exact(name: str, par: dict) -> None:
    from tests.harness.attach_cluster import Trainers
    from tests.harness.megatron_models import assemble, global_to_hf
    from tests.harness.tiny import tiny_spec

    spec = tiny_spec(name)
    trainers = Trainers(2, roundtrip_rank, name, par, 5)
    try:
        answers = trainers.ready()
        assert all(a[0] == "ready" for a in answers), answers
        boxes = trainers.ask("boxes")
    finally:
        trainers.close()
    g = assemble(boxes)
    assert any(k.startswith("mtp.layers.0.transformer_layer.") for k in g), "the model has no MTP layer"
    got, want = global_to_hf(g, spec), random_hf(name, 5)
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:6]
    n = spec.config.num_layers
    assert f"model.layers.{n}.eh_proj.weight" in got and f"model.layers.{n}.mlp.experts.0.up_proj.weight" in got
    bad = [k for k, t in want.items() if got[k].dtype != t.dtype or got[k].shape != t.shape
           or not torch.equal(got[k].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8))]
    assert not bad, f"{len(bad)} of {len(want)} differ: {bad[:6]}"
