"""Trainer shards that cut FP8 blocks, quantized on CUDA (`refit.executor.shared_blocks`):
`make test-gpu`.

The shared-scale quantizer's CUDA path (``scatter_reduce_`` of the partial amaxes, the division
by a tensor, ``_foreach_copy_`` into float8) must give the bits of the whole tensor's
quantization on the CPU (which tests/unit/test_quantize.py checks against vLLM): every value and
scale each engine rank lands, on random data with outliers, for FSDP2 and Megatron trainers that
cut blocks, in one chunk and in chunks of one slice.  Without a CUDA device every test skips.
"""

from __future__ import annotations

import pytest
import torch

from refit.executor.shared_blocks import SharedQuantizer, allocate_derived
from refit.layouts.quantized import shared_scale_table
from refit.planners import make_plan
from tests.unit.test_shared_blocks import expected, fp8_spec, land, mismatches, trainer_tensors, weights

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not CUDA, reason="no CUDA device (make test-gpu runs these on a GPU machine)")]


@pytest.mark.parametrize("chunk", [1 << 26, 1 << 14], ids=["one-chunk", "slice-chunks"])
@pytest.mark.parametrize("case", [
    ({}, "fsdp:dp4", "vllm:tp2"),  # 64 of k's 256 rows a rank
    ({"moe_intermediate_size": 384}, "fsdp:dp5", "vllm:tp1"),  # torch.chunk rows, experts 77 rows a rank
    ({"num_attention_heads": 4, "head_dim": 64}, "megatron:tp1", "vllm:tp1"),  # 64-row heads interleaved
], ids=["fsdp-dp4", "fsdp-dp5", "megatron-64-row-heads"])
def test_cut_blocks_quantize_on_cuda_as_the_whole_tensor_on_cpu(case, chunk) -> None:
    changes, src_text, dst_text = case
    q = fp8_spec(**changes)
    r = make_plan(q, src_text, dst_text, "disaggregated", "p2p", 1 << 16)
    src, dst = r.src, r.dst
    canon = weights(q, 5)
    cuda = torch.device("cuda")
    sent = []
    for s in range(src.world_size):
        rank = {name: t.to(cuda) for name, t in trainer_tensors(q, src, s, canon).items()}
        rank.update(allocate_derived(q, src, s, cuda))
        sent.append(rank)
    table = shared_scale_table(q, src)
    quantizers = [SharedQuantizer(q, src, {s: sent[s]}, table, chunk_elems=chunk) for s in range(src.world_size)]
    amax = torch.zeros(quantizers[0].size, device=cuda)
    for sq in quantizers:  # the members' all-reduce (MAX)
        amax = torch.maximum(amax, sq.partial_amax(cuda))
    for sq in quantizers:
        sq.quantize(amax)
    torch.cuda.synchronize()
    on_cpu = [{name: t.cpu() for name, t in rank.items()} for rank in sent]
    assert not mismatches(q, dst, land(q, r.plan, src, dst, on_cpu), expected(q, canon))
