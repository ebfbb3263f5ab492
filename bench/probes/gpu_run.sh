#!/usr/bin/env bash
# The GPU measurements of bench/RESULTS.md, in one go (on a 2-GPU machine; 1-GPU cases restrict
# CUDA_VISIBLE_DEVICES).  Writes each run's JSON and log under ${OUT:-bench/out}.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$(cd "$(dirname "$0")/../.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -4
python3 -c "import torch, cupy; from cupy.cuda import nccl; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'nccl', nccl.get_version())"
run() {  # name, then refit-bench arguments
  local name=$1 limit=$2; shift 2
  echo "=== $name: refit-bench $*"
  timeout "$limit" python3 -m refit.bench "$@" --json >"$OUT/$name.json" 2>"$OUT/$name.log"
  echo "rc=$?"; tail -c 2500 "$OUT/$name.log" | grep -v "step/s" | tail -5
  python3 -c "import json,sys; from refit.bench.direct import table; print(table(json.load(open(sys.argv[1]))))" "$OUT/$name.json" 2>&1 | tail -14
}
for what in "$@"; do case "$what" in
  smoke) run smoke-8b-tp1-tp2 240 --model qwen3-8b --src tp1 --dst tp2 --vs broadcast --iters 3 ;;
  moe2) run q30-tp2ep2-tp2 420 --model qwen3-30b-moe --src megatron:tp2ep2 --dst vllm:tp2 --vs broadcast --iters 10 ;;
  disagg) run q8-tp1-tp1-disagg 240 --model qwen3-8b --src tp1 --dst tp1 --placement disaggregated --vs broadcast --iters 10 ;;
  ipc1) CUDA_VISIBLE_DEVICES=0 run q30-tp1-tp1-1gpu-ipc 300 --model qwen3-30b-moe --src tp1 --dst tp1 --iters 10 ;;
  ipc) run q30-tp2ep2-tp2-ipc 300 --model qwen3-30b-moe --src megatron:tp2ep2 --dst vllm:tp2 --vs broadcast --iters 10 --transport ipc
       run q30-tp2ep2-tp2-nccl 300 --model qwen3-30b-moe --src megatron:tp2ep2 --dst vllm:tp2 --iters 10 --transport nccl ;;
  ipc8) run q8-tp1-tp1-disagg-ipc 240 --model qwen3-8b --src tp1 --dst tp1 --placement disaggregated --iters 10 --transport ipc
        run q8-tp1-tp2-ipc 240 --model qwen3-8b --src tp1 --dst tp2 --vs broadcast --iters 10 --transport ipc ;;
  copies) timeout 240 python3 bench/probes/profile_copies.py 4 2>&1 | tee "$OUT/profile_copies.txt" ;;
  dma) run q30-tp2ep2-tp2-ipc-dma 300 --model qwen3-30b-moe --src megatron:tp2ep2 --dst vllm:tp2 --vs broadcast --iters 10 --transport ipc
       REFIT_COPY=torch run q30-tp2ep2-tp2-ipc-torchcopy 300 --model qwen3-30b-moe --src megatron:tp2ep2 --dst vllm:tp2 --iters 10 --transport ipc
       run q30-tp2ep2-tp2-nccl-dma 300 --model qwen3-30b-moe --src megatron:tp2ep2 --dst vllm:tp2 --iters 10 --transport nccl
       CUDA_VISIBLE_DEVICES=0 run q30-tp1-tp1-1gpu-dma 300 --model qwen3-30b-moe --src tp1 --dst tp1 --iters 10 ;;
  pulls) run q30-tp2ep2-tp2-ipc-pull-dst 240 --model qwen3-30b-moe --src megatron:tp2ep2 --dst vllm:tp2 --iters 10 --transport ipc
         REFIT_PULL_ON=src run q30-tp2ep2-tp2-ipc-pull-src 240 --model qwen3-30b-moe --src megatron:tp2ep2 --dst vllm:tp2 --iters 10 --transport ipc ;;
  trace) REFIT_TRACE=1 run q30-tp2ep2-tp2-ipc-trace 200 --model qwen3-30b-moe --src megatron:tp2ep2 --dst vllm:tp2 --iters 2 --transport ipc
         grep trace "$OUT/q30-tp2ep2-tp2-ipc-trace.log" | tail -4 | cut -c1-200 ;;
  sweep) for mb in 128 512 1024; do
           run q30-tp2ep2-tp2-b$mb 200 --model qwen3-30b-moe --src megatron:tp2ep2 --dst vllm:tp2 --iters 5 --bucket-mb $mb
         done ;;
  *) echo "usage: $0 smoke|moe2|ipc|ipc8|disagg|ipc1|sweep|copies|dma|pulls|trace"; exit 2 ;;
esac; done
