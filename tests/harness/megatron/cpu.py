"""CPU shims and the fake process-group world, used inside the harness subprocesses only.

Megatron hard-codes CUDA in two construction paths; ``install_cpu_shims`` replaces:
  * ``torch.cuda.current_device = lambda: "cpu"``  (TopKRouter allocates its expert_bias /
    local_tokens_per_expert buffers with ``device=torch.cuda.current_device()``)
  * ``torch.Tensor.cuda = identity``  (LanguageModule.setup_embeddings_and_output_layer does
    ``weight.data.cuda()`` before the tied-embedding all-reduce when pp > 1)
  * only for ``moe_grouped_gemm=True`` with the local spec (done in ``gpt.py``):
    ``grouped_gemm_util.assert_grouped_gemm_is_available`` is bypassed so the legacy ``GroupedMLP``
    can be *constructed* (parameter names/shapes only; its CUDA kernel is never called).
Distributed groups use ``torch.testing._internal.distributed.fake_pg`` (backend ``"fake"``): the
real ``torch.distributed.new_group`` / ``initialize_model_parallel`` code runs and every rank gets
its real group membership and rank, but collectives are no-ops, so any world size can be
simulated one rank at a time in a single process (``fake_world`` / ``teardown_world``;
``ps_coords`` reads the current rank's coordinates off parallel_state).
"""

from __future__ import annotations


def install_cpu_shims() -> None:
    """See the module docstring.  Only ever called inside a harness subprocess."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[assignment]


def fake_world(rank: int, world_size: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def teardown_world() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def ps_coords() -> dict:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_rank(),
        "cp": ps.get_context_parallel_rank(),
        "dp": ps.get_data_parallel_rank(with_context_parallel=False),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "etp": ps.get_expert_tensor_parallel_rank(),
        "ep": ps.get_expert_model_parallel_rank(),
        "edp": ps.get_expert_data_parallel_rank(),
    }
