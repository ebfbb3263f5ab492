"""Errors that refit reports to users.

A `RefitError` means the *input* is wrong (unknown model, a layout that cannot split the model,
files that do not match a layout).  The CLI prints its message without a traceback; anything else
that escapes is a bug in refit and keeps its traceback.
"""


class RefitError(ValueError):
    """Bad input, explained in the message.  Raised before any byte moves."""
