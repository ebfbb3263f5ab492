#!/usr/bin/env bash
# Fifth session: ipc push (REFIT_IPC=push: the source's driver writes into the destination) against
# pull, framework-style allocations and arena.  JSON under $OUT, logs in /tmp.  2-GPU cases pin
# CUDA_VISIBLE_DEVICES=0,1.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site  # /tmp/site: carried wheels (grpc_health for --via grpc)
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
run() { local name=$1; shift; echo "=== $name: $* (REFIT_IPC=${REFIT_IPC:-auto})"; timeout 300 python3 -m refit.bench "$@" --json >"$OUT/$name.json" 2>"/tmp/$name.log"; echo rc=$?
  grep -i "error" /tmp/$name.log | head -3
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); r=d['runs'][0]; print('median %.2f ms  x floor %.3f  verified %s' % (r['seconds']['median']*1e3, r['x_floor'], r['verified'])); [print('  vs %s: %.2f ms' % (x['planner'], x['seconds']['median']*1e3)) for x in d['runs'][1:]]" "$OUT/$name.json" 2>&1 | tail -3; }
Q="--model qwen3-30b-moe"
for what in "$@"; do case "$what" in
  push2) CUDA_VISIBLE_DEVICES=0,1 REFIT_IPC=push run push2-fw $Q --src megatron:tp2ep2 --dst vllm:tp2 --iters 10 ;;
  pusharena2) CUDA_VISIBLE_DEVICES=0,1 REFIT_IPC=push run push2-arena $Q --src megatron:tp2ep2 --dst vllm:tp2 --iters 10 --alloc arena ;;
  pull2) CUDA_VISIBLE_DEVICES=0,1 run pull2-fw $Q --src megatron:tp2ep2 --dst vllm:tp2 --iters 10 ;;
  arena2) CUDA_VISIBLE_DEVICES=0,1 run pull2-arena $Q --src megatron:tp2ep2 --dst vllm:tp2 --iters 10 --alloc arena ;;
  tracepush2) CUDA_VISIBLE_DEVICES=0,1 REFIT_TRACE=1 REFIT_IPC=push run push2-trace $Q --src megatron:tp2ep2 --dst vllm:tp2 --iters 2 -v
         grep "trace cuda:0" /tmp/push2-trace.log | tail -2 ;;
  tracelog2) CUDA_VISIBLE_DEVICES=0,1 REFIT_TRACE=1 run push2-trace $Q --src megatron:tp2ep2 --dst vllm:tp2 --iters 2 -v
         grep "trace cuda:" /tmp/push2-trace.log > "$OUT/push2-trace.txt" ;;
  tracelog4) REFIT_TRACE=1 run push4-trace $Q --src megatron:tp4ep4 --dst vllm:tp4 --iters 2 -v
         grep "trace cuda:" /tmp/push4-trace.log > "$OUT/push4-trace.txt" ;;
  push4) REFIT_IPC=push run push4-fw $Q --src megatron:tp4ep4 --dst vllm:tp4 --iters 10 ;;
  pull4) run pull4-fw $Q --src megatron:tp4ep4 --dst vllm:tp4 --iters 10 --vs broadcast ;;
  arena4) run pull4-arena $Q --src megatron:tp4ep4 --dst vllm:tp4 --iters 10 --alloc arena ;;
  auto4) run auto4-fw $Q --src megatron:tp4ep4 --dst vllm:tp4 --iters 10 --vs broadcast ;;
  auto2) CUDA_VISIBLE_DEVICES=0,1 run auto2-fw $Q --src megatron:tp2ep2 --dst vllm:tp2 --iters 10 ;;
  autoarena2) CUDA_VISIBLE_DEVICES=0,1 run auto2-arena $Q --src megatron:tp2ep2 --dst vllm:tp2 --iters 10 --alloc arena ;;
  grpc2) CUDA_VISIBLE_DEVICES=0,1 run grpc2 $Q --src megatron:tp2ep2 --dst vllm:tp2 --iters 10 --via grpc ;;
  push8) REFIT_IPC=push run push8-fw $Q --src tp4ep8 --dst tp8 --iters 10 ;;
  pull8) run pull8-fw $Q --src tp4ep8 --dst tp8 --iters 10 --vs broadcast ;;
  q235) run q235-8 --model qwen3-235b-moe --src megatron:tp4ep8 --dst vllm:tp8 --iters 10 ;;
esac; done
