"""GPU check of `refit.executor.table_copy`: random views copied by the table kernel equal torch's
copy, on one GPU and from a peer.  python3 bench/check_table_copy.py"""
import torch

from refit.executor.copies import _memcpy_pairs
from refit.executor.device import enable_peer_access
from refit.executor.table_copy import TableCopy, table_rows

def check(src_dev: int, dst_dev: int) -> None:
    g = torch.Generator().manual_seed(0)
    src = torch.randint(-2**15, 2**15, (64, 3000), dtype=torch.int16, generator=g).to(f"cuda:{src_dev}")
    dst = torch.zeros(64, 3000, dtype=torch.int16, device=f"cuda:{dst_dev}")
    pairs = [(dst[0:10, 0:3000], src[5:15, 0:3000]), (dst[20:40, 8:200], src[0:20, 16:208]),
             (dst[50:51, 1:7], src[60:61, 3:9]), (dst[41:49, :].view(-1)[3:5000], src[10:20, :].reshape(-1)[7:5004])]
    calls, rest = _memcpy_pairs(pairs)
    assert not rest, rest
    if src_dev != dst_dev:
        enable_peer_access(dst_dev, src_dev); enable_peer_access(src_dev, dst_dev)
    torch.cuda.synchronize(dst_dev)
    t = TableCopy(calls, dst_dev)
    s = torch.cuda.Stream(f"cuda:{dst_dev}")
    t.launch(s.cuda_stream)
    torch.cuda.synchronize(dst_dev)
    ref = torch.zeros_like(dst)
    for d, sv in pairs:
        ref[tuple(slice(None) for _ in ())] if False else None
    want = torch.zeros(64, 3000, dtype=torch.int16, device=f"cuda:{dst_dev}")
    wp = [(want[0:10, 0:3000], src[5:15, 0:3000]), (want[20:40, 8:200], src[0:20, 16:208]),
          (want[50:51, 1:7], src[60:61, 3:9]), (want[41:49, :].view(-1)[3:5000], src[10:20, :].reshape(-1)[7:5004])]
    for d, sv in wp:
        d.copy_(sv)
    print(f"cuda:{src_dev} -> cuda:{dst_dev}: {len(calls)} memcpys, {len(table_rows(calls))} pieces, equal={bool((dst == want).all())}", flush=True)

if __name__ == "__main__":
    check(0, 0)
    if torch.cuda.device_count() > 1:
        check(1, 0)
