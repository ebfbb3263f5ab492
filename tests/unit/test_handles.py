"""`refit.executor.handles`: what crosses processes through the store is plain JSON, validated
field by field, never unpickled; malformed or foreign values are refused with a clear error."""

from __future__ import annotations

import base64
import json
import pickle

import pytest

from refit.executor import handles
from refit.executor.handles import HandleError

CUDA = {  # the fields torch's reduce_tensor gives for a CUDA tensor, as plain data
    "tensor_cls": "Parameter", "size": [4, 8], "stride": [8, 1], "offset": 16, "dtype": "bfloat16", "device": 1,
    "handle": handles.b64(bytes(range(64))), "storage_size_bytes": 4096, "storage_offset_bytes": 512,
    "requires_grad": True, "ref_counter_handle": handles.b64(b"/torch_123_456"), "ref_counter_offset": 3,
    "event_handle": handles.b64(bytes(64)), "event_sync_required": True,
}


def test_round_trips() -> None:
    assert handles.decode(handles.shm_handle("/dev/shm/refit-abc-src0", 4096), "shm") == \
        {"kind": "shm", "path": "/dev/shm/refit-abc-src0", "nbytes": 4096}
    got = handles.decode(handles.encode("cuda", CUDA), "cuda", "shm")
    assert got["kind"] == "cuda" and got["handle"] == bytes(range(64)) and got["size"] == (4, 8)
    assert got["event_handle"] == bytes(64) and got["ref_counter_handle"] == b"/torch_123_456"
    many = handles.decode(handles.encode("tensors", {"tensors": {"layers.0.w": CUDA, "b": {**CUDA, "event_handle": None}}}),
                          "tensors")
    assert many["tensors"]["b"]["event_handle"] is None and many["tensors"]["layers.0.w"]["dtype"] == "bfloat16"
    uid = tuple((i * 37) % 256 - 128 for i in range(128))  # signed C chars, as older cupy gives them
    assert handles.nccl_id(handles.nccl_handle(uid), like=uid) == uid
    raw = bytes((i * 37) % 256 for i in range(128))  # bytes, as cupy 14 gives them (GPU machine)
    assert handles.nccl_id(handles.nccl_handle(raw), like=raw) == raw


@pytest.mark.parametrize("value,match", [
    (pickle.dumps(("shm", "/dev/shm/refit-x", 8)), "not JSON"),  # the old pickled form is refused
    (b'{"kind": "shm", "path": "/etc/passwd", "nbytes": 8}', "path must be /dev/shm/refit-"),
    (b'{"kind": "shm", "path": "/dev/shm/refit-../../etc", "nbytes": 8}', "path must be"),
    (b'{"kind": "shm", "path": "/dev/shm/refit-a", "nbytes": -1}', "'nbytes' must be an integer"),
    (b'{"kind": "shm", "path": "/dev/shm/refit-a", "nbytes": true}', "'nbytes' must be an integer"),
    (b'{"kind": "exec", "code": "import os"}', "expected a cuda/shm handle"),
    (b'[1, 2]', "expected a cuda/shm handle"),
    (b"[" * 100000, "not JSON"),
    (b"\xff\xfe", "not JSON"),
])
def test_refusals(value: bytes, match: str) -> None:
    with pytest.raises(HandleError, match=match):
        handles.decode(value, "cuda", "shm")


@pytest.mark.parametrize("field,bad", [
    ("tensor_cls", "os.system"), ("dtype", "object"), ("handle", "not base64!"), ("size", [1, "2"]),
    ("device", 5000), ("requires_grad", 1), ("event_handle", 7), ("offset", 2**70),
])
def test_cuda_fields_are_checked(field: str, bad: object) -> None:
    with pytest.raises(HandleError, match=repr(field)):
        handles.decode(handles.encode("cuda", {**CUDA, field: bad}), "cuda")


def test_nccl_id_size_and_oversized_values() -> None:
    with pytest.raises(HandleError, match="128 bytes"):
        handles.decode(json.dumps({"kind": "nccl", "id": base64.b64encode(b"x" * 10).decode()}).encode(), "nccl")
    with pytest.raises(HandleError, match="at most"):
        handles.decode(b" " * (handles.MAX_HANDLE_BYTES + 1), "nccl")
    with pytest.raises(HandleError, match="bad entry"):
        handles.decode(handles.encode("tensors", {"tensors": {"a b;": CUDA}}), "tensors")
