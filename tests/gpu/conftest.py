"""Every GPU test leaves ``/dev/shm`` as it found it: the refit barriers' files
(`refit.executor.shm_barrier`) are unlinked once every member mapped them, however the run ended."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

SHM = Path("/dev/shm")


def _barrier_files() -> set[str]:
    return {p.name for p in SHM.glob("refit-barrier-*")} if SHM.is_dir() else set()


@pytest.fixture(autouse=True)
def no_barrier_file_left() -> Iterator[None]:
    before = _barrier_files()
    yield
    left = _barrier_files() - before
    assert not left, f"barrier files left in {SHM}: {sorted(left)}"
