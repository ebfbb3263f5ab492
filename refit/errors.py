"""Errors that refit reports to users: one base, two kinds.

* `InvalidInput` (a `ValueError`): the input is wrong — an unknown model, a layout that cannot
  split the model, files or tensors that do not match a layout, a request the coordinator
  refuses.  Raised before any byte moves; the commands print its message in one line and exit 2.
* `RefitFailed` (a `RuntimeError`): a refit, or the set-up for one, started and failed — a peer
  died or hung, the coordinator abandoned the refit, a worker reported an error.  What it wrote may
  be partial (engines then report themselves stale); the commands exit 3.

Both derive from `RefitError`: ``except refit.RefitError`` catches everything refit raises on
purpose.  Anything else that escapes is a bug in refit and keeps its traceback.
"""


class RefitError(Exception):
    """What refit raises on purpose: `InvalidInput` or `RefitFailed`."""


class InvalidInput(RefitError, ValueError):
    """Bad input, explained in the message.  Raised before any byte moves."""


class RefitFailed(RefitError, RuntimeError):
    """A refit (or its set-up) started and failed; the message names who and why."""
