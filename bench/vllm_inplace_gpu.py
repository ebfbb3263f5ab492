"""The vLLM backend's in-place path on GPUs, without vLLM: refit into one allocation per parameter.

What it measures.  With ``bounded`` staging (refit/integrations/vllm/landing.py) the data plane
writes a CUDA engine's unquantized bf16 parameters straight into their storage.  vLLM allocates
every parameter on its own (``torch.empty`` per parameter, module by module, at model init), so
this bench allocates each engine rank's local tensors the same way, one ``torch.empty`` per
parameter in layout order, hands exactly those tensors to an `EngineAgent` and times
``Client.refit`` round trips through a real coordinator (gRPC, loopback), as an RL loop drives
it.  The trainers hold their shards as ``refit-bench --alloc framework`` does.  After the timed
refits every element of every engine parameter is checked bit-exact against the last version,
and every parameter must still sit at the address it was allocated at (CUDA graphs hold them).

No vLLM, no pydantic: torch, grpcio and refit only (runs on the GPU machine as it is).

    python bench/vllm_inplace_gpu.py                          # 2 GPUs: qwen3-30b-moe megatron:tp2ep2 -> vllm:tp2
    python bench/vllm_inplace_gpu.py --cpu                    # CPU, reduced width (checks the script)

Writes ``vllm_inplace_gpu.json`` under ``$OUT`` (or ``--out``) and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from a checkout without installing refit
    sys.path.insert(0, ROOT)

log = logging.getLogger("vllm_inplace_gpu")


def per_parameter(locals_: list[Any], device: Any) -> dict[str, Any]:
    """One allocation per parameter, in layout (model) order, as vLLM's model init makes them."""
    import torch

    from refit.executor.values import TORCH_DTYPES

    return {lt.name: torch.empty(lt.shape, dtype=TORCH_DTYPES[lt.dtype], device=device) for lt in locals_}


def _rank_main(conn: Any, address: str, spec: Any, role: str, rank: int, layout: str, gpu: int, transport: str,
               level: int) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    logging.basicConfig(level=level, format=f"[{role} {rank}] %(levelname)s %(message)s")
    import torch

    from refit.control import EngineAgent, TrainerAgent
    from refit.control.dataplane_executor import ExecutorDataPlane
    from refit.executor.shards import SENTINEL, Shards, allocate, fill_source, verify
    from refit.layouts import resolve_layout

    torch.set_num_threads(1)
    try:
        lay = resolve_layout(layout, spec, "src" if role == "trainer" else "dst")
        device = torch.device("cuda", gpu) if gpu >= 0 else torch.device("cpu")
        if gpu >= 0:
            torch.cuda.set_device(gpu)
        locals_ = list(lay.local_tensors(spec, rank))
        if role == "trainer":
            shards = allocate(locals_, device, scattered=True)
            tensors = shards.tensors
        else:
            tensors = per_parameter(locals_, device)
            for t in tensors.values():
                t.view(torch.uint8).fill_(SENTINEL)  # a missed write cannot look like a value
            shards = Shards(locals_, torch.empty(0, dtype=torch.uint8), tensors)
        addresses = {n: t.data_ptr() for n, t in tensors.items()}
        own = sum(t.numel() * t.element_size() for t in tensors.values())
        if gpu >= 0:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        cls = TrainerAgent if role == "trainer" else EngineAgent
        agent = cls(address, group=role, rank=rank, spec=spec, layout=lay, tensors=tensors, gpu=gpu,
                    data_plane=ExecutorDataPlane(transport)).start()
        conn.send(("ready", {"tensors": len(tensors), "bytes": own}))
        while True:
            cmd, arg = conn.recv()
            if cmd == "fill":
                fill_source(shards, spec, arg)
                if gpu >= 0:
                    torch.cuda.synchronize(device)
                conn.send(("ok", None))
            elif cmd == "verify":
                v = verify(shards, spec, arg)
                moved = [n for n, t in tensors.items() if t.data_ptr() != addresses[n]]
                extra = (torch.cuda.max_memory_allocated(device) - base) if gpu >= 0 else None
                conn.send(("ok", {"checked": v.checked, "mismatches": v.mismatches, "stray": v.stray,
                                  "first": v.first, "moved": moved, "peak_extra_bytes": extra}))
            else:
                agent.stop()
                conn.send(("ok", None))
                break
    except BaseException as e:  # the driver reports it, naming the rank
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()
        os._exit(0)


class Ranks:
    def __init__(self, address: str, spec: Any, plan: Any, src: str, dst: str, cuda: bool, transport: str,
                 level: int) -> None:
        ctx = mp.get_context("spawn")
        self.procs, self.conns, self.names, self.roles = [], [], [], []
        for role, layout, gpus in (("trainer", src, plan.placement.src_gpus), ("engine", dst, plan.placement.dst_gpus)):
            for rank, g in enumerate(gpus):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_rank_main, daemon=True, args=(child, address, spec, role, rank, layout,
                                                                      g if cuda else -1, transport, level))
                p.start()
                self.procs.append(p)
                self.conns.append(parent)
                self.names.append(f"{role} {rank}")
                self.roles.append(role)

    def ask(self, which: list[int], cmd: str, arg: Any = None, timeout: float = 240.0) -> list[Any]:
        for i in which:
            if cmd != "ready":
                self.conns[i].send((cmd, arg))
        out = []
        for i in which:
            if not self.conns[i].poll(timeout):
                raise RuntimeError(f"{self.names[i]} did not answer {cmd!r} within {timeout:.0f} s")
            kind, value = self.conns[i].recv()
            if kind == "error":
                raise RuntimeError(f"{self.names[i]}: {value}")
            out.append(value)
        return out

    def of(self, role: str) -> list[int]:
        return [i for i, r in enumerate(self.roles) if r == role]

    def close(self) -> None:
        for i, p in enumerate(self.procs):
            if p.is_alive():
                try:
                    self.ask([i], "stop", timeout=10)
                except (RuntimeError, OSError, EOFError):
                    pass
            p.join(5)
            if p.is_alive():
                p.kill()


def _stats(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from planners import make_plan
    from refit.bench.cli import _gpu_count, choose_transport, reduce_spec
    from refit.control import Client
    from refit.control.server import ThreadedServer
    from refit.hf_checkpoint import load_spec
    from refit.units import MiB

    spec = load_spec(args.model)
    gpus = _gpu_count(args.cpu)
    cuda = gpus > 0
    reduced = None
    if not cuda:
        spec, reduced = reduce_spec(spec, args.src, args.dst)
    bucket = int((256 if cuda else 1) * MiB)
    made = make_plan(spec, args.src, args.dst, "colocated", "p2p", bucket)
    need = made.plan.placement.num_gpus
    if cuda and need > gpus:
        raise SystemExit(f"{args.src} -> {args.dst} colocated needs {need} GPUs, this machine has {gpus}")
    transport = choose_transport(args.transport, "cuda" if cuda else "cpu", need)
    level = logging.INFO if args.verbose else logging.WARNING
    server = ThreadedServer(default_timeout=args.timeout)
    client = Client(server.address)
    ranks = Ranks(server.address, spec, made.plan, made.src.describe(), made.dst.describe(), cuda,
                  "ipc" if transport == "ipc" else "comm", level)
    t_start = time.perf_counter()
    try:
        ready = ranks.ask(list(range(len(ranks.procs))), "ready")
        created = client.create_plan("trainer", "engine", placement="colocated", planner="p2p", bucket_bytes=bucket)
        trips, data = [], []
        for k in range(args.warmup + args.iters):
            version = k + 1
            ranks.ask(ranks.of("trainer"), "fill", version)
            t0 = time.perf_counter()
            result = client.refit(created["plan_id"], version=version, timeout=args.timeout)
            trip = time.perf_counter() - t0
            if k >= args.warmup:
                trips.append(trip)
                data.append(max(w.seconds for w in result.workers.values()))
            log.info("refit %d: %.1f ms round trip", version, trip * 1e3)
        checks = ranks.ask(ranks.of("engine"), "verify", args.warmup + args.iters)
    finally:
        logging.getLogger("refit.control.coordinator").setLevel(logging.ERROR)  # agents leaving is expected now
        ranks.close()
        client.close()
        server.stop()
    engines = [ready[i] for i in ranks.of("engine")]
    ok = all(c["mismatches"] == 0 and c["stray"] == 0 and not c["moved"] for c in checks)
    return {
        "bench": "vllm_inplace_gpu", "model": spec.name, "src": made.src.describe(), "dst": made.dst.describe(),
        "device": "cuda" if cuda else "cpu (reduced width: checks the script, not speed)", "reduced": reduced,
        "transport": transport, "engine_allocation": "one torch.empty per parameter (as vLLM), written in place",
        "engine_parameters_per_rank": [e["tensors"] for e in engines],
        "engine_bytes_per_rank": [e["bytes"] for e in engines], "engine_bytes_received": result.total_bytes,
        "round_trip_s": _stats(trips), "data_s": _stats(data),
        "bandwidth_GBps_median": result.total_bytes / statistics.median(trips) / 1e9,
        "verified": ok, "checks": checks, "wall_s": time.perf_counter() - t_start,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-30b-moe")
    p.add_argument("--src", default="megatron:tp2ep2")
    p.add_argument("--dst", default="vllm:tp2")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--transport", default="auto", choices=["auto", "nccl", "gloo", "ipc"])
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--cpu", action="store_true", help="CPU (gloo), reduced width, even if GPUs exist")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for the JSON (default $OUT or .)")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    r = run(args)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "vllm_inplace_gpu.json")
    with open(path, "w") as f:
        json.dump(r, f, indent=1)
    rt = r["round_trip_s"]
    log.info("%s %s -> %s on %s (%s): %d refits, median %.2f ms round trip (%.1f GB/s into %d per-parameter "
             "allocations per engine rank), verified: %s; %s", r["model"], r["src"], r["dst"], r["device"],
             r["transport"], len(rt["all"]), rt["median"] * 1e3, r["bandwidth_GBps_median"],
             r["engine_parameters_per_rank"][0], "yes" if r["verified"] else "NO", path)
    return 0 if r["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
