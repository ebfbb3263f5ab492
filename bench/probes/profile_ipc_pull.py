"""Peer copies out of memory *another process* exported through CUDA IPC (the ipc transport's
situation), timed with CUDA events.  Process A allocates on GPU 1 and exports; process B, driving
GPU 0, imports and pulls 4 GiB contiguous and 2 GiB of pitched rows (768 B of every 1536 B):

  torch copy_ (cudaMemcpyAsync / kernel on the source device's stream), cupy memcpyAsync /
  memcpy2DAsync on the destination's or the source's stream — with the handle opened by torch
  (under the source device) and by cupy under the destination device.

Run: python bench/probes/profile_ipc_pull.py   (needs 2 GPUs and cupy)
"""

from __future__ import annotations

import pickle

import torch
import torch.multiprocessing as mp
from profile_copies import timed  # bench/probes/ is on sys.path when run as a script

GiB = 2**30
N = 2 * GiB  # int16 elements: 4 GiB


def exporter(q_out, q_in) -> None:
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.set_device(1)
    t = torch.randint(-2**15, 2**15, (N,), dtype=torch.int16, device="cuda:1")
    torch.cuda.synchronize()
    rebuild, args = reduce_tensor(t)
    raw = t.untyped_storage()._share_cuda_()
    q_out.put(pickle.dumps((rebuild, args, raw)))
    q_in.get()  # keep alive until the importer is done



def main() -> None:
    from cupy.cuda import runtime

    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=exporter, args=(q_out, q_in), daemon=True)
    p.start()
    try:
        measure(q_out)
    finally:
        q_in.put(1)
        p.join(10)


def measure(q_out) -> None:
    from cupy.cuda import runtime

    rebuild, args, raw = pickle.loads(q_out.get())
    torch.cuda.set_device(0)
    for peer_first in (True,):
        if peer_first:
            for a, b in ((0, 1), (1, 0)):
                with torch.cuda.device(a):
                    try:
                        runtime.deviceEnablePeerAccess(b)
                    except runtime.CUDARuntimeError as e:
                        print("peer access", a, b, e)
    src = rebuild(*args)  # torch opens it under device 1
    print("imported by torch:", src.device, hex(src.data_ptr()), "can access peer 0->1:", runtime.deviceCanAccessPeer(0, 1))
    dst = torch.empty(N, dtype=torch.int16, device="cuda:0")
    s0, s1 = torch.cuda.Stream(0), torch.cuda.Stream(1)
    D, D2D = runtime.memcpyDefault, runtime.memcpyDeviceToDevice
    nb, rows = N * 2, N // 768
    half = rows * 768  # bytes of the pitched case: rows of 768 B

    def rep(name, nbytes, sec):
        print(f"{name:64s} {sec * 1e3:8.2f} ms {nbytes / sec / 1e9:8.1f} GB/s", flush=True)

    def variants(tag: str, sptr: int) -> None:
        rep(f"{tag}: memcpyAsync Default, dst stream", nb, timed(lambda: runtime.memcpyAsync(dst.data_ptr(), sptr, nb, D, s0.cuda_stream), [s0]))
        rep(f"{tag}: memcpyAsync D2D, dst stream", nb, timed(lambda: runtime.memcpyAsync(dst.data_ptr(), sptr, nb, D2D, s0.cuda_stream), [s0]))
        rep(f"{tag}: memcpyAsync Default, src stream", nb, timed(lambda: runtime.memcpyAsync(dst.data_ptr(), sptr, nb, D, s1.cuda_stream), [s1]))
        rep(f"{tag}: memcpyPeerAsync, dst stream", nb, timed(lambda: runtime.memcpyPeerAsync(dst.data_ptr(), 0, sptr, 1, nb, s0.cuda_stream), [s0]))
        rep(f"{tag}: memcpy2DAsync pitched Default, dst stream", half, timed(lambda: runtime.memcpy2DAsync(dst.data_ptr(), 768, sptr, 1536, 768, rows, D, s0.cuda_stream), [s0]))
        rep(f"{tag}: memcpy2DAsync pitched Default, src stream", half, timed(lambda: runtime.memcpy2DAsync(dst.data_ptr(), 768, sptr, 1536, 768, rows, D, s1.cuda_stream), [s1]))
        rep(f"{tag}: memcpy2DAsync pitched D2D, dst stream", half, timed(lambda: runtime.memcpy2DAsync(dst.data_ptr(), 768, sptr, 1536, 768, rows, D2D, s0.cuda_stream), [s0]))
        rep(f"{tag}: memcpy2DAsync 1 row (contiguous), dst stream", nb, timed(lambda: runtime.memcpy2DAsync(dst.data_ptr(), nb, sptr, nb, nb, 1, D, s0.cuda_stream), [s0]))

    with torch.cuda.stream(s1):
        rep("torch copy_ contiguous (src stream)", nb, timed(lambda: dst.copy_(src), [s1]))
        d2, s2 = dst[:rows * 384].view(rows, 384), src[:rows * 768].view(rows, 768)
        rep("torch copy_ pitched (kernel on src)", half, timed(lambda: d2.copy_(s2[:, :384]), [s1]))
    variants("torch-opened", src.data_ptr())
    # the same handle opened by cupy while device 0 is current
    dev, handle, size, offset = raw[0], raw[1], raw[2], raw[3]
    with torch.cuda.device(0):
        base = runtime.ipcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess)
    variants("cupy-opened-on-0", base + offset)


if __name__ == "__main__":
    main()
