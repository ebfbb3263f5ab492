"""The vLLM landing's decisions, without an engine (real vLLM quant-method classes, toy modules).

* `landing_path`: vLLM 0.32's unquantized linear / embedding methods re-process on CPU (GEMM
  prepacking) but not on CUDA, where the weights go in place; a module without post-load
  processing goes in place when shape and dtype match, and is refused otherwise.
* `Landing` bookkeeping: with ``bounded`` staging the agent's tensors for in-place parameters *are*
  the live parameters (same storage, nothing staged); with ``atomic`` everything is staged and
  copied in on `apply`, bit-exact; a bad mode is refused.
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
    from tests.harness.vllm_capture.make_models import make_tiny_qwen3

    d = str(tmp_path_factory.mktemp("tiny"))
    make_tiny_qwen3(d, seed=1)
    spec = load_spec(d)
    return spec, resolve_layout("vllm:tp2", spec, "dst")


def test_bounded_registers_live_tensors(spec_layout) -> None:
    from refit.integrations.vllm.landing import Landing

    spec, layout = spec_layout
    local = layout.local_tensors(spec, 1)
    model = toy_model(local)
    landing = Landing(model, spec, layout, 1, CPU, "bounded")
    assert landing.staging == {} and landing.nbytes == 0
    for lt in local:
        live = model.get_parameter(lt.name)
        assert landing.tensors[lt.name].data_ptr() == live.data_ptr(), lt.name
    assert landing.direct_nbytes == sum(t.numel() * t.element_size() for t in model.parameters())


def test_atomic_stages_and_applies_exactly(spec_layout) -> None:
    from refit.integrations.vllm.landing import Landing

    spec, layout = spec_layout
    local = layout.local_tensors(spec, 0)
    model = toy_model(local)
    before = {lt.name: model.get_parameter(lt.name).clone() for lt in local}
    addresses = {lt.name: model.get_parameter(lt.name).data_ptr() for lt in local}
    landing = Landing(model, spec, layout, 0, CPU, "atomic")
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
    from refit.integrations.vllm.landing import Landing

    spec, layout = spec_layout
    with pytest.raises(RefitError, match="staging must be one of bounded, atomic, not 'lazy'"):
        Landing(toy_model(layout.local_tensors(spec, 0)), spec, layout, 0, CPU, "lazy")
