"""A Megatron-Core trainer of a policy with MTP layers, for the live speculative-engine tests
(tests/integration/test_megatron_mtp_vllm.py), driven like tests/harness/vllm_mtp_eagle.py's
`DrafterTrainer` by `tests.harness.vllm_draft.refit_target_then_drafter`.

`MegatronDrafterTrainer` spawns ``world`` gloo ranks (`tests.harness.attach_cluster.Trainers`),
each building a real megatron-core GPTModel with ``mtp_num_layers=1`` shaped like the HF checkpoint
``target_dir`` (`build_gpt`: MLA with tests/harness/megatron_models.py's CPU stand-ins), loaded
from it by Megatron's own ``sharded_state_dict`` placement (`load_hf_by_placement`), and attached
twice: ``refit_megatron.attach`` as group ``trainer-<name>`` (the policy) and
``refit_megatron.attach_mtp`` as ``draft-trainer-<name>`` (its MTP layers).  Commands: "step" (one
real ``torch.optim.SGD`` step on every rank, gradients placed by `optimizer_step`) and "save" (every
rank's boxes assembled here, converted by hand with `global_to_hf` + `with_mtp_copies`: the HF
checkpoint, MTP layer included, that a fresh vLLM engine loads).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

LR = 0.01  # placed gradients in [-0.5, 0.5]: each element moves at most 0.005 (the orbit walk holds)


class _Agents:
    """What `tests.harness.attach_cluster` expects of a rank's agent: ``spec`` and ``stop()``."""

    def __init__(self, *agents: Any) -> None:
        self.agents = [a for a in agents if a is not None]
        self.spec = agents[0].spec

    def stop(self) -> None:
        for a in self.agents:
            a.stop()


def megatron_mtp_rank(rank: int, world: int, address: str, name: str, target_dir: str, par: dict) -> tuple[Any, Any]:
    """One trainer rank (`Trainers`' builder): ``par`` as `init_parallel` takes it."""
    import torch

    from tests.harness.megatron_models import (build_gpt, init_parallel, install_cpu_shims, load_hf_by_placement,
                                               local_boxes, optimizer_step)

    install_cpu_shims()
    from refit.hf_checkpoint import load_spec
    from tests.harness.vllm_rl import read_hf
    from refit.integrations import megatron as refit_megatron

    init_parallel(**par)
    spec = load_spec(target_dir)
    chunks = build_gpt(spec, mtp_num_layers=1)
    load_hf_by_placement(chunks, read_hf(target_dir), spec)
    params = [p for c in chunks for p in c.parameters()]
    policy = refit_megatron.attach(chunks[0], address, group=f"trainer-{name}", spec=target_dir)
    draft = refit_megatron.attach_mtp(chunks[0], address, group=f"draft-trainer-{name}", spec=target_dir)
    assert draft is not None, "pp1: every rank holds the MTP layers"

    def handle(cmd: str, arg: Any) -> Any:
        if cmd == "step":  # a fresh SGD (no state): one step, in place, the served views stay live
            optimizer_step(chunks, torch.optim.SGD(params, lr=LR), seed=arg)
            return None
        if cmd == "boxes":
            return local_boxes(chunks)
        raise ValueError(cmd)

    return _Agents(policy, draft), handle


class MegatronDrafterTrainer:
    """Groups ``trainer-<name>`` (the policy) and ``draft-trainer-<name>`` (its MTP layers) held by
    ``world`` Megatron ranks of parallelism ``par`` (`init_parallel`'s arguments)."""

    def __init__(self, address: str, name: str, target_dir: str, par: dict, world: int = 2) -> None:
        from tests.harness.attach_cluster import Trainers

        self.target_dir = target_dir
        self.trainers = Trainers(world, megatron_mtp_rank, address, name, target_dir, par)
        try:
            answers = self.trainers.ready()
            assert all(a[0] == "ready" for a in answers), answers
            self.spec = answers[0][1]
        except BaseException:
            self.trainers.close()
            raise

    def ask(self, cmd: str, arg: Any = None, timeout: float = 300.0) -> Any:
        if cmd == "save":
            return self.save(arg)
        return self.trainers.ask(cmd, arg, timeout)

    def save(self, dirs: dict[str, str]) -> None:
        """The trainer's weights now, as an HF checkpoint with its MTP layer, into ``dirs["target"]``."""
        from tests.harness.attach_cluster import write_hf
        from tests.harness.megatron_models import assemble, global_to_hf, with_mtp_copies

        hf = with_mtp_copies(global_to_hf(assemble(self.trainers.ask("boxes")), self.spec), self.spec)
        write_hf(dirs["target"], hf)
        for f in os.listdir(self.target_dir):  # config.json, generation_config.json
            if f.endswith(".json") and not f.endswith(".index.json"):
                shutil.copy(os.path.join(self.target_dir, f), os.path.join(dirs["target"], f))

    def close(self) -> None:
        self.trainers.close()
