"""Parallelism below the model: the process groups (tensor, pipeline, context, expert, data), the
environment a launched rank reads, the pipeline's layer layout, sequence parallelism, and the CPU
shim that lets megatron-core's parallel state run without CUDA. Launching and driving the ranks
(`ranks.py`, `worker.py`) and the pipelined step (`pipeline_step.py`) sit one level up."""
