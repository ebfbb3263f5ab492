"""Does a refit that lands the very weights an engine already holds change its answers?

tests/gpu/test_gpu_vllm.py finds a refitted dense engine's weights equal to a fresh engine's bit for
bit (digests of every parameter and buffer) while, in about one run of two, its logprobs differ
in the 5th decimal.  This separates the engine's state beside its weights from the weights: one
engine loads a checkpoint and answers; a trainer holding exactly that checkpoint's weights refits
it (no optimizer step between); the engine answers again, with its digests before and after.  A
fresh engine of the same checkpoint answers beside it.

    python bench/probes/refit_same_weights.py [--model gpu-qwen3] [--refits 2]

Prints one JSON object: whether the answers after each refit equal the engine's own first answers
and the fresh engine's, and whether the digests moved.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from tests.gpu.vllm_gpu import GpuEngine, GpuTrainer, write_checkpoint
from tests.harness.loopback import loopback


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpu-qwen3")
    p.add_argument("--refits", type=int, default=2)
    a = p.parse_args()
    tmp = tempfile.mkdtemp()
    ckpt = write_checkpoint(os.path.join(tmp, "ckpt"), a.model, seed=2)
    with loopback(default_timeout=120.0) as (server, client):
        engine = GpuEngine("refitted", ckpt, server.address, group="engine")
        fresh = GpuEngine("fresh", ckpt)
        trainer = GpuTrainer(server.address, a.model, ckpt, tmp)
        try:
            engine.ready()
            first, digests0 = engine.ask("generate"), engine.ask("digests")
            reference = fresh.ready().ask("generate")
            plan = client.create_plan(a.model, "engine")["plan_id"]
            after = []
            for version in range(1, a.refits + 1):
                engine.ask("refit", (plan, version))
                answers, digests = engine.ask("generate"), engine.ask("digests")
                after.append({"version": version, "equal_to_own_first": answers == first,
                              "equal_to_fresh": answers == reference,
                              "digests_moved": sorted(n for n in digests0 if digests[n] != digests0[n])[:8],
                              "first_logprobs": answers[0][1][:3]})
            report = {"model": a.model, "first_equal_to_fresh": first == reference,
                      "first_logprobs": first[0][1][:3], "fresh_logprobs": reference[0][1][:3], "refits": after}
        finally:
            for proc in (engine, fresh, trainer):
                proc.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
