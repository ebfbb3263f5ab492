#!/usr/bin/env bash
# Fifth session, 2x H200: table-kernel grids for peer pulls and same-GPU copies running side by side
# (REFIT_TABLE_BLOCKS=PEER,LOCAL), and the NCCL transport with 1 GiB buckets.  JSON under $OUT, logs in /tmp.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
run() { local name=$1; shift; echo "=== $name: $* ${REFIT_TABLE_BLOCKS:-}"; timeout 300 python3 -m refit.bench "$@" --json >"$OUT/$name.json" 2>"/tmp/$name.log"; echo rc=$?
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); r=d['runs'][0]; print('median %.2f ms  x floor %.3f  verified %s' % (r['seconds']['median']*1e3, r['x_floor'], r['verified']))" "$OUT/$name.json" 2>&1 | tail -1; }
Q2="--model qwen3-30b-moe --src megatron:tp2ep2 --dst vllm:tp2"
for what in "$@"; do case "$what" in
  fw) run s5-fw-table $Q2 --iters 10 ;;
  g*) REFIT_TABLE_BLOCKS=${what#g} run s5-fw-grid-${what#g} $Q2 --iters 10 ;;
  trace) REFIT_TRACE=1 REFIT_TABLE_BLOCKS=$TRACE_GRID run s5-fw-trace $Q2 --iters 2 -v; grep "trace cuda:0" /tmp/s5-fw-trace.log | tail -2 ;;
  nccl1g) run s5-nccl-1g $Q2 --iters 10 --transport nccl --bucket-mb 1024 ;;
esac; done
