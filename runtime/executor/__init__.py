"""Executor: the model runner, decode CUDA graphs, the per-step forward context, tensor parallelism."""
