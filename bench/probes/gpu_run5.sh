#!/usr/bin/env bash
# The GPU measurements of bench/RESULTS.md that name `gpu_run5.sh` (first used 2026-11-22, push instead of pull),
# one case per argument:
#   bash bench/probes/gpu_run5.sh CASE [CASE ...]      JSON (and trace lines) under ${OUT:-bench/out}, logs in /tmp
# Checks: check-table (the table kernel against torch's copy, one GPU and from a peer).
# Probes: nccl-reg (NCCL out of/into registered ncclMemAlloc buffers vs torch's), nccl-ops (NCCL message shapes, both ways), nccl-oneway, nccl-chunk (NCCL_P2P_NVL_CHUNKSIZE), nccl-env (channels, buffer size, copy engines),
#   push-pull (SM loads vs stores, copy engines, across two GPUs), kernels (table-kernel variants: probe_table_kernel.py).
# refit-bench, qwen3-30b-moe, framework allocations unless the name says arena; REFIT_IPC as named (auto:
#   the default), 2-GPU cases pinned to CUDA_VISIBLE_DEVICES=0,1:
#   pull2 push2 auto2 arena2 pusharena2 pushpeer2 (kernel run on the peer: REFIT_PULL_ON=src)
#   gPEER,LOCAL (table grids, pulled: REFIT_TABLE_BLOCKS=PEER,LOCAL, e.g. g528,132) nccl256-2 nccl512-2 nccl1g-2 nccl2g-2 ncclarena2
#   ncclarenatable2 (the arena over NCCL, every copy a table kernel: REFIT_TABLE_COPY=on) ncclarenatrace2 (traced)
#   ncclbcast2 (nccl 1 GiB, and the broadcast plan: two stages over NCCL) arenatrace2 (ipc, packed arenas, traced)
#   disagg-nccl (tp1 -> tp1 disaggregated over NCCL) grpc2 (--via grpc) grpctrace2 (traced) grpc4 grpctrace4 (the same on 4 GPUs) trace2 trace4 (REFIT_TRACE=1 lines)
#   grpcnccl2 grpcnccl4 grpcnccltrace4 (--via grpc, the agents over NCCL: 1 GiB / 1200 MiB buckets)
#   nccltrace2 (nccl, 1 GiB buckets, traced) ncclbB (nccl 1 GiB, moves beside it on B blocks: REFIT_TABLE_BLOCKS=528,132,B) pushflat2 (push, 1-D runs on copy engines: REFIT_BATCH_MEMCPY=flat)
#   pull4 push4 auto4 arena4 nccl4 (1 GiB buckets) nccl4-1200; auto8 push8 pull8 q235 nccl8 trace8 (8 GPUs, never lent so far);
#   moon2 (moonlight-16b, DeepSeek-V3's architecture) glm2 (glm-4.5-air, 18 of its 46 layers), tp2ep2 -> tp2;
#   q235-2 q235pull2 q235arena2 q235trace2 q235nccl2 q235nccltrace2 (qwen3-235b-moe's shapes, 20 of its 94 layers, on 2 GPUs)
set -u
# /tmp/site: carried wheels (grpc_health for --via grpc)
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
run() {  # name, then refit-bench arguments
  local name=$1; shift
  echo "=== $name: $* (REFIT_IPC=${REFIT_IPC:-auto}${REFIT_TABLE_BLOCKS:+, REFIT_TABLE_BLOCKS=$REFIT_TABLE_BLOCKS})"
  timeout 300 python3 -m refit.bench "$@" --json >"$OUT/$name.json" 2>"/tmp/$name.log"; echo rc=$?
  grep -i "error" "/tmp/$name.log" | head -3
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); r=d['runs'][0]; print('median %.2f ms  x floor %.3f  verified %s' % (r['seconds']['median']*1e3, r['x_floor'], r['verified'])); [print('  vs %s: %.2f ms  verified %s' % (x['planner'], x['seconds']['median']*1e3, x.get('verified'))) for x in d['runs'][1:]]" "$OUT/$name.json" 2>&1 | tail -3
}
traced() {  # name, then refit-bench arguments: two refits with REFIT_TRACE=1, the trace lines kept
  local name=$1; shift
  REFIT_TRACE=1 run "$name" "$@" --iters 2 -v
  grep "trace cuda:" "/tmp/$name.log" > "$OUT/$name.txt"
}
Q="--model qwen3-30b-moe"
T2="$Q --src megatron:tp2ep2 --dst vllm:tp2"
T4="$Q --src megatron:tp4ep4 --dst vllm:tp4"
two() { CUDA_VISIBLE_DEVICES=0,1 "$@"; }
Q235_2="--model qwen3-235b-moe --layers 20 --src megatron:tp2ep2 --dst vllm:tp2"  # what fits in two H200s
for what in "$@"; do case "$what" in
  nccl-ops) timeout 150 python3 bench/probes/probe_nccl_ops.py 2>&1 | tail -8 ;;
  nccl-oneway) PROBE_ONE_WAY=1 PROBE_CASES=256:256,1024:1024,1024:256 timeout 100 python3 bench/probes/probe_nccl_ops.py 2>&1 | tail -4 ;;
  nccl-chunk) for chunk in 1048576 4194304 16777216; do
                echo "NCCL_P2P_NVL_CHUNKSIZE=$chunk"
                NCCL_P2P_NVL_CHUNKSIZE=$chunk PROBE_CASES=256:256,1024:1024 timeout 100 python3 bench/probes/probe_nccl_ops.py 2>&1 | tail -2
              done ;;
  nccl-env) for env in "" NCCL_MIN_P2P_NCHANNELS=32 "NCCL_MIN_NCHANNELS=32 NCCL_MIN_P2P_NCHANNELS=32" \
                  NCCL_BUFFSIZE=16777216 NCCL_P2P_USE_CUDA_MEMCPY=1 NCCL_NTHREADS=512; do
              echo "env: ${env:-(defaults)}"
              env $env PROBE_CASES=256:256,1024:1024 timeout 100 python3 bench/probes/probe_nccl_ops.py 2>&1 | tail -2
            done ;;
  kernels) CUDA_VISIBLE_DEVICES=0,1 timeout 300 python3 bench/probes/probe_table_kernel.py 2>&1 | tail -40 ;;
  check-table) timeout 120 python3 bench/probes/check_table_copy.py ;;
  nccl-reg) timeout 200 python3 bench/probes/probe_nccl_reg.py 2>&1 | tail -8
            timeout 200 python3 bench/probes/probe_nccl_reg.py --beside-gib 16 2>&1 | tail -8 ;;
  push-pull) timeout 200 python3 bench/probes/probe_push_pull.py 2>&1 | tail -16 ;;
  pull2) REFIT_IPC=pull two run pull2-fw $T2 --iters 10 ;;
  push2) REFIT_IPC=push two run push2-fw $T2 --iters 10 ;;
  auto2) two run auto2-fw $T2 --iters 10 ;;
  arena2) two run auto2-arena $T2 --iters 10 --alloc arena ;;
  arenatrace2) two traced arena2-trace $T2 --alloc arena ;;
  pusharena2) REFIT_IPC=push two run push2-arena $T2 --iters 10 --alloc arena ;;
  pushpeer2) REFIT_IPC=pull REFIT_PULL_ON=src two run pushpeer2-fw $T2 --iters 10 ;;
  g[0-9]*,[0-9]*) REFIT_IPC=pull REFIT_TABLE_BLOCKS=${what#g} two run "grid2-${what#g}" $T2 --iters 10 ;;
  nccl256-2) two run nccl2-256 $T2 --iters 10 --transport nccl ;;
  nccl512-2) two run nccl2-512 $T2 --iters 10 --transport nccl --bucket-mb 512 ;;
  nccl2g-2) two run nccl2-2g $T2 --iters 10 --transport nccl --bucket-mb 2048 ;;
  nccl1g-2) two run nccl2-1g $T2 --iters 10 --transport nccl --bucket-mb 1024 ;;
  ncclarena2) two run nccl2-1g-arena $T2 --iters 10 --transport nccl --bucket-mb 1024 --alloc arena ;;
  ncclarenatable2) REFIT_TABLE_COPY=on two run nccl2-1g-arena-table $T2 --iters 10 --transport nccl --bucket-mb 1024 --alloc arena ;;
  ncclbcast2) two run nccl2-1g-vs-broadcast $T2 --iters 5 --transport nccl --bucket-mb 1024 --vs broadcast ;;
  ncclarenatrace2) two traced nccl2-1g-arena-trace $T2 --transport nccl --bucket-mb 1024 --alloc arena ;;
  disagg-nccl) two run disagg-nccl $Q --src megatron:tp1 --dst vllm:tp1 --placement disaggregated --transport nccl --iters 5 ;;
  grpc2) two run grpc2 $T2 --iters 10 --via grpc ;;
  grpctrace2) two traced grpc2-trace $T2 --via grpc ;;
  grpc4) run grpc4 $T4 --iters 20 --via grpc ;;
  grpcnccl2) two run grpcnccl2 $T2 --iters 20 --via grpc --transport nccl --bucket-mb 1024 ;;
  grpcnccl4) run grpcnccl4 $T4 --iters 20 --via grpc --transport nccl --bucket-mb 1200 ;;
  grpcnccltrace4) traced grpcnccl4-trace $T4 --via grpc --transport nccl --bucket-mb 1200 ;;
  grpctrace4) traced grpc4-trace $T4 --via grpc ;;
  nccltrace2) two traced nccl2-1g-trace $T2 --transport nccl --bucket-mb 1024 ;;
  ncclb[0-9]*) REFIT_TABLE_BLOCKS=528,132,${what#ncclb} two run "nccl2-1g-beside${what#ncclb}" $T2 --iters 10 --transport nccl --bucket-mb 1024 ;;
  pushflat2) REFIT_IPC=push REFIT_BATCH_MEMCPY=flat two run pushflat2-fw $T2 --iters 10 ;;
  trace2) two traced push2-trace $T2 ;;
  trace4) traced push4-trace $T4 ;;
  pull4) REFIT_IPC=pull run pull4-fw $T4 --iters 10 --vs broadcast ;;
  push4) REFIT_IPC=push run push4-fw $T4 --iters 10 ;;
  auto4) run auto4-fw $T4 --iters 10 --vs broadcast ;;
  arena4) run auto4-arena $T4 --iters 10 --alloc arena ;;
  nccl4) run nccl4-1g $T4 --iters 10 --transport nccl --bucket-mb 1024 ;;
  nccl4-1200) run nccl4-1200 $T4 --iters 10 --transport nccl --bucket-mb 1200 ;;
  nccl8) run nccl8-1g $Q --src tp4ep8 --dst tp8 --iters 10 --transport nccl --bucket-mb 1024 ;;
  auto8) run auto8-fw $Q --src tp4ep8 --dst tp8 --iters 10 --vs broadcast ;;
  trace8) traced push8-trace $Q --src tp4ep8 --dst tp8 ;;
  push8) REFIT_IPC=push run push8-fw $Q --src tp4ep8 --dst tp8 --iters 10 ;;
  pull8) REFIT_IPC=pull run pull8-fw $Q --src tp4ep8 --dst tp8 --iters 10 --vs broadcast ;;
  q235-2) two run q235-20l-2 $Q235_2 --iters 10 ;;
  q235pull2) REFIT_IPC=pull two run q235-20l-pull2 $Q235_2 --iters 10 ;;
  q235arena2) two run q235-20l-arena2 $Q235_2 --iters 10 --alloc arena ;;
  q235trace2) two traced q235-20l-trace2 $Q235_2 ;;
  q235nccl2) two run q235-20l-nccl2-1g $Q235_2 --iters 10 --transport nccl --bucket-mb 1024 ;;
  q235nccltrace2) two traced q235-20l-nccl2-1g-trace $Q235_2 --transport nccl --bucket-mb 1024 ;;
  moon2) two run moonlight-2 --model moonlight-16b --src megatron:tp2ep2 --dst vllm:tp2 --iters 10 ;;
  glm2) two run glm-air-18l-2 --model glm-4.5-air --layers 18 --src megatron:tp2ep2 --dst vllm:tp2 --iters 10 ;;
  q235) run q235-8 --model qwen3-235b-moe --src megatron:tp4ep8 --dst vllm:tp8 --iters 10 ;;
  *) echo "unknown case $what (see the header of $0)"; exit 2 ;;
esac; done
