#!/usr/bin/env bash
# Fifth session, first 2x H200 call: NCCL message shapes, push vs pull in the refit, NCCL disaggregated.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
timeout 150 python3 bench/probe_nccl_ops.py 2>&1 | tail -8
PROBE_ONE_WAY=1 PROBE_CASES=256:256,1024:1024,1024:256 timeout 100 python3 bench/probe_nccl_ops.py 2>&1 | tail -4
run() { local name=$1; shift; echo "=== $name: $*"; timeout 300 python3 -m refit.bench "$@" --json >"$OUT/$name.json" 2>"$OUT/$name.log"; echo rc=$?
  python3 -c "import json,sys; from refit.bench.direct import table; print(table(json.load(open(sys.argv[1]))))" "$OUT/$name.json" 2>&1 | grep -v "^$" | tail -7; }
Q2="--model qwen3-30b-moe --src megatron:tp2ep2 --dst vllm:tp2 --iters 10"
REFIT_PULL_ON=src run q30-2-pushpeer $Q2
run q30-disagg-nccl --model qwen3-30b-moe --src megatron:tp1 --dst vllm:tp1 --placement disaggregated --transport nccl --iters 5
