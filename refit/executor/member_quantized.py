"""What a plan's members do for engines that hold float8 weights.

Two things, both only where the source layout is a `refit.layouts.QuantizedLayout`:

* **Blocks cut across trainer ranks** (`refit.executor.shared_blocks`): the tensors derived from
  them are made before anything is shared (`_derive`), every member learns which scale tensors
  some rank cuts (`_agree_shared`), and each refit the cut blocks get their shared scales
  (`share_scales`).
* **Quantizing on landing** (`refit.executor.fused_quantize`): a trainer that hands its member its
  unquantized local tensors (``unquantized``) has them shared like its shards
  (`_share_unquantized`, `_import_unquantized`); a driver that holds them turns the same-device
  moves of float8 values into quantizations straight into the engine (`_fuse`) and publishes
  which local tensors it took over, so that their trainer skips quantizing them for the wire
  (`fused_sources`).

Apart from `refit.executor.member` to keep that module to the sequence every plan runs: `Member`
inherits `MemberQuantized` and sets the attributes it reads.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import TYPE_CHECKING, Mapping

import torch
import torch.distributed as dist

from refit.errors import InvalidInput
from refit.settings import Settings
from refit.executor.bound import Remaining
from refit.executor.device import Device
from refit.executor.fused_quantize import (UNQUANTIZED_PREFIX, fuse_program, read_elsewhere, unquantized_views,
                                           wire_reads)
from refit.executor.schedule import Program
from refit.executor.shards import Own, Shards, check_own, views
from refit.executor.shared_blocks import SharedQuantizer, allocate_derived, share
from refit.executor.topology import Endpoint, Topology, endpoint_key, endpoint_name
from refit.executor.transports import import_share
from refit.layouts import Layout
from refit.layouts.quantized import QuantizedLayout, scale_table
from refit.plan import Plan
from refit.quantization import is_quantized, quant_format
from refit.sides import Side
from refit.spec import ModelSpec, base_spec

log = logging.getLogger("refit.executor")


class MemberQuantized:
    """`Member`'s work for float8 engines (see the module)."""

    # Set by `Member.__init__`.
    store: dist.Store
    topo: Topology
    spec: ModelSpec
    src: Layout
    dst: Layout
    name: str
    names: list[str]
    device: Device
    cuda: bool
    scattered: bool
    ipc: bool
    settings: Settings
    shared: SharedQuantizer | None
    tensors: dict[Endpoint, dict[str, torch.Tensor]]
    imported: list[torch.Tensor]
    _fused: dict[str, set[str]]  # endpoint key -> its local tensors quantized on landing, this plan
    _plan_hash: str | None

    # ------------------------------------------------------------------ blocks cut across ranks
    def _derive(self, own: Mapping[Endpoint, Own]) -> tuple[dict[Endpoint, Own], dict[int, dict[str, torch.Tensor]]]:
        """``own`` with the tensors its source ranks derive from local tensors that cut FP8
        blocks (`refit.executor.shared_blocks`), made before anything is shared; and those
        ranks' tensors (none where they cut no block)."""
        own, mine = dict(own), {}
        if not isinstance(self.src, QuantizedLayout):
            return own, mine
        for ep, tensors in own.items():
            derived = allocate_derived(self.spec, self.src, ep[1], self.device.torch) if ep[0] is Side.TRAINER else {}
            if derived and isinstance(tensors, Shards):
                raise InvalidInput(f"{self.name}: {endpoint_name(ep)} of {self.src.describe()} cuts FP8 blocks, "
                                   f"which needs separate tensors, not an arena (the bench's --alloc arena)")
            if derived:
                own[ep] = mine[ep[1]] = {**tensors, **derived}
        return own, mine

    def _agree_shared(self, mine: dict[int, dict[str, torch.Tensor]], remaining: Remaining) -> SharedQuantizer | None:
        """Every member learns which scale tensors some trainer rank cuts — a MAX all-reduce of
        one flag per scale tensor of the spec (a handful: they are stacked), instead of every
        member walking every rank's tensors — and gets the quantizer of its own cut tensors over
        the table of those (None, on every member, where no rank cuts a block)."""
        if not isinstance(self.src, QuantizedLayout):
            return None
        suffix = quant_format(self.src.quantization).scale_suffix
        names = [t.name + suffix for t in self.spec.tensors if is_quantized(t.name)]
        cut = {name for rank in mine for name in self.src.shared_scales(self.spec, rank)}
        flags = torch.tensor([float(name in cut) for name in names])
        self._reduce("setup (shared scales)", flags, dist.ReduceOp.MAX, remaining)
        used = [name for name, flag in zip(names, flags.tolist()) if flag]
        return SharedQuantizer(self.spec, self.src, mine, scale_table(self.spec, used)) if used else None

    def share_scales(self, remaining: Remaining) -> None:
        """Quantize the source ranks' local tensors that cut FP8 blocks, with each block's scale
        shared: partial amaxes, all-reduced (MAX) over every member, then each rank its own part
        (`refit.executor.shared_blocks`); a barrier after, so that no driver reads a peer's values
        before they are written.  Every member calls it, in lockstep, when the plan's trainers cut blocks."""
        if self.shared is None:
            return
        share(self.shared, self.device.torch, lambda t: self._reduce("shared-scale", t, dist.ReduceOp.MAX, remaining))
        if self.cuda:
            self.device.synchronize()
        self.barrier("shared-scale", remaining)

    # ------------------------------------------------------------------ quantizing on landing
    def _share_unquantized(self, unquantized: Mapping[Endpoint, Own], own: Mapping[Endpoint, Own],
                           shared: set[Endpoint]) -> None:
        """Check a trainer's unquantized tensors (all its local tensors or some: an agent hands
        over the weights the plan quantizes) against its framework's layout, add them to this
        member's tensors under `UNQUANTIZED_PREFIX`, and publish them (an empty value: none) for
        each endpoint of ``shared`` (those whose shards are shared)."""
        for ep, tensors in unquantized.items():
            if ep not in own or ep[0] is not Side.TRAINER or not isinstance(self.src, QuantizedLayout):
                raise InvalidInput(f"{self.name}: unquantized tensors are a quantizing trainer's, and "
                                   f"{endpoint_name(ep)} is not one of this member's")
            check_own(ep, tensors, self.src.inner, base_spec(self.spec), self.device.torch,
                      f"{self.name} (unquantized)", some=True)
            self.tensors[ep].update(unquantized_views(tensors.tensors if isinstance(tensors, Shards) else tensors))
        for ep in shared:
            if ep[0] is Side.TRAINER:
                value = self._export(ep, unquantized[ep]) if ep in unquantized else b""
                self.store.set(f"share/{endpoint_key(ep)}/unquantized", value)

    def _import_unquantized(self, ep: Endpoint) -> None:
        """A peer trainer's unquantized tensors, where it shares any."""
        handle = self.store.get(f"share/{endpoint_key(ep)}/unquantized")
        if not handle or not isinstance(self.src, QuantizedLayout):
            return
        shared = import_share(handle)
        if not isinstance(shared, dict):  # an arena: the views follow from the framework's layout
            self.imported.append(shared)
            shared = views(shared, list(self.src.inner.local_tensors(base_spec(self.spec), ep[1])), self.scattered)
        self.tensors[ep].update(unquantized_views(shared))

    def _fuse(self, programs: list[Program], plan: Plan) -> list[Program]:
        """``programs`` with the moves this driver can quantize on landing fused; publishes, for
        every trainer endpoint on its devices, which local tensors nothing reads from the wire
        any more (`fused_sources`)."""
        if not isinstance(self.src, QuantizedLayout):
            return programs
        if not self.settings.quantize_on_landing:
            sources: dict[Endpoint, set[str]] = {}
        else:
            sources = {ep: {n.removeprefix(UNQUANTIZED_PREFIX) for n in ts if n.startswith(UNQUANTIZED_PREFIX)}
                       for ep, ts in self.tensors.items() if ep[0] is Side.TRAINER}
        fused: dict[Endpoint, set[str]] = {}
        out = []
        for program in programs:
            program, took = fuse_program(program, self.spec, self.dst, sources)
            out.append(program)
            for ep, names in took.items():
                fused.setdefault(ep, set()).update(names)
        blocks = sum(len(st.quantizes) for program in out for st in program.stages)
        if blocks:
            log.info("%s: %d blocks of %d trainer tensors quantized on landing", self.name, blocks,
                     sum(len(names) for names in fused.values()))
        if blocks:  # a weight this driver's copies or wires still read stays on the wire
            for program in out:
                for ep, names in wire_reads(program).items():
                    fused.get(ep, set()).difference_update(names)
        for dev in self.topo.driven_devices(self.member):
            for ep in self.topo.endpoints_on(dev):
                if ep[0] is Side.TRAINER:
                    skip = fused.get(ep, set())
                    if skip and self.ipc and read_elsewhere(plan, self.topo, ep):
                        skip = set()
                    self.store.set(f"fused/{plan.plan_hash}/{endpoint_key(ep)}", json.dumps(sorted(skip)))
        return out

    def fused_sources(self, ep: Endpoint, remaining: Remaining) -> set[str]:
        """The local tensors of this member's trainer endpoint ``ep`` that the prepared plan's
        driver quantizes on landing: its trainer need not quantize them for the wire (the values
        it would write there are never read).  Waits, within ``remaining``, for that driver's
        `prepare`."""
        if self._plan_hash is None:
            raise InvalidInput(f"{self.name}: no plan prepared")
        if not isinstance(self.src, QuantizedLayout) or ep[0] is not Side.TRAINER:
            return set()
        key = endpoint_key(ep)
        if key not in self._fused:
            name = f"fused/{self._plan_hash}/{key}"
            self.store.wait([name], datetime.timedelta(seconds=max(remaining(), 0.001)))
            self._fused[key] = set(json.loads(self.store.get(name)))
        return self._fused[key]

    if TYPE_CHECKING:  # provided by `Member` and `MemberBarriers`
        def _export(self, ep: Endpoint, tensors: Own) -> bytes: ...

        def _reduce(self, what: str, values: torch.Tensor, op: dist.ReduceOp, remaining: Remaining) -> None: ...

        def barrier(self, what: str, remaining: Remaining, flag: float = 0.0) -> float: ...
