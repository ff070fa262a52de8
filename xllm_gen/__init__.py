"""xllm-gen: a declarative model compiler for LLM inference.

The import package maps the repository's top-level folders: xllm_gen.codegen (codegen/),
xllm_gen.runtime (runtime/), xllm_gen.generated (generated/), xllm_gen.templates, xllm_gen.specs.
"""
__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):  # lazy: `import xllm_gen.codegen` must not import torch
    if name == "LLM":
        from xllm_gen.runtime.llm import LLM
        return LLM
    if name == "SamplingParams":
        from xllm_gen.runtime.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
