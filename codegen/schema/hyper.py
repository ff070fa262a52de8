"""Hyper-connections (`hyper_connection`): the residual stream as several parallel streams, mixed into a block's
input and the block's output mixed back (DeepSeek-V4's mHC, HY-V4's iHC, Qwen4-Exp's gated residual). A layer's
step names one with `{hyper: HC, norm: N, block: B}`; `decoder.hyper_head` collapses the streams before the final
norm. codegen/README.md, "Hyper-connections"; runtime/layers/hyper_connection.py."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import StrictBool, StrictFloat, StrictInt

from .base import Dim, Num, Strict


class HyperNorm(Strict):
    """The RMS normalization of the streams the coefficients read: over all n * dim features (`per_stream: false`,
    DeepSeek-V4 / HY-V4's weightless input norm) or over each stream's dim (`per_stream: true`, Qwen4-Exp's grouped
    RMSNorm); `weight: true`: times a learned `offset + w` over n * dim (parameter `hc_norm.weight`)."""
    eps: Num
    per_stream: StrictBool = False
    weight: StrictBool = False
    weight_offset: Union[StrictInt, StrictFloat] = 0


class HyperPre(Strict):
    """The pre-mix (the block's input from the streams): `eps` added to each sigmoid weight (form `fused` only)."""
    eps: Num = 0


class HyperPost(Strict):
    """The post-mix (the block's output into each stream): `post_k = magnitude * sigmoid(logit_k) + eps`."""
    magnitude: Num = 1
    eps: Num = 0


class HyperMix(Strict):
    """The residual mix of the streams, an input-dependent n x n matrix made doubly stochastic by Sinkhorn-Knopp:
    `softmax_row(logits) + eps`, a column normalization, then `sinkhorn_iters - 1` row / column rounds (each
    `m / (sum + eps)`). Absent: the identity (each stream keeps itself). Form `fused` only."""
    sinkhorn_iters: Dim
    eps: Num = 0


class HyperConnectionBlock(Strict):
    """`streams` residual streams of width `dim`. `form: fused`: one projection `fn [m, streams * dim]` of the normed
    streams gives every logit (pre, post, mix), each group scaled by a learned `scale[g]` plus a learned `base`; the
    block input is the pre-weighted sum of the raw streams. `form: low_rank` (`rank`): per-channel input gates from a
    low-rank MLP of the normed streams (`input_mix_weight_down [rank, n * dim]`, `input_mix_weight_up [n * dim,
    rank]`), the block input the mean of the gated normed streams; post from `block_inject_weight [n, n * dim]`, the
    logits divided by n. Without `post`: a collapse only (`decoder.hyper_head`)."""
    kind: Literal["hyper_connection"]
    streams: Dim
    dim: Dim
    norm: HyperNorm
    form: Literal["fused", "low_rank"] = "fused"
    rank: Optional[Dim] = None           # form low_rank: the input mixer's rank
    pre: HyperPre = HyperPre()
    post: Optional[HyperPost] = None     # absent: no output mix (the decoder's final collapse)
    mix: Optional[HyperMix] = None       # absent: the identity residual
