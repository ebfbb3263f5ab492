#!/usr/bin/env bash
# Fourth-session GPU measurements of bench/RESULTS.md (2x H200), in one go.  Writes each run's JSON and
# log under ${OUT:-bench/out}.  Cases: bulk (framework-style allocations with batched copy-engine pulls
# against the table kernel alone and the arena), moon (moonlight-16b), nccl (the NCCL transport).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
run() {  # name, time limit, then refit-bench arguments
  local name=$1 limit=$2; shift 2
  echo "=== $name: refit-bench $*"
  timeout "$limit" python3 -m refit.bench "$@" --json >"$OUT/$name.json" 2>"$OUT/$name.log"
  echo "rc=$?"; grep -i "error\|trace" "$OUT/$name.log" | head -6
  python3 -c "import json,sys; from refit.bench.direct import table; print(table(json.load(open(sys.argv[1]))))" "$OUT/$name.json" 2>&1 | grep -v "^$" | tail -9
}
Q30="--model qwen3-30b-moe --src megatron:tp2ep2 --dst vllm:tp2"
for what in "$@"; do case "$what" in
  bulk) run q30-2-framework-bulk 200 $Q30 --iters 10
        REFIT_BATCH_MEMCPY=all run q30-2-framework-all 200 $Q30 --iters 10
        REFIT_BATCH_MEMCPY=off run q30-2-framework-table 200 $Q30 --iters 10
        run q30-2-arena 200 $Q30 --iters 10 --alloc arena ;;
  trace) REFIT_TRACE=1 run q30-2-framework-bulk-trace 200 $Q30 --iters 2 ;;
  moon) run moonlight-2 300 --model moonlight-16b --src megatron:tp2ep2 --dst vllm:tp2 --vs broadcast --iters 10 ;;
  nccl) run q30-2-nccl 200 $Q30 --iters 10 --transport nccl ;;
  *) echo "usage: $0 bulk|trace|moon|nccl ..."; exit 2 ;;
esac; done
