"""The ``vllm.general_plugins`` entry point: registers the ``refit`` weight-transfer backend.

vLLM calls this in every process it starts (front end, engine core, workers), possibly more than
once per process, so it must be cheap and idempotent: the engine module is imported lazily, when
a worker creates its weight-transfer engine.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

BACKEND = "refit"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND in WeightTransferEngineFactory._registry:  # loaded twice in this process
        return
    WeightTransferEngineFactory.register_engine(BACKEND, "refit.integrations.vllm.engine", "RefitWeightTransferEngine")
    log.debug("registered the %r weight-transfer backend", BACKEND)
