"""The rendezvous store, served by the coordinator: where the members of a refit meet.

Members of a plan build their data plane (gloo groups, NCCL communicators, CUDA IPC maps) by
exchanging small records: peer addresses, device records, shared-memory handles.  They exchange
them here, through the coordinator's own gRPC service (`StoreSet` / `StoreGet` / `StoreAdd`), so
the token that guards every other call guards these too: a process without it can neither list,
read nor write a key.  (A torch ``TCPStore`` has no authentication, and ``list_keys`` gives every
key away to whoever reaches its port.)

One key space per rendezvous prefix, opened when the coordinator hands a prefix out and dropped
when that generation is replaced; a call naming any other prefix is refused (`NotFound`).  When
the coordinator abandons a refit it aborts the space: every wait under way ends at once with the
reason (`Aborted`), and so does every later call, so that a member blocked on a peer that failed
before the rendezvous leaves in milliseconds instead of at the refit's deadline.

Runs on the coordinator's event loop: no locks.
"""

from __future__ import annotations

import asyncio

from refit.control.common import Aborted, NotFound, short
from refit.errors import InvalidInput

MAX_KEY_CHARS = 512
MAX_SPACE_BYTES = 64 * 2**20  # one generation's records: ~100 B per shared tensor handle, a few KiB per peer


class Space:
    """The keys of one rendezvous prefix, and who waits for them."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.nbytes = 0
        self.aborted = ""  # why, once aborted
        self._changed: asyncio.Future | None = None  # resolved at each change: wakes every waiter

    def changed(self) -> asyncio.Future:
        if self._changed is None or self._changed.done():
            self._changed = asyncio.get_running_loop().create_future()
        return self._changed

    def wake(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)

    def abort(self, why: str) -> None:
        self.aborted = why or "abandoned"
        self.data.clear()  # nobody may read it any more: free it now
        self.nbytes = 0
        self.wake()


class RendezvousStore:
    """The key spaces of the live rendezvous prefixes (see the module docstring)."""

    def __init__(self) -> None:
        self.spaces: dict[str, Space] = {}

    # ------------------------------------------------------------------ the coordinator's side
    def open(self, prefix: str) -> None:
        self.spaces.setdefault(prefix, Space())

    def abort(self, prefix: str, why: str) -> None:
        """End every wait under ``prefix`` and refuse later calls, with ``why``."""
        space = self.spaces.get(prefix)
        if space is not None:
            space.abort(why)

    def drop(self, prefix: str, why: str) -> None:
        """Forget ``prefix`` (its generation was replaced); waits under way end with ``why``."""
        space = self.spaces.pop(prefix, None)
        if space is not None:
            space.abort(why)

    def close(self) -> None:
        for prefix in list(self.spaces):
            self.drop(prefix, "the coordinator stopped")

    # ------------------------------------------------------------------ the members' calls
    def set(self, prefix: str, keys: list[str], values: list[bytes]) -> None:
        if len(keys) != len(values):
            raise InvalidInput(f"StoreSet: {len(keys)} keys but {len(values)} values")
        space = self._space(prefix)
        for key in keys:
            _check_key(key)
        for key, value in zip(keys, values):
            grown = space.nbytes + len(key) + len(value) - _size(key, space.data.get(key))
            if grown > MAX_SPACE_BYTES:
                raise InvalidInput(f"StoreSet: the rendezvous space would hold {grown} bytes, over its "
                                 f"{MAX_SPACE_BYTES} limit")
            space.data[key] = bytes(value)
            space.nbytes = grown
        space.wake()

    async def get(self, prefix: str, keys: list[str], wait_seconds: float) -> list[bytes] | None:
        """The values of ``keys`` once all exist; None if ``wait_seconds`` passed first."""
        for key in keys:
            _check_key(key)
        loop = asyncio.get_running_loop()
        end = loop.time() + max(0.0, wait_seconds)
        while True:
            space = self._space(prefix)  # raises once aborted or dropped, also after a wait
            if all(k in space.data for k in keys):
                return [space.data[k] for k in keys]
            left = end - loop.time()
            if left <= 0:
                return None
            await asyncio.wait((space.changed(),), timeout=left)

    def add(self, prefix: str, key: str, amount: int) -> int:
        _check_key(key)
        space = self._space(prefix)
        try:
            value = int(space.data.get(key, b"0")) + amount
        except ValueError:
            raise InvalidInput(f"StoreAdd: key {short(key)} does not hold an integer") from None
        if not -2**63 <= value < 2**63:  # the answer's field is an int64: refused before anything is stored
            raise InvalidInput(f"StoreAdd: key {short(key)} plus {amount} is {value}, beyond a signed 64-bit integer")
        self.set(prefix, [key], [str(value).encode()])
        return value

    def _space(self, prefix: str) -> Space:
        space = self.spaces.get(prefix)
        if space is None:
            raise NotFound("no refit rendezvous under this prefix (never handed out, or its generation was replaced)")
        if space.aborted:
            raise Aborted(f"rendezvous abandoned: {space.aborted}")
        return space


def _check_key(key: str) -> None:
    if not key or len(key) > MAX_KEY_CHARS:
        raise InvalidInput(f"store keys must have 1 to {MAX_KEY_CHARS} characters, got {len(key)}")


def _size(key: str, value: bytes | None) -> int:
    return 0 if value is None else len(key) + len(value)
