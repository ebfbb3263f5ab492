"""Landing an adapter-only refit in a live vLLM engine's LoRA slots (``init_info["adapter"]``).

    llm = LLM(model=..., enable_lora=True, max_lora_rank=16, max_loras=1,
              weight_transfer_config={"backend": "refit"})
    llm.init_weight_transfer_engine({"init_info": {"coordinator": ..., "group": "engine",
        "adapter": {"name": "policy", "id": 1, "r": 8, "lora_alpha": 16,
                    "target_modules": ["q_proj", "v_proj"]}}})
    ... llm.update_weights(...) as for base weights, then
    llm.generate(prompts, params, lora_request=LoRARequest("policy", 1, "refit://policy"))

Why this landing.  vLLM 0.32 keeps an adapter twice on each worker: as a `LoRAModel` registered
in the LoRA manager (whole-shaped, B already multiplied by the scaling: ``optimize()``, q/k/v and
gate/up packed per module), and, while active, copied into one slot of every LoRA layer's
``lora_a_stacked`` / ``lora_b_stacked`` (``set_lora``, which takes this TP rank's slices), which
is all the forward pass reads.  At init the landing registers a `LoRAModel` of zeros under the
adapter's int id (a request naming that id then loads nothing from a path:
``LRUCacheWorkerLoRAManager.add_adapter`` finds it registered) and pins it into a slot
(``pin_adapter``).  A refit moves this rank's slices of A and B (`refit.layouts.vllm_lora`) into
staging tensors in the LoRA dtype; after the commit, inside ``update_weights`` (between engine
steps), `AdapterLanding.apply` writes them into the same places of the registered `LoRAModel`
(A as it came, B times the scaling as ``LoRALayerWeights.optimize`` does: ``lora_b *= scaling``
in the LoRA dtype) and activates it again through vLLM's own ``activate_adapter``, whose
``set_lora`` resets the slot and copies this rank's slices in: the slot switches whole, and holds
what loading the saved adapter from disk gives, bit for bit.  The rest of the `LoRAModel`
(other ranks' slices) stays zero; ``set_lora`` never reads it.  A failed refit never reaches
``apply``: the slot keeps the previous version.

vLLM drops every adapter after a weight update (``finish_weight_update`` ->
``reset_lora_state`` -> ``remove_all_adapters``, pinned ones too: it assumes adapters loaded from
paths, reloaded on the next request).  An adapter that refit lands has no path: the landing wraps
the manager's ``remove_all_adapters`` so that, after it, the refit adapters are registered and
pinned again from their `LoRAModel`, which holds the last committed version (the adapter's
values do not depend on the base weights).

Refused at ``init_weight_transfer_engine``, before the engine registers and so before any byte
moves, naming the numbers: an engine without LoRA, a rank above ``max_lora_rank``, a target the
engine's LoRA layers do not hold (its ``lora_target_modules``), no slot left to pin (every one of
``max_loras`` holds a pinned adapter), an id already loaded from a path, fully sharded LoRA.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Annotated, Any, Union

import torch
from pydantic import Field

from refit.adapters import TARGETS
from refit.dtypes import DTYPE_BYTES
from refit.errors import InvalidInput
from refit.layouts import Layout
from refit.integrations.vllm import compat
from refit.layouts.vllm_lora import vllm_module
from refit.spec import ModelSpec, adapter_spec
from refit.validation import check_fields, parse

log = logging.getLogger(__name__)

@dataclass
class AdapterInfo:
    """``init_info["adapter"]``, declared once (`refit.validation`), in PEFT's ``LoraConfig`` names."""

    name: Annotated[str, Field(min_length=1, description="the adapter's name in vLLM (its LoRARequest's)")]
    id: Annotated[int, Field(ge=1, description="vLLM's lora_int_id (from 1)")]
    r: Annotated[int, Field(ge=1, description="the LoRA rank")]
    lora_alpha: Annotated[float, Field(gt=0)]
    target_modules: Annotated[Union[str, list[str]], Field(description="PEFT's target modules")]
    use_rslora: bool = False

    def __post_init__(self) -> None:
        check_fields(self, "init_info.adapter")


def adapter_of(info: dict[str, Any]) -> tuple[str, int, int, list[str], float]:
    """(name, int id, rank, targets, scaling) of an ``init_info["adapter"]`` entry."""
    a = parse(AdapterInfo, info, "init_info.adapter")
    name, lora_id, r, alpha = a.name, a.id, a.r, a.lora_alpha
    targets = [a.target_modules] if isinstance(a.target_modules, str) else list(a.target_modules)
    targets = sorted(set(map(str, targets)), key=lambda t: (list(TARGETS).index(t) if t in TARGETS else len(TARGETS), t))
    # PEFT's scaling (LoraLayer.update_layer), which vLLM's PEFTHelper computes alike
    scaling = alpha / math.sqrt(r) if a.use_rslora else alpha / r
    return name, lora_id, r, targets, float(scaling)


class AdapterLanding:
    """The `refit.engine.landing.Landing` of an adapter-only engine: ``tensors`` are staging
    tensors of this rank's slices (never phased); ``apply`` writes them into the slot."""

    phase_layers = 0
    window = None
    direct_nbytes = 0
    stages = True  # the slot switches whole at `apply`: atomic refits need nothing more
    tensors: dict[str, torch.Tensor]  # staging of this rank's slices of A and B
    nbytes: int

    def __init__(self, model: torch.nn.Module, base: ModelSpec, layout: Layout, rank: int, device: torch.device,
                 adapter: dict[str, Any]) -> None:
        self.name, self.id, r, targets, self.scaling = adapter_of(adapter)
        self.manager = getattr(model, "lora_manager", None)
        if self.manager is None:
            raise InvalidInput(f"init_info adapter {self.name!r}: this engine has no LoRA: start it with "
                               f"enable_lora=True (and max_lora_rank >= {r}, max_loras >= 1)")
        lc = self.manager.lora_config
        if lc.fully_sharded_loras:
            raise InvalidInput("init_info adapter: fully_sharded_loras engines split LoRA otherwise than refit's "
                               "vllm layout places it; start the engine without it")
        if r > lc.max_lora_rank:
            raise InvalidInput(f"init_info adapter {self.name!r}: LoRA rank {r} exceeds the engine's max_lora_rank "
                               f"{lc.max_lora_rank}: start the engine with max_lora_rank >= {r}")
        dtype = str(lc.lora_dtype).removeprefix("torch.")
        dtype = dtype if dtype in DTYPE_BYTES else base.config.dtype  # "auto": the model's
        self.spec = adapter_spec(base, r, targets, self.scaling, dtype=dtype, name=f"{base.name}:{self.name}")
        self.layout = layout.resolve(self.spec)
        self._check_targets(base, targets)
        self.device = device
        self.local = self.layout.local_tensors(self.spec, rank)
        self._check_slots()
        self._pieces = {lt.name: lt.pieces[0] for lt in self.local}
        self.tensors = {lt.name: torch.zeros(lt.shape, dtype=getattr(torch, lt.dtype), device=device)
                        for lt in self.local}
        self.staging = self.tensors
        self.nbytes = self.unphased_nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        self._pin()
        log.info("refit landing, rank %d: adapter %r (LoRA id %d, rank %d of max_lora_rank %d, scaling %g, %s) in "
                 "slot %d of %d; %d tensors, %.3f MiB staged", rank, self.name, self.id, r, lc.max_lora_rank,
                 self.scaling, ",".join(targets), self.slot, lc.max_loras, len(self.tensors), self.nbytes / 2**20)

    def _check_targets(self, base: ModelSpec, targets: list[str]) -> None:
        """Every target's vLLM LoRA module exists in every layer (the engine's lora_target_modules
        may leave some out)."""
        held = self.manager.modules
        for target in targets:
            absent = [layer for layer in range(base.config.num_layers) if vllm_module(target, layer)[0] not in held]
            if absent:
                module = vllm_module(target, absent[0])[0]
                allowed = self.manager.lora_config.target_modules
                raise InvalidInput(f"init_info adapter {self.name!r}: target {target} has no LoRA layer in this engine "
                                   f"({module} is not a LoRA module on {len(absent)} of {base.config.num_layers} layers; "
                                   f"the engine's lora_target_modules: {allowed or 'all supported'})")

    def _pin(self) -> None:
        """Register a zero adapter under the id and pin it into a slot (see the module docstring).
        One refit adapter per engine: one registered before (an earlier init) is replaced, or kept
        with the version it holds when it is this very adapter."""
        m = self.manager
        registered = m.list_adapters()
        mine: dict[int, AdapterLanding] = getattr(m, "refit_adapters", {})
        if self.id in registered and self.id not in mine:
            raise InvalidInput(f"init_info adapter {self.name!r}: LoRA id {self.id} is already loaded in this engine "
                               f"(from a path): give refit's adapter an id of its own")
        pinned = sorted(i for i in compat.pinned_adapters(m) if i not in mine)  # refit's own are replaced
        if len(pinned) >= m.lora_slots:
            raise InvalidInput(f"init_info adapter {self.name!r}: max_loras {m.lora_slots}, and all {len(pinned)} "
                               f"slots hold pinned adapters (ids {pinned}): start the engine with max_loras >= "
                               f"{len(pinned) + 1}")
        same = mine.get(self.id)
        if same is not None and same.spec.config == self.spec.config:
            self.lora_model = same.lora_model  # registered again: it holds the version landed
        else:
            same = None
            self.lora_model = self._zero_model()
        for other in list(mine):
            if mine[other] is not same:
                m.remove_adapter(other)
                del mine[other]
        if not hasattr(m, "refit_adapters"):
            m.refit_adapters = {}
            compat.keep_through_resets(m, lambda: [a.restore() for a in list(m.refit_adapters.values())])
        m.refit_adapters[self.id] = self
        self.restore()

    def restore(self) -> None:
        """Registered and pinned (again): after init, and after vLLM dropped every adapter."""
        m = self.manager
        if self.id not in m.list_adapters():
            m.add_adapter(self.lora_model)
        m.pin_adapter(self.id)
        self.slot = m.lora_index_to_id.index(self.id)

    def _zero_model(self) -> Any:
        from refit.adapters import check_adapter, target_shape

        LoRAModel, LoRALayerWeights = compat.lora_model_classes()

        c, dtype = self.spec.config, getattr(torch, self.spec.config.dtype)
        lora = check_adapter(c)
        loras = {}
        for layer in range(c.num_layers):
            for target in lora.targets:
                rows, cols = target_shape(c, target)
                name = f"model.layers.{layer}.{TARGETS[target]}.{target}"
                loras[name] = LoRALayerWeights(name, lora.rank, 1, torch.zeros(lora.rank, cols, dtype=dtype),
                                               torch.zeros(rows, lora.rank, dtype=dtype), scaling=1.0)
        return LoRAModel(self.id, lora.rank, loras)

    def _check_slots(self) -> None:
        """Each local tensor fits the live LoRA layer's slot (refit's layout = vLLM's slicing)."""
        for lt in self.local:
            module_name, attr, index = lt.name.rsplit(".", 2)
            stacked = getattr(self.manager.modules[module_name], attr)[int(index)]  # [max_loras, 1, rows, cols]
            rows, cols = lt.shape
            fits = (stacked.shape[2] >= rows and stacked.shape[3] == cols) if attr == "lora_a_stacked" else \
                (stacked.shape[2] == rows and stacked.shape[3] >= cols)
            if not fits:
                raise InvalidInput(f"vllm: {lt.name} is {list(stacked.shape[2:])} per slot in the live engine, refit's "
                                   f"layout lands {list(lt.shape)} in it")

    def _target(self, name: str) -> torch.Tensor:
        """Where local tensor ``name`` lies in the registered `LoRAModel` (whole-shaped tensors;
        looked up at every refit: vLLM may swap them for pinned copies when it registers them)."""
        module_name, attr, index = name.rsplit(".", 2)
        lora = self.lora_model.loras[module_name]
        full = lora.lora_a if attr == "lora_a_stacked" else lora.lora_b
        full = full[int(index)] if isinstance(full, list) else full
        piece = self._pieces[name]
        return full[piece.start[1]:piece.start[1] + piece.size[1], piece.start[2]:piece.start[2] + piece.size[2]]

    # ------------------------------------------------------------------ a refit
    def begin(self) -> None:
        pass

    def check(self, plan: Any) -> None:
        pass  # never phased: the agent holds no phase hook

    def landed(self, plan: Any, phase: int) -> None:
        pass

    @torch.no_grad()
    def apply(self, model_config: Any = None) -> float:
        """Write the committed adapter into its `LoRAModel` and switch the slot to it (between
        engine steps)."""
        t0 = time.perf_counter()
        for name, staged in self.tensors.items():
            target = self._target(name)
            if ".lora_b_stacked." in name and self.scaling != 1:
                target.copy_(staged * self.scaling)  # vLLM's optimize(): lora_b *= scaling, in the LoRA dtype
            else:
                target.copy_(staged)
        self.manager.deactivate_adapter(self.id)  # unpins it from its slot; activated again at once
        self.restore()
        return time.perf_counter() - t0
