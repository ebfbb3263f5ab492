"""The helper interpreter that runs Megatron code away from the calling (pytest) process.

Subprocess work runs in a separate helper interpreter (``python -m tests.harness.megatron
--serve``, with the repository root on ``sys.path``; started on first use, imports megatron once,
one JSON request per line; every request tears its process groups / parallel_state down in
``finally``; restarted if it dies; results cached per argument set).  So the process-global state
of ``parallel_state`` / ``torch.distributed`` and the CPU shims (``cpu.py``) never touch the
calling (pytest) process, and every call can be repeated.
``MEGATRON_HARNESS_FRESH=1`` runs each call in a brand-new interpreter instead
(``python -m tests.harness.megatron <fn>``, JSON on stdin/stdout).

The function a request names is looked up in ``IMPLS``, filled by ``@register(name)`` on the
``_impl_*`` functions of the sibling modules (the package ``__init__`` imports them all, and
``python -m tests.harness.megatron`` imports the package before it serves).

Errors raised by Megatron inside a subprocess are re-raised here with the same builtin exception
type (AssertionError, ValueError, RuntimeError, ...) and Megatron's message; non-builtin types
become ``MegatronError``.
"""

from __future__ import annotations

import atexit
import builtins
import functools
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Optional

from tests.harness.megatron.cpu import install_cpu_shims

# the repository root: `tests` must be importable as a package in the helper interpreter
_REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
_SERVE_MODULE = "tests.harness.megatron"
_SUBPROCESS_TIMEOUT_S = 300
_RESULT_MARK = "@@MEGATRON_HARNESS_RESULT@@"

# request name -> the function that answers it inside the helper interpreter
IMPLS: dict[str, Callable[..., Any]] = {}


def register(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Make ``fn`` callable by ``name`` through ``run_subprocess``."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        assert name not in IMPLS, f"two harness functions registered as {name!r}"
        IMPLS[name] = fn
        return fn

    return deco


class MegatronError(Exception):
    """A non-builtin exception raised by Megatron code inside a harness subprocess."""

    def __init__(self, exc_type: str, message: str, tb: str = ""):
        super().__init__(f"{exc_type}: {message}")
        self.exc_type = exc_type
        self.message = message
        self.tb = tb


def _raise_from_payload(err: dict) -> None:
    exc_type = err.get("type", "Exception")
    message = err.get("message", "")
    builtin = getattr(builtins, exc_type, None)
    if isinstance(builtin, type) and issubclass(builtin, Exception):
        exc = builtin(message)
        exc.megatron_traceback = err.get("traceback", "")  # type: ignore[attr-defined]
        raise exc
    raise MegatronError(exc_type, message, err.get("traceback", ""))


def _subprocess_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONWARNINGS", "ignore")
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class _Worker:
    """One long-lived helper interpreter (``python -m tests.harness.megatron --serve``) that imports
    megatron.core once and then runs requests one at a time (JSON line in, marked JSON line out).
    Every request cleans up its process groups / parallel_state in ``finally``; if the worker
    dies it is restarted once.  Set MEGATRON_HARNESS_FRESH=1 to use a brand-new interpreter per
    call instead."""

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self.lock = threading.Lock()
        self.stderr_file = None
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()

    def _start(self) -> None:
        self.stderr_file = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", _SERVE_MODULE, "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr_file,
            text=True,
            bufsize=1,
            env=_subprocess_env(),
            cwd=_REPO_ROOT,
        )
        self.lines = queue.Queue()
        proc, lines = self.proc, self.lines

        def pump() -> None:
            for out in proc.stdout:
                lines.put(out)
            lines.put(None)  # EOF

        threading.Thread(target=pump, daemon=True).start()

    def _stderr_tail(self) -> str:
        try:
            self.stderr_file.seek(0)
            return self.stderr_file.read()[-4000:]
        except Exception:  # noqa: BLE001
            return ""

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001
                self.proc.kill()
        self.proc = None

    def _request_once(self, line: str) -> str:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        tail = []
        deadline = time.monotonic() + _SUBPROCESS_TIMEOUT_S
        while True:
            try:
                out = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                self.proc = None
                raise TimeoutError(f"megatron harness worker timed out: {line[:200]}")
            if out is None:
                raise _WorkerDied("".join(tail[-50:]) + "\n--- stderr ---\n" + self._stderr_tail())
            if out.startswith(_RESULT_MARK):
                return out[len(_RESULT_MARK) :].rstrip("\n")
            tail.append(out)

    def request(self, fn_name: str, kwargs_json: str) -> str:
        line = json.dumps({"fn": fn_name, "kwargs": json.loads(kwargs_json)})
        with self.lock:
            try:
                return self._request_once(line)
            except _WorkerDied:
                self.close()
                return self._request_once(line)


class _WorkerDied(RuntimeError):
    pass


_WORKER = _Worker()
atexit.register(_WORKER.close)


@functools.lru_cache(maxsize=256)
def _run_subprocess_cached(fn_name: str, kwargs_json: str) -> str:
    if os.environ.get("MEGATRON_HARNESS_FRESH"):
        proc = subprocess.run(
            [sys.executable, "-m", _SERVE_MODULE, fn_name],
            input=kwargs_json,
            capture_output=True,
            text=True,
            timeout=_SUBPROCESS_TIMEOUT_S,
            env=_subprocess_env(),
            cwd=_REPO_ROOT,
        )
        for line in reversed(proc.stdout.splitlines()):
            if line.startswith(_RESULT_MARK):
                return line[len(_RESULT_MARK) :]
        raise RuntimeError(
            f"megatron harness subprocess {fn_name} produced no result (rc={proc.returncode})\n"
            f"--- stdout tail ---\n{proc.stdout[-4000:]}\n--- stderr tail ---\n{proc.stderr[-4000:]}"
        )
    return _WORKER.request(fn_name, kwargs_json)


def run_subprocess(fn_name: str, **kwargs) -> Any:
    """Run the function registered as ``fn_name`` in the helper interpreter; re-raise its error."""
    payload = json.loads(_run_subprocess_cached(fn_name, json.dumps(kwargs, sort_keys=True)))
    if "error" in payload:
        _raise_from_payload(payload["error"])
    return payload["result"]


def _call_impl(fn_name: str, kwargs: dict) -> dict:
    try:
        fn = IMPLS[fn_name]
        return {"result": fn(**kwargs)}
    except BaseException as e:  # noqa: BLE001 - we forward everything to the parent
        return {
            "error": {
                "type": type(e).__name__,
                "message": str(e),
                "traceback": traceback.format_exc(),
            }
        }


def subprocess_main() -> None:
    """The helper interpreter's entry (``python -m tests.harness.megatron --serve | <fn>``)."""
    if sys.argv[1] == "--serve":
        # import once up front so that every request is fast
        install_cpu_shims()
        import megatron.core.models.gpt  # noqa: F401

        for line in sys.stdin:
            if not line.strip():
                continue
            req = json.loads(line)
            out = _call_impl(req["fn"], req["kwargs"])
            sys.stdout.write("\n" + _RESULT_MARK + json.dumps(out) + "\n")
            sys.stdout.flush()
        return
    kwargs = json.loads(sys.stdin.read() or "{}")
    out = _call_impl(sys.argv[1], kwargs)
    sys.stdout.write("\n" + _RESULT_MARK + json.dumps(out) + "\n")
    sys.stdout.flush()
