"""The two sides of a refit: a trainer sends, an engine receives.  One name for both, from the
layouts and the executor up to the control plane.

The ground floor: it imports nothing of refit but its errors, so that any layer (the layouts,
the executor's endpoints, the coordinator) can speak it.  What a side is called elsewhere stays
where that name lives: the proto's ``ROLE_TRAINER``/``ROLE_ENGINE`` in `refit.control.common`
(`role_of`, `side_of_role`), the plan's serialized ``src``/``dst`` keys in `refit.plan`."""

from __future__ import annotations

import enum
from typing import Protocol

from refit.errors import InvalidInput


class _Layouts(Protocol):
    """What `Side.layout_of` reads of a plan (`refit.plan.Plan`, which this floor cannot import)."""

    @property
    def src_layout(self) -> str: ...

    @property
    def dst_layout(self) -> str: ...


class _Ends(Protocol):
    """What `Side.rank_in` reads of a bucket (`refit.plan.Bucket`)."""

    @property
    def sender(self) -> int: ...

    @property
    def receiver(self) -> int: ...


class Side(str, enum.Enum):
    """A trainer sends, as a plan's source (``src``, its bare layout read as Megatron's); an
    engine receives, as ``dst`` (read as vLLM's).  A `str` whose value is what logs, JSON and the
    CLI show: ``Side.TRAINER == "trainer"``."""

    TRAINER = "trainer"
    ENGINE = "engine"

    def __str__(self) -> str:
        """The value, in logs and f-strings alike (3.11's `str` of a mixed-in enum is ``Side.TRAINER``)."""
        return self.value

    @property
    def end(self) -> str:
        """The plan file's word for this side: ``src`` or ``dst`` (its serialized keys)."""
        return "src" if self is Side.TRAINER else "dst"

    @property
    def other(self) -> Side:
        return Side.ENGINE if self is Side.TRAINER else Side.TRAINER

    @property
    def plural(self) -> str:
        return f"{self.value}s"

    @property
    def with_article(self) -> str:
        return "a trainer" if self is Side.TRAINER else "an engine"

    @classmethod
    def named(cls, name: str) -> Side:
        """``trainer`` or ``engine``; InvalidInput otherwise."""
        try:
            return cls(name)
        except ValueError:
            raise InvalidInput(f"role must be one of {', '.join(s.value for s in cls)}, not {name!r}") from None

    @classmethod
    def of_end(cls, end: str) -> Side:
        """The side the plan file (and the CLI's ``--role``) calls ``src`` or ``dst``; InvalidInput
        otherwise."""
        if end == "src":
            return Side.TRAINER
        if end == "dst":
            return Side.ENGINE
        raise InvalidInput(f"a side is src or dst, not {end!r}")

    def layout_of(self, plan: _Layouts) -> str:
        """This side's layout in a plan."""
        return plan.src_layout if self is Side.TRAINER else plan.dst_layout

    def rank_in(self, bucket: _Ends) -> int:
        """This side's rank in a bucket of a plan."""
        return bucket.sender if self is Side.TRAINER else bucket.receiver
