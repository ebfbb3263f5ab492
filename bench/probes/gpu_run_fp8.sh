#!/usr/bin/env bash
# The FP8 measurements of bench/RESULTS.md ("Quantizing on the wire", one GPU): the quantizer's
# GPU tests and bandwidth, then refit-bench tp1 -> tp1 with and without --dst-dtype fp8, and fp8 with
# quantizing on landing turned off (REFIT_QUANTIZE_ON_LANDING=0: the trainer quantizes into wire shards).
# Usage: gpu_run_fp8.sh kernel|8b|30b|30b-tp2 ...  (30b-tp2: two GPUs; not run yet on 2026-11-29)   Writes JSON and logs under ${OUT:-bench/out}.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 REFIT_ALLOW_MISSING_DEPS=1
export PYTHONPATH="$(cd "$(dirname "$0")/../.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
run() {  # name, time limit, then refit-bench arguments
  local name=$1 limit=$2; shift 2
  echo "=== $name: refit-bench $*"
  timeout "$limit" python3 -m refit.bench "$@" --json >"$OUT/$name.json" 2>"$OUT/$name.log"
  echo "rc=$?"; tail -c 2500 "$OUT/$name.log" | grep -v "step/s" | tail -5
  python3 -c "import json,sys; from refit.bench.direct import table; print(table(json.load(open(sys.argv[1]))))" "$OUT/$name.json" 2>&1 | tail -14
}
for what in "$@"; do case "$what" in
  kernel) timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_quantize.py 2>&1 | tail -3
          timeout 300 python3 bench/quantize_fp8.py --json >"$OUT/quantize_fp8.json" 2>"$OUT/quantize_fp8.log"
          echo "rc=$?"; tail -5 "$OUT/quantize_fp8.log"; cat "$OUT/quantize_fp8.json" ;;
  suite) timeout 400 make test-gpu PY=python3 2>&1 | tail -4 ;;
  8b) run q8-tp1-tp1-bf16 240 --model qwen3-8b --src tp1 --dst tp1 --iters 10
      run q8-tp1-tp1-fp8 240 --model qwen3-8b --src tp1 --dst tp1 --iters 10 --dst-dtype fp8
      REFIT_QUANTIZE_ON_LANDING=0 run q8-tp1-tp1-fp8-wire 240 --model qwen3-8b --src tp1 --dst tp1 --iters 10 --dst-dtype fp8 ;;
  30b) run q30-tp1-tp1-bf16 300 --model qwen3-30b-moe --src tp1 --dst tp1 --iters 10
       run q30-tp1-tp1-fp8 300 --model qwen3-30b-moe --src tp1 --dst tp1 --iters 10 --dst-dtype fp8
       REFIT_QUANTIZE_ON_LANDING=0 run q30-tp1-tp1-fp8-wire 300 --model qwen3-30b-moe --src tp1 --dst tp1 --iters 10 --dst-dtype fp8 ;;
  30b-tp2)  # two GPUs: each trainer rank beside an engine rank; the other rank's bytes over CUDA IPC or NCCL
       for t in ipc nccl; do
         run q30-tp2ep2-tp2-bf16-$t 300 --model qwen3-30b-moe --src megatron:tp2ep2 --dst vllm:tp2 --transport $t --iters 10
         run q30-tp2ep2-tp2-fp8-$t 300 --model qwen3-30b-moe --src megatron:tp2ep2 --dst vllm:tp2 --transport $t --iters 10 --dst-dtype fp8
       done ;;
  *) echo "usage: $0 kernel|suite|8b|30b|30b-tp2"; exit 2 ;;
esac; done
