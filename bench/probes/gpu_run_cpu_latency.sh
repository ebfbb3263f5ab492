#!/usr/bin/env bash
# Is the control time of a one-GPU --via grpc refit thread wake-ups out of deep CPU idle states,
# or out of halted (virtual) CPUs?  Each measurement three times in one run: as the host is, with
# /dev/cpu_dma_latency held at 0 us (bench/probes/with_cpu_latency.py), and with a SCHED_IDLE
# spinner on every CPU (bench/probes/with_idle_spinners.py).  idle: the bare gRPC round trip after pauses
# (grpc_idle_latency.py); 8b: refit-bench qwen3-8b tp1 -> tp1 --via grpc, 20 refits.
# Usage: gpu_run_cpu_latency.sh idle|8b ...   Writes JSON and logs under ${OUT:-bench/out}.
set -u
source "$(dirname "$0")/gpu_env.sh"
HOLD="python3 $ROOT/bench/probes/with_cpu_latency.py --us 0 --"
SPIN="python3 $ROOT/bench/probes/with_idle_spinners.py --"
echo "virt: $(systemd-detect-virt 2>/dev/null || echo unknown); hypervisor flag on $(grep -c hypervisor /proc/cpuinfo) of $(nproc) cpus"
ls -la /dev/cpu_dma_latency; cat /sys/devices/system/cpu/cpuidle/current_governor* 2>/dev/null
grep -H . /sys/devices/system/cpu/cpu0/cpuidle/state*/name 2>/dev/null | head
for what in "$@"; do case "$what" in
  idle) for hold in "" "$HOLD" "$SPIN"; do
          echo "=== grpc_idle_latency ${hold:+(with ${hold##*/})}"
          timeout 240 $hold python3 bench/probes/grpc_idle_latency.py --calls 200 2>&1 | tail -5
        done ;;
  8b) for hold in "" "$HOLD" "$SPIN"; do
        case "$hold" in "") tag= ;; "$HOLD") tag=-held ;; *) tag=-spinners ;; esac
        name="grpc-q8-tp1-tp1$tag"
        echo "=== $name"
        timeout 300 $hold python3 -m refit.bench --model qwen3-8b --src tp1 --dst tp1 --iters 20 --via grpc --json \
          >"$OUT/$name.json" 2>"$OUT/$name.log"
        echo "rc=$?"; tail -c 1500 "$OUT/$name.log" | tail -3
        python3 -c "import json,sys; from refit.bench.via_grpc import table_grpc; print(table_grpc(json.load(open(sys.argv[1]))))" \
          "$OUT/$name.json" 2>&1 | tail -12
      done ;;
  *) echo "usage: $0 idle|8b"; exit 2 ;;
esac; done
