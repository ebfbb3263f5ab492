"""A second engine beside vLLM: a plain PyTorch module served by a `refit.engine.Landing` and
driven by `refit.engine.HostRefit` (tests/harness/torch_engine.py), refitted from trainer agents
(``megatron:tp2``, this process, gloo on CPU) into refit's ``hf`` layout.

What it proves of the engine side, with no vLLM: two versions of random weights land bit for bit,
in place and staged; the same version asked again moves and applies nothing; atomic refits are
taken by a staging landing and refused by an in-place one before any byte moves; a refit the
engine's loop did not ask for is refused and writes nothing; a landing that breaks after the commit
leaves the engine stale (to itself and to the coordinator) until the next refit lands whole.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from refit.engine import HostDrivenAgent, Landing
from refit.errors import RefitError, RefitFailed
from refit.layouts import resolve_layout
from refit.control.agent import TrainerAgent
from refit.sides import Side
from refit.spec import ModelSpec
from tests.harness.tiny import tiny_spec
from tests.harness.torch_engine import TorchEngine
from tests.harness.vllm_rl import fill_from as local  # a rank's local tensors of canonical ones

MODEL, SRC = "tiny-llama", "megatron:tp2"
GROUPS = itertools.count()


def random_weights(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Every canonical tensor, random (normal), in the spec's dtype."""
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g).to(getattr(torch, spec[t.name].dtype)) for t in spec.tensors}


class Job:
    """Two trainer ranks and one torch engine on ``server``'s coordinator, with a plan between them."""

    def __init__(self, server: tuple, staged: bool) -> None:
        srv, self.client = server
        self.spec = tiny_spec(MODEL)
        self.src = resolve_layout(SRC, self.spec, Side.TRAINER)
        n = next(GROUPS)
        trainer, engine = f"torch-trainer-{n}", f"torch-engine-{n}"
        self.tensors = [local(self.spec, self.src, r, random_weights(self.spec, 0)) for r in range(2)]
        self.trainers = [TrainerAgent(srv.address, group=trainer, rank=r, spec=self.spec, layout=self.src,
                                      tensors=self.tensors[r]).start() for r in range(2)]
        self.engine = TorchEngine(self.spec, staged=staged).register(srv.address, engine)
        self.engine_group = engine
        self.plan = self.client.create_plan(trainer, engine)["plan_id"]

    def train(self, seed: int) -> dict[str, torch.Tensor]:
        """New random weights in the trainers' own tensors; the engine's expected tensors."""
        canon = random_weights(self.spec, seed)
        for r in range(2):
            local(self.spec, self.src, r, canon, self.tensors[r])
        return local(self.spec, self.engine.layout, 0, canon)

    def assert_holds(self, expected: dict[str, torch.Tensor]) -> None:
        got = self.engine.weights()
        assert set(got) == set(expected)
        bad = [n for n in expected if not torch.equal(got[n].view(torch.uint8), expected[n].view(torch.uint8))]
        assert not bad, f"{len(bad)} tensors differ, e.g. {bad[:3]}"

    def listed(self) -> dict:
        (row,) = self.client.list_workers(self.engine_group)
        return row

    def close(self) -> None:
        self.engine.close()
        for a in self.trainers:
            a.stop()
            a.data_plane.close()


@pytest.fixture(params=[False, True], ids=["in-place", "staged"])
def job(server, request):
    j = Job(server, staged=request.param)
    yield j
    j.close()


def test_the_torch_landing_is_a_landing(job: Job) -> None:
    assert isinstance(job.engine.landing, Landing)
    assert isinstance(job.engine.refits.agent, HostDrivenAgent)


def test_two_versions_land_bit_for_bit(job: Job) -> None:
    for version, seed in ((1, 11), (2, 22)):
        expected = job.train(seed)
        job.engine.refit(job.plan, version)
        job.assert_holds(expected)
        assert job.engine.refits.holding.version == version and not job.engine.refits.holding.stale
        row = job.listed()
        assert row["version"] == version and not row["stale"]
    applied = job.engine.landing.applied
    job.engine.refit(job.plan, 2)  # asked again: the coordinator answers, nothing moves or is applied
    assert job.engine.landing.applied == applied
    job.assert_holds(expected)


def test_atomic_refits_need_a_staging_landing(job: Job) -> None:
    before = job.engine.weights()
    before = {n: t.clone() for n, t in before.items()}
    expected = job.train(33)
    if not job.engine.landing.stages:
        # the coordinator knows from its registration (``stages``) that it cannot stage a version
        with pytest.raises(RefitFailed, match="write in place and cannot stage a whole version"):
            job.engine.refit(job.plan, 1, atomic=True)
        job.assert_holds(before)  # refused before any byte moved
        assert not job.engine.refits.holding.stale
        return
    job.engine.refit(job.plan, 1, atomic=True)
    job.assert_holds(expected)
    assert job.listed()["version"] == 1


def test_a_refit_the_engine_did_not_ask_for_is_refused(job: Job) -> None:
    before = {n: t.clone() for n, t in job.engine.weights().items()}
    job.train(44)
    result = job.client.refit(job.plan, 1, timeout=30, check=False)
    assert not result.ok and "is not inside its host's refit call" in result.error
    job.assert_holds(before)
    assert not job.engine.refits.holding.stale


def test_a_landing_that_breaks_after_the_commit_leaves_the_engine_stale(job: Job) -> None:
    job.engine.refit(job.plan, 1)  # version 1 whole first
    job.engine.landing.fail_apply = True
    expected = job.train(55)
    with pytest.raises(RuntimeError, match="the landing broke after the commit"):
        job.engine.refit(job.plan, 2)
    assert job.engine.refits.holding.stale
    assert job.listed()["stale"], "the coordinator still lists the engine holding a version it does not hold whole"
    job.engine.refit(job.plan, 3)  # the next refit moves every byte and lands whole
    job.assert_holds(expected)
    assert not job.engine.refits.holding.stale and not job.listed()["stale"]


def test_a_refit_without_registering_is_refused() -> None:
    with pytest.raises(RefitError, match="registered no agent"):
        TorchEngine(tiny_spec(MODEL)).refit("no-plan", 1)
