"""Integrations of refit with the frameworks an RL job runs on (Ray, vLLM, HF, FSDP, Megatron).

Each submodule imports its framework; importing `refit.integrations` itself imports nothing."""
