"""Stands in for Ray on the GPU machine, which has none (bench/vllm_gpu.py; put bench/probes/no_ray
on PYTHONPATH there only).  vLLM 0.26's ipc weight-transfer module imports ray at its top and uses it
only for its "ray" send mode, which the bench does not use; vLLM's other Ray paths import
``ray.util`` and friends, which stay missing, so they see no Ray."""
