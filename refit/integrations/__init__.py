"""Integrations: refit inside the frameworks users run.

* `refit.integrations.vllm` — the vLLM weight-transfer backend named ``refit`` (registered through
  the ``vllm.general_plugins`` entry point);
* `refit.integrations.ray` — the coordinator as a named Ray actor, agents' host and GPU from Ray,
  placement groups for colocated and disaggregated RL jobs;
* trainers: attach a live model to the refit control plane in one call::

    from refit.integrations import hf as refit_hf, fsdp as refit_fsdp, megatron as refit_megatron
    agent = refit_hf.attach(model, "127.0.0.1:50051", group="trainer")        # unsharded transformers model
    agent = refit_fsdp.attach(model, "127.0.0.1:50051", group="trainer")      # FSDP2 fully_shard, every rank
    agent = refit_megatron.attach(model, "127.0.0.1:50051", group="trainer", spec="/path/to/hf")  # megatron-core

  Each returns a started `refit.control.agent.TrainerAgent` serving views of the model's live
  parameters (no copy is kept aside): a refit sends what the trainer holds when it runs.  Every
  parameter of the model is mapped to a tensor of refit's layout, or the attach fails naming it.
"""
