"""The attention backend interface, and the attention variants (sliding window, logit soft-capping)."""
from __future__ import annotations

import math
from typing import Iterable, NamedTuple, Optional

import torch

from xllm_gen.runtime.executor.context import ForwardContext


class AttentionVariant(NamedTuple):
    """What a layer's attention computes besides plain causal softmax attention (HF semantics):

    - sliding_window W (None: off): key j is visible to query i iff j <= i and j > i - W
      (transformers masking_utils.sliding_window_causal_mask_function); FlashInfer's window_left = W - 1.
    - logit_softcap c (None: off): scores = c * tanh(scores / c) on the scaled scores, before masking.
    - sinks (False: off): a learned per-head logit s_h joins the softmax denominator, p = exp(x) / (sum exp(x) +
      exp(s_h)) (GPT-OSS; the layer passes the per-rank tensor [H] to `forward(..., sinks=)`).
    - alibi (False: off): ALiBi, slope_h * (key_pos - query_pos) added to the scaled scores (Bloom, MPT; the layer
      passes this rank's slopes [H] to `forward(..., alibi_slopes=)`).
    - chunk_size C (None: off): chunked local attention, key j is visible to query i iff j <= i and
      j // C == i // C (transformers masking_utils.chunked_causal_mask_function).

    Layers with different variants need their own attention plan; backends plan once per distinct variant.
    """
    sliding_window: Optional[int] = None
    logit_softcap: Optional[float] = None
    sinks: bool = False
    alibi: bool = False
    chunk_size: Optional[int] = None

    @property
    def window_left(self) -> int:
        return -1 if self.sliding_window is None else self.sliding_window - 1


FULL = AttentionVariant()

# Head dims FlashInfer's paged prefill / decode kernels are built for (DISPATCH_HEAD_DIM: 64, 128, 256; 512 only
# on SM12x): any other one fails inside the kernel (GPT-J's tiny head_dim 16 did on an H200). Smaller ones are
# served zero-padded to the next of these (padded_head_dim; Attention.pad_head_dim): Phi-2's 80, Phi-3-mini's 96.
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def padded_head_dim(head_dim: int) -> Optional[int]:
    """The kernel head dim a layer of `head_dim` is served at on CUDA: itself when the kernels have it, else the next
    larger one (zero-padded heads: a wider KV cache, the same attention), None past the largest."""
    return next((d for d in FLASHINFER_HEAD_DIMS if d >= head_dim), None)


def cuda_attention_refusal(head_dims: Iterable[int], chunked: bool = False,
                           shared_kv: bool = False) -> Optional[str]:
    """Why the CUDA attention path (FlashInfer) cannot serve layers of these head dims / variants, naming the
    feature; None when it can. Decided at load, before any kernel runs (no GPU needed to decide). Attention sinks are
    served (attention/flashinfer_run.py: the output rescaled from FlashInfer's log-sum-exp; the Triton decode kernel
    takes them itself)."""
    if shared_kv:
        return ("this model shares KV caches across layers (num_kv_shared_layers: later layers attend over an earlier "
                "layer's cache and write none), which the CUDA path (FlashInfer wrappers planned per owning layer, "
                "decode and piecewise prefill graphs) has not been wired or tested for; serve it on the CPU "
                "(device='cpu')")
    if chunked:
        return ("this model uses chunked local attention (attention_chunk_size: a query sees only the keys of its "
                "own chunk), which the CUDA attention path (FlashInfer paged prefill / decode wrappers as planned "
                "here: a causal mask with at most a sliding window) does not implement; serve it on the CPU "
                "(device='cpu')")
    bad = sorted({int(d) for d in head_dims if padded_head_dim(int(d)) is None})
    if bad:
        return (f"this model's attention head_dim {', '.join(map(str, bad))} is larger than FlashInfer's paged "
                f"prefill / decode kernels support ({', '.join(map(str, FLASHINFER_HEAD_DIMS))}; smaller ones are "
                "served zero-padded), so the CUDA attention path cannot serve it; serve it on the CPU (device='cpu')")
    return None


def make_variant(sliding_window=None, logit_softcap=None, sinks: bool = False, alibi: bool = False,
                 chunk_size=None) -> AttentionVariant:
    """A validated AttentionVariant: sliding_window / chunk_size None or an int >= 1, logit_softcap None or a
    finite float > 0."""
    for name, v in (("sliding_window", sliding_window), ("chunk_size", chunk_size)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be None or an int >= 1, got {v!r}")
    if logit_softcap is not None:
        if isinstance(logit_softcap, bool) or not isinstance(logit_softcap, (int, float)) \
                or not math.isfinite(logit_softcap) or logit_softcap <= 0:
            raise ValueError(f"logit_softcap must be None or a finite number > 0, got {logit_softcap!r}")
        logit_softcap = float(logit_softcap)
    return AttentionVariant(sliding_window, logit_softcap, bool(sinks), bool(alibi), chunk_size)


def attention_variants(layers: Iterable) -> tuple[AttentionVariant, ...]:
    """The distinct variants of attention layers (objects with a `variant` attribute; FULL for those without),
    in order of first appearance."""
    seen: dict = {}
    for layer in layers:
        seen.setdefault(getattr(layer, "variant", FULL), None)
    return tuple(seen)


class AttentionBackend:
    """plan(ctx) once per step (outside graph capture), shared by all layers; forward(...) per layer.

    When forward runs, the step's K/V are already written to (k_cache, v_cache) ([num_blocks, block_size,
    Hk, D], NHD; v_cache [..., Hk, Dv] where the value heads have a width of their own) by the Attention layer.
    q [N, H, D], k [N, Hk, D], v [N, Hk, Dv] -> out [N, H, Dv]. Layers may differ in shape (H, Hk, D, Dv). `variant` (an
    AttentionVariant; None = FULL) selects the layer's sliding window / soft-cap; the Attention layer passes it
    only when it is not FULL, so a backend without variants keeps working for plain models. With
    `variant.sinks` the layer also passes `sinks` ([H] float, this rank's heads). A layer whose cache is scaled
    (fp8 KV-cache scales from the checkpoint: the cache holds K / k_scale and V / v_scale) passes `k_scale=` /
    `v_scale=`: floats (per tensor) or float32 tensors [Hk, 1] (per KV head, this rank's heads); the backend reads the
    cache back as cache * scale (per head: each KV head's values times its own).
    """

    def plan(self, ctx: ForwardContext) -> None:
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, ctx: ForwardContext, scale: float,
                variant: Optional[AttentionVariant] = None) -> torch.Tensor:
        raise NotImplementedError

    def decode_page_table(self, ctx: ForwardContext):
        """A pure decode step's page table in FlashInfer's CSR form (indptr [B+1], page indices, last-page length
        [B], int32 on the model's device; persistent buffers inside a decode graph bucket), for kernels that attend
        on their own (the whole-layer decode kernel, runtime/layers/layer_kernel.py); None: not available."""
        return None
