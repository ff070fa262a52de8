"""xllm-gen: a declarative model compiler for LLM inference.

The import package maps the repository's top-level folders: xllm_gen.codegen (codegen/),
xllm_gen.runtime (runtime/), xllm_gen.generated (generated/), xllm_gen.templates, xllm_gen.specs.
"""
import os as _os

__version__ = "0.1.0"

# From a source checkout that is not installed (e.g. `PYTHONPATH=.` on a GPU host), the top-level folders
# are found through this package's path; an installed package (editable or wheel) maps them itself.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "runtime", "model_runner.py")) and _root not in __path__:
    __path__.append(_root)

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):  # lazy: `import xllm_gen.codegen` must not import torch
    if name == "LLM":
        from xllm_gen.runtime.llm import LLM
        return LLM
    if name == "SamplingParams":
        from xllm_gen.runtime.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
