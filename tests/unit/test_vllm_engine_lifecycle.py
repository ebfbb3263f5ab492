"""The ``refit`` backend's `RefitWeightTransferEngine` around vLLM's worker calls, without an engine.

* A draft session (``start_draft_weight_update``) of an engine that registered no agent for its
  drafter (an EAGLE head, MTP layers, a drafter the trainer does not train) is refused before any
  byte moves: vLLM's own worker code (`Worker._start_weight_update`, run here on a stand-in worker)
  retargets the backend, the engine refuses naming the drafter, and the worker restores the target.
  A separate draft model's own agent is tested live (integration/test_vllm_draft.py); a target
  refit whose drafter skipped the previous version names it.
* ``shutdown`` (vLLM's ``shutdown_weight_transfer_engine``) drops the landing, whose staging can be
  a whole extra shard: nothing may keep it alive after the trainer connection is released.
* Engines refit cannot land into correctly (EPLB, prefill context parallel, a quantized
  checkpoint) are refused when they register (`config.identify`), before any byte moves.
The configs are stand-ins (SimpleNamespace) holding only the fields read before the refusal.
"""

from __future__ import annotations

import importlib.util
import weakref
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")


def make_engine():  # noqa: ANN201 - RefitWeightTransferEngine, imported with vllm
    from refit.integrations.vllm.engine import RefitWeightTransferEngine

    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(), model_config=SimpleNamespace())
    return RefitWeightTransferEngine(None, vllm_config, torch.device("cpu"), torch.nn.Linear(4, 4))


def test_a_draft_session_without_a_drafter_agent_is_refused() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    from refit.errors import RefitError

    engine = make_engine()
    engine.vllm_config.speculative_config = SimpleNamespace(method="eagle", model="eagle-head",
                                                            draft_model_config=SimpleNamespace(model="eagle-head"))
    draft = torch.nn.Linear(2, 2)
    worker = SimpleNamespace(weight_transfer_engine=engine, _weight_update_active=False,
                             _check_weight_transfer_engine=lambda: None,
                             _set_draft_weight_update_target=lambda: engine.set_weight_update_target(
                                 draft, SimpleNamespace()))
    with pytest.raises(RefitError, match="registered no agent for its eagle drafter eagle-head"):
        Worker._start_weight_update(worker, is_draft=True)
    assert engine.model is not draft and not worker._weight_update_active
    with pytest.raises(RefitError, match="call init_weight_transfer_engine"):  # the target: on to the next check
        engine.start_weight_update()


def test_shutdown_releases_the_staging() -> None:
    from refit.errors import RefitError

    engine = make_engine()
    engine.landing = SimpleNamespace(staging={"x": torch.ones(1024)}, window=None)  # stands in for a Landing
    freed = weakref.ref(engine.landing.staging["x"])
    engine.init_info = SimpleNamespace()
    engine.shutdown()
    assert freed() is None, "the staging outlives shutdown"
    assert engine.landing is None and engine.init_info is None and engine.agent is None
    with pytest.raises(RefitError, match="call init_weight_transfer_engine"):
        engine.staging_report()


def test_a_bad_adapter_init_info_leaves_the_registered_agent() -> None:
    """A malformed ``init_info["adapter"]`` is refused before the engine drops the agent it holds."""
    from refit.errors import RefitError
    from refit.integrations.vllm.engine import RefitInitInfo

    engine = make_engine()
    held = engine.agent = SimpleNamespace(stop=lambda: pytest.fail("the registered agent was stopped"))
    with pytest.raises(RefitError, match=r"init_info\.adapter: 'lora_alpha', 'target_modules' required"):
        engine.init_transfer_engine(RefitInitInfo(adapter={"name": "policy", "id": 0, "r": 8}))
    assert engine.agent is held


@pytest.mark.parametrize("setting,message", [
    ({"enable_eplb": True}, r"expert-parallel load balancing \(enable_eplb\) is not supported"),
    ({"prefill_context_parallel_size": 2}, r"prefill context parallel \(pcp2\) is not supported"),
])
def test_parallel_settings_refit_cannot_follow_are_refused(setting, message) -> None:
    """EPLB moves experts between ranks while serving (and adds redundant ones); prefill context
    parallel ranks would share refit ranks.  Either would put weights where vLLM does not read
    them: refused when the engine registers, before any byte moves."""
    from refit.errors import RefitError
    from refit.integrations.vllm.config import identify

    pc = dict(pipeline_parallel_size=1, decode_context_parallel_size=1, prefill_context_parallel_size=1,
              enable_elastic_ep=False, enable_eplb=False, tensor_parallel_size=2, data_parallel_size=2,
              data_parallel_rank=0, enable_expert_parallel=True)
    pc.update(setting)
    with pytest.raises(RefitError, match=message):
        identify(SimpleNamespace(model_config=SimpleNamespace(), parallel_config=SimpleNamespace(**pc)))


def test_a_checkpoint_quantized_otherwise_than_refit_writes_is_refused() -> None:
    """A checkpoint served quantized in a format refit does not write (per-tensor FP8, AWQ...)
    holds weights and scales refit cannot produce: refused when the engine registers, naming it."""
    from refit.errors import RefitError
    from refit.integrations.vllm.config import identify

    pc = SimpleNamespace(pipeline_parallel_size=1, decode_context_parallel_size=1, prefill_context_parallel_size=1,
                         enable_elastic_ep=False, enable_eplb=False)
    for qc, method in (({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8"),
                       ({"quant_method": "awq", "bits": 4}, "awq")):
        hf_config = SimpleNamespace(quantization_config=qc)
        with pytest.raises(RefitError, match=rf"the checkpoint is quantized \({method}\) in a format refit does not "
                                             rf"write: .*refit reshard --dst-dtype fp8"):
            identify(SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config), parallel_config=pc))


def test_an_fp8_block_checkpoint_is_served_in_refits_fp8_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """An FP8 checkpoint of the format `refit reshard --dst-dtype fp8` writes (DeepSeek-V3 /
    Qwen3-FP8: float8 weights, 128x128 ``weight_scale_inv``): the engine's spec is refit's FP8 spec,
    so plans quantize on the wire into its layers (live on a GPU: tests/gpu/test_gpu_vllm.py)."""
    from vllm.distributed import parallel_state

    from refit.integrations.vllm.config import identify
    from refit.quantization import hf_quantization_config
    from tests.harness.tiny import TINY_CONFIGS

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    cfg = {**TINY_CONFIGS["tiny-qwen3-moe-fp8"], "quantization_config": hf_quantization_config("fp8", (0,))}
    mc = SimpleNamespace(hf_config=SimpleNamespace(to_dict=lambda: dict(cfg), quantization_config=cfg["quantization_config"]),
                         dtype="torch.bfloat16", model="/models/tiny-qwen3-moe-fp8")
    pc = SimpleNamespace(pipeline_parallel_size=1, decode_context_parallel_size=1, prefill_context_parallel_size=1,
                         enable_elastic_ep=False, enable_eplb=False, tensor_parallel_size=1, data_parallel_size=1,
                         data_parallel_rank=0, enable_expert_parallel=False)
    who = identify(SimpleNamespace(model_config=mc, parallel_config=pc))
    assert who.spec.config.quantization == "fp8"
    held = {lt.name: lt.dtype for lt in who.layout.local_tensors(who.spec, 0)}
    assert held["model.layers.0.self_attn.qkv_proj.weight"] == "float8_e4m3fn"
    assert held["model.layers.0.self_attn.qkv_proj.weight_scale_inv"] == "float32"


def _deepseek_identity(monkeypatch: pytest.MonkeyPatch, **parallel: Any) -> Any:
    """`identify` of a tiny DeepSeek-V3 engine at tp2 dp2 with expert parallel (TP rank 1)."""
    from vllm.distributed import parallel_state

    from refit.integrations.vllm.config import identify
    from tests.harness.tiny import TINY_CONFIGS

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 1)
    cfg = TINY_CONFIGS["tiny-deepseek-v3"]
    mc = SimpleNamespace(hf_config=SimpleNamespace(to_dict=lambda: dict(cfg)), dtype="torch.bfloat16",
                         model="/models/tiny-deepseek-v3")
    pc = SimpleNamespace(pipeline_parallel_size=1, decode_context_parallel_size=1, prefill_context_parallel_size=1,
                         enable_elastic_ep=False, enable_eplb=False, tensor_parallel_size=2, data_parallel_size=2,
                         data_parallel_rank=1, enable_expert_parallel=True, **parallel)
    return identify(SimpleNamespace(model_config=mc, parallel_config=pc))


def test_deepseek_shared_experts_under_moe_sequence_parallel_are_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM replicates DeepSeek's shared experts (``disable_tp``) when it runs MoE sequence
    parallel (tp>1, dp>1, expert parallel, the default all2all backend): the engine's layout holds
    them whole on every rank."""
    who = _deepseek_identity(monkeypatch, use_sequence_parallel_moe=True, all2all_backend="allgather_reducescatter")
    assert who.rank == 3 and (who.layout.tp, who.layout.dp, who.layout.ep) == (2, 2, 4)
    shared = [p for lt in who.layout.local_tensors(who.spec, who.rank) for p in lt.pieces if "shared_experts" in p.tensor]
    assert shared and all(tuple(p.size[1:]) == tuple(who.spec[p.tensor].shape[1:]) for p in shared)  # [layer, ...]


def test_deepseek_shared_experts_split_by_another_all2all_backend_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An all2all backend that keeps MoE off sequence parallel splits the shared experts where
    refit's layout expects them whole: refused when the engine registers, naming why."""
    from refit.errors import RefitError

    with pytest.raises(RefitError, match=r"deepseek_v3's shared experts are split over tp under all2all backend "
                                         r"flashinfer_nvlink_two_sided"):
        _deepseek_identity(monkeypatch, use_sequence_parallel_moe=False, all2all_backend="flashinfer_nvlink_two_sided")


def test_a_drafter_that_skips_a_version_is_named(caplog) -> None:
    """The RL loop refits the target, then the drafter, with the same version: a target refit whose
    drafter did not follow the previous one names it (its acceptance rate falls)."""
    from refit.integrations.vllm import draft as drafts

    spec = SimpleNamespace(method="draft_model", model="d", draft_model_config=SimpleNamespace(model="/ckpt/draft"))
    drafter = SimpleNamespace(version=None, target_version=None)
    engine = SimpleNamespace(draft=drafter, vllm_config=SimpleNamespace(speculative_config=spec))
    with caplog.at_level("WARNING", logger="refit.integrations.vllm.draft"):
        drafts.after_target(engine, 1)
        drafter.version = 1  # the draft session of version 1
        drafts.after_target(engine, 2)
        assert not caplog.records
        drafts.after_target(engine, 3)  # the drafter skipped version 2
    assert [r.getMessage() for r in caplog.records] == [
        "refit: the draft_model drafter /ckpt/draft still holds version 1 while the target moves from version 2 to 3: "
        "refit it each step (start_draft_weight_update) or its acceptance rate falls"]
