"""One planned decode / prefill wrapper run with what FlashInfer's kernels do not compute themselves: attention sinks
and per-KV-head KV-cache scales. Shared by FlashInferBackend.forward (eager steps) and the decode CUDA graphs'
bucket backend (runtime/executor/cuda_graph.py), so both compute the same.

- Attention sinks (a logit s_h per query head in the softmax denominator; GPT-OSS): the wrapper runs with
  return_lse=True and the output is rescaled per (token, head) by sigmoid(lse_e - s_h), exact (softmax with the extra
  logit: out * S / (S + exp(s_h)), S = exp(lse_e)). FlashInfer's LSE is base 2 (attention/state.cuh `get_lse`:
  m + log2(d), the logits scaled by sm_scale * log2(e) in variants.cuh), so lse_e = lse * ln 2.
- Per-KV-head KV-cache scales (float32 [Hk, 1]; the cache holds K / k_scale[kh], V / v_scale[kh]): q is multiplied
  by its KV head's k_scale before the kernel (the softmax scale unchanged: the scores, and so the LSE, are the scaled
  cache's), and each head's output by v_scale[kh] after it. Per-tensor scales (floats) go to run() as before
  (FlashInfer folds k_scale into the softmax scale and multiplies the output by v_scale).
- The Triton decode kernel (TritonDecodeWrapper) takes sinks and per-head scales itself.

Both extra steps are small Triton kernels (ops/attention_epilogue.py) with no host sync, so they are captured in
the decode graphs with the attention they follow.
"""
from __future__ import annotations

from typing import Optional

import torch


def run_attention(wrapper, q: torch.Tensor, kv: tuple, *, k_scale=None, v_scale=None,
                  sinks: Optional[torch.Tensor] = None, ragged: bool = False, rope=None) -> torch.Tensor:
    """`wrapper.run` on q and kv ((k_cache, v_cache), or with ragged=True this step's (k, v) for a ragged prefill
    wrapper), with attention sinks (sinks [H]) and KV-cache scales (k_scale / v_scale: floats per tensor, float32
    tensors [Hk, 1] per KV head, or None); rope: the Triton decode kernel's q/k norm + rotary + KV-store prologue
    (ops/fused_rope_store.RopeStore; that kernel only)."""
    from xllm_gen.runtime.attention.triton_decode import TritonDecodeWrapper
    from xllm_gen.runtime.ops.attention_epilogue import attention_epilogue_, fold_k_scale  # (imports triton)
    if isinstance(wrapper, TritonDecodeWrapper):
        extra = {} if sinks is None else {"sinks": sinks}
        if rope is not None:
            extra["rope"] = rope
        if k_scale is None and v_scale is None:
            return wrapper.run(q, kv, **extra)
        return wrapper.run(q, kv, k_scale=k_scale, v_scale=v_scale, **extra)
    if rope is not None:
        raise RuntimeError("run_attention: a rope prologue for a kernel other than the Triton decode kernel")
    if ragged and (k_scale is not None or v_scale is not None):     # never: a float8 cache plans paged prefill
        raise RuntimeError("ragged prefill on this step's K / V cannot apply KV-cache scales")
    kw: dict = {}
    if isinstance(k_scale, torch.Tensor):
        q = fold_k_scale(q, k_scale)
    elif k_scale is not None:
        kw["k_scale"] = k_scale
    v_head = v_scale if isinstance(v_scale, torch.Tensor) else None
    if v_scale is not None and v_head is None:
        kw["v_scale"] = v_scale
    args = (q, *kv) if ragged else (q, kv)
    if sinks is None:
        out = wrapper.run(*args, **kw)
        return out if v_head is None else attention_epilogue_(out, v_scale=v_head)
    out, lse = wrapper.run(*args, return_lse=True, **kw)
    return attention_epilogue_(out, lse, sinks, v_head, lse_base2=True)
