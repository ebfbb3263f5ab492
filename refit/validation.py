"""What a user hands refit as data, checked against one typed declaration before anything runs.

Declarations are dataclasses (attribute access and defaults, as callers use them) whose field
annotations carry the rules as pydantic reads them: the type, ``Literal`` choices, and
``Annotated[..., Field(ge=..., description=...)]`` bounds and words.  pydantic checks each value
strictly (a string where an int belongs is refused, not converted), and every refusal is one
`InvalidInput` naming the field, the value given and what is allowed.  Keys the declaration does
not know are refused by name, with the nearest known one: a typo must not be ignored.  The same
declarations give the JSON schemas ``refit settings --json-schema`` prints and the docs' tables.

pydantic is imported here only, when a check runs: the executor never needs it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import typing
from typing import Any, Iterable, Mapping, TypeVar

from refit.errors import InvalidInput

T = TypeVar("T")


def check_keys(data: Mapping[str, Any], known: Iterable[str], what: str) -> None:
    """Refuse keys of ``data`` that are not in ``known``, naming the nearest known one."""
    known = list(known)
    for key in data:
        if key not in known:
            near = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise InvalidInput(f"{what}: unknown key {key!r}{hint} (known: {', '.join(known)})")


def parse(cls: type[T], data: Mapping[str, Any], what: str) -> T:
    """``cls(**data)`` for a declaration ``cls``: unknown keys and missing required ones refused by
    name; its ``__post_init__`` checks the values (`check_fields`)."""
    if not isinstance(data, Mapping):
        raise InvalidInput(f"{what} must be a mapping of keys to values, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    check_keys(data, fields, what)
    missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise InvalidInput(f"{what}: {', '.join(repr(m) for m in missing)} required")
    return cls(**data)


def check_fields(obj: Any, what: str) -> None:
    """Every field of dataclass ``obj`` against its annotation, strictly; refuse the first wrong
    one naming it, its value and what is allowed."""
    from pydantic import ValidationError

    for name, adapter in _adapters(type(obj)).items():
        value = getattr(obj, name)
        try:
            adapter.validate_python(value, strict=True)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in (name, *err["loc"]))
            raise InvalidInput(f"{what}.{where}: {value!r} is refused: {err['msg']}") from None


def json_schema(cls: type) -> dict[str, Any]:
    """The JSON schema of declaration ``cls`` (pydantic's)."""
    from pydantic import TypeAdapter

    return TypeAdapter(cls).json_schema()


def describe(cls: type) -> list[tuple[str, str, str, str]]:
    """Each field of declaration ``cls`` (a dataclass or a TypedDict) as (name, type as the schema
    says it, default, description): the rows of a docs table."""
    schema = json_schema(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init] if dataclasses.is_dataclass(cls) \
        else list(schema["properties"])
    rows = []
    for name in names:
        prop = schema["properties"][name]
        if name in schema.get("required", ()):
            default = "required"
        else:
            default = f"`{json_value(prop['default'])}`" if "default" in prop else "optional"
        rows.append((name, _type_of(prop), default, prop.get("description", "")))
    return rows


def markdown_table(cls: type, meaning: str = "what it does") -> str:
    rows = [f"| key | type | default | {meaning} |", "|---|---|---|---|"]
    rows += [f"| `{n}` | {t} | {d} | {w} |" for n, t, d, w in describe(cls)]
    return "\n".join(rows)


def json_value(v: Any) -> str:
    return json.dumps(v)


def _type_of(prop: Mapping[str, Any]) -> str:
    if "enum" in prop:
        return " / ".join(f"`{json_value(v)}`" for v in prop["enum"])
    if "anyOf" in prop:
        return " or ".join(_type_of(p) for p in prop["anyOf"])
    kind = "object" if "$ref" in prop else prop.get("type", "any")
    bounds = [f"{op} {prop[k]}" for k, op in (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"))
              if k in prop]
    return kind + (f" ({', '.join(bounds)})" if bounds else "")


@functools.lru_cache(maxsize=None)
def _adapters(cls: type) -> dict[str, Any]:
    from pydantic import TypeAdapter

    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: TypeAdapter(hints[f.name]) for f in dataclasses.fields(cls) if f.init}
