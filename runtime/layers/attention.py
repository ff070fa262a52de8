"""The attention layer: writes this step's K/V into the paged cache, then runs the step's backend."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from xllm_gen.runtime import ops
from xllm_gen.runtime.attention.base import FULL, make_variant
from xllm_gen.runtime.executor import sharding
from xllm_gen.runtime.executor.context import get_context
from xllm_gen.runtime.executor.distributed import get_tp_rank, get_tp_size
from xllm_gen.runtime.executor.sharding import ParamSplit, Segment, attach, raise_or_defer, split_segment
from xllm_gen.runtime.ops.reference import unit_scale


class Attention(nn.Module):
    """forward(q [N, H, D], k [N, Hk, D], v [N, Hk, D]) -> [N, H * D]. Head counts are per rank.

    sliding_window (None or an int >= 1): key j is visible to query i iff j <= i and j > i - sliding_window
    (HF masking_utils). logit_softcap (None or > 0): scores = cap * tanh(scores / cap) on the scaled scores,
    before masking. Both are per layer: `variant` (an AttentionVariant) is what the backend plans for;
    layers of one model may differ (e.g. alternating sliding-window and full layers).

    `k_cache` / `v_cache` ([num_blocks, block_size, Hk, D], NHD) are plain attributes attached by the runner
    (not parameters or buffers: they are not part of the state dict). The backend comes from the forward
    context (`ctx.backend`, already planned for the step); this layer never imports a backend.

    chunk_size (None or an int >= 1): chunked local attention, key j is visible to query i iff j <= i and
    j // chunk_size == i // chunk_size. The CPU backend implements it; the CUDA path refuses it at load.

    sinks=True: attention sinks, a learned logit per query head in the softmax denominator; the owning module
    holds the parameter (`attention_sinks`) and passes it to forward(..., sinks=) (and the layer to a piecewise
    prefill graph's break, `ctx.graph_break(layer, q, k, v, sinks=)`, which calls `layer.attend` with them again).

    v_head_dim (default head_dim): the value heads' width, when it differs from the q/k heads' (MiMo-V2-Flash's
    `v_head_dim`; multi-head latent attention expanded to per-head K/V: q/k nope + rope dims, v its own). The cache
    holds each at its own width (k_cache [..., Hk, head_dim], v_cache [..., Hk, v_head_dim]); forward takes
    v [N, Hk, v_head_dim] and returns [N, H * v_head_dim]. The CPU backend computes it as is; the CUDA path refuses
    it at load (runtime/attention/base.py cuda_attention_refusal).

    Every layer has a shape of its own (heads, kv_heads, head_dim, v_head_dim): the runner allocates each layer's
    cache at its shape and accounts for each in the cache's memory (a model may mix them: MiMo-V2-Flash's sliding
    layers have twice the KV heads of its full ones, Laguna per-layer query heads).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None, sinks: bool = False,
                 v_head_dim: Optional[int] = None, alibi_slopes: Optional[torch.Tensor] = None,
                 chunk_size: Optional[int] = None, alibi_bf16_scale: Optional[float] = None):
        super().__init__()
        for name, x in (("heads", num_heads), ("kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("v_head_dim", head_dim if v_head_dim is None else v_head_dim)):
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise ValueError(f"attention {name} must be an int >= 1, got {x!r}")
        if num_heads % num_kv_heads and not sharding.deferring():     # (a TP plan's bad split: reported already)
            tp = get_tp_size()
            raise ValueError(f"attention heads ({num_heads}) must be a multiple of kv_heads ({num_kv_heads})"
                             + (f" (this rank's share at tensor parallel size {tp}; check the config's "
                                f"num_attention_heads / num_key_value_heads)" if tp > 1 else ""))
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = self.qk_head_dim = head_dim      # q / k heads' width (the k cache's)
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim      # value heads' width (the v cache's)
        self.model_head_dim: Optional[int] = None         # set by pad_head_dim: the model's width, when padded
        self.scale = scale
        self.variant = make_variant(sliding_window, logit_softcap, sinks, alibi_slopes is not None, chunk_size)
        self.alibi_slopes = alibi_slopes     # ALiBi: this rank's heads' slopes [H] (float32), a plain attribute
        # the ALiBi bias in bfloat16 at absolute key positions, times this factor (the backend's alibi_bias); None:
        # slope * (key position - query position) in float32
        self.alibi_extra = {} if alibi_bf16_scale is None else {"alibi_bf16_scale": float(alibi_bf16_scale)}
        if alibi_bf16_scale is not None and alibi_slopes is None:
            raise ValueError("attention: alibi_bf16_scale without alibi_slopes")
        self.sliding_window = self.variant.sliding_window
        self.logit_softcap = self.variant.logit_softcap
        self.k_cache = torch.tensor([])
        self.v_cache = torch.tensor([])
        # KV-cache scales (set by the loader from the checkpoint's k_scale / v_scale when the cache is float8): floats
        # (per tensor) or float32 tensors [kv_heads, 1] (per KV head, this rank's heads); the cache holds K / k_scale
        # and V / v_scale, read back times them
        self.k_scale = 1.0
        self.v_scale = 1.0
        # KV sharing across layers (`share_kv`): a reader attends over its owner's cache (same shape, same step) and
        # writes none of its own; an owner keeps this step's k, v for its readers (the cache-less path reads them)
        self.__dict__["kv_owner"] = None      # not a submodule (the owner is another layer's)
        self.kv_readers = 0
        self.last_kv: tuple = ()

    def pad_head_dim(self, width: int) -> None:
        """Serve this layer's heads zero-padded to `width` (> head_dim) for kernels built for a few head dims only
        (FlashInfer's: 64, 128, 256): q, k and v get width - head_dim zero columns before the cache write and the
        kernels, and the output's padding (zero: the padded values are zero) is cut off again. q . k and the
        softmax are unchanged (the scale is the layer's own, given explicitly); the KV cache is width wide.
        Before the cache is allocated (runner); q / k / v heads of one width only."""
        if self.model_head_dim is not None or self.k_cache.numel():
            raise RuntimeError("Attention.pad_head_dim: once, before the KV cache is allocated")
        if self.qk_head_dim != self.v_head_dim or self.kv_owner is not None or self.kv_readers:
            raise NotImplementedError("Attention.pad_head_dim: value heads of another width, or a shared KV cache")
        if width <= self.head_dim:
            raise ValueError(f"Attention.pad_head_dim: width {width} <= head_dim {self.head_dim}")
        self.model_head_dim = self.head_dim
        self.head_dim = self.qk_head_dim = self.v_head_dim = int(width)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                sinks: Optional[torch.Tensor] = None, kv_stored: bool = False,
                key_mask: Optional[torch.Tensor] = None, key_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """kv_stored: this step's k, v are already in the cache (L.qk_norm_rope_store wrote them). key_mask [N, L]
        bool (a sparse-attention indexer's selection, runtime/layers/indexer.py): query token t sees key position p
        only where key_mask[t, p] (on top of the causal mask and the variant's); key_bias [N, Hk, L] float32 (a
        per-key score bias, runtime/layers/key_bias.py): added to the scores of query token t's heads of KV head h
        against key position p after scaling (and any soft-cap), -inf hiding the key. The torch backend takes both,
        the CUDA path refuses such a model at load."""
        if (sinks is not None) != self.variant.sinks:
            raise ValueError("Attention: pass `sinks` exactly when the layer was built with sinks=True")
        if self.model_head_dim is not None:       # heads served zero-padded (pad_head_dim)
            if kv_stored:
                raise RuntimeError("Attention: K / V stored by a fused kernel into a padded cache")
            d, pad = self.model_head_dim, self.head_dim - self.model_head_dim
            q, k, v = (F.pad(t.reshape(-1, h, d), (0, pad)) for t, h in
                       ((q, self.num_heads), (k, self.num_kv_heads), (v, self.num_kv_heads)))
            out = self.attend(q, k, v, sinks, False, key_mask, key_bias)
            return out.view(-1, self.num_heads, self.head_dim)[..., :d].reshape(-1, self.num_heads * d)
        return self.attend(q, k, v, sinks, kv_stored, key_mask, key_bias)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: Optional[torch.Tensor], kv_stored: bool = False,
               key_mask: Optional[torch.Tensor] = None, key_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """forward on heads as this layer's cache holds them (zero-padded already where pad_head_dim applies): what a
        piecewise prefill graph's break receives and replays."""
        ctx = get_context()
        if self.kv_owner is not None and key_bias is not None:
            raise NotImplementedError("Attention: a per-key score bias on a layer that reads another layer's KV cache")
        if self.kv_owner is not None:         # another layer's keys and values: its cache, nothing written here
            return self._attend_shared(ctx, q.view(-1, self.num_heads, self.head_dim), sinks)
        if self.kv_readers:                   # this step's k, v for the layers that read this layer's cache
            self.last_kv = (k, v)
        # kv_stored, a RopeStore (L.qk_norm_rope_store with XLLM_ATTENTION_ROPE): q / k are not normed and rotated yet
        # and k / v not stored; the Triton decode kernel does it in its launch, any other path runs its kernel first
        rope = None if isinstance(kv_stored, bool) else kv_stored
        if rope is not None:
            rope.check(q, k)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.v_head_dim)
        if ctx.graph_break is not None:      # piecewise prefill capture: attention runs between captured pieces
            return ctx.graph_break(self, q, k, v, sinks=sinks)
        # a scaled cache: the backend gets the scales (only then: backends without them serve unscaled caches)
        kv = {} if unit_scale(self.k_scale) and unit_scale(self.v_scale) else \
            {"k_scale": self.k_scale, "v_scale": self.v_scale}
        if rope is not None and not (getattr(ctx.backend, "takes_rope", False) and key_mask is None
                                     and key_bias is None and self.alibi_slopes is None and not kv):
            q, k = rope.apply(q, self.k_cache, self.v_cache)
            rope = None
        if rope is not None:                  # (a unit-scaled cache: kv was empty) the backend's kernel takes it
            kv = {"rope": rope}
        if self.k_cache.numel() and self.v_cache.numel() and not kv_stored:
            ops.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping, self.k_scale, self.v_scale)
        elif kv_stored and kv and rope is None:
            raise RuntimeError("Attention: K / V already stored by a fused kernel that does not apply KV-cache scales")
        if key_mask is not None or key_bias is not None:   # a selection / a bias of keys: the torch backend
            if self.alibi_slopes is not None and self.alibi_slopes.device != q.device:
                self.alibi_slopes = self.alibi_slopes.to(q.device)
            extra = {"sinks": sinks} if sinks is not None else {}
            if self.alibi_slopes is not None:
                extra["alibi_slopes"] = self.alibi_slopes
                extra.update(self.alibi_extra)
            if key_mask is not None:
                extra["key_mask"] = key_mask
            if key_bias is not None:
                extra["key_bias"] = key_bias
            out = ctx.backend.forward(q, k, v, self.k_cache, self.v_cache, ctx, self.scale, variant=self.variant,
                                      **extra, **kv)
        elif self.variant == FULL:
            out = ctx.backend.forward(q, k, v, self.k_cache, self.v_cache, ctx, self.scale, **kv)
        elif self.alibi_slopes is not None:
            if self.alibi_slopes.device != q.device:
                self.alibi_slopes = self.alibi_slopes.to(q.device)
            out = ctx.backend.forward(q, k, v, self.k_cache, self.v_cache, ctx, self.scale, variant=self.variant,
                                      sinks=sinks, alibi_slopes=self.alibi_slopes, **self.alibi_extra, **kv)
        elif sinks is not None:
            out = ctx.backend.forward(q, k, v, self.k_cache, self.v_cache, ctx, self.scale, variant=self.variant,
                                      sinks=sinks, **kv)
        else:
            out = ctx.backend.forward(q, k, v, self.k_cache, self.v_cache, ctx, self.scale, variant=self.variant,
                                      **kv)
        return out.reshape(-1, self.num_heads * self.v_head_dim)

    def _attend_shared(self, ctx, q: torch.Tensor, sinks: Optional[torch.Tensor]) -> torch.Tensor:
        o = self.kv_owner
        if not o.last_kv:
            raise RuntimeError("Attention: a layer that reads another layer's KV cache ran before that layer")
        k = o.last_kv[0].view(-1, o.num_kv_heads, o.head_dim)
        v = o.last_kv[1].view(-1, o.num_kv_heads, o.v_head_dim)
        if ctx.graph_break is not None:
            raise NotImplementedError("KV sharing across layers inside piecewise prefill graphs")
        kv = {} if unit_scale(o.k_scale) and unit_scale(o.v_scale) else {"k_scale": o.k_scale, "v_scale": o.v_scale}
        extra = {} if self.variant == FULL else {"variant": self.variant}
        if sinks is not None:
            extra["sinks"] = sinks
        if self.alibi_slopes is not None:
            extra["alibi_slopes"] = self.alibi_slopes.to(q.device)
            extra.update(self.alibi_extra)
        out = ctx.backend.forward(q, k, v, o.k_cache, o.v_cache, ctx, self.scale, **extra, **kv)
        return out.reshape(-1, self.num_heads * self.v_head_dim)

    def kv_bytes_per_token(self, elem: int) -> int:
        """Bytes of this layer's K and V cache per token (at `elem` bytes per element)."""
        return self.num_kv_heads * (self.head_dim + self.v_head_dim) * elem

    def extra_repr(self) -> str:
        s = f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, scale={self.scale}"
        if self.qk_head_dim != self.v_head_dim:
            s += f", v_head_dim={self.v_head_dim}"
        if self.sliding_window is not None:
            s += f", sliding_window={self.sliding_window}"
        if self.logit_softcap is not None:
            s += f", logit_softcap={self.logit_softcap}"
        if self.variant.chunk_size is not None:
            s += f", chunk_size={self.variant.chunk_size}"
        if self.variant.sinks:
            s += ", sinks=True"
        if self.variant.alibi:
            s += ", alibi=True"
        if not (unit_scale(self.k_scale) and unit_scale(self.v_scale)):
            def fmt(x):
                return f"{x:g}" if not isinstance(x, torch.Tensor) else "per head " + \
                    "/".join(f"{float(v):g}" for v in x.flatten())
            s += f", kv_cache_scales=(k {fmt(self.k_scale)}, v {fmt(self.v_scale)})"
        return s


def share_kv(layers, block: str) -> None:
    """KV sharing across layers: layer i's attention block `block` reads the KV cache of layer `block.kv_source`
    (an earlier layer whose attention has the same shape), where that is not i itself. The reader's `attn` gets the
    owner's `attn` as `kv_owner`: it writes no K / V and attends over the owner's cache (which holds this step's keys:
    the owner ran earlier in the same forward); the runner allocates caches for owners only."""
    for i, layer in enumerate(layers):
        blk = getattr(layer, block, None)
        src = getattr(blk, "kv_source", i)
        if blk is None or src == i:
            continue
        owner = getattr(layers[src], block, None) if 0 <= src < i else None
        if owner is None or getattr(owner, "kv_source", src) != src:
            raise ValueError(f"layer {i}: {block} reads the KV cache of layer {src}, which is not an earlier layer "
                             f"with a cache of its own")
        a, o = blk.attn, owner.attn
        if (a.num_kv_heads, a.head_dim, a.v_head_dim) != (o.num_kv_heads, o.head_dim, o.v_head_dim):
            raise ValueError(f"layer {i}: {block} reads the KV cache of layer {src}, whose shape differs (kv heads, "
                             f"head_dim, v_head_dim: {(o.num_kv_heads, o.head_dim, o.v_head_dim)} vs "
                             f"{(a.num_kv_heads, a.head_dim, a.v_head_dim)})")
        a.__dict__["kv_owner"] = o
        o.kv_readers += 1


def attention_sinks(num_heads: int) -> nn.Parameter:
    """The attention-sink logits of `num_heads` query heads (global count), one float per head, split over the
    TP ranks by heads as the query heads are (rank r holds its heads' sinks): a parameter [num_heads / tp]."""
    tp, rank = get_tp_size(), get_tp_rank()
    problems: list = []
    seg = split_segment(Segment("sinks", num_heads, 1), tp, rank, problems)
    param = nn.Parameter(torch.empty(seg.rows))
    holder = nn.Module()
    raise_or_defer(holder, problems)
    return attach(param, ParamSplit("column", 0, (seg,), (seg.rows,), tp, rank, "attention_sinks"))


def head_bias(num_heads: int) -> nn.Parameter:
    """A learned value per query head (global count), split over the TP ranks by heads as q is: [num_heads / tp]
    (an output gate's per-head logit bias)."""
    tp, rank = get_tp_size(), get_tp_rank()
    problems: list = []
    seg = split_segment(Segment("head_bias", num_heads, 1), tp, rank, problems)
    param = nn.Parameter(torch.zeros(seg.rows))
    raise_or_defer(nn.Module(), problems)
    return attach(param, ParamSplit("column", 0, (seg,), (seg.rows,), tp, rank, "head_bias"))


OUT_GATE_ACTIVATIONS = ("sigmoid", "softplus")


def gate_output(out: torch.Tensor, gate: torch.Tensor, activation: str, head_dim: int,
                head_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The attention output [N, heads * head_dim] (this rank's heads) times act(gate): `gate` [N, heads * head_dim]
    gates each element, [N, heads] each head (broadcast over its dims). `head_bias` [heads]: added to each head's gate
    logits first (Beam's gate_bias). The activation is computed in float32 and cast to the output's dtype."""
    if activation not in OUT_GATE_ACTIVATIONS:
        raise ValueError(f"gate_output: activation must be one of {OUT_GATE_ACTIVATIONS}, got {activation!r}")
    if head_bias is not None:
        n, h = gate.shape[0], head_bias.shape[0]
        gate = (gate.view(n, h, -1) + head_bias.to(gate.dtype).view(1, h, 1)).view(gate.shape)
    g = gate.float()
    g = (torch.sigmoid(g) if activation == "sigmoid" else torch.nn.functional.softplus(g)).to(out.dtype)
    if g.shape[-1] == out.shape[-1]:
        return out * g
    n, heads = g.shape
    return (out.view(n, heads, head_dim) * g.unsqueeze(-1)).view(n, heads * head_dim)


def alibi_slopes(num_heads: int, bias_max: float = 8.0) -> torch.Tensor:
    """This rank's ALiBi slopes (float32 [num_heads / tp]) of `num_heads` query heads (global count), as Bloom's
    build_alibi_tensor and MPT's build_alibi_bias compute them (the two agree): with n the largest power of 2 at most
    num_heads, the slopes 2 ** (-bias_max * i / n), i = 1..n, followed where num_heads is not a
    power of 2 by the odd-indexed slopes of the 2n series. Split over the TP ranks by heads as q is."""
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-bias_max * i / n) for i in range(1, n + 1)]
    if n != num_heads:
        slopes += [2.0 ** (-bias_max * i / (2 * n)) for i in range(1, 2 * (num_heads - n), 2)]
    tp, rank = get_tp_size(), get_tp_rank()
    if num_heads % tp:
        raise ValueError(f"ALiBi: {num_heads} heads cannot be split over {tp} tensor-parallel ranks")
    per = num_heads // tp
    return torch.tensor(slopes[rank * per:(rank + 1) * per], dtype=torch.float32, device="cpu")


class QueryScale(nn.Module):
    """A position-dependent query scale: the query of the token at position p is multiplied by
    1 + beta * log(1 + floor((p + offset) / floor)) (an attention temperature that grows with the position; the spec's
    attention `query_scale` gives beta, floor and offset).
    Elementwise on the device from the step's positions (no host sync: capturable in a CUDA graph); no parameters.
    forward(positions [N], q [N, H, D]) -> q scaled per token (in q's dtype)."""

    def __init__(self, beta: float, floor: float, offset: float = 0.0, form: str = "log"):
        super().__init__()
        if form not in ("log", "power"):
            raise ValueError(f"QueryScale: form must be 'log' or 'power', got {form!r}")
        self.form = form
        for name, v in (("beta", beta), ("floor", floor), ("offset", offset)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"QueryScale: {name} must be a finite number, got {v!r}")
        if floor <= 0:
            raise ValueError(f"QueryScale: floor must be > 0, got {floor!r}")
        self.beta, self.floor, self.offset = float(beta), float(floor), float(offset)

    def scale(self, positions: torch.Tensor) -> torch.Tensor:
        """[N] float32 scales of the tokens at `positions` [N]."""
        p = positions.reshape(-1).float()
        if self.form == "power":         # (1 + (p + offset) / floor) ** beta, as exp(beta * log1p(.))
            return torch.exp(torch.log1p((p + self.offset) / self.floor) * self.beta)
        return torch.log1p(torch.floor((p + self.offset) / self.floor)) * self.beta + 1.0

    def forward(self, positions: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        if positions.dim() != 1:
            raise ValueError(f"QueryScale: one position per token expected, got positions of shape "
                             f"{tuple(positions.shape)}")
        s = self.scale(positions).to(q.dtype)
        return q * s.view(-1, *([1] * (q.dim() - 1)))

    def extra_repr(self) -> str:
        if self.form == "power":
            return f"(1 + (position + {self.offset}) / {self.floor}) ** {self.beta}"
        return f"1 + {self.beta} * log(1 + floor((position + {self.offset}) / {self.floor}))"


class DifferentialAttention(nn.Module):
    """Differential attention (Differential Transformer, arXiv 2410.05258, in transformers' two-call form): one
    softmax per query head over the shared q / k, applied to two value sets, the first and second halves of the KV
    heads (each tiled over all KV groups); head i's output minus lambda times head i + heads/2's, a weightless RMSNorm
    over the pair's 2 * head_dim, times (1 - lambda_init):

        o_h = softmax(q_h k^T * scale) [v_a | v_b] (value width 2 * head_dim; v_a = v[kv % (KV/2)], v_b = v[KV/2 + ...])
        out_i = (1 - lambda_init) * rmsnorm(o_i - lambda * o_{i + H/2}),  i < H/2  -> [N, H/2 * 2 * head_dim]
        lambda = exp(sum(lambda_q1 * lambda_k1)) - exp(sum(lambda_q2 * lambda_k2)) + lambda_init  (sums in float32)

    lambda_init = 0.8 - 0.6 * exp(-0.3 * layer) (the paper's depth schedule). Parameters lambda_q1, lambda_k1,
    lambda_q2, lambda_k2 [head_dim] belong to the owning attention block (passed in). The attention runs with value
    heads of width 2 * head_dim (`attn`: an Attention built with v_head_dim = 2 * head_dim), so the pairs (i, i + H/2)
    and the KV halves must all be on one rank: tensor parallelism is refused (at construction)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, layer_idx: int):
        super().__init__()
        if get_tp_size() > 1:
            raise NotImplementedError(
                "differential attention pairs query head i with head i + heads/2 and the two halves of the KV heads, "
                "which a tensor-parallel split by heads puts on different ranks: serve it with tensor_parallel_size=1")
        if num_heads % 2 or num_kv_heads % 2:
            raise ValueError(f"differential attention needs an even number of query and KV heads, got {num_heads} "
                             f"and {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = num_heads, num_kv_heads, head_dim, float(eps)
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer_idx)

    def values(self, v: torch.Tensor) -> torch.Tensor:
        """v [N, KV * head_dim] -> [N, KV, 2 * head_dim]: KV head j holds [v[j % (KV/2)] | v[KV/2 + j % (KV/2)]]."""
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        half = self.num_kv_heads // 2
        return torch.cat([v[:, :half].repeat(1, 2, 1), v[:, half:].repeat(1, 2, 1)], dim=-1)

    def mix(self, out: torch.Tensor, lq1: torch.Tensor, lk1: torch.Tensor, lq2: torch.Tensor,
            lk2: torch.Tensor) -> torch.Tensor:
        """The attention output [N, H * 2 * head_dim] -> [N, H * head_dim] (see the class)."""
        n, H = out.shape[0], self.num_heads
        o = out.view(n, H, 2 * self.head_dim)
        lam1 = torch.exp(torch.sum(lq1 * lk1, dim=-1, dtype=torch.float32)).to(o.dtype)
        lam2 = torch.exp(torch.sum(lq2 * lk2, dim=-1, dtype=torch.float32)).to(o.dtype)
        d = o[:, : H // 2] - (lam1 - lam2 + self.lambda_init) * o[:, H // 2:]
        d = F.rms_norm(d, (2 * self.head_dim,), eps=self.eps)
        return ((1 - self.lambda_init) * d).reshape(n, H * self.head_dim)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, eps={self.eps}, "
                f"lambda_init={self.lambda_init:.6g}")
