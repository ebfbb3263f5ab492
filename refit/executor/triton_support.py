"""Whether Triton can be used here: the kernels of `refit.executor.quantize_triton` and
`refit.executor.checksum_triton` run through it on CUDA and fall back to torch without it."""

from __future__ import annotations

import functools
import importlib
import logging

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def triton_importable(fallback: str) -> bool:
    """Whether triton (and triton.language) import; if not, say once what ``fallback`` names
    (e.g. "checksums on CUDA use the torch path")."""
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception as e:  # ImportError, or a triton that cannot load its backend
        log.warning("triton unavailable (%s: %s): %s", type(e).__name__, e, fallback)
        return False
    return True
