"""`refit.executor.topology`: members, devices and the one driver per device."""

from __future__ import annotations

from refit.executor.topology import Topology, endpoint_name, endpoints
from refit.plan import Placement
from refit.sides import Side


def test_colocated_one_per_rank_engines_drive() -> None:
    topo = Topology.one_per_rank(Placement.make("colocated", 4, 2))
    assert topo.members[:2] == (((Side.TRAINER, 0),), ((Side.TRAINER, 1),)) and len(topo.members) == 6
    # GPUs 0-1 hold a source and a destination: the destination drives; GPUs 2-3 only sources.
    assert topo.driver_of == {0: 4, 1: 5, 2: 2, 3: 3}
    assert topo.drivers == (2, 3, 4, 5) and [topo.comm_rank(m) for m in topo.drivers] == [0, 1, 2, 3]
    assert topo.driven_devices(0) == [] and topo.driven_devices(4) == [0]
    assert topo.endpoints_on(1) == [(Side.TRAINER, 1), (Side.ENGINE, 1)]
    assert topo.member_devices(5) == [1] and topo.member_of[(Side.ENGINE, 1)] == 5


def test_disaggregated_and_single() -> None:
    place = Placement.make("disaggregated", 2, 2)
    topo = Topology.one_per_rank(place)
    assert topo.device_of == {(Side.TRAINER, 0): 0, (Side.TRAINER, 1): 1, (Side.ENGINE, 0): 2, (Side.ENGINE, 1): 3}
    assert topo.drivers == (0, 1, 2, 3)  # every rank alone on its GPU drives it
    one = Topology.single(place)
    assert one.drivers == (0,) and one.driven_devices(0) == [0, 1, 2, 3]
    assert one.describe_member(0) == "trainer rank 0, trainer rank 1, engine rank 0, engine rank 1"
    assert endpoint_name((Side.ENGINE, 3)) == "engine rank 3"


def test_endpoints_are_trainers_then_engines() -> None:
    place = Placement.make("colocated", 2, 1)
    assert endpoints(place) == [(Side.TRAINER, 0), (Side.TRAINER, 1), (Side.ENGINE, 0)]
    assert [ep for (ep,) in Topology.one_per_rank(place).members] == endpoints(place)


def test_lowest_source_drives_a_device_without_destination() -> None:
    topo = Topology((((Side.TRAINER, 1),), ((Side.TRAINER, 0),)), (((Side.TRAINER, 1), 0), ((Side.TRAINER, 0), 0)))
    assert topo.driver_of == {0: 1} and topo.drivers == (1,)


# ------------------------------------------------------------------ GPU identity (fake visible lists)

from refit.executor.topology import GpuSeat, all_visible, local_indices, number_gpus  # noqa: E402

ALL = ("uuid-a", "uuid-b", "uuid-c", "uuid-d")


def test_one_machine_everything_visible_keeps_torch_indices() -> None:
    """The usual single machine: ids are torch indices, and every process maps them to themselves."""
    seats = [GpuSeat("h", ALL[g], ALL) for g in (2, 0, 2, 0)]  # src0 on 2, src1 on 0, dst0 on 2, dst1 on 0
    ids = number_gpus(seats)
    assert ids == [2, 0, 2, 0] and all_visible(seats)
    assert local_indices(seats, ids, seats[0]) == ((0, 0), (2, 2))


def test_ray_isolation_each_process_sees_its_gpu_as_cuda0() -> None:
    """Ray's default: each actor sees only its GPU, as index 0.  Two GPUs of one host stay two
    devices; a colocated pair (one GPU) stays one; a peer's GPU is not visible (no ipc)."""
    seats = [GpuSeat("h", "uuid-a", ("uuid-a",)), GpuSeat("h", "uuid-b", ("uuid-b",)),
             GpuSeat("h", "uuid-a", ("uuid-a",)), GpuSeat("h", "uuid-b", ("uuid-b",))]
    ids = number_gpus(seats)
    assert ids == [0, 1, 0, 1] and not all_visible(seats)
    assert local_indices(seats, ids, seats[0]) == ((0, 0), (1, None))
    assert local_indices(seats, ids, seats[3]) == ((0, None), (1, 0))


def test_all_gpus_visible_in_another_order() -> None:
    """Every process sees every GPU but in its own order (CUDA_VISIBLE_DEVICES permuted): one
    device per UUID, each process maps it to its own index."""
    seats = [GpuSeat("h", "uuid-a", ("uuid-a", "uuid-b")), GpuSeat("h", "uuid-b", ("uuid-b", "uuid-a"))]
    ids = number_gpus(seats)
    assert ids == [0, 1] and all_visible(seats)
    assert local_indices(seats, ids, seats[0]) == ((0, 0), (1, 1))
    assert local_indices(seats, ids, seats[1]) == ((0, 1), (1, 0))


def test_two_hosts_same_uuid_text_are_two_devices() -> None:
    """Two Ray nodes on one machine are two hosts: a GPU of the other host is never local, even
    where (fake) UUIDs collide, and host b's own GPUs map to its indices."""
    seats = [GpuSeat("a", "uuid-a", ALL[:2]), GpuSeat("b", "uuid-a", ALL[:2]), GpuSeat("b", "uuid-b", ALL[:2])]
    ids = number_gpus(seats)
    assert ids == [0, 1, 2] and not all_visible(seats)
    assert local_indices(seats, ids, seats[1]) == ((0, None), (1, 0), (2, 1))


def test_topology_torch_index() -> None:
    topo = Topology.one_per_rank(Placement.make("colocated", 2, 2))
    assert topo.torch_index(1) == 1  # no local view: ids are torch indices
    local = Topology(topo.members, topo.devices, ((0, 0), (1, None)))
    assert (local.torch_index(0), local.torch_index(1), local.torch_index(5)) == (0, None, None)
