"""Does NCCL move a refit's steps faster out of and into *registered* buffers?  Two GPUs, both
directions at once, 1 GiB per step (refit's NCCL bucket), cupy NCCL like refit's transport:

* ``torch``: buffers from torch's caching allocator (what refit stages into today);
* ``registered``: buffers from ``ncclMemAlloc`` (VMM memory), registered with the communicator
  (``ncclCommRegister``), which lets NCCL send from / receive into them without its own
  intermediate buffers where the transport supports it;
* ``mem-alloc``: ``ncclMemAlloc`` buffers not registered (to tell the allocator from the
  registration).

Also the same-GPU copy engines beside each (HBM contention is what slowed the wire in a refit):
``--beside-gib`` of local copies issued on another stream while the steps run.

Run: python bench/probes/probe_nccl_reg.py [--gib 13.5] [--beside-gib 0]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time

import torch

from probe_nccl_ops import run_pair  # bench/probes/ is on the path when run as a script

GiB = 2**30
STEP = GiB


def _libnccl() -> ctypes.CDLL:
    """The libnccl cupy loaded (found in this process's memory map), so that our calls act on
    the communicator cupy built."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libnccl" in line}
    if not paths:
        raise RuntimeError("libnccl is not loaded")
    return ctypes.CDLL(sorted(paths)[0])


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"{what}: {lib.ncclGetErrorString(rc).decode()} ({rc})")


def _nccl_buffer(lib: ctypes.CDLL, nbytes: int, device: int) -> torch.Tensor:
    ptr = ctypes.c_void_p()
    _check(lib, lib.ncclMemAlloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "ncclMemAlloc")
    import cupy

    mem = cupy.cuda.UnownedMemory(ptr.value, nbytes, owner=None, device_id=device)
    arr = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
    return torch.as_tensor(arr, device=f"cuda:{device}")


def worker(rank: int, uid: bytes, total: int, beside: int, q) -> None:
    import cupy
    from cupy.cuda import nccl

    torch.cuda.set_device(rank)
    cupy.cuda.Device(rank).use()
    comm = nccl.NcclCommunicator(2, uid, rank)
    lib = _libnccl()
    raw = ctypes.c_void_p(comm.comm)
    peer = 1 - rank
    stream = torch.cuda.Stream()
    side = torch.cuda.Stream()
    s = stream.cuda_stream
    local_src = torch.randint(0, 256, (max(beside, 1),), dtype=torch.uint8, device=f"cuda:{rank}")
    local_dst = torch.empty_like(local_src)
    torch.cuda.synchronize()

    def data(of: int) -> torch.Tensor:  # what rank ``of`` sends: random, the same on both sides
        g = torch.Generator(device=f"cuda:{rank}").manual_seed(1000 + of)
        return torch.randint(0, 256, (STEP,), dtype=torch.uint8, device=f"cuda:{rank}", generator=g)

    def buffers(kind: str) -> tuple[torch.Tensor, torch.Tensor, list]:
        if kind == "torch":
            return data(rank), torch.empty(STEP, dtype=torch.uint8, device=f"cuda:{rank}"), []
        sbuf, rbuf = _nccl_buffer(lib, STEP, rank), _nccl_buffer(lib, STEP, rank)
        sbuf.copy_(data(rank))
        handles = []
        if kind == "registered":
            for b in (sbuf, rbuf):
                h = ctypes.c_void_p()
                _check(lib, lib.ncclCommRegister(raw, ctypes.c_void_p(b.data_ptr()), ctypes.c_size_t(STEP),
                                                 ctypes.byref(h)), "ncclCommRegister")
                handles.append(h)
        return sbuf, rbuf, handles

    steps = total // STEP
    for kind in os.environ.get("PROBE_KINDS", "torch,registered,mem-alloc").split(","):
        try:
            sbuf, rbuf, handles = buffers(kind)
        except Exception as e:  # an NCCL without the API: say so, go on
            if rank == 0:
                q.put(f"{kind:11s}: {e}")
            continue

        def run(sbuf: torch.Tensor, rbuf: torch.Tensor) -> None:
            if beside:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    local_dst.copy_(local_src)
            for _ in range(steps):
                nccl.groupStart()
                comm.send(sbuf.data_ptr(), STEP, nccl.NCCL_UINT8, peer, s)
                comm.recv(rbuf.data_ptr(), STEP, nccl.NCCL_UINT8, peer, s)
                nccl.groupEnd()

        run(sbuf, rbuf)
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run(sbuf, rbuf)
            stream.synchronize()
            times.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        ok = bool(torch.equal(rbuf, data(peer)))  # every byte the peer sent
        sec = min(times)
        if rank == 0:
            q.put(f"{kind:11s}: {steps} steps of 1 GiB each way in {sec * 1e3:7.1f} ms (best of 5), "
                  f"{steps * STEP / sec / 1e9:6.1f} GB/s per GPU in"
                  + (f", {beside / GiB:.1f} GiB of local copies beside" if beside else "")
                  + (", received bytes equal" if ok else ", RECEIVED BYTES DIFFER"))
        for h in handles:
            lib.ncclCommDeregister(raw, h)
        if kind != "torch":
            for b in (sbuf, rbuf):
                lib.ncclMemFree(ctypes.c_void_p(b.data_ptr()))
        del sbuf, rbuf
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=13.5, help="bytes each way per run")
    ap.add_argument("--beside-gib", type=float, default=0, help="same-GPU copies issued beside the steps")
    a = ap.parse_args()
    from cupy.cuda import nccl

    print(f"NCCL {nccl.get_version()}", flush=True)
    run_pair(worker, int(a.gib * GiB), int(a.beside_gib * GiB))


if __name__ == "__main__":
    main()
