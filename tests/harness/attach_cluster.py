"""Shared machinery of the attach tests: a coordinator and engine agents in the test process,
trainer ranks in spawned processes (real gloo default group, real FSDP2 / megatron-core), and the
independent reference the engines are compared with.

Reference.  The engines' tensors (vLLM layout) must equal, bit for bit, what `refit.reshard`'s
offline path makes of an HF checkpoint of the trainer's weights, where that checkpoint comes from
the framework itself (``save_pretrained``, ``DTensor.full_tensor()``, Megatron's own
``sharded_state_dict`` placement) and never from the integration under test.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from typing import Any, Callable

import torch
from safetensors.torch import load_file

from refit.control.agent import EngineAgent
from refit.layouts import HFLayout, resolve_layout
from refit.reshard import SafetensorsWriter, rank_file, reshard
from refit.sides import Side
from refit.spec import ModelSpec

from tests.harness.procs import warm_context

CTX = warm_context()  # its processes fork from a server that imported torch once


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_hf(directory: str, tensors: dict[str, torch.Tensor]) -> None:
    os.makedirs(directory, exist_ok=True)
    names = sorted(tensors)
    dt = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}
    w = SafetensorsWriter(os.path.join(directory, "model.safetensors"),
                          [(n, tuple(tensors[n].shape), dt[tensors[n].dtype]) for n in names], {"format": "pt"})
    for n in names:
        w.write(n, tensors[n])
    w.close()


def expected_engine_tensors(spec: ModelSpec, layout: str, hf_dir: str) -> list[dict[str, torch.Tensor]]:
    """The vLLM-layout tensors of every engine rank, from an HF checkpoint, by the offline path."""
    dst = resolve_layout(layout, spec, Side.ENGINE)
    with tempfile.TemporaryDirectory() as out:
        reshard(spec, HFLayout(), dst, hf_dir, out)
        return [load_file(rank_file(out, r)) for r in range(dst.world_size)]


class Engines:
    """Engine agents of one vLLM layout in this process, their tensors zeroed at start."""

    def __init__(self, address: str, spec: ModelSpec, layout: str, group: str = "engine") -> None:
        self.layout = resolve_layout(layout, spec, Side.ENGINE)
        self.tensors = [{lt.name: torch.zeros(lt.shape, dtype=getattr(torch, lt.dtype))  # float32 router biases
                         for lt in self.layout.local_tensors(spec, r)} for r in range(self.layout.world_size)]
        self.agents = [EngineAgent(address, group=group, rank=r, spec=spec, layout=self.layout,
                                   tensors=self.tensors[r]).start() for r in range(self.layout.world_size)]

    def mismatches(self, expected: list[dict[str, torch.Tensor]]) -> list[str]:
        """Every local tensor compared bit for bit; the names that differ."""
        bad = []
        for r, (got, want) in enumerate(zip(self.tensors, expected)):
            assert set(got) == set(want), (r, set(got) ^ set(want))
            for n in want:
                if got[n].dtype != want[n].dtype or not torch.equal(got[n].flatten().view(torch.uint8),
                                                                   want[n].flatten().view(torch.uint8)):
                    bad.append(f"engine/{r} {n}")
        return bad

    def close(self) -> None:
        for a in self.agents:
            a.stop()
        for a in self.agents:
            a.data_plane.close()


def make_hf_model(cls_name: str, seed: int = 0, **cfg: Any) -> torch.nn.Module:
    """A tiny transformers model in bf16 whose every parameter holds random values (norms included)."""
    import transformers

    config_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config_cls(**cfg)).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def train_step(model: torch.nn.Module, seed: int) -> None:
    """One real optimizer step: the parameters change in place."""
    torch.manual_seed(seed)
    x = torch.randint(0, model.config.vocab_size, (2, 6))
    loss = model(x).logits.float().pow(2).mean()
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    model.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------------------------
# Trainer processes


def _trainer_main(conn: Any, rank: int, world: int, port: int, builder: Callable[..., Any], args: tuple) -> None:
    """One trainer rank: gloo default group, ``builder(rank, world, *args)`` builds the model and
    attaches it, returning a handler of test commands; then serve the pipe."""
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
        agent, handle = builder(rank, world, *args)
        conn.send(("ready", agent.spec if agent is not None else None))
    except BaseException as e:  # reported to the test (an attach refused is an expected outcome)
        conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            agent.stop()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", handle(cmd, arg)))
        except BaseException as e:
            conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))


class Trainers:
    """``world`` spawned trainer ranks running ``builder`` (a top-level function)."""

    def __init__(self, world: int, builder: Callable[..., Any], *args: Any) -> None:
        port = free_port()
        self.conns, self.procs = [], []
        for r in range(world):
            parent, child = CTX.Pipe()
            p = CTX.Process(target=_trainer_main, args=(child, r, world, port, builder, args), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def ready(self, timeout: float = 300.0) -> list[Any]:
        """Each rank's answer: ("ready", spec) or ("error", message, traceback)."""
        out = []
        for c in self.conns:
            assert c.poll(timeout), "a trainer rank did not start"
            out.append(c.recv())
        return out

    def ask(self, cmd: str, arg: Any = None, timeout: float = 300.0) -> list[Any]:
        for c in self.conns:
            c.send((cmd, arg))
        out = []
        for c in self.conns:
            assert c.poll(timeout), f"no answer to {cmd}"
            msg = c.recv()
            assert msg[0] == "ok", msg[1:]
            out.append(msg[1])
        return out

    def close(self) -> None:
        for c, p in zip(self.conns, self.procs):
            if p.is_alive():
                try:
                    c.send(("stop", None))
                    c.poll(10)
                except (OSError, EOFError):
                    pass
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
