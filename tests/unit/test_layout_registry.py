"""Unit tests of the layout registry in refit.layouts: parsing, help and errors come from the
registered classes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import pytest
from hypothesis import given, settings

from refit.errors import RefitError
from refit.hf_checkpoint import load_spec
from refit.layouts import (DEFAULT_FRAMEWORK, LAYOUT_HELP, LAYOUTS, FsdpLayout, HFLayout, MegatronLayout, VllmLayout,
                           layout_help, parse_layout, register_layout, resolve_layout)
from refit.layouts.fsdp import FsdpLayout as FsdpFromItsModule
from refit.sides import Side
from refit.spec import ModelConfig, build_spec
from tests.harness.strategies import layouts, model_specs

# The help text, derived from the registry (the CLI shows it; users and tests read it).
HELP_BEFORE_THE_REGISTRY = (
    "layouts: megatron:<tp,pp,vpp,ep,etp,dp,cp,first,last,vocabdiv,local><N>... (e.g. megatron:tp4ep8, megatron:tp2pp2vpp2), "
    "vllm:<tp,ep,dp><N>... (e.g. vllm:tp8, vllm:tp4ep4, vllm:tp8dp4), fsdp:<dp,rep,tp,fused><N>... (e.g. fsdp:dp8, fsdp:dp4rep2, fsdp:dp4tp2, fsdp:dp8fused1), hf. "
    "A bare tp4ep8 means megatron as a source and vllm as a destination."
)


def test_registry_holds_one_class_per_framework():
    assert LAYOUTS == {"megatron": MegatronLayout, "vllm": VllmLayout, "fsdp": FsdpLayout, "hf": HFLayout}
    assert FsdpFromItsModule is FsdpLayout
    for name, cls in LAYOUTS.items():
        assert cls.framework == name
        fields = {f.name for f in dataclasses.fields(cls)}
        assert set(cls.degrees) <= fields, cls  # every degree is a constructor keyword
        for example in cls.examples:
            assert parse_layout(example).framework == name
    assert DEFAULT_FRAMEWORK == {Side.TRAINER: "megatron", Side.ENGINE: "vllm"}


def test_help_is_derived_from_the_registry_and_unchanged():
    assert LAYOUT_HELP == layout_help() == HELP_BEFORE_THE_REGISTRY


@pytest.mark.parametrize("text,role,expected", [
    ("megatron:tp4ep8", Side.TRAINER, MegatronLayout(tp=4, ep=8)),
    ("tp4ep8", Side.TRAINER, MegatronLayout(tp=4, ep=8)),
    ("tp4ep8", Side.ENGINE, VllmLayout(tp=4, ep=8)),
    (" VLLM:TP8DP4 ", Side.ENGINE, VllmLayout(tp=8, dp=4)),
    ("megatron:tp2pp4vpp2etp1first11last9", Side.TRAINER, MegatronLayout(tp=2, pp=4, vpp=2, etp=1, first=11, last=9)),
    ("fsdp:dp8", Side.TRAINER, FsdpLayout(dp=8)),
    ("hf", Side.ENGINE, HFLayout()),
])
def test_parse(text, role, expected):
    assert parse_layout(text, role) == expected


@pytest.mark.parametrize("role", ["src", "dst", "engine"])
def test_a_role_that_is_not_a_side_is_refused(role):
    """Refused rather than read: a bare "dst" (the role's old spelling) would otherwise read as a trainer's."""
    with pytest.raises(RefitError, match="role must be a refit.sides.Side"):
        parse_layout("tp2", role)
    with pytest.raises(RefitError, match="role must be a refit.sides.Side"):
        resolve_layout("tp2", load_spec("qwen3-8b"), role)


@pytest.mark.parametrize("text,message", [
    ("hf:", "hf layouts take no degrees: 'hf:'"),
    ("hf:tp2", "hf layouts have no 'tp' degree (layout 'hf:tp2'); " + HELP_BEFORE_THE_REGISTRY),
    ("fsdp:pp2", "fsdp layouts have no 'pp' degree (layout 'fsdp:pp2'); " + HELP_BEFORE_THE_REGISTRY),
    ("fsdp:", "cannot parse layout 'fsdp:' (stopped at ''); " + HELP_BEFORE_THE_REGISTRY),
    ("vllm:tp2 ep2", "cannot parse layout 'vllm:tp2 ep2' (stopped at ' ep2'); " + HELP_BEFORE_THE_REGISTRY),
    ("jax:tp2", "unknown framework 'jax' in layout 'jax:tp2'; " + HELP_BEFORE_THE_REGISTRY),
    ("megatron:pp2pp2", "pp given twice in layout 'megatron:pp2pp2'"),
])
def test_errors_keep_their_words(text, message):
    with pytest.raises(RefitError) as e:
        parse_layout(text)
    assert str(e.value) == message


@settings(max_examples=100, deadline=None)
@given(model_specs().flatmap(lambda spec: layouts(spec).map(lambda layout: (spec, layout))))
def test_describe_parses_back_to_the_same_resolved_layout(case):
    spec, layout = case
    assert parse_layout(layout.describe()).resolve(spec) == layout


def test_expert_tp_without_ep_survives_describe():
    """Bug found by the property above: describe() dropped etp when ep was 1, so
    ``megatron:tp1etp2`` came back as ``megatron:tp1dp2`` (expert TP 1)."""
    spec = build_spec("moe", ModelConfig.from_hf({
        "model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48, "moe_intermediate_size": 16, "num_experts": 8,
        "vocab_size": 300}))
    layout = parse_layout("megatron:tp1etp2").resolve(spec)
    assert layout.describe() == "megatron:tp1etp2dp2"
    assert parse_layout(layout.describe()).resolve(spec) == layout


@dataclass(frozen=True)
class ToyLayout:
    """A framework that exists only in this test: every rank a full replica."""

    framework: ClassVar[str] = "toy"
    degrees: ClassVar[tuple[str, ...]] = ("rep",)
    examples: ClassVar[tuple[str, ...]] = ("toy:rep3",)
    rep: int = 1


def test_a_new_framework_is_one_registration():
    register_layout(ToyLayout)  # type: ignore[arg-type]
    try:
        assert parse_layout("toy:rep3") == ToyLayout(rep=3)
        assert "toy:<rep><N>... (e.g. toy:rep3)" in layout_help()
        with pytest.raises(RefitError, match="toy layouts have no 'tp' degree.*toy:<rep>"):
            parse_layout("toy:tp2")
        with pytest.raises(ValueError, match="already registered"):
            register_layout(ToyLayout)  # type: ignore[arg-type]
    finally:
        del LAYOUTS["toy"]
    with pytest.raises(RefitError, match="unknown framework 'toy'"):
        parse_layout("toy:rep3")
