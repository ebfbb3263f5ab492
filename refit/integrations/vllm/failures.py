"""refit's errors through vLLM's processes, told apart by type in the RL loop.

With vLLM's default multiprocessing (``VLLM_ENABLE_V1_MULTIPROCESSING`` unset) the engine core,
and with TP > 1 the workers, run in processes of their own: an error a worker raises in
``update_weights`` reaches the loop as vLLM's bare ``Exception("Call to collective_rpc method
failed: ...")`` (TP > 1: around vLLM's ``"Worker failed with error '...'"``), its type lost.  So
the worker marks refit's errors in their message (`carried`: ``[refit.RefitFailed] ... [/refit]``),
and the loop gets them back by type (`refit_errors`)::

    from refit.integrations.vllm.failures import refit_errors

    try:
        with refit_errors():
            llm.start_weight_update()
            llm.update_weights({"update_info": {"plan_id": plan_id, "version": step}})
            llm.finish_weight_update(weight_version=str(step))
    except refit.RefitFailed as e:  # the worker's message: the coordinator's, naming the member at fault
        ...  # no finish_weight_update: the failure ended vLLM's session; the next step starts a new one

The same holds in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where the worker's own
exception arrives: `refit_errors` gives it back without the marks.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator

from refit.errors import InvalidInput, RefitError, RefitFailed

__all__ = ["carried", "refit_errors", "refit_error_of"]

# most specific first: RefitFailed and InvalidInput are both RefitErrors
KINDS: dict[str, type[RefitError]] = {"RefitFailed": RefitFailed, "InvalidInput": InvalidInput,
                                      "RefitError": RefitError}
_MARKED = re.compile(r"\[refit\.(RefitFailed|InvalidInput|RefitError)\] (.*?) \[/refit\]", re.S)


@contextmanager
def carried() -> Iterator[None]:
    """Worker side: a refit error raised inside marks its message with its kind, so that the loop
    tells it by type however many processes vLLM passes its text through.  The exception itself
    (its class, its attributes) is raised unchanged otherwise."""
    try:
        yield
    except RefitError as e:
        if not _MARKED.search(str(e)):
            kind = next(name for name, cls in KINDS.items() if isinstance(e, cls))
            e.args = (f"[refit.{kind}] {e} [/refit]",)
        raise


def refit_error_of(error: BaseException) -> RefitError | None:
    """The refit error a vLLM exception carries (`carried`'s marks in its text), with the
    worker's message; None for any other error."""
    m = _MARKED.search(str(error))
    return KINDS[m[1]](m[2]) if m else None


@contextmanager
def refit_errors() -> Iterator[None]:
    """Loop side: around vLLM's weight-update calls, a refit error a worker raised is raised as
    `refit.RefitFailed` (a refit that failed) or `refit.InvalidInput` (a call refused before any
    byte moved), with the worker's message; other errors pass through as they are."""
    try:
        yield
    except Exception as e:
        found = refit_error_of(e)
        if found is None:
            raise
        raise found from e
