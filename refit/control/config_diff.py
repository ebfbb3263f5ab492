"""Two registered model configs compared field by field, for messages that name what differs.

Registrations carry a model's config as JSON (`refit.control.common.config_json`); when two groups
or two replicas of a group disagree, the coordinator's refusal names every field that differs with
both values (a digest alone tells a user nothing).  Apart from `refit.control.registry`, which
uses it, because it is plain JSON comparison: no workers, no plans.
"""

from __future__ import annotations

import json
from typing import Any

from refit.control.common import short


def config_differences(a: str, b: str, a_name: str, b_name: str, ignore: tuple[str, ...] = ()) -> str:
    """Every field on which two registered model configs differ, with both values, the first pair
    labelled with whose it is: ``dtype 'float32' (trainer) vs 'bfloat16' (engine); vocab_size 300
    vs 302``.  A nested value (the LoRA adapter) is compared field by field and named by its path,
    ``lora.rank 8 vs 16``; against a config without one, each field shows None.  ``ignore``: paths
    left out.  Empty if equal.  Values are cut short: a registration may be 64 KiB of JSON."""
    rows = [row for row in differing_fields(json.loads(a), json.loads(b)) if row[0] not in ignore]
    value = lambda v: "(absent)" if v is ABSENT else short(v, 40)  # noqa: E731
    parts = [f"{k} {value(va)} vs {value(vb)}" for k, va, vb in rows]
    if parts:
        k, va, vb = rows[0]
        parts[0] = f"{k} {value(va)} ({a_name}) vs {value(vb)} ({b_name})"
    return "; ".join(parts)


ABSENT = object()  # a field one side lacks differs from every value


def differing_fields(a: Any, b: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted path, value in ``a``, value in ``b``) of each field on which two JSON values differ,
    in order of path.  An object is compared field by field, also against null or a lacking field
    (which then stands for each of its fields): a message names the number that differs."""
    nested = lambda v: isinstance(v, dict) or v is None or v is ABSENT  # noqa: E731
    if (isinstance(a, dict) or isinstance(b, dict)) and nested(a) and nested(b):
        keys = sorted({*(a if isinstance(a, dict) else ()), *(b if isinstance(b, dict) else ())})
        at = lambda v, k: v.get(k, ABSENT) if isinstance(v, dict) else v  # noqa: E731
        return [row for k in keys for row in differing_fields(at(a, k), at(b, k), f"{path}.{k}" if path else k)]
    return [] if a == b else [(path, a, b)]
