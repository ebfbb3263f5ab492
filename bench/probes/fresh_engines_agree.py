"""Do two fresh vLLM engines of one checkpoint, started side by side on one GPU with the GPU tests'
settings, answer bit for bit alike?  (tests/gpu/test_gpu_vllm.py compares refitted engines with
fresh ones; a difference between two fresh ones is the engines', not refit's.)

    python bench/probes/fresh_engines_agree.py [--model gpu-qwen3] [--engines 3]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from tests.gpu.vllm_gpu import GpuEngine, write_checkpoint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpu-qwen3")
    p.add_argument("--engines", type=int, default=3)
    a = p.parse_args()
    d = write_checkpoint(os.path.join(tempfile.mkdtemp(), "ckpt"), a.model, seed=2)
    engines = [GpuEngine(f"fresh-{i}", d) for i in range(a.engines)]
    try:
        answers = [e.ready().ask("generate") for e in engines]
    finally:
        for e in engines:
            e.close()
    first = answers[0]
    report = {"model": a.model, "engines": a.engines,
              "equal_to_first": [ans == first for ans in answers],
              "first_logprobs": [ans[0][1][:3] for ans in answers]}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
