"""`refit.executor.shm_barrier`: the barriers of members on one host, in real processes — every
member passes each round only once all arrived, flags are counted per round even when a fast member
is already at the next one, a wait gives up when ``remaining`` raises and names who never came,
and a file of the wrong size is refused."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import threading
import time

import pytest

from refit.executor.shm_barrier import ShmBarrier

ROUNDS = 60


def _member(path: str, member: int, members: int, seed: int, out: "mp.Queue") -> None:
    barrier = ShmBarrier(path, member, members, create=False)
    rng = random.Random(seed * 100 + member)
    seen = []
    for r in range(1, ROUNDS + 1):
        if rng.random() < 0.3:  # some members late, by varying amounts (the others spin, then nap)
            time.sleep(rng.random() * 2e-3)
        flag = (r + member) % 3 == 0
        before = time.monotonic()
        count = barrier.wait(r, flag, lambda: 1.0)
        seen.append((r, count, before, time.monotonic()))
    barrier.close()
    out.put((member, seen))


def test_rounds_pass_together_and_count_each_rounds_flags(tmp_path) -> None:
    members = 3
    path = str(tmp_path / "barrier")
    owner = ShmBarrier(path, 0, members + 1, create=True)  # member 0 is this process
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(path, m, members + 1, 7, out)) for m in range(1, members + 1)]
    for p in procs:
        p.start()
    try:
        mine = []
        for r in range(1, ROUNDS + 1):
            before = time.monotonic()
            mine.append((r, owner.wait(r, r % 3 == 0, lambda: 1.0), before, time.monotonic()))
        results = dict(out.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
    results[0] = mine
    for r in range(1, ROUNDS + 1):
        expected = sum((r + m) % 3 == 0 for m in range(members + 1))
        rows = [results[m][r - 1] for m in range(members + 1)]
        assert all(count == expected for _, count, _, _ in rows), (r, rows)
        # nobody passed round r before the last member arrived at it
        last_arrival = max(before for _, _, before, _ in rows)
        assert all(after >= last_arrival for _, _, _, after in rows)
    owner.unlink()
    owner.close()
    assert not os.path.exists(path)


def _giving_up_after(seconds: float):
    deadline = time.monotonic() + seconds

    def remaining() -> float:
        if time.monotonic() > deadline:
            raise TimeoutError("past the deadline")
        return deadline - time.monotonic()
    return remaining


def test_a_wait_gives_up_when_remaining_raises_and_names_the_absent(tmp_path) -> None:
    path = str(tmp_path / "barrier")
    a = ShmBarrier(path, 0, 3, create=True)
    b = ShmBarrier(path, 1, 3, create=False)  # member 2 never comes
    assert a.absent(1) == [0, 1, 2]
    gave_up: list[BaseException] = []

    def wait_b() -> None:  # b arrives and waits for member 2 too, until it gives up
        try:
            b.wait(1, False, _giving_up_after(0.3))
        except TimeoutError as e:
            gave_up.append(e)

    waiting = threading.Thread(target=wait_b)
    waiting.start()
    with pytest.raises(TimeoutError, match="past the deadline"):
        a.wait(1, False, _giving_up_after(0.05))
    assert a.absent(1) == [2]
    waiting.join()
    assert len(gave_up) == 1  # b did not pass the round without member 2 either
    for x in (a, b):
        x.close()
    a.unlink()


def test_a_file_of_another_size_is_refused(tmp_path) -> None:
    path = str(tmp_path / "barrier")
    a = ShmBarrier(path, 0, 2, create=True)
    with pytest.raises(OSError, match="not 384"):
        ShmBarrier(path, 1, 3, create=False)
    with pytest.raises(FileExistsError):
        ShmBarrier(path, 0, 2, create=True)
    a.close()
    a.unlink()
    a.unlink()  # twice: no error
