#!/usr/bin/env bash
# refit on Ray, on a 2-GPU machine (issue 13, item 6).  Everything lands under $OUT; at most ~7.5
# minutes (each step has its own time limit: 120 + 150 + 30 + 40 + 90 + 15 + 45 s).
#
#  (a) one node: `refit-bench --model qwen3-30b-moe --src megatron:tp2ep2 --dst vllm:tp2 --iters 10`
#      direct, then the same with `--ray auto` (a local Ray cluster; every rank an actor, all GPUs
#      visible to them, CUDA IPC as direct): a-direct.json, a-ray.json.  Goal: within 5%.
#  (b) two Ray nodes on this host (`ray start` twice, each node given one GPU through its own
#      CUDA_VISIBLE_DEVICES and --num-gpus 1): qwen3-8b tp1 -> tp1 disaggregated, the trainer on one
#      node and the engine on the other, so every byte crosses nodes over NCCL (two Ray nodes are
#      two hosts to refit: no IPC, no peer access) -> b-ray.json; then NCCL's own send/recv of the
#      same bytes in the same message size between the same two GPUs, each process seeing only its
#      own GPU as the Ray actors do -> b-nccl.json.
#  summary.json / summary.txt: the comparisons (bench/probes/ray_summary.py).
#
# Ray is not installed on the device: carry a ray wheel and its deps in .whl/ and first
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
# GPU_RAY_CPU=1 runs the same steps on CPU (reduced width, gloo): a test of the plumbing, not a measurement.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# Token auth off: a closed machine, and `ray start` and drivers would otherwise disagree on it.
export RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=0 RAY_AUTH_MODE=disabled
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$ROOT/bench/out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
CPU=${GPU_RAY_CPU:-0}
STEPS=${GPU_RAY_STEPS:-ab}  # which of (a) and (b) to run
unset RAY_ADDRESS
if [ "$CPU" = 1 ]; then DEV=(--cpu); NODE_RES=(--num-cpus 1); PAIR=(--backend gloo); else DEV=(); NODE_RES=(--num-gpus 1 --num-cpus 4); PAIR=(--backend nccl); fi

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nvidia-smi topo -m | head -4; } >"$OUT/machine.txt" 2>&1
$PY -c "import torch, ray; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count(), 'ray', ray.__version__)" 2>&1 | tee -a "$OUT/machine.txt"

bench() {  # name, time limit (s), then refit-bench arguments
  local name=$1 limit=$2; shift 2
  echo "=== $name: refit-bench $*"
  timeout "$limit" $PY -m refit.bench "$@" --json >"$OUT/$name.json" 2>"$OUT/$name.log"
  local rc=$?
  echo "$name rc=$rc"; grep -v "step/s" "$OUT/$name.log" | tail -4
  if [ $rc != 0 ] && [[ " $* " == *" --ray "* ]]; then  # the actors' side of a failure: Ray's logs
    tail -n 40 /tmp/ray/session_latest/logs/*.err >"$OUT/$name-raylogs.txt" 2>&1
  fi
}

# (a) one node, direct vs --ray
A=(--model qwen3-30b-moe --src megatron:tp2ep2 --dst vllm:tp2 --iters 10 "${DEV[@]}")
if [[ $STEPS == *a* ]]; then
  bench a-direct 120 "${A[@]}"
  bench a-ray 150 "${A[@]}" --ray auto
fi
[[ $STEPS == *b* ]] || { $PY "$ROOT/bench/probes/ray_summary.py" "$OUT" | tee "$OUT/summary.txt"; exit 0; }

# (b) two Ray nodes on this host, one GPU each; started with --block in process groups of their
# own, so that only they are stopped at the end (never `ray stop`, which stops every Ray on the host).
PORT=$($PY -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
RAYCLI=($PY -m ray.scripts.scripts start --block "${NODE_RES[@]}")
stop_nodes() {  # SIGTERM (Ray drains), then whatever of their process groups is left
  for pid in ${NODES:-}; do kill -TERM -- "-$pid" 2>/dev/null; done
  for _ in $(seq 15); do alive=0; for pid in ${NODES:-}; do kill -0 "$pid" 2>/dev/null && alive=1; done
                         [ $alive = 0 ] && break; sleep 1; done
  for pid in ${NODES:-}; do kill -KILL -- "-$pid" 2>/dev/null; done; NODES=; }
trap stop_nodes EXIT
CUDA_VISIBLE_DEVICES=0 setsid "${RAYCLI[@]}" --head --port "$PORT" --include-dashboard false >"$OUT/b-head.log" 2>&1 &
NODES="$!"
for _ in $(seq 30); do grep -q "ray start --address=" "$OUT/b-head.log" && break; sleep 1; done
ADDR=$(grep -o "ray start --address='[^']*'" "$OUT/b-head.log" | head -1 | cut -d"'" -f2)
echo "=== Ray head at ${ADDR:-?}"
CUDA_VISIBLE_DEVICES=1 setsid "${RAYCLI[@]}" --address "$ADDR" >"$OUT/b-node.log" 2>&1 &
NODES="$NODES $!"
export RAY_ADDRESS="$ADDR"
timeout 40 $PY - <<'EOF' 2>&1 | tee "$OUT/b-cluster.txt"
import time, ray
ray.init(include_dashboard=False, logging_level="warning")
for _ in range(60):
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= 2:
        break
    time.sleep(1)
print("nodes:", [(n["NodeID"][:8], n["NodeManagerAddress"], n["Resources"].get("GPU", 0)) for n in alive])
EOF
bench b-ray 90 --model qwen3-8b --src tp1 --dst tp1 --placement disaggregated --transport nccl --iters 10 "${DEV[@]}" --ray auto
unset RAY_ADDRESS
stop_nodes

# (b) reference: NCCL send/recv of the bytes the refit moved across nodes, in its bucket size
read -r BYTES CHUNK_MB < <($PY -c "
import json, sys
r = json.load(open(sys.argv[1]))
print(r['ray']['runs'][0]['across_nodes'], r['runs'][0]['bucket_bytes'] / 2**20)" "$OUT/b-ray.json" 2>/dev/null || echo "0 0")
if [ "${BYTES:-0}" -gt 0 ]; then
  echo "=== b-nccl: $BYTES bytes in ${CHUNK_MB} MiB messages"
  timeout 45 $PY "$ROOT/bench/probes/nccl_pair.py" "${PAIR[@]}" --gpus 0,1 --bytes "$BYTES" --chunk-mb "$CHUNK_MB" \
    --iters 10 --json >"$OUT/b-nccl.json" 2>"$OUT/b-nccl.log"
  echo "b-nccl rc=$?"; tail -3 "$OUT/b-nccl.log"
else
  echo "b-nccl skipped: b-ray.json has no cross-node bytes"
fi

$PY "$ROOT/bench/probes/ray_summary.py" "$OUT" | tee "$OUT/summary.txt"
