"""Many small copies as one kernel over a descriptor table (CUDA, through cupy).

Frameworks allocate one tensor per parameter (vLLM) or lay parameters out in their own order
(Megatron's DDP buffers), so the blocks of a refit rarely merge: a 30B MoE refit on 4 GPUs is
~12k copies of ~0.8 MB per GPU.  Issued one ``cudaMemcpy2DAsync`` each, the host cannot keep up
(3.5x the time of the same bytes in merged copies: bench/RESULTS.md, case
"qwen3-30b-moe megatron:tp4ep4 → vllm:tp4, 4× H200, CUDA IPC", its history: pulls in rounds and
framework-style allocations).  Here the
copies of a `refit.executor.copies.CopyBatch` (`refit.executor.memcpys.Memcpy` descriptors) become
rows of a table on the device, built once per plan, and one launch copies them all: each thread
block takes table rows (pieces of at most `PIECE_BYTES`, so blocks stay balanced) and moves
16-byte words where every address, width and pitch allows it, bytes otherwise.  Reads of a peer GPU's memory go over NVLink like any load.
"""

from __future__ import annotations

from typing import Any, Sequence

from refit import settings
from refit.executor.memcpys import Memcpy

PIECE_BYTES = 256 << 10
THREADS = 512


class _StreamHandle:
    """A raw ``cudaStream_t`` (a torch stream's ``cuda_stream``) speaking the CUDA stream
    protocol, which cupy >= 14 takes in ``Stream.from_external``."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.handle


def cupy_stream(handle: int) -> Any:
    """cupy's view of the CUDA stream ``handle``, to launch on with ``with``.  cupy 14 deprecates
    ``ExternalStream`` for ``Stream.from_external``; older cupy has only the former."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    return from_external(_StreamHandle(handle)) if from_external else cupy.cuda.ExternalStream(handle)


_TEMPLATE = r"""#define UNROLL %(unroll)d
typedef %(index)s IDX;

extern "C" __global__ void copy_table(const unsigned long long* __restrict__ t, long long n) {
    // t: n rows of (dst, dpitch, src, spitch, width, height), addresses and bytes.
    for (long long r = blockIdx.x; r < n; r += gridDim.x) {
        const unsigned long long* d = t + 6 * r;
        char* dst = (char*)d[0];
        const char* src = (const char*)d[2];
        unsigned long long dp = d[1], sp = d[3], w = d[4], h = d[5];
        if (h == 1 && (((unsigned long long)dst | (unsigned long long)src | w) & 15) == 0) {
            // One run of 16-byte words (most rows: pieces of contiguous blocks): no per-word
            // row / column division, which costs more than the copy within one GPU's HBM.
            IDX words = (IDX)(w >> 4);
            const uint4* s4 = (const uint4*)src;
            uint4* d4 = (uint4*)dst;
            for (IDX base = threadIdx.x; base < words; base += UNROLL * blockDim.x) {
                uint4 v[UNROLL];
                #pragma unroll
                for (int k = 0; k < UNROLL; k++) {
                    IDX i = base + k * blockDim.x;
                    if (i < words) v[k] = s4[i];
                }
                #pragma unroll
                for (int k = 0; k < UNROLL; k++) {
                    IDX i = base + k * blockDim.x;
                    if (i < words) d4[i] = v[k];
                }
            }
        } else if ((((unsigned long long)dst | (unsigned long long)src | dp | sp | w) & 15) == 0) {
            // UNROLL loads in flight per thread before the stores: reads of a peer over NVLink
            // take microseconds each, so bandwidth needs many outstanding loads.
            IDX words = (IDX)(w >> 4), total = words * (IDX)h;
            for (IDX base = threadIdx.x; base < total; base += UNROLL * blockDim.x) {
                uint4 v[UNROLL];
                #pragma unroll
                for (int k = 0; k < UNROLL; k++) {
                    IDX i = base + k * blockDim.x;
                    if (i < total) {
                        IDX row = i / words, col = i - row * words;
                        v[k] = ((const uint4*)(src + row * sp))[col];
                    }
                }
                #pragma unroll
                for (int k = 0; k < UNROLL; k++) {
                    IDX i = base + k * blockDim.x;
                    if (i < total) {
                        IDX row = i / words, col = i - row * words;
                        ((uint4*)(dst + row * dp))[col] = v[k];
                    }
                }
            }
        } else {
            unsigned long long total = w * h;
            for (unsigned long long i = threadIdx.x; i < total; i += blockDim.x) {
                unsigned long long row = i / w, col = i - row * w;
                dst[row * dp + col] = src[row * sp + col];
            }
        }
    }
}
"""


def kernel_source(unroll: int = 4, index: str = "unsigned long long") -> str:
    """The kernel's CUDA source: ``unroll`` loads in flight per thread, ``index`` the type of word
    indices.  The defaults are the package's; `bench/probes/probe_table_kernel.py` measures variants
    (32-bit indices made same-GPU copies 7% faster alone but a 2-GPU refit slower: they took HBM
    from the peer copies beside them)."""
    return _TEMPLATE % {"unroll": unroll, "index": index}


_KERNELS: dict[int, Any] = {}


def table_rows(memcpys: Sequence[Memcpy], piece: int = PIECE_BYTES) -> list[tuple[int, int, int, int, int, int]]:
    """The copies cut into pieces of at most ``piece`` bytes (whole rows, or parts of one long
    row), as (dst, dpitch, src, spitch, width, height).  Pure arithmetic: tested on CPU."""
    out = []
    for m in memcpys:
        if m.height == 1 or m.width >= piece:
            for row in range(m.height):
                d, s = m.dst + row * m.dpitch, m.src + row * m.spitch
                for off in range(0, m.width, piece):
                    w = min(piece, m.width - off)
                    out.append((d + off, w, s + off, w, w, 1))
        else:
            rows = max(1, piece // m.width)
            for r0 in range(0, m.height, rows):
                h = min(rows, m.height - r0)
                out.append((m.dst + r0 * m.dpitch, m.dpitch, m.src + r0 * m.spitch, m.spitch, m.width, h))
    return out


def enabled(memcpys: Sequence[Memcpy], beside_kernel: bool = False, beside_pipeline: bool = False,
            alone: bool = False) -> bool:
    """Whether ``memcpys`` run as one table kernel (``REFIT_TABLE_COPY``): ``auto`` when more than
    `MIN_CALLS` memcpys average under `MAX_MEAN_BYTES` (big merged copies stay on the copy engines,
    which cost the host and the SMs nothing); ``on``; ``off`` (one memcpy call each).

    A stage's same-GPU moves with nothing beside them (``alone``: a refit within one GPU) always
    do: there the kernel runs at 0.93 of a device copy, the copy engines at 0.45-0.61 of it, big
    copies or small (bench/RESULTS.md, "Same-GPU refits at copy speed").  Beside peer copies or an
    NCCL pipeline the copy engines keep the big ones, which leaves the SMs and HBM to the work
    beside (there the same rule cost an NCCL refit 8%).  Beside the rest of a refit:

    * ``beside_kernel`` (beside a peer table kernel, which fills every SM): any memcpys; one call
      each, they crawl behind the kernel;
    * ``beside_pipeline`` (beside an NCCL pipeline): more than `MIN_CALLS`, whose host calls would
      hold back the pipeline's next step; a packed arena's few big copies stay on the copy engines,
      where they cost the host nothing and take no SMs from NCCL.

    Measured: bench/RESULTS.md, case "qwen3-235b-moe --layers 20 …, megatron:tp2ep2 → vllm:tp2, 2× H200"
    (its history from 8c9a4ff: 1.52x -> 1.07x)."""
    mode = settings.current().table_copy
    if mode != "auto":
        return mode == "on"
    if beside_kernel or alone:
        return bool(memcpys)
    many = len(memcpys) > MIN_CALLS
    return many and (beside_pipeline or sum(m.width * m.height for m in memcpys) < MAX_MEAN_BYTES * len(memcpys))


MAX_MEAN_BYTES = 8 << 20
MIN_CALLS = 64


def grid(peer: bool, beside: bool = False) -> int:
    """Thread blocks of one table launch (``REFIT_TABLE_BLOCKS`` = ``PEER,LOCAL,BESIDE``): a peer
    pull and the same-GPU copies run beside each other, and a smaller grid for one leaves SMs to
    the other.  ``beside``: same-GPU moves that run for a whole NCCL pipeline
    (`refit.executor.device.CudaDevice.beside`); on LOCAL's grid they and a pack filled every SM
    and NCCL's kernel waited for them, so they get a quarter of the SMs and spread over the wire's
    time.  Measured: bench/RESULTS.md, cases "qwen3-30b-moe megatron:tp2ep2 → vllm:tp2, 2× H200, NCCL"
    (its history: the NCCL pipeline, and from 45ab304) and
    "qwen3-30b-moe megatron:tp2ep2 → vllm:tp2, 2× H200, CUDA IPC" (its history: push instead of pull,
    table-kernel grids)."""
    peer_blocks, local_blocks, beside_blocks = settings.current().table_blocks
    if beside:
        return beside_blocks
    return peer_blocks if peer else local_blocks


class TableCopy:
    """The table of one batch on device ``index``; `launch` copies all of it on a stream."""

    def __init__(self, memcpys: Sequence[Memcpy], index: int, alias_sources: bool = False,
                 peer: bool = False, alias_dests: bool = False, beside: bool = False) -> None:
        """``alias_sources`` / ``alias_dests``: read sources (write destinations) through this
        device's own mappings of peer IPC memory (`refit.executor.ipc_alias`); raises LookupError
        when one has none (the caller then runs the table on the peer instead).  ``peer``: a
        copy between this device and a peer, ``beside``: moves beside an NCCL pipeline (their
        grids: `grid`)."""
        import cupy

        self.index = index
        rows = table_rows(memcpys)
        if alias_sources or alias_dests:
            from refit.executor import ipc_alias

            def mapped(addr: int) -> int:
                a = ipc_alias.alias(addr, index)
                if a is None:
                    raise LookupError(f"address 0x{addr:x} has no mapping on cuda:{index}")
                return a

            rows = [(mapped(d) if alias_dests else d, dp, mapped(s) if alias_sources else s, sp, w, h)
                    for d, dp, s, sp, w, h in rows]
        self.n = len(rows)
        with cupy.cuda.Device(index):
            self.table = cupy.asarray([v for row in rows for v in row], dtype=cupy.uint64)
            # The upload ran on cupy's stream; `launch` runs on another (non-blocking) one, which
            # would not wait for it.  Built once per plan, so a full sync here costs nothing later.
            cupy.cuda.runtime.deviceSynchronize()
            if index not in _KERNELS:
                _KERNELS[index] = cupy.RawKernel(kernel_source(), "copy_table")
        self.blocks = max(1, min(self.n, grid(peer, beside)))

    def launch(self, stream: int) -> None:
        import cupy

        with cupy.cuda.Device(self.index), cupy_stream(stream):
            _KERNELS[self.index]((self.blocks,), (THREADS,), (self.table, cupy.int64(self.n)))
