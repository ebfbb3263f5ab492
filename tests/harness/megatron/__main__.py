"""``python -m tests.harness.megatron --serve`` (or ``<fn>``): the harness's helper interpreter.

Run from the repository root (``worker.py`` starts it with that as cwd and on PYTHONPATH).
Importing the package first registers every ``_impl_*`` function in ``worker.IMPLS``.
"""

import tests.harness.megatron  # noqa: F401  (fills worker.IMPLS)
from tests.harness.megatron.worker import subprocess_main

if __name__ == "__main__":
    subprocess_main()
