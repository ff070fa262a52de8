"""An engine that is shut down, left by a `with` block, or deleted releases its model and KV cache at once
(on a GPU, the next engine of the process must find the memory free)."""
from __future__ import annotations

import gc
import weakref

from xllm_gen import LLM, SamplingParams


def _refs(llm):
    runner = llm.engine.runner
    return [weakref.ref(next(runner.model.parameters())), weakref.ref(runner.attn_layers[0].k_cache)]


def test_shutdown_and_with_release_memory(qwen3_tied):
    with LLM(str(qwen3_tied), device="cpu", dtype="float32") as llm:
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3))
        assert len(out[0].outputs[0].token_ids) == 3
        refs = _refs(llm)
    gc.collect()
    assert all(r() is None for r in refs), "model / KV cache still alive after the with block"
    llm.shutdown()                                     # idempotent


def test_del_releases_memory(qwen3_tied):
    llm = LLM(str(qwen3_tied), device="cpu", dtype="float32")
    refs = _refs(llm)
    del llm
    gc.collect()
    assert all(r() is None for r in refs), "model / KV cache still alive after del"
