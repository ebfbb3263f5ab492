"""Whether torch._foreach_copy_ of bfloat16 on CUDA keeps every bit (it does not: NaN payloads are
rewritten, which the atomic switch ran into); copy_ per tensor for comparison.  Run on a GPU."""
import torch
from refit.hf_checkpoint import load_spec
from refit.layouts import resolve_layout
from refit.sides import Side
from refit.executor.shards import allocate_each
spec = load_spec("qwen3-8b")
lay = resolve_layout("vllm:tp1", spec, Side.ENGINE)
sh = allocate_each(list(lay.local_tensors(spec, 0)), torch.device("cuda", 0))
live = sh.tensors
staged = {n: t.clone() for n, t in live.items()}
for t in staged.values():
    t.view(torch.int16).random_()
names = list(live)
torch._foreach_copy_([live[n] for n in names], [staged[n] for n in names])
torch.cuda.synchronize()
bad = [(n, int((live[n].view(torch.int16) != staged[n].view(torch.int16)).sum())) for n in names]
bad = [b for b in bad if b[1]]
print("foreach_copy_ wrong tensors:", len(bad), bad[:5])
for n in names:
    live[n].copy_(staged[n])
torch.cuda.synchronize()
print("copy_ wrong:", sum(int((live[n].view(torch.int16) != staged[n].view(torch.int16)).sum()) for n in names))
