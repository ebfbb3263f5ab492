"""What a typed protocol declares, and what a candidate implementation lacks of it: one structural
check that the agent (its data plane, when it takes one) and `refit.extension_points` (every
extension point) both make.  Ground floor: it knows no protocol of refit's own."""

from __future__ import annotations

import inspect
from typing import Any


def members(protocol: Any) -> set[str]:
    """The names a protocol declares: its methods, properties and annotated attributes."""
    names = {n for n, v in vars(protocol).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    for klass in protocol.__mro__:
        if klass is object or klass.__name__ == "Protocol" or klass.__module__ == "typing":
            continue
        names |= {n for n in inspect.get_annotations(klass) if not n.startswith("_")}
    return names


def missing(candidate: Any, protocol: Any) -> list[str]:
    """The members of ``protocol`` that ``candidate`` lacks, sorted; [] when it has them all.  An
    instance must hold each one; a class may instead annotate an attribute its ``__init__`` sets.
    Structural only: what each member does is the protocol's contract."""
    annotated = _instance_attributes(candidate) if inspect.isclass(candidate) else set()
    return sorted(n for n in members(protocol) if not hasattr(candidate, n) and n not in annotated)


def _instance_attributes(cls: type) -> set[str]:
    """Attributes a class declares by annotation only (set on its instances in ``__init__``)."""
    return {n for klass in cls.__mro__ for n in inspect.get_annotations(klass)}
