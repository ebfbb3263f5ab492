#!/usr/bin/env bash
# Same-GPU refits against one device copy of the same bytes (issue: same-GPU refits at copy speed):
# refit-bench tp1 -> tp1 on one GPU (two processes, CUDA IPC) for the three direct cases, with the
# default copy path (copy-engine memcpys for big blocks) and with every same-GPU copy in the
# descriptor-table kernel (REFIT_TABLE_COPY=on; REFIT_TABLE_BLOCKS' second value: its grid).  Each
# report carries the device copy (torch copy_ of 4 GiB) and the ratio to it.
# Usage: gpu_run_same_gpu.sh [suite] [8b|30b|235b] ...   JSON and logs under ${OUT:-bench/out}.
set -u
source "$(dirname "$0")/gpu_env.sh"
run() {  # name, environment (VAR=value ...), then refit-bench arguments
  local name=$1 envs=$2; shift 2
  echo "=== $name: $envs refit-bench $*"
  env $envs timeout 300 python3 -m refit.bench "$@" --json >"$OUT/$name.json" 2>"$OUT/$name.log"
  echo "rc=$?"
  python3 - "$OUT/$name.json" <<'PY' 2>&1 | tail -3
import json, sys
r = json.load(open(sys.argv[1])); run = r["runs"][0]; c = r.get("copy") or {}
print(f"median {run['seconds']['median']*1e3:.2f} ms  min {run['seconds']['min']*1e3:.2f}  copy floor "
      f"{(run.get('copy_floor_seconds') or 0)*1e3:.2f} ms ({c.get('gbps', 0):.0f} GB/s)  x {run.get('x_copy_floor')}  "
      f"memcpys {run['memcpys']} copies {run['copies']} verified {run['verified']}")
PY
}
case_args() {
  case "$1" in
    8b) echo "--model qwen3-8b --src tp1 --dst tp1 --iters 10" ;;
    30b) echo "--model qwen3-30b-moe --src tp1 --dst tp1 --iters 10" ;;
    235b) echo "--model qwen3-235b-moe --layers 8 --src tp1 --dst tp1 --iters 10" ;;
  esac
}
# OLD=dir: a tree holding the package before the change (its refit/ first on the path), run beside.
OLD=${OLD:-}
old() { [ -n "$OLD" ] && PYTHONPATH="$OLD:$PYTHONPATH" run "$@"; }
for what in "$@"; do case "$what" in
  suite) timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tail -5 ;;
  8b|30b|235b) run "same-$what" "" $(case_args "$what") ;;
  ab-8b|ab-30b|ab-235b)  # the copy paths side by side
    args=$(case_args "${what#ab-}")
    run "same-${what#ab-}-default" "REFIT_TABLE_COPY=auto" $args
    run "same-${what#ab-}-table132" "REFIT_TABLE_COPY=on REFIT_TABLE_BLOCKS=528,132" $args
    run "same-${what#ab-}-table528" "REFIT_TABLE_COPY=on REFIT_TABLE_BLOCKS=528,528" $args ;;
  grpc8b) run "same-grpc-8b" "" --model qwen3-8b --src tp1 --dst tp1 --iters 10 --via grpc ;;
  2gpu)  # colocated 2-GPU cases, whose same-GPU part runs beside the peer copies: new, then OLD
    for variant in "" "--alloc arena" "--transport nccl --bucket-mb 1024"; do
      tag=$(echo "$variant" | tr -d ' -' | tr -c 'a-z0-9\n' '_'); tag=${tag:-framework}
      run "two-q30-$tag" "" --model qwen3-30b-moe --src megatron:tp2ep2 --dst vllm:tp2 --iters 10 $variant
      old "two-q30-$tag-old" "" --model qwen3-30b-moe --src megatron:tp2ep2 \
        --dst vllm:tp2 --iters 10 $variant
    done ;;
  *) echo "usage: $0 [suite] [8b|30b|235b|ab-8b|ab-30b|ab-235b|grpc8b|2gpu] ..."; exit 2 ;;
esac; done
