# Sourced by the gpu_run_*.sh scripts: the device machine's environment for refit's benches.
# NCCL multicast off (KINDS.md), the carried wheels the device lacks (.whl/: grpcio-health-checking)
# installed under /tmp/site, this checkout importable, and $OUT (the device's, else bench/out).
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 REFIT_ALLOW_MISSING_DEPS=1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$ROOT"/.whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
