"""``python -m refit.bench``: the same as ``refit-bench``."""

import sys

from refit.bench.cli import main

sys.exit(main())
