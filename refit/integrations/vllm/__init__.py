"""refit as a vLLM weight-transfer backend named ``refit``.

Installing ``refit[vllm]`` registers it through vLLM's ``vllm.general_plugins`` entry point
(`refit.integrations.vllm.plugin.register`), so an RL loop drives it with vLLM's own calls::

    llm = LLM(model=..., weight_transfer_config={"backend": "refit"})
    llm.init_weight_transfer_engine({"init_info": {"coordinator": "127.0.0.1:50051", "group": "engine"}})
    plan = refit.Client("127.0.0.1:50051").create_plan("trainer", "engine")
    llm.start_weight_update()
    llm.update_weights({"update_info": {"plan_id": plan["plan_id"], "version": step}})
    llm.finish_weight_update(weight_version=str(step))

This package is glue: the engine side every engine shares (the host-driven refit, the staging
window of ``window_layers``) is `refit.engine`'s; vLLM implements its `refit.engine.Landing`.
Modules: ``plugin`` (registration), ``config`` (rank, layout and spec from vLLM's configs),
``landing`` (which parameters are written in place, which staged and re-processed; the staging
modes), ``lora_slot`` (an adapter landed in a LoRA slot), ``engine`` (the worker-side
`WeightTransferEngine`, which runs `refit.engine.HostRefit` over its landing), ``draft`` (a
speculative engine's separate draft model, refitted in vLLM's draft weight updates), ``compat``
(every vLLM internal refit reaches, and the differences between vLLM versions).
"""
