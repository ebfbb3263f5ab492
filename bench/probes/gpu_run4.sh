#!/usr/bin/env bash
# The H200 measurements of bench/RESULTS.md made on 2026-11-22 from pulls in rounds on (each case's history
# names them), in one go; 2- and 1-GPU cases
# restrict CUDA_VISIBLE_DEVICES (on a 2-GPU machine run only those).  Writes each run's JSON and log
# under ${OUT:-bench/out}.  Cases: four, two, one (pulls in rounds, merged main); bulk, trace, moon, nccl (then:
# batched copy-engine pulls against the table kernel alone and the arena, moonlight-16b, the NCCL
# transport with direct wires).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$(cd "$(dirname "$0")/../.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
run() {  # name, time limit, then refit-bench arguments
  local name=$1 limit=$2; shift 2
  echo "=== $name: refit-bench $*"
  timeout "$limit" python3 -m refit.bench "$@" --json >"$OUT/$name.json" 2>"$OUT/$name.log"
  echo "rc=$?"; grep -i "error" "$OUT/$name.log" | head -3
  python3 -c "import json,sys; from refit.bench.direct import table; print(table(json.load(open(sys.argv[1]))))" "$OUT/$name.json" 2>&1 | grep -v "^$" | tail -9
}
Q30="--model qwen3-30b-moe"
for what in "$@"; do case "$what" in
  four) run q30-tp4ep4-tp4 300 $Q30 --src megatron:tp4ep4 --dst vllm:tp4 --vs broadcast --iters 10
        run q30-tp4ep4-tp4-arena 200 $Q30 --src megatron:tp4ep4 --dst vllm:tp4 --iters 10 --alloc arena ;;
  two)  CUDA_VISIBLE_DEVICES=0,1 run q30-tp2ep2-tp2 200 $Q30 --src megatron:tp2ep2 --dst vllm:tp2 --iters 10
        CUDA_VISIBLE_DEVICES=0,1 run q30-tp2ep2-tp2-nccl 200 $Q30 --src megatron:tp2ep2 --dst vllm:tp2 --iters 10 --transport nccl ;;
  one)  CUDA_VISIBLE_DEVICES=0 run q30-tp1-tp1-1gpu 200 $Q30 --src tp1 --dst tp1 --iters 5 ;;
  bulk) Q2="$Q30 --src megatron:tp2ep2 --dst vllm:tp2 --iters 10"; export CUDA_VISIBLE_DEVICES=0,1
        run q30-2-framework-bulk 200 $Q2
        REFIT_BATCH_MEMCPY=all run q30-2-framework-all 200 $Q2
        REFIT_BATCH_MEMCPY=off run q30-2-framework-table 200 $Q2
        run q30-2-arena 200 $Q2 --alloc arena; unset CUDA_VISIBLE_DEVICES ;;
  trace) CUDA_VISIBLE_DEVICES=0,1 REFIT_TRACE=1 run q30-2-framework-bulk-trace 200 $Q30 --src megatron:tp2ep2 --dst vllm:tp2 --iters 2 ;;
  moon) CUDA_VISIBLE_DEVICES=0,1 run moonlight-2 300 --model moonlight-16b --src megatron:tp2ep2 --dst vllm:tp2 --vs broadcast --iters 10 ;;
  nccl) CUDA_VISIBLE_DEVICES=0,1 run q30-2-nccl 200 $Q30 --src megatron:tp2ep2 --dst vllm:tp2 --iters 10 --transport nccl ;;
  *) echo "usage: $0 four|two|one|bulk|trace|moon|nccl ..."; exit 2 ;;
esac; done
