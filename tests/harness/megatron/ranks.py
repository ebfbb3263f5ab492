"""Rank coordinates as Megatron assigns them, two ways:

* ``megatron_rank_coords``            -> ``parallel_state.RankGenerator.get_ranks`` (pure, in process)
* ``megatron_rank_coords_via_initialize`` -> the full ``parallel_state.initialize_model_parallel``
  + ``get_*_rank()`` getters, once per global rank, on torch's in-memory "fake" process-group
  backend (subprocess)
"""

from __future__ import annotations

from typing import Optional

from tests.harness.megatron.cpu import fake_world, install_cpu_shims, ps_coords, teardown_world
from tests.harness.megatron.worker import register, run_subprocess


DEFAULT_ORDER = "tp-cp-ep-dp-pp"  # parallel_state.initialize_model_parallel(order=...) default


def megatron_rank_coords(
    world_size: int,
    tp: int,
    pp: int,
    cp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    order: str = DEFAULT_ORDER,
) -> list[dict[str, int]]:
    """Per global rank: {'tp','cp','dp','pp','etp','ep','edp'} as Megatron assigns them.

    Builds the same two ``RankGenerator`` objects ``initialize_model_parallel`` builds
    (parallel_state.py: ``decoder_rank_generator`` with ep=1 and ``expert_decoder_rank_generator``
    with cp=1) and reads every coordinate off the group-membership lists ``get_ranks(token)``
    returns: a rank's coordinate along a dimension is its index in the (ascending) group list that
    contains it -- exactly what ``torch.distributed.get_rank(group)`` returns for those groups.

    The dp/edp sizes and the two divisibility errors replicate the first lines of
    ``initialize_model_parallel`` (dp = world // (tp*pp*cp), edp = world // (etp*ep*pp),
    etp=None -> tp). ``megatron_rank_coords_via_initialize`` runs the real function instead.
    """
    from megatron.core.parallel_state import RankGenerator

    if etp is None:
        etp = tp
    model_size = tp * pp * cp
    if world_size % model_size != 0:
        raise RuntimeError(f"world_size ({world_size}) is not divisible by {model_size}")
    dp = world_size // model_size
    etmp = etp * ep * pp
    if world_size % etmp != 0:
        raise RuntimeError(
            f"world_size ({world_size}) is not divisible by expert_tensor_model_pipeline_parallel"
            f" size ({etmp})"
        )
    edp = world_size // etmp

    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order, rank_offset=0)
    expert = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order, rank_offset=0)
    assert (
        order.endswith("pp") or pp == 1 or edp == dp
    ), "When not using pp-last rank ordering, the data parallel size of the attention and moe layers must be the same"
    if dense.get_ranks("pp") != expert.get_ranks("pp"):
        raise AssertionError(
            "Pipeline parallel groups are expected to be the same for Non-Expert and Expert part"
        )

    coords: list[dict[str, int]] = [dict() for _ in range(world_size)]

    def fill(gen, token: str, key: str) -> None:
        seen = set()
        for group in gen.get_ranks(token):
            assert list(group) == sorted(group), (token, group)
            for idx, r in enumerate(group):
                assert r not in seen, (token, r)
                seen.add(r)
                coords[r][key] = idx
        assert seen == set(range(world_size)), (token, sorted(seen))

    # key order matches the documented dict layout
    fill(dense, "tp", "tp")
    fill(dense, "cp", "cp")
    fill(dense, "dp", "dp")
    fill(dense, "pp", "pp")
    fill(expert, "tp", "etp")
    fill(expert, "ep", "ep")
    fill(expert, "dp", "edp")
    return [
        {k: c[k] for k in ("tp", "cp", "dp", "pp", "etp", "ep", "edp")} for c in coords
    ]


def megatron_rank_coords_via_initialize(
    world_size: int,
    tp: int,
    pp: int,
    cp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    order: str = DEFAULT_ORDER,
    vpp: Optional[int] = None,
) -> list[dict[str, int]]:
    """Same as ``megatron_rank_coords`` but by running the complete
    ``parallel_state.initialize_model_parallel`` once per global rank (fake process groups) and
    reading ``get_tensor_model_parallel_rank()``, ``get_context_parallel_rank()``,
    ``get_data_parallel_rank()``, ``get_pipeline_model_parallel_rank()``,
    ``get_expert_tensor_parallel_rank()``, ``get_expert_model_parallel_rank()``,
    ``get_expert_data_parallel_rank()``.  Raises whatever initialize_model_parallel raises."""
    return run_subprocess(
        "rank_coords_via_initialize",
        world_size=world_size,
        tp=tp,
        pp=pp,
        cp=cp,
        ep=ep,
        etp=etp,
        order=order,
        vpp=vpp,
    )


@register("rank_coords_via_initialize")
def _impl_rank_coords_via_initialize(world_size, tp, pp, cp, ep, etp, order, vpp):
    install_cpu_shims()
    from megatron.core import parallel_state as ps

    out = []
    for r in range(world_size):
        fake_world(r, world_size)
        try:
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=vpp,
                context_parallel_size=cp,
                expert_model_parallel_size=ep,
                expert_tensor_parallel_size=etp,
                order=order,
                create_gloo_process_groups=False,
            )
            out.append(ps_coords())
        finally:
            teardown_world()
    return out
