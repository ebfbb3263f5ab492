"""Where a run's members sit: the rendezvous store they meet in, and `locate`, by which each
publishes its device (a GPU by host and UUID, or ``cpu@host``) and learns everyone's — the
`refit.executor.topology.Topology` of the run, and whether CUDA IPC can join them."""

from __future__ import annotations

import datetime
import json
from typing import Sequence

import torch
import torch.distributed as dist

from refit.errors import InvalidInput
from refit.executor.topology import Endpoint, GpuSeat, Topology, all_visible, local_indices, number_gpus


def connect(host: str, port: int, prefix: str, timeout_s: float) -> dist.Store:
    """The rendezvous store (a client of a ``TCPStore``), keys under ``prefix``."""
    store = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return dist.PrefixStore(prefix, store)


def visible_gpus() -> tuple[str, ...]:
    """The UUIDs of the GPUs this process sees, in torch index order."""
    return tuple(str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count()))


def locate(store: dist.Store, member: int, endpoints: Sequence[Endpoint], device: str, host: str,
           names: Sequence[str]) -> tuple[Topology, bool, bool]:
    """Agents: publish where this member sits (``cpu@host``, or for a GPU its host, UUID and the
    GPUs this process sees), read everyone's, and return the topology (one member per endpoint,
    with this process's torch index of every GPU: `Topology.local`), whether all are on GPUs, and
    whether the ipc transport is possible (one host, every member's GPU visible to every member:
    not so under CUDA_VISIBLE_DEVICES isolation, e.g. Ray's default).  GPUs are told apart by
    UUID, not torch index (`refit.executor.topology.number_gpus`); on CPU every member is its own
    device."""
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        visible = visible_gpus()
        mine = {"host": host, "uuid": visible[index], "visible": list(visible)}
    else:
        mine = {"host": host, "cpu": True}
    store.set(f"device/{member}", json.dumps(mine))
    where = [json.loads(store.get(f"device/{m}")) for m in range(len(endpoints))]
    cuda = all("uuid" in w for w in where)
    if not cuda and any("uuid" in w for w in where):
        raise InvalidInput(f"members mix CPU and GPU tensors: "
                         f"{ {n: 'cuda' if 'uuid' in w else 'cpu' for n, w in zip(names, where)} }")
    one_host = len({w["host"] for w in where}) == 1
    if not cuda:
        devices = tuple((ep, i) for i, ep in enumerate(endpoints))
        return Topology(tuple((ep,) for ep in endpoints), devices), False, one_host
    seats = [GpuSeat(w["host"], w["uuid"], tuple(w["visible"])) for w in where]
    ids = number_gpus(seats)
    topo = Topology(tuple((ep,) for ep in endpoints), tuple(zip(endpoints, ids)),
                    local_indices(seats, ids, seats[member]))
    return topo, True, all_visible(seats)
