"""GPU check of `refit.executor.table_copy`: random views copied by the table kernel equal torch's
copy, on one GPU and from a peer.  PYTHONPATH=. python3 bench/probes/check_table_copy.py"""
from __future__ import annotations

import torch

from refit.executor.copies import _memcpy_pairs
from refit.executor.device import enable_peer_access
from refit.executor.table_copy import TableCopy, table_rows


def views(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) views: whole rows, a pitched block, a few elements, an unaligned run."""
    return [(dst[0:10, 0:3000], src[5:15, 0:3000]), (dst[20:40, 8:200], src[0:20, 16:208]),
            (dst[50:51, 1:7], src[60:61, 3:9]), (dst[41:49, :].view(-1)[3:5000], src[10:20, :].reshape(-1)[7:5004])]


def check(src_dev: int, dst_dev: int) -> bool:
    g = torch.Generator().manual_seed(0)
    src = torch.randint(-2**15, 2**15, (64, 3000), dtype=torch.int16, generator=g).to(f"cuda:{src_dev}")
    dst = torch.zeros(64, 3000, dtype=torch.int16, device=f"cuda:{dst_dev}")
    calls, rest = _memcpy_pairs(views(dst, src))
    assert not rest, rest
    if src_dev != dst_dev:
        enable_peer_access(dst_dev, src_dev)
        enable_peer_access(src_dev, dst_dev)
    torch.cuda.synchronize(dst_dev)
    stream = torch.cuda.Stream(f"cuda:{dst_dev}")
    TableCopy(calls, dst_dev).launch(stream.cuda_stream)
    torch.cuda.synchronize(dst_dev)
    want = torch.zeros_like(dst)
    for d, s in views(want, src):
        d.copy_(s)
    equal = bool((dst == want).all())
    print(f"cuda:{src_dev} -> cuda:{dst_dev}: {len(calls)} memcpys, {len(table_rows(calls))} pieces, equal={equal}",
          flush=True)
    return equal


if __name__ == "__main__":
    ok = check(0, 0)
    if torch.cuda.device_count() > 1:
        ok = check(1, 0) and ok
    raise SystemExit(0 if ok else 1)
