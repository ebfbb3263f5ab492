"""The refit barriers of members on one host, over a few shared bytes instead of gloo.

Why.  Every refit passes two barriers (start: the trainers' weights are final and the engines no
longer read theirs; end: every byte landed).  Over gloo each costs 0.6–0.8 ms on an H200 host even
when both members arrive together: gloo's own threads sleep between refits and take that long to
wake (bench/RESULTS.md, "Where the control time goes").  GPU members that share a host (every CUDA
IPC run, and NCCL runs on one host) can instead meet in shared memory, where an arrival is visible
to the others at once.  Whether they share one is found, not assumed: the file's random name exists
only in the ``/dev/shm`` of the host (or container) that created it.

How.  Member 0 creates a small file in ``/dev/shm`` and publishes its name in the run's store;
every member maps it, says whether it could, and only if every member could do they use it (else
gloo, as before); member 0 then unlinks the name, so nothing is left behind however the run ends.
Each member owns two 64-byte lines (its own cache lines: no false sharing), one per parity of the
barrier's round, and writes there one 8-byte word, ``round << 1 | flag``: one aligned store, so a
reader never sees half of it.  Two lines, because a member that passed round ``r`` may arrive at
``r + 1`` before a slower one has read round ``r``'s flags; it cannot reach ``r + 2`` before that
one arrives at ``r + 1``.  A waiter spins for its first `SPIN_S`, then sleeps in short naps (longer
ones after `NAP_AFTER_S`, to leave the cores to the work it waits for), and asks ``remaining``
every `CHECK_S`: a refit abandoned or past its deadline ends the wait, and the slots name who never
arrived.  A member that dies is not seen in the slots (gloo's broken connection said so at once):
its agent's stream closes, the coordinator abandons the refit, and ``remaining`` ends the others'
waits; under `refit-bench` without agents, the launcher names the dead worker and stops the rest.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import time
from typing import Callable

LINE = 64  # bytes per slot: one cache line
SPIN_S = 200e-6  # spin this long before the first nap (members of one refit arrive within it)
NAP_S, LONG_NAP_S, NAP_AFTER_S = 20e-6, 200e-6, 0.02
CHECK_S = 0.01  # how often a waiter asks ``remaining`` (the refit abandoned? past its deadline?)


class ShmBarrier:
    """The barrier of ``members`` members over the mapped file ``path``; this is member ``member``."""

    def __init__(self, path: str, member: int, members: int, create: bool) -> None:
        self.member, self.members, self.path = member, members, path
        size = 2 * LINE * members
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)  # zero-filled: every slot at round 0
            elif os.fstat(fd).st_size != size:
                raise OSError(f"{path} holds {os.fstat(fd).st_size} bytes, not {size}")
            self.mem = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        # ctypes reads and writes each word with one aligned 8-byte load or store (struct's
        # little-endian formats go byte by byte, and a reader could see half a word)
        self.words = [[ctypes.c_int64.from_buffer(self.mem, (2 * m + parity) * LINE) for parity in (0, 1)]
                      for m in range(members)]

    @staticmethod
    def new_path() -> str:
        """An unguessable name in ``/dev/shm`` for member 0 to create."""
        return f"/dev/shm/refit-barrier-{secrets.token_hex(8)}"

    def _word(self, member: int, round_: int) -> int:
        return self.words[member][round_ % 2].value

    def wait(self, round_: int, flag: bool, remaining: Callable[[], float]) -> int:
        """Arrive at round ``round_`` with ``flag`` and wait for every member; returns how many
        members raised their flag.  ``remaining`` raises to give up (the caller names who is
        missing with `absent`)."""
        self.words[self.member][round_ % 2].value = round_ << 1 | int(flag)
        start = time.perf_counter()
        checked = start
        while True:
            words = [self._word(m, round_) for m in range(self.members)]
            if all(w >> 1 >= round_ for w in words):
                return sum(w & 1 for w in words)
            now = time.perf_counter()
            if now - checked >= CHECK_S:
                remaining()
                checked = now
            waited = now - start
            if waited >= SPIN_S:
                time.sleep(NAP_S if waited < NAP_AFTER_S else LONG_NAP_S)

    def absent(self, round_: int) -> list[int]:
        """The members that have not arrived at round ``round_``."""
        return [m for m in range(self.members) if self._word(m, round_) >> 1 < round_]

    def unlink(self) -> None:
        """Remove the name (every member has mapped it; the mappings stay)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.words = []  # the views first: a mapping with views into it cannot close
        self.mem.close()
