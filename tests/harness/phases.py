"""What an engine must hold while a phased refit (`refit.phases`) is half way: the canonical rows
of the phases landed so far hold the new version, the rest still the old one."""

from __future__ import annotations

import torch

from refit.layouts import Layout
from refit.phases import phase_key
from refit.plan import Plan
from refit.regions import slices
from refit.spec import ModelSpec
from tests.harness.control_cluster import canonical


def mixed_canonical(spec: ModelSpec, old: int, new: int, plan: Plan, landed: int) -> dict[str, torch.Tensor]:
    """Canonical tensors holding version ``new`` in every row of a phase keyed ``<= landed`` and
    version ``old`` elsewhere (`landed` = the last phase key landed)."""
    before, after = canonical(spec, old), canonical(spec, new)
    out = {}
    for t in spec.tensors:
        rows = range(len(t.layers)) if t.layers else [0]
        done = torch.tensor([phase_key(spec, t.name, r, plan.phase_layers) <= landed for r in rows])
        if not t.layers:
            out[t.name] = after[t.name] if done.item() else before[t.name]
            continue
        mask = done.view((-1,) + (1,) * (len(t.shape) - 1))
        out[t.name] = torch.where(mask, after[t.name], before[t.name])
    return out


def rank_tensors(spec: ModelSpec, layout: Layout, rank: int, canon: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A rank's local tensors filled from ``canon`` through the layout's pieces (padding 0)."""
    out = {}
    for lt in layout.local_tensors(spec, rank):
        t = out[lt.name] = torch.zeros(lt.shape, dtype=torch.bfloat16)
        for p in lt.pieces:
            t.view(lt.view_shape(len(spec[p.tensor].shape)))[slices(p.local_start, p.size)] = \
                canon[p.tensor][slices(p.start, p.size)]
    return out


def differing(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """Names of the local tensors that differ bit for bit."""
    return [n for n in want if not torch.equal(want[n].view(torch.int16), got[n].view(torch.int16))]
