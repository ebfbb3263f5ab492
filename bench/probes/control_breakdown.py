"""Where the control time of a ``refit-bench --via grpc`` refit goes, step by step.

Runs the bench with ``REFIT_CONTROL_TRACE`` (`refit.timeline`), merges every process's steps into
one timeline per refit (cut at each ``client: Refit sent``), and prints each step's median offset
from that call over the last ``--last`` refits, with the gap from the step before it.  Any
``refit-bench`` arguments after ``--`` pass through (``--via grpc`` is added).

    python3 bench/probes/control_breakdown.py -- --model qwen3-8b --src tp1 --dst tp1 --iters 20
    python3 bench/probes/control_breakdown.py -- --model qwen3-8b --src tp1 --dst tp1 --cpu --layers 1 --iters 20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from refit.timeline import read_steps, timeline


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--last", type=int, default=15, help="refits to take the medians over (the last ones)")
    ap.add_argument("--json", action="store_true", help="print the bench's JSON and the timeline as one object")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then refit-bench arguments")
    args = ap.parse_args()
    bench = [a for a in args.bench if a != "--"]
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "steps")
        env = {**os.environ, "REFIT_CONTROL_TRACE": prefix}
        out = subprocess.run([sys.executable, "-m", "refit.bench", *bench, "--via", "grpc", "--json"], env=env,
                             stdout=subprocess.PIPE, check=True, text=True).stdout
        steps = timeline(read_steps(prefix), args.last)
    result = json.loads(out)
    if args.json:
        print(json.dumps({"bench": result, "timeline_us": dict(steps)}, indent=1))
        return
    print(f"round trip {result['round_trip']['median'] * 1e3:.2f} ms, data {result['data']['median'] * 1e3:.2f} ms, "
          f"control + barriers {result['overhead']['median'] * 1e3:.2f} ms (medians)")
    print(f"{'after the call':>15} {'gap':>8}  step (medians of the last {args.last} refits, microseconds)")
    before = 0.0
    for step, us in steps:
        print(f"{us:15.0f} {us - before:8.0f}  {step}")
        before = us


if __name__ == "__main__":
    main()
