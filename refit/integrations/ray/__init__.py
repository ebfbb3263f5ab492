"""refit inside a Ray job: the coordinator as a named actor, agents inside trainer/engine actors.

    import ray
    from refit.integrations import ray as refit_ray

    ray.init()
    address = refit_ray.start_coordinator()          # `refit serve` as an actor on the head node
    pl = refit_ray.rl_placement(num_trainers=2, num_engines=2, colocated=True)
    trainers = [Trainer.options(**pl.trainer_options(r)).remote(r) for r in range(2)]
    engines = [Engine.options(**pl.engine_options(r)).remote(r) for r in range(2)]

    # inside a Trainer / Engine actor: the agent takes where it runs from Ray
    agent = TrainerAgent(**refit_ray.agent_kwargs(), group="trainer", rank=r, spec=spec,
                         layout="megatron:tp2", tensors=params).start()

    # the driver (RL loop)
    client = Client(address)
    plan = pl.create_plan(client, "trainer", "engine")  # placement as built, checked
    client.refit(plan["plan_id"], version=step)

Where endpoints sit, as refit sees it: a *host* is a Ray node (its id, not its machine: two Ray
nodes on one machine are two hosts), a *GPU* is the accelerator id Ray assigned the actor.  See
`endpoint()` for the host string agents register with.
"""

from __future__ import annotations

from refit.integrations.ray.coordinator import (COORDINATOR_NAME, RayEndpoint, agent_kwargs, coordinator_address,
                                                cuda_index, endpoint, host_for, start_coordinator, stop_coordinator)
from refit.integrations.ray.placement import RLPlacement, Traffic, check_placement, plan_traffic, rl_placement, traffic

__all__ = ["COORDINATOR_NAME", "RayEndpoint", "RLPlacement", "agent_kwargs", "check_placement", "coordinator_address",
           "cuda_index", "endpoint", "host_for", "plan_traffic", "rl_placement", "start_coordinator",
           "stop_coordinator", "Traffic", "traffic"]
