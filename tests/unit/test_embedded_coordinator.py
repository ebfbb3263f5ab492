"""`refit.control.embedded`: with no coordinator configured, the first piece of a job that needs one
serves it at the loopback default, and every other piece reaches it there.  In child processes:
the default port and ``REFIT_ADDRESS`` are process-wide."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import logging, sys, torch
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
from refit.control import embedded
from refit.control.client import Client
from refit.integrations import hf as refit_hf
from tests.harness.attach_cluster import make_hf_model

model = make_hf_model("Qwen3ForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32)
agent = refit_hf.attach(model, group="trainer")  # no address, no REFIT_ADDRESS
assert embedded.serving(), "attach served no coordinator"
assert embedded.coordinator_for(None) == "127.0.0.1:50051"  # the second piece finds it: one server
with Client() as client:  # the RL loop's client reaches the default without being told
    workers = client.list_workers()
assert [w["worker_id"] for w in workers] == ["trainer/0"], workers
agent.stop()
print("EMBEDDED OK")
"""


@pytest.mark.skipif(os.environ.get("REFIT_ADDRESS") is not None, reason="REFIT_ADDRESS is set here")
def test_attach_without_an_address_serves_the_job_s_coordinator() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("REFIT_ADDRESS", "REFIT_TOKEN")}
    busy = subprocess.run([sys.executable, "-c", "import socket; s = socket.socket(); "
                           "s.bind(('127.0.0.1', 50051)); s.close()"], capture_output=True)
    if busy.returncode != 0:
        pytest.skip("127.0.0.1:50051 is in use on this machine")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode == 0 and "EMBEDDED OK" in r.stdout, (r.stdout[-2000:], r.stderr[-3000:])
    assert "this process serves one at 127.0.0.1:50051" in r.stdout, r.stdout[-2000:]


def test_a_given_address_embeds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from refit.control import embedded

    assert embedded.coordinator_for("10.0.0.1:7000") == "10.0.0.1:7000" and not embedded.serving()
