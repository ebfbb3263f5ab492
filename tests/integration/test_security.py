"""A process without the coordinator's token learns nothing of a refit's rendezvous and changes
nothing of it, whatever port of the coordinator it reaches.

The repro this guards against: `REFIT_TOKEN=... refit serve`, two trainer and two engine agents,
one refit, then a torch ``TCPStore`` client on the port the coordinator's log printed for its
rendezvous store: ``list_keys()`` gave every key (the per-generation secret prefix, the members'
gloo addresses and device records), and ``set`` / ``delete_key`` could change them.  Now the store
is part of the gRPC service, under the token; the coordinator listens on no other port.
"""

from __future__ import annotations

import datetime
import os
import secrets
import subprocess
import sys
import time

import grpc
import pytest
import torch
import torch.distributed as dist

from refit.control.agent import EngineAgent, TrainerAgent
from refit.control.client import Client
from refit.control.common import auth_metadata
from refit.control.v1 import refit_pb2 as pb
from refit.control.v1 import refit_pb2_grpc as pb_grpc
from refit.layouts import resolve_layout
from refit.sides import Side
from tests.harness.attach_cluster import free_port
from tests.harness.control_cluster import DST, MODEL, SRC, fill
from tests.harness.tiny import tiny_spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (from /proc: its sockets in state LISTEN)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.fixture()
def served():
    """`refit serve` in its own process, with $REFIT_TOKEN."""
    token, port = secrets.token_hex(16), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "refit.cli", "serve", "--port", str(port), "-v"], cwd=ROOT,
                            env={**os.environ, "REFIT_TOKEN": token, "PYTHONPATH": ROOT},
                            stderr=subprocess.PIPE, text=True)
    address = f"127.0.0.1:{port}"
    client = Client(address, token=token)
    end = time.monotonic() + 60
    while True:
        try:
            if client.health() == "SERVING":
                break
        except grpc.RpcError:
            pass
        assert proc.poll() is None and time.monotonic() < end, "refit serve did not start"
        time.sleep(0.1)
    yield proc, address, token, client
    client.close()
    proc.terminate()
    proc.communicate(timeout=30)


def test_no_port_of_the_coordinator_gives_the_rendezvous_away(served) -> None:
    proc, address, token, client = served
    spec = tiny_spec(MODEL)
    src, dst = resolve_layout(SRC, spec, Side.TRAINER), resolve_layout(DST, spec, Side.ENGINE)
    got = [fill(spec, dst, r, 0) for r in range(dst.world_size)]
    agents = [TrainerAgent(address, group="t", rank=r, spec=spec, layout=src, tensors=fill(spec, src, r, 1),
                           token=token).start() for r in range(src.world_size)]
    agents += [EngineAgent(address, group="e", rank=r, spec=spec, layout=dst, tensors=got[r], token=token).start()
               for r in range(dst.world_size)]
    try:
        plan = client.create_plan("t", "e")["plan_id"]
        assert client.refit(plan, version=1, timeout=60).ok

        # The repro: a TCPStore client on every port the coordinator listens on.
        ports = listening_ports(proc.pid)
        for port in ports:
            with pytest.raises(Exception):  # noqa: B017 - any refusal will do: nothing is listed
                store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=5))
                store.list_keys()
        assert ports == {int(address.rsplit(":", 1)[1])}, ports  # the gRPC port, nothing else

        # The store's own calls, without the token or with a wrong one: refused, nothing read.
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            calls = [lambda md: stub.StoreGet(pb.StoreGetRequest(prefix="", keys=["device/0"]), metadata=md),
                     lambda md: stub.StoreSet(pb.StoreSetRequest(prefix="", keys=["device/0"], values=[b"x"]),
                                              metadata=md),
                     lambda md: stub.StoreAdd(pb.StoreAddRequest(prefix="", key="n", amount=1), metadata=md),
                     lambda md: stub.ListWorkers(pb.ListWorkersRequest(), metadata=md)]
            for md in ((), auth_metadata("wrong")):
                for call in calls:
                    with pytest.raises(grpc.RpcError) as e:
                        call(md)
                    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # With the token but without the members' secret prefix, a key space is not found.
            with pytest.raises(grpc.RpcError) as e:
                stub.StoreGet(pb.StoreGetRequest(prefix=secrets.token_hex(16) + "/1/", keys=["device/0"]),
                              metadata=auth_metadata(token))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND

        # The probes changed nothing: the next refit lands bit for bit.
        for a in agents[:src.world_size]:
            fill(spec, src, a.rank, 2, a.tensors)
        assert client.refit(plan, version=2, timeout=60).ok
        for r in range(dst.world_size):
            want = fill(spec, dst, r, 2)
            assert [n for n in want if not torch.equal(want[n].view(torch.int16), got[r][n].view(torch.int16))] == []
    finally:
        for a in agents:
            a.stop()


def test_one_environment_configures_every_entry_point(served, monkeypatch: pytest.MonkeyPatch) -> None:
    """$REFIT_ADDRESS and $REFIT_TOKEN reach the coordinator from a `Client` and agents that name
    neither: before, only `refit serve` read the token, and every other entry point needed it by hand."""
    from refit import settings

    proc, address, token, _ = served
    monkeypatch.setenv("REFIT_ADDRESS", address)
    monkeypatch.setenv("REFIT_TOKEN", token)
    settings.reload()
    spec = tiny_spec(MODEL)
    src, dst = resolve_layout(SRC, spec, Side.TRAINER), resolve_layout(DST, spec, Side.ENGINE)
    got = [fill(spec, dst, r, 0) for r in range(dst.world_size)]
    agents = [TrainerAgent(group="env-t", rank=r, spec=spec, layout=src, tensors=fill(spec, src, r, 1)).start()
              for r in range(src.world_size)]
    agents += [EngineAgent(group="env-e", rank=r, spec=spec, layout=dst, tensors=got[r]).start()
               for r in range(dst.world_size)]
    try:
        with Client() as client:
            assert client.address == address
            plan = client.create_plan("env-t", "env-e")["plan_id"]
            assert client.refit(plan, version=1, timeout=60).ok
        want = [fill(spec, dst, r, 1) for r in range(dst.world_size)]
        assert all(torch.equal(want[r][n].view(torch.int16), got[r][n].view(torch.int16))
                   for r in range(dst.world_size) for n in want[r])
    finally:
        for a in agents:
            a.stop()
        monkeypatch.delenv("REFIT_ADDRESS")
        monkeypatch.delenv("REFIT_TOKEN")
        settings.reload()
