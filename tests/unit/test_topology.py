"""`refit.executor.topology`: members, devices and the one driver per device."""

from __future__ import annotations

from refit.executor.topology import Topology, endpoint_name
from refit.plan import Placement


def test_colocated_one_per_rank_engines_drive() -> None:
    topo = Topology.one_per_rank(Placement.make("colocated", 4, 2))
    assert topo.members[:2] == ((("src", 0),), (("src", 1),)) and len(topo.members) == 6
    # GPUs 0-1 hold a source and a destination: the destination drives; GPUs 2-3 only sources.
    assert topo.driver_of == {0: 4, 1: 5, 2: 2, 3: 3}
    assert topo.drivers == (2, 3, 4, 5) and [topo.comm_rank(m) for m in topo.drivers] == [0, 1, 2, 3]
    assert topo.driven_devices(0) == [] and topo.driven_devices(4) == [0]
    assert topo.endpoints_on(1) == [("src", 1), ("dst", 1)]
    assert topo.member_devices(5) == [1] and topo.member_of[("dst", 1)] == 5


def test_disaggregated_and_single() -> None:
    place = Placement.make("disaggregated", 2, 2)
    topo = Topology.one_per_rank(place)
    assert topo.device_of == {("src", 0): 0, ("src", 1): 1, ("dst", 0): 2, ("dst", 1): 3}
    assert topo.drivers == (0, 1, 2, 3)  # every rank alone on its GPU drives it
    one = Topology.single(place)
    assert one.drivers == (0,) and one.driven_devices(0) == [0, 1, 2, 3]
    assert one.describe_member(0) == "src rank 0, src rank 1, dst rank 0, dst rank 1"
    assert endpoint_name(("dst", 3)) == "dst rank 3"


def test_lowest_source_drives_a_device_without_destination() -> None:
    topo = Topology(((("src", 1),), (("src", 0),)), ((("src", 1), 0), (("src", 0), 0)))
    assert topo.driver_of == {0: 1} and topo.drivers == (1,)
