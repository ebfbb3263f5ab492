"""What the test harness's warm process server imports once (`tests.harness.procs.warm_context`):
torch, vLLM's `LLM` and refit's vLLM integration, which every engine, reference engine and trainer
process of the vLLM tests would otherwise import again (10-15 s each on the loaded 2-core VM).
Importing these starts no thread that a fork could leave holding a lock: torch and vLLM start
only idle native helpers at import."""

import torch  # noqa: F401
from vllm import LLM  # noqa: F401

import refit.integrations.vllm  # noqa: F401
import tests.harness.vllm_rl  # noqa: F401
