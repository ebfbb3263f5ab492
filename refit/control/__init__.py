"""The refit control plane: a gRPC coordinator (`refit serve`), worker agents, and a client.

Data never flows through gRPC: the coordinator registers workers, creates plans, and on
``Refit(plan_id)`` tells every member of the plan to run its share through its data plane.

* `refit.control.server` — the coordinator as a gRPC server (`serve_main`, `CoordinatorServer`;
  what each call does with its request: `servicer`);
* `refit.control.coordinator` — what a refit does (`coordinator_state`: the workers and plans it
  runs on, `registry`: their records and checks, `refits`: one refit's bookkeeping and response,
  `events`: WatchRefits);
* `refit.control.client` — `Client` for the RL loop;
* `refit.control.agent` — `TrainerAgent`, `EngineAgent` inside trainer and engine ranks (their
  stream to the coordinator: `agent_stream`; running their share through the data plane:
  `agent_share`; what they share with host threads: `agent_state`);
* `refit.control.dataplane` — the data-plane contract; `dataplane_executor` runs `refit.executor` under it.

The API itself is proto/refit/v1/refit.proto (stubs in `refit.control.v1`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Client", "RefitFailed", "RefitResult", "TrainerAgent", "EngineAgent", "serve_main"]


def __getattr__(name: str) -> Any:  # lazy: importing refit.control must not import grpc or torch
    if name in ("Client", "RefitFailed", "RefitResult"):
        from refit.control import client

        return getattr(client, name)
    if name in ("TrainerAgent", "EngineAgent"):
        from refit.control import agent

        return getattr(agent, name)
    if name == "serve_main":
        from refit.control.server import serve_main

        return serve_main
    raise AttributeError(name)
