"""Layouts: how each framework splits a model over ranks.  `parse_layout` turns strings such as
``megatron:tp4ep8``, ``vllm:tp8dp4``, ``fsdp:dp8`` or ``hf`` into layout objects.

Every framework is one layout class in its own module, declaring its ``framework`` name, the
``degrees`` its strings may give and a few ``examples``; `LAYOUTS` maps framework names to those
classes, and parsing, help and error messages are derived from it.
"""

from __future__ import annotations

import re

from refit.errors import InvalidInput
from refit.layouts.base import Layout, LocalTensor, Piece, all_holdings, holdings, sent_tensors
from refit.layouts.fsdp import FsdpLayout
from refit.layouts.hf import HFLayout
from refit.layouts.megatron import MegatronLayout
from refit.layouts.quantized import QuantizedLayout
from refit.layouts.vllm import VllmLayout
from refit.sides import Side
from refit.spec import ModelSpec

__all__ = ["Layout", "LocalTensor", "Piece", "parse_layout", "resolve_layout", "holdings", "all_holdings",
           "sent_tensors", "MegatronLayout", "VllmLayout", "FsdpLayout", "HFLayout", "QuantizedLayout", "LAYOUTS",
           "LAYOUT_HELP", "register_layout"]

# framework name -> layout class (in the order LAYOUT_HELP lists them)
LAYOUTS: dict[str, type[Layout]] = {}

# A layout string without a framework prefix: Megatron for a trainer, vLLM for an engine.
DEFAULT_FRAMEWORK: dict[Side, str] = {Side.TRAINER: "megatron", Side.ENGINE: "vllm"}


def register_layout(cls: type[Layout]) -> type[Layout]:
    """Add a layout class to the registry (its ``framework`` must be new)."""
    if cls.framework in LAYOUTS:
        raise ValueError(f"a layout for framework {cls.framework!r} is already registered: {LAYOUTS[cls.framework]}")
    LAYOUTS[cls.framework] = cls
    return cls


for _builtin in (MegatronLayout, VllmLayout, FsdpLayout, HFLayout):
    register_layout(_builtin)


def _help_for(cls: type[Layout]) -> str:
    if not cls.degrees:
        return cls.framework
    if len(cls.degrees) == 1 and not cls.examples:
        return f"{cls.framework}:{cls.degrees[0]}<N>"
    return f"{cls.framework}:<{','.join(cls.degrees)}><N>... (e.g. {', '.join(cls.examples)})"


def layout_help() -> str:
    """One paragraph on layout strings, from the registry (shown by the CLI and in errors)."""
    return (f"layouts: {', '.join(_help_for(cls) for cls in LAYOUTS.values())}. "
            f"A bare tp4ep8 means {DEFAULT_FRAMEWORK[Side.TRAINER]} as a source and {DEFAULT_FRAMEWORK[Side.ENGINE]} "
            "as a destination.")


LAYOUT_HELP = layout_help()  # of the built-in layouts; errors call layout_help() to list later ones too


def _degree_token() -> re.Pattern[str]:
    """``<degree><N>`` for every degree any registered layout takes; longer names first so that
    an alternative is never cut short by one that is its prefix."""
    names = sorted({d for cls in LAYOUTS.values() for d in cls.degrees}, key=lambda d: (-len(d), d))
    return re.compile(rf"({'|'.join(names)})(\d+)")


def _check_role(role: Side) -> None:
    # refused, not guessed: a bare "dst" (this argument's old spelling) would read as a trainer's
    if not isinstance(role, Side):
        raise InvalidInput(f"role must be a refit.sides.Side (Side.TRAINER or Side.ENGINE), not {role!r}")


def parse_layout(text: str, role: Side = Side.TRAINER) -> Layout:
    """Parse a layout string.  Without a framework prefix, a trainer's is Megatron and an engine's
    vLLM (the RL refit direction).  Raises `refit.InvalidInput` for a string that is not a layout."""
    _check_role(role)
    text = text.strip().lower()
    bare = LAYOUTS.get(text)
    if bare is not None and not bare.degrees:
        return bare()
    framework, _, degrees = text.rpartition(":")
    if not framework:
        framework = DEFAULT_FRAMEWORK[role]
    cls = LAYOUTS.get(framework)
    if cls is None:
        raise InvalidInput(f"unknown framework {framework!r} in layout {text!r}; {layout_help()}")
    values: dict[str, int] = {}
    pos = 0
    for m in _degree_token().finditer(degrees):
        if m.start() != pos:
            break
        key, val = m.group(1), int(m.group(2))
        if key not in cls.degrees:
            raise InvalidInput(f"{framework} layouts have no {key!r} degree (layout {text!r}); {layout_help()}")
        if key in values:
            raise InvalidInput(f"{key} given twice in layout {text!r}")
        values[key] = val
        pos = m.end()
    if pos != len(degrees) or (cls.degrees and not degrees):
        raise InvalidInput(f"cannot parse layout {text!r} (stopped at {degrees[pos:]!r}); {layout_help()}")
    if not cls.degrees:
        raise InvalidInput(f"{framework} layouts take no degrees: {text!r}")
    return cls(**values)  # type: ignore[call-arg]


DRAFTER_FRAMEWORKS = ("hf", "vllm", "megatron")  # the layouts of MTP / EAGLE drafter specs (refit.drafters)


def resolve_layout(text: str | Layout, spec: ModelSpec, role: Side = Side.TRAINER) -> Layout:
    """The layout, resolved against the model (every degree derived, the split checked).  Raises
    `refit.InvalidInput` when the model cannot be split that way, with the numbers."""
    _check_role(role)
    layout = parse_layout(text, role) if isinstance(text, str) else text
    if spec.config.quantization and not isinstance(layout, QuantizedLayout):  # an FP8 engine, or a trainer sending to one
        # a trainer's shards may cut blocks (their scales are shared); an engine's may not
        layout = QuantizedLayout(layout, spec.config.quantization, shares_blocks=role is Side.TRAINER)
    if not spec.config.quantization and isinstance(layout, QuantizedLayout):
        layout = layout.inner
    if spec.config.drafter and layout.framework not in DRAFTER_FRAMEWORKS:  # refit/drafters.py
        raise InvalidInput(f"{layout.framework}: a {spec.config.drafter} drafter is laid out by refit in "
                           f"{', '.join(DRAFTER_FRAMEWORKS)} only (a trainer attaches one unsharded with "
                           f"refit.integrations.hf_draft, Megatron's MTP layers with refit_megatron.attach_mtp)")
    return layout.resolve(spec)
