"""The members' end of the coordinator's rendezvous store (`refit.control.rendezvous`).

`CoordinatorStore` is a ``torch.distributed.Store``, so gloo process groups and every rendezvous
of `refit.executor` build on it as they would on a ``TCPStore``; each call is a gRPC call to the
coordinator, carrying the token.  Only set-up and barrier bookkeeping go through it, never
weights.  A wait the coordinator aborts (its refit was abandoned) raises `Cancelled` at once.
"""

from __future__ import annotations

import collections
import datetime
from typing import Sequence

import grpc
import torch.distributed as dist

from refit.control.common import auth_metadata, channel_options
from refit.control.dataplane import Cancelled
from refit.control.v1 import refit_pb2 as pb
from refit.control.v1 import refit_pb2_grpc as pb_grpc

CHUNK_BYTES = 3 * 2**20  # under the coordinator's 4 MiB request limit
_CHUNKED = b"\x00refit-chunked\x00"  # a value stored in parts: this marker, then the part count
SLACK_S = 5.0  # a call's gRPC deadline beyond the wait it asks for


def _text(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class CoordinatorStore(dist.Store):
    """Keys under ``prefix`` (a rendezvous prefix: one key space of the coordinator at
    ``address``), each named with ``key_prefix`` first; waits last at most ``timeout_s``
    (``set_timeout`` changes it, as gloo does)."""

    def __init__(self, address: str, prefix: str, token: str | None, timeout_s: float, key_prefix: str = "") -> None:
        super().__init__()
        self.address, self.prefix, self.token, self.key_prefix = address, prefix, token, key_prefix
        self.set_timeout(datetime.timedelta(seconds=max(timeout_s, 0.001)))
        self._channel = grpc.insecure_channel(address, options=channel_options())
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self._md = auth_metadata(token)
        self._posted: collections.deque = collections.deque(maxlen=8)  # set_async calls in flight

    def within(self, key_prefix: str) -> "CoordinatorStore":
        """The same key space, keys under ``key_prefix`` (a store of its own, like a PrefixStore)."""
        return CoordinatorStore(self.address, self.prefix, self.token, self.timeout.total_seconds(),
                                self.key_prefix + key_prefix)

    # ------------------------------------------------------------------ torch.distributed.Store
    def set(self, key: str, value: str | bytes) -> None:
        self.multi_set([key], [value])

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        out_keys, out_values = [], []
        for key, value in zip(map(self._key, keys), map(_text, values)):
            if len(value) > CHUNK_BYTES:  # parts first: the marker is what readers wait for
                parts = [value[i:i + CHUNK_BYTES] for i in range(0, len(value), CHUNK_BYTES)]
                for i, part in enumerate(parts):
                    self._call("StoreSet", pb.StoreSetRequest(prefix=self.prefix, keys=[f"{key}#{i}"], values=[part]))
                value = _CHUNKED + str(len(parts)).encode()
            out_keys.append(key)
            out_values.append(value)
        self._call("StoreSet", pb.StoreSetRequest(prefix=self.prefix, keys=out_keys, values=out_values))

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        full = [self._key(k) for k in keys]
        values = self._get(full, self.timeout.total_seconds())
        return [self._whole(k, v) for k, v in zip(full, values)]

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        self._get([self._key(k) for k in keys], (timeout or self.timeout).total_seconds())

    def check(self, keys: Sequence[str]) -> bool:
        resp = self._call("StoreGet", pb.StoreGetRequest(prefix=self.prefix, keys=[self._key(k) for k in keys],
                                                         wait_seconds=0.0))
        return resp.found

    def add(self, key: str, amount: int) -> int:
        return self._call("StoreAdd", pb.StoreAddRequest(prefix=self.prefix, key=self._key(key), amount=amount)).value

    def clone(self) -> "CoordinatorStore":
        return self.within("")

    def set_async(self, key: str, value: str | bytes) -> None:
        """Set without waiting for the answer: for records only read after a failure (a
        barrier's arrival marks), so that a refit does not pay a round trip for them."""
        request = pb.StoreSetRequest(prefix=self.prefix, keys=[self._key(key)], values=[_text(value)])
        self._posted.append(self._stub.StoreSet.future(request, metadata=self._md, timeout=SLACK_S))

    def close(self) -> None:
        self._channel.close()

    # ------------------------------------------------------------------ helpers
    def _key(self, key: str) -> str:
        return self.key_prefix + key

    def _get(self, keys: list[str], wait_s: float) -> list[bytes]:
        resp = self._call("StoreGet", pb.StoreGetRequest(prefix=self.prefix, keys=keys, wait_seconds=wait_s), wait_s)
        if not resp.found:
            raise TimeoutError(f"rendezvous: {', '.join(keys[:3])}{'...' if len(keys) > 3 else ''} not set "
                               f"within {wait_s:g} s (a member never came?)")
        return list(resp.values)

    def _whole(self, key: str, value: bytes) -> bytes:
        if not value.startswith(_CHUNKED):
            return value
        count = int(value[len(_CHUNKED):])
        return b"".join(self._get([f"{key}#{i}" for i in range(count)], self.timeout.total_seconds()))

    def _call(self, method: str, request: object, wait_s: float = 0.0) -> object:
        try:
            return getattr(self._stub, method)(request, metadata=self._md, timeout=wait_s + SLACK_S)
        except grpc.RpcError as e:
            code, details = e.code(), e.details()  # type: ignore[attr-defined]
            if code in (grpc.StatusCode.ABORTED, grpc.StatusCode.NOT_FOUND):
                raise Cancelled(details) from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(f"rendezvous store at {self.address}: no answer within {wait_s + SLACK_S:g} s") \
                    from None
            raise ConnectionError(f"rendezvous store at {self.address}: {code.name}: {details}") from None
