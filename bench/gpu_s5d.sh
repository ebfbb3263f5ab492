#!/usr/bin/env bash
# Fifth session: NCCL's p2p chunk size against the 256 MiB two-way message rate (probe_nccl_ops.py).
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for chunk in default 1048576 4194304 16777216; do
  if [ "$chunk" = default ]; then unset NCCL_P2P_NVL_CHUNKSIZE; else export NCCL_P2P_NVL_CHUNKSIZE=$chunk; fi
  echo "NCCL_P2P_NVL_CHUNKSIZE=$chunk"
  PROBE_CASES=256:256,1024:1024 timeout 100 python3 bench/probe_nccl_ops.py 2>&1 | tail -2
done
