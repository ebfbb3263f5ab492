"""What a dtype cast on the way costs: a trainer holding the model in float32 (verl's FSDP2
masters) refits a bfloat16 engine, against a bfloat16 trainer doing the same refit.

One trainer process and one engine process (agents of `refit.control`, a loopback coordinator in
this process), on one GPU (colocated: CUDA IPC) or on CPU (gloo).  The trainer's values are random
normals; after every refit the engine's tensors are compared bit for bit with the trainer's
``.to(bfloat16)`` (torch's round to nearest even, the conversion vLLM's loaders make).  Reported:
the median round trip of ``Client.refit`` for each trainer dtype, and the bytes each moved.

    python bench/cast_refit.py --model qwen3-8b --layers 8 --iters 5          # GPU 0 if there is one
    python bench/cast_refit.py --model qwen3-8b --layers 2 --cpu --iters 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

log = logging.getLogger("cast_refit")
CTX = mp.get_context("spawn")


def _rank_main(conn: Any, address: str, spec: Any, role: str, layout: str, device: str) -> None:
    import torch

    from refit.control import EngineAgent, TrainerAgent
    from refit.layouts import resolve_layout
    from refit.sides import Side

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    lay = resolve_layout(layout, spec, Side.named(role))
    tensors = {lt.name: torch.empty(lt.shape, dtype=getattr(torch, lt.dtype), device=dev)
               for lt in lay.local_tensors(spec, 0)}
    cls = TrainerAgent if role == "trainer" else EngineAgent
    gpu = dev.index if dev.type == "cuda" else -1
    agent = cls(address, group=f"{role}-{spec.config.dtype}" if role == "trainer" else role, rank=0, spec=spec,
                layout=lay, tensors=tensors, gpu=gpu).start()
    conn.send("ready")
    while True:
        cmd, arg = conn.recv()
        if cmd == "fill":  # new random weights, and their bf16 image for the check
            gen = torch.Generator(device=dev).manual_seed(arg)
            for t in tensors.values():
                t.normal_(generator=gen)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            conn.send({n: t.to(torch.bfloat16).cpu() for n, t in tensors.items()})
        elif cmd == "get":
            conn.send({n: t.cpu() for n, t in tensors.items()})
        else:
            agent.stop()
            conn.send("bye")
            return


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--layers", type=int, default=8, help="keep the first N decoder layers, full width")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import torch

    import refit
    from refit.bench.smaller_specs import first_layers
    from refit.control.server import ThreadedServer
    from refit.spec import build_spec

    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda:0"
    bf16 = first_layers(refit.load_spec(args.model), args.layers)
    fp32 = build_spec(bf16.name, dataclasses.replace(bf16.config, dtype="float32"))
    server = ThreadedServer(default_timeout=300.0)
    client = refit.Client(server.address)
    procs: dict[str, tuple[Any, Any]] = {}

    def spawn(name: str, spec: Any, role: str, layout: str) -> Any:
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=_rank_main, args=(child, server.address, spec, role, layout, device), daemon=True)
        proc.start()
        assert parent.recv() == "ready"
        procs[name] = (parent, proc)
        return parent

    def ask(conn: Any, cmd: str, arg: Any = None) -> Any:
        conn.send((cmd, arg))
        return conn.recv()

    out: dict[str, Any] = {"model": bf16.name, "device": torch.cuda.get_device_name(0) if device != "cpu" else "cpu",
                           "command": " ".join(["python", "bench/cast_refit.py", *sys.argv[1:]])}
    try:
        engine = spawn("engine", bf16, "engine", "hf")  # the same names on both ends: compared as they are
        for spec in (bf16, fp32):
            dtype = spec.config.dtype
            trainer = spawn(dtype, spec, "trainer", "hf")
            plan = client.create_plan(f"trainer-{dtype}", "engine")
            info = client.get_plan(plan["plan_id"], include_plan=True)
            times = []
            for it in range(args.iters + 1):
                want = ask(trainer, "fill", it + (100 if spec is fp32 else 0))
                version = it + 1 + (1000 if spec is fp32 else 0)
                t0 = time.perf_counter()
                result = client.refit(plan["plan_id"], version=version, timeout=300)
                dt = time.perf_counter() - t0
                assert result.ok, result
                if it:  # the first builds the members
                    times.append(dt)
                got = ask(engine, "get")
                bad = [n for n in want if not torch.equal(got[n].view(torch.int16), want[n].view(torch.int16))]
                assert not bad, f"{dtype}: {len(bad)} tensors differ, first {bad[0]}"
            out[dtype] = {"median_ms": round(statistics.median(times) * 1e3, 2), "iters": len(times),
                          "casts": len(info["plan"].casts), "bytes": int(info["total_bytes"]),
                          "verified": "bit-exact against .to(bfloat16)"}
            log.info("%s trainer -> bfloat16 engine: %.2f ms median over %d refits, %d tensors cast, %.1f MiB, "
                     "bit-exact", dtype, out[dtype]["median_ms"], len(times), out[dtype]["casts"],
                     out[dtype]["bytes"] / 2**20)
            ask(trainer, "stop")
    finally:
        for conn, proc in procs.values():
            if proc.is_alive():
                try:
                    conn.send(("stop", None))
                except OSError:
                    pass
            proc.join(10)
        server.stop()
    if args.json:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
