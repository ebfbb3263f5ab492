#!/usr/bin/env bash
# The measurements of bench/RESULTS.md "All or none, and verified refits" (one GPU): the
# checksum's GPU tests and speed, then refit-bench --via grpc tp1 -> tp1 (two agent processes on
# one GPU, CUDA IPC) plain, --atomic and --verify, in one run so the three compare.
# Usage: gpu_run_fleet.sh checksum|8b|30b-tp2 ...  (30b-tp2: two GPUs; not run yet on 2026-11-29)   Writes JSON and logs under ${OUT:-bench/out}.
set -u
source "$(dirname "$0")/gpu_env.sh"
run() {  # name, time limit, then refit-bench arguments
  local name=$1 limit=$2; shift 2
  echo "=== $name: refit-bench $*"
  timeout "$limit" python3 -m refit.bench "$@" --json >"$OUT/$name.json" 2>"$OUT/$name.log"
  echo "rc=$?"; tail -c 2000 "$OUT/$name.log" | tail -4
  python3 -c "import json,sys; from refit.bench.via_grpc import table_grpc; print(table_grpc(json.load(open(sys.argv[1]))))" "$OUT/$name.json" 2>&1 | tail -12
}
for what in "$@"; do case "$what" in
  checksum) timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_checksum.py 2>&1 | tail -3
            timeout 200 python3 bench/probes/checksum_speed.py 2>&1 | tail -12 ;;
  8b) for opt in "" --atomic --verify; do
        run "grpc-q8-tp1-tp1${opt:+-${opt#--}}" 240 --model qwen3-8b --src tp1 --dst tp1 --iters 10 --via grpc $opt
      done ;;
  30b-tp2)  # two GPUs, a wire between them: what --verify adds where the wire is the bottleneck
      for opt in "" --verify; do
        run "grpc-q30-tp2ep2-tp2-nccl${opt:+-${opt#--}}" 300 --model qwen3-30b-moe --src megatron:tp2ep2 --dst vllm:tp2 \
          --transport nccl --iters 10 --via grpc $opt
      done ;;
  *) echo "usage: $0 checksum|8b|30b-tp2"; exit 2 ;;
esac; done
