"""xllm-gen: a declarative model compiler for LLM inference.

The repository's top-level folders are this package's sub-packages through symlinks (xllm_gen/runtime ->
../runtime, ...), so `xllm_gen.runtime` resolves the same way for Python, pyright and an IDE.
"""
__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name):  # lazy: `import xllm_gen.codegen` must not import torch
    if name == "LLM":
        from xllm_gen.runtime.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from xllm_gen.runtime.engine.sampling_params import SamplingParams
        return SamplingParams
    if name == "StructuredOutputsParams":
        from xllm_gen.runtime.engine.structured_outputs import StructuredOutputsParams
        return StructuredOutputsParams
    raise AttributeError(name)
