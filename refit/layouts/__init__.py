"""Layouts: how each framework splits a model over ranks.  `parse_layout` turns strings such as
``megatron:tp4ep8``, ``vllm:tp8dp4``, ``fsdp:dp8`` or ``hf`` into layout objects."""

from __future__ import annotations

import re
from typing import Literal

from refit.errors import RefitError
from refit.layouts.base import Layout, LocalTensor, Piece, all_holdings, holdings
from refit.layouts.hf import FsdpLayout, HFLayout
from refit.layouts.megatron import MegatronLayout
from refit.layouts.vllm import VllmLayout
from refit.spec import ModelSpec

__all__ = ["Layout", "LocalTensor", "Piece", "parse_layout", "resolve_layout", "holdings", "all_holdings",
           "MegatronLayout", "VllmLayout", "FsdpLayout", "HFLayout", "LAYOUT_HELP"]

_DEGREES = {
    "megatron": ("tp", "pp", "vpp", "ep", "etp", "dp", "cp", "first", "last"),
    "vllm": ("tp", "ep", "dp"),
    "fsdp": ("dp",),
    "hf": (),
}
_TOKEN = re.compile(r"(vpp|etp|first|last|tp|pp|ep|dp|cp)(\d+)")

LAYOUT_HELP = (
    "layouts: megatron:<tp,pp,vpp,ep,etp,dp,cp,first,last><N>... (e.g. megatron:tp4ep8, megatron:tp2pp2vpp2), "
    "vllm:<tp,ep,dp><N>... (e.g. vllm:tp8, vllm:tp4ep4, vllm:tp8dp4), fsdp:dp<N>, hf. "
    "A bare tp4ep8 means megatron as a source and vllm as a destination."
)


def parse_layout(text: str, role: Literal["src", "dst"] = "src") -> Layout:
    """Parse a layout string.  Without a framework prefix, a source is Megatron and a destination
    vLLM (the RL refit direction)."""
    text = text.strip().lower()
    if text == "hf":
        return HFLayout()
    framework, _, degrees = text.rpartition(":")
    if not framework:
        framework = "megatron" if role == "src" else "vllm"
    if framework not in _DEGREES:
        raise RefitError(f"unknown framework {framework!r} in layout {text!r}; {LAYOUT_HELP}")
    values: dict[str, int] = {}
    pos = 0
    for m in _TOKEN.finditer(degrees):
        if m.start() != pos:
            break
        key, val = m.group(1), int(m.group(2))
        if key not in _DEGREES[framework]:
            raise RefitError(f"{framework} layouts have no {key!r} degree (layout {text!r}); {LAYOUT_HELP}")
        if key in values:
            raise RefitError(f"{key} given twice in layout {text!r}")
        values[key] = val
        pos = m.end()
    if pos != len(degrees) or (framework != "hf" and not degrees):
        raise RefitError(f"cannot parse layout {text!r} (stopped at {degrees[pos:]!r}); {LAYOUT_HELP}")
    if framework == "megatron":
        return MegatronLayout(**values)
    if framework == "vllm":
        return VllmLayout(**values)
    if framework == "fsdp":
        return FsdpLayout(**values)
    raise RefitError(f"hf layouts take no degrees: {text!r}")


def resolve_layout(text: str | Layout, spec: ModelSpec, role: Literal["src", "dst"] = "src") -> Layout:
    layout = parse_layout(text, role) if isinstance(text, str) else text
    return layout.resolve(spec)
