"""The tail every refit command shares (`refit`, `refit serve`, `refit-bench`): logging set-up and
how a command ends.

    from refit.entrypoint import run_main, setup_logging

    def main(argv=None) -> int:
        args = build_parser().parse_args(argv)
        setup_logging(args.verbose)
        return run_main(lambda: run(args))

`run_main(fn, prog)` calls ``fn()`` and returns its exit status, mapping what may escape it:

* `refit.errors.InvalidInput` (bad input) → its message as one line on stderr,
  ``<prog>: error: ...``, status 2 (``EXIT_USAGE``), no traceback;
* `refit.errors.RefitFailed` (a refit that started failed) → one line, status 3 (``EXIT_FAILED``);
* Ctrl-C (`KeyboardInterrupt`) → status 130 (``EXIT_INTERRUPTED``), quietly;
* `BrokenPipeError` (output piped into ``head``, the reader went away) → status 141
  (``EXIT_BROKEN_PIPE``, as a process killed by SIGPIPE), quietly;
* anything else is a bug in refit and keeps its traceback.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable

from refit import settings
from refit.errors import RefitError, RefitFailed

EXIT_USAGE, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 2, 3, 130, 141
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def setup_logging(verbose: bool = False) -> None:
    """INFO with ``verbose``, else WARNING, on stderr; a no-op when the host already set logging up."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format=LOG_FORMAT)


def error_line(prog: str, error: BaseException) -> str:
    """``<prog>: error: <message>`` on one line (a message's later lines are joined)."""
    text = " ".join(str(error).split("\n")) or type(error).__name__
    return f"{prog}: error: {text}"


def run_main(fn: Callable[[], int], prog: str = "refit") -> int:
    """Run a command body and return the process exit status (see the module docstring).  The
    command reads the ``REFIT_*`` knobs first (`refit.settings`): a bad value exits 2 before
    anything starts."""
    try:
        settings.reload()
        return fn()
    except RefitError as e:
        _stderr(error_line(prog, e))
        return EXIT_FAILED if isinstance(e, RefitFailed) else EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE


def _stderr(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (BrokenPipeError, ValueError):
        pass


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that Python's flush at exit does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout is not a real file (pytest's capture)
        pass
