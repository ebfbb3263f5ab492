"""Who runs where: endpoints (source and destination ranks), the processes ("members") holding
them, and the device each endpoint sits on.  Pure data, no torch.

The rule that shapes the executor: **every device has one driver**, the member that moves all
bytes of all endpoints on that device.  The driver is the member holding a destination endpoint
on the device (else the lowest source one); the other members on the device are passive — they
own their shards and export them once (CUDA IPC / shared memory), the driver maps them.

Why: NCCL refuses a communicator with two ranks on one GPU, so colocated trainer and engine
processes cannot both join it.  With one driver per device the data communicator has exactly one
member per GPU; a colocated trainer's shard is read by its GPU's driver through IPC and sent from
there.  It also serialises all of a device's work in one process, so a broadcast root's gathered
data is ready before the same process sends it on, with no cross-process signal.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from refit.plan import Placement
from refit.sides import Side

Endpoint = tuple[Side, int]  # (Side.TRAINER, rank): a source rank; (Side.ENGINE, rank): a destination rank


def endpoint_name(ep: Endpoint) -> str:
    return f"{ep[0].value} rank {ep[1]}"


def endpoint_key(ep: Endpoint) -> str:
    """An endpoint in names other processes find it by (store keys, shared-memory files): ``src0``,
    ``dst1``, the plan's word for its side, as those names have always been."""
    return f"{ep[0].end}{ep[1]}"


def endpoints(placement: Placement) -> list[Endpoint]:
    """Every endpoint of a placement, trainer ranks first: the order of a refit's members."""
    return ([(Side.TRAINER, r) for r in range(len(placement.src_gpus))]
            + [(Side.ENGINE, r) for r in range(len(placement.dst_gpus))])


@dataclass(frozen=True)
class Topology:
    """``members[m]`` lists the endpoints process ``m`` holds; ``devices`` maps every endpoint to
    its device (the placement's GPU index, or a virtual device on CPU)."""

    members: tuple[tuple[Endpoint, ...], ...]
    devices: tuple[tuple[Endpoint, int], ...]
    # This process's view (the rest is the same in every member): device id -> its torch index
    # here, None where that GPU is not visible in this process.  Empty: ids are torch indices.
    local: tuple[tuple[int, int | None], ...] = ()

    @classmethod
    def one_per_rank(cls, placement: Placement) -> "Topology":
        """One process per rank: source ranks first, then destination ranks (the bench's layout)."""
        return cls(tuple((ep,) for ep in endpoints(placement)), cls._devices(placement))

    @classmethod
    def single(cls, placement: Placement) -> "Topology":
        """Every endpoint in one process: all copies are direct (the local transport)."""
        return cls((tuple(endpoints(placement)),), cls._devices(placement))

    @staticmethod
    def _devices(placement: Placement) -> tuple[tuple[Endpoint, int], ...]:
        return tuple([((Side.TRAINER, r), g) for r, g in enumerate(placement.src_gpus)]
                     + [((Side.ENGINE, r), g) for r, g in enumerate(placement.dst_gpus)])

    # ------------------------------------------------------------------ lookups
    @cached_property
    def device_of(self) -> dict[Endpoint, int]:
        return dict(self.devices)

    @cached_property
    def member_of(self) -> dict[Endpoint, int]:
        return {ep: m for m, eps in enumerate(self.members) for ep in eps}

    @cached_property
    def driver_of(self) -> dict[int, int]:
        """Device -> the member that drives it."""
        out: dict[int, int] = {}
        # per device, engine endpoints before trainer ones (False sorts first), then by rank
        for ep, dev in sorted(self.devices, key=lambda x: (x[1], x[0][0] is not Side.ENGINE, x[0][1])):
            out.setdefault(dev, self.member_of[ep])
        return out

    @cached_property
    def drivers(self) -> tuple[int, ...]:
        """Members that drive at least one device, in order; a driver's index here is its rank
        in the data communicator."""
        return tuple(sorted(set(self.driver_of.values())))

    def comm_rank(self, member: int) -> int:
        return self.drivers.index(member)

    def driven_devices(self, member: int) -> list[int]:
        return sorted(d for d, m in self.driver_of.items() if m == member)

    def endpoints_on(self, device: int) -> list[Endpoint]:
        return [ep for ep, d in self.devices if d == device]

    def member_devices(self, member: int) -> list[int]:
        return sorted({self.device_of[ep] for ep in self.members[member]})

    @cached_property
    def _local_index(self) -> dict[int, int | None]:
        return dict(self.local)

    def torch_index(self, device: int) -> int | None:
        """The torch index of ``device`` in this process (None: not visible here)."""
        return self._local_index.get(device) if self.local else device

    def describe_member(self, member: int) -> str:
        return ", ".join(endpoint_name(ep) for ep in self.members[member])


# ---------------------------------------------------------------------------------------------
# GPU identity.  A torch index names a GPU only within one process: under CUDA_VISIBLE_DEVICES
# isolation (Ray's default) every process sees its own GPU as cuda:0.  Members therefore publish
# their GPU's UUID and the UUIDs their process sees (in torch order), and each process maps every
# device to its own index.


@dataclass(frozen=True)
class GpuSeat:
    """Where one member's GPU is: its host, its UUID, and every GPU its process sees (UUIDs in
    torch index order)."""

    host: str
    uuid: str
    visible: tuple[str, ...]


def number_gpus(seats: Sequence[GpuSeat]) -> list[int]:
    """A device id per member; members on one GPU (same host and UUID) share it.  Where every
    member sits on one host and sees the same GPUs in the same order (one machine, nothing
    isolated) the id is the GPU's torch index, as everywhere else in refit; otherwise GPUs are
    numbered in order of first appearance."""
    if len({s.host for s in seats}) == 1 and len({s.visible for s in seats}) == 1 and \
            all(s.uuid in s.visible for s in seats):
        return [s.visible.index(s.uuid) for s in seats]
    ids: dict[tuple[str, str], int] = {}
    return [ids.setdefault((s.host, s.uuid), len(ids)) for s in seats]


def local_indices(seats: Sequence[GpuSeat], ids: Sequence[int], me: GpuSeat) -> tuple[tuple[int, int | None], ...]:
    """For the process at ``me``: every device id and its torch index there, None where that GPU
    is on another host or not visible (then neither peer access nor CUDA IPC reach it: bytes to
    and from it go over the communicator)."""
    out: dict[int, int | None] = {}
    for s, d in zip(seats, ids):
        out[d] = me.visible.index(s.uuid) if s.host == me.host and s.uuid in me.visible else None
    return tuple(sorted(out.items()))


def all_visible(seats: Sequence[GpuSeat]) -> bool:
    """Whether every member sits on one host and sees every member's GPU: the condition for the
    ipc transport (peer pulls between GPUs, CUDA IPC between any two members)."""
    return len({s.host for s in seats}) == 1 and all(o.uuid in s.visible for s in seats for o in seats)
