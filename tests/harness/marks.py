"""The test being run, for harness code that must know its marks.

tests/conftest.py records the item pytest is running (set-up, call and tear-down: module fixtures
start engines in the set-up of their module's first test).  Everything that starts a vLLM engine
or runs vLLM's loaders (tests/harness/vllm_*.py, vllm_capture) calls `require_vllm_mark` first:
a test without the ``vllm`` marker fails there, naming itself, so that ``make test-fast``
(``-m "not vllm"``) never starts an engine.  Outside pytest (a script using the harness) there is
no item, and no check.
"""

from __future__ import annotations

from typing import Any

_item: Any = None


def set_item(item: Any) -> None:
    global _item
    _item = item


def require_vllm_mark(what: str = "starts a vLLM engine") -> None:
    """Fail the running test unless it carries the ``vllm`` marker (directly, through its class
    or its module's ``pytestmark``)."""
    item = _item
    if item is None or item.get_closest_marker("vllm") is not None:
        return
    import pytest

    pytest.fail(f"{item.nodeid} {what} but is not marked `vllm`: mark it (tests/harness/vllm_rl.py's "
                f"vllm_marks(), or pytest.mark.vllm) so that `make test-fast` leaves it out", pytrace=False)
