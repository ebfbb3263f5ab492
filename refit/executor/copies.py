"""Batched block copies: thousands of small boxes must not mean thousands of kernel launches.

A `CopyBatch` is built once per plan from (destination view, source view) pairs and replayed
every refit.  Two things cut launches:

1. **Merging.** Blocks of equal shape and strides whose addresses step evenly on both sides (the
   16 expert tensors of a layer in an arena, the layers of a stacked box in a bucket buffer) become
   one strided view with an extra leading dimension.  Passes repeat, so a [layer][expert] grid of
   blocks collapses to a single copy.
2. **Multi-tensor launches.** What remains goes through ``torch._foreach_copy_``: on CUDA the
   list of dense, same-stride pairs is one multi-tensor-apply launch; strided pairs go in a second
   list (torch loops over those).  CPU runs the very same code.

3. **Copy engines for big blocks** (CUDA, ``dma=True``).  A merged pair whose rows are
   contiguous becomes a few ``cudaMemcpy2DAsync`` calls (`memcpy_plan`): one per 2-D slab, issued
   on *this* process's stream.  Copy engines move big blocks at full HBM / NVLink speed without
   SMs, so they run beside the kernels of other work; and a pull from a peer GPU issued on our own
   device's stream stays in our own CUDA context.  That matters when several processes share a
   GPU (colocated trainer and engine): work that one process issues on *another* process's GPU is
   time-sliced against that process's kernels instead of running beside them.

A batch with a ``peer`` device reads from another GPU's memory (the ipc transport).  With
``dma`` every pair that `memcpy_plan` can express is a copy-engine pull on our stream; the rest
(element-strided views) fall back to torch's cross-device ``copy_``, which runs on the source
device (`refit.executor.device.CudaDevice.pull` gives it a pair of streams of its own).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from refit.executor import batch_memcpy, table_copy
from refit.executor.memcpys import Memcpy, memcpy_plan

Pair = tuple[torch.Tensor, torch.Tensor]  # (destination view, source view)


def _key(dst: torch.Tensor, src: torch.Tensor) -> tuple:
    return (dst.untyped_storage().data_ptr(), src.untyped_storage().data_ptr(), dst.dtype, src.dtype,
            tuple(dst.shape), dst.stride(), src.stride())


def _merge_pass(pairs: list[Pair]) -> tuple[list[Pair], bool]:
    """One pass: runs of evenly spaced pairs (same key) become one pair with a leading dim."""
    groups: dict[tuple, list[Pair]] = defaultdict(list)
    for d, s in pairs:
        groups[_key(d, s)].append((d, s))
    out: list[Pair] = []
    merged = False
    for items in groups.values():
        items.sort(key=lambda p: (p[0].storage_offset(), p[1].storage_offset()))
        i = 0
        while i < len(items):
            j = i + 1
            if j < len(items):
                dd = items[j][0].storage_offset() - items[i][0].storage_offset()
                ds = items[j][1].storage_offset() - items[i][1].storage_offset()
                while (j < len(items) and dd > 0 and ds >= 0  # as_strided takes no negative strides
                       and items[j][0].storage_offset() - items[j - 1][0].storage_offset() == dd
                       and items[j][1].storage_offset() - items[j - 1][1].storage_offset() == ds):
                    j += 1
            j = max(j, i + 1)
            if j - i == 1:
                out.append(items[i])
            else:
                (d0, s0), n = items[i], j - i
                out.append((d0.as_strided((n,) + tuple(d0.shape), (dd,) + d0.stride(), d0.storage_offset()),
                            s0.as_strided((n,) + tuple(s0.shape), (ds,) + s0.stride(), s0.storage_offset())))
                merged = True
            i = j
    return out, merged


def merge(pairs: list[Pair]) -> list[Pair]:
    """Merge evenly spaced blocks until nothing changes.  Destination blocks must be disjoint
    (each destination element is written once), which makes every merged view exact."""
    pairs = [(d, s) for d, s in pairs if d.numel()]
    for d, s in pairs:
        if d.shape != s.shape or d.dtype != s.dtype:
            raise ValueError(f"copy pair mismatch: {tuple(d.shape)}/{d.dtype} <- {tuple(s.shape)}/{s.dtype}")
    merged = True
    while merged and len(pairs) > 1:
        pairs, merged = _merge_pass(pairs)
    return pairs


def _memcpy_pairs(pairs: list[Pair]) -> tuple[list[Memcpy], list[Pair]]:
    """Split pairs into copy-engine memcpys and pairs left to torch."""
    calls: list[Memcpy] = []
    rest: list[Pair] = []
    for d, s in pairs:
        plan = memcpy_plan((d.data_ptr(), tuple(d.shape), d.stride()), (s.data_ptr(), tuple(s.shape), s.stride()),
                           d.element_size())
        if plan is None:
            rest.append((d, s))
        else:
            calls.extend(plan)
    return calls, rest


DMA_MIN_BYTES = 1 << 20  # below this per copy, one multi-tensor kernel beats a memcpy call each


BULK_MIN_BYTES = 256 << 10  # 1-D pulls from this size on go to the copy engines in one batch call


def _split_bulk(memcpys: list[Memcpy], src_device: int, dst_device: int) -> tuple[list[Memcpy], "batch_memcpy.CopyEngineBatch | None"]:
    """Of a peer pull too fragmented for one call per copy (`table_copy.enabled`), the copies the
    batch APIs take go to the copy engines in one call each (`batch_memcpy`): 1-D runs of at least
    `BULK_MIN_BYTES` (big rows of a pitched copy, one expert's block each, count as runs) and,
    with ``cudaMemcpy3DBatchAsync``, pitched blocks.  The rest stays for the table kernel, which
    runs beside them."""
    if not table_copy.enabled(memcpys) or not batch_memcpy.available():
        return memcpys, None
    pitched_ok = batch_memcpy.available(pitched=True)
    rest: list[Memcpy] = []
    flat: list[tuple[int, int, int]] = []  # (dst, src, bytes)
    pitched: list[Memcpy] = []
    for m in memcpys:
        if m.height == 1 or m.dpitch == m.spitch == m.width:  # one run of bytes
            if m.width * m.height >= BULK_MIN_BYTES:
                flat.append((m.dst, m.src, m.width * m.height))
                continue
        elif m.width >= BULK_MIN_BYTES:  # big rows (an expert's block per row): a copy per row
            flat.extend((m.dst + r * m.dpitch, m.src + r * m.spitch, m.width) for r in range(m.height))
            continue
        elif pitched_ok and m.width * m.height >= BULK_MIN_BYTES:
            pitched.append(m)
            continue
        rest.append(m)
    if not flat and not pitched:
        return memcpys, None
    return rest, batch_memcpy.CopyEngineBatch(flat, [tuple(m) for m in pitched], src_device, dst_device)


def engine_split(pairs: list[Pair], peer: bool) -> tuple[list[Memcpy], list[Pair]]:
    """Of a CUDA batch, the memcpys (copy engines, or one table kernel when there are many: see
    `CopyBatch.table`) and the pairs left to torch.  Every pull goes to memcpys; same-GPU copies
    when big (`DMA_MIN_BYTES`), or all of them when they are only small ones and many (a pack of
    an expert's blocks of 384-byte rows at TP4, one torch launch per strided copy, was most of a
    4-GPU NCCL refit: bench/RESULTS.md, case
    "qwen3-30b-moe megatron:tp4ep4 → vllm:tp4, 4× H200, NCCL", its history: small packs in the
    table kernel)."""
    def big(p: Pair) -> bool:
        return peer or p[0].numel() * p[0].element_size() >= DMA_MIN_BYTES
    memcpys, rest = _memcpy_pairs([p for p in pairs if big(p)])
    small = [p for p in pairs if not big(p)]
    if small and not memcpys:
        calls, left = _memcpy_pairs(small)
        if table_copy.enabled(calls):
            return calls, rest + left
    return memcpys, rest + small


def join_table(memcpys: list[Memcpy], rest: list[Pair]) -> tuple[list[Memcpy], list[Pair]]:
    """Once a batch's big copies run as one table kernel, the small pairs `engine_split` left to
    torch join it wherever `memcpy_plan` can express them: torch launches once per strided pair.
    A colocated agent's same-GPU moves (the trainer's tensors mapped one handle each: blocks of
    different tensors never merge) left at least 1777 such pairs beside the table, 36 ms of
    launches where the kernel took 7 ms (bench/RESULTS.md, case
    "qwen3-30b-moe megatron:tp4ep4 → vllm:tp4, 4× H200, --via grpc")."""
    calls, left = _memcpy_pairs(rest)
    return memcpys + calls, left


class CopyBatch:
    """A fixed set of copies between fixed views; `run` issues them on the current stream.

    ``dma`` (CUDA only): pairs of at least `DMA_MIN_BYTES` that `memcpy_plan` can express run as
    copy-engine memcpys on the current stream of this process's device — for a ``peer`` batch
    that means pulled by our own device, in our own context."""

    def __init__(self, pairs: list[Pair], do_merge: bool = True, peer: torch.device | None = None,
                 dma: bool = False, beside: bool = False, beside_kernel: bool = False, alone: bool = False) -> None:
        self.peer = peer
        self.alone = alone  # a stage's same-GPU moves with nothing beside them: `table_copy.enabled`
        self.beside = beside  # same-GPU moves beside an NCCL pipeline: a smaller table grid
        self.beside_kernel = beside_kernel  # same-GPU moves beside a peer table kernel: `table_copy.enabled`
        self.blocks = len(pairs)
        # A peer batch whose destinations are on the peer is a push: our device runs it.
        self.pushes = peer is not None and bool(pairs) and pairs[0][0].device == peer
        ours = pairs[0][1] if self.pushes else pairs[0][0] if pairs else None
        self.device_index = ours.device.index if ours is not None and ours.is_cuda else None
        self._table: "table_copy.TableCopy | None" = None
        self._use_table: bool | None = None
        pairs = merge(pairs) if do_merge else list(pairs)
        self.copies = len(pairs)
        self.nbytes = sum(d.numel() * d.element_size() for d, _ in pairs)
        self.memcpys: list[Memcpy] = []
        self.bulk: "batch_memcpy.CopyEngineBatch | None" = None
        if dma and pairs and pairs[0][0].is_cuda:
            self.memcpys, pairs = engine_split(pairs, peer is not None)
            if peer is not None and self.device_index is not None:
                ends = (self.device_index, peer.index) if self.pushes else (peer.index, self.device_index)
                self.memcpys, self.bulk = _split_bulk(self.memcpys, *ends)
            elif pairs and self.table:
                self.memcpys, pairs = join_table(self.memcpys, pairs)
        dense = [p for p in pairs if p[0].is_contiguous() and p[1].is_contiguous()]
        strided = [p for p in pairs if not (p[0].is_contiguous() and p[1].is_contiguous())]
        self._lists = [([d for d, _ in ps], [s for _, s in ps]) for ps in (dense, strided) if ps]
        self._pairs = pairs  # what torch copies (all of them without dma)

    @property
    def torch_pairs(self) -> int:
        return len(self._pairs)

    def table_pulls_here(self) -> bool:
        """Whether this peer batch's table kernel can run on our own device, reading (pushing:
        writing) the peer through our own mappings (`refit.executor.ipc_alias`); else it runs on
        the peer."""
        if self._table is not None:
            return self._table.index == self.device_index
        try:
            self._table = self._make_table(self.device_index)
        except LookupError:
            return False
        return True

    def _make_table(self, index: int) -> "table_copy.TableCopy":
        """The table kernel of this batch on device ``index``: a peer's memory, seen from there,
        through that device's own mappings (`ipc_alias`; LookupError when it has none)."""
        alias = self.peer is not None and self.peer.index != index
        return table_copy.TableCopy(self.memcpys, index, alias_sources=alias and not self.pushes,
                                    alias_dests=alias and self.pushes, peer=self.peer is not None,
                                    beside=self.beside)

    @property
    def table(self) -> bool:
        """Whether the memcpys run as one table kernel (`refit.executor.table_copy`).  A push
        always does: copy engines writing a peer's memory were 10x slower than SM stores
        (bench/RESULTS.md, case "qwen3-30b-moe megatron:tp2ep2 → vllm:tp2, 2× H200, CUDA IPC", its
        history: push instead of pull)."""
        if self._use_table is None:
            self._use_table = bool(self.memcpys) and (
                self.pushes or table_copy.enabled(self.memcpys, self.beside_kernel, self.beside, self.alone))
        return self._use_table

    def run_bulk(self, stream: int) -> None:
        """Issue the copy-engine batch (`_split_bulk`) on ``stream`` of our own device."""
        if self.bulk is not None:
            self.bulk.launch(stream)

    def run_memcpys(self, stream: int, device_index: int | None = None) -> None:
        """Issue the copy-engine part on the CUDA stream handle ``stream`` (of device
        ``device_index``, default the destination's; a table kernel runs on that device)."""
        if not self.memcpys:
            return
        if self.table:  # many small copies: one kernel over a table, not a call each
            index = self.device_index if device_index is None else device_index
            if self._table is None or self._table.index != index:
                self._table = self._make_table(index)
            self._table.launch(stream)
            return
        from cupy.cuda import runtime

        default = runtime.memcpyDefault  # unified addressing: the driver knows each pointer's device
        for m in self.memcpys:
            runtime.memcpy2DAsync(m.dst, m.dpitch, m.src, m.spitch, m.width, m.height, default, stream)

    def run(self) -> None:
        """Issue the torch part on the current stream (the peer's, for a cross-device batch)."""
        if self.peer is not None:  # cross-device: plain copy_ per pair (foreach has no such fast path)
            for d, s in self._pairs:
                d.copy_(s)
            return
        for dsts, srcs in self._lists:
            torch._foreach_copy_(dsts, srcs)

    def __repr__(self) -> str:
        how = (f"{self.bulk.n} batched memcpys + " if self.bulk else "") + f"{len(self.memcpys)} memcpys" + (f" as one table kernel of {self._table.n} pieces on cuda:{self._table.index}" if self._table else "")
        return (f"CopyBatch({self.blocks} blocks -> {self.copies} copies, {how}, "
                f"{self.nbytes} bytes)")
