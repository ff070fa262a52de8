"""`L.decoder_layer_kernel`: a whole pre-norm decoder layer as one persistent kernel at a small decode step.

The compiler emits the call at the top of a layer's forward where the layer is exactly `norm -> attention` and
`norm -> gated MLP` (codegen/fusion.py); the call means exactly the layer's steps written below it. It returns the
layer's (hidden_states, residual) when the kernel (ops/layer_kernel.py) runs the step, else None and the plain
steps run. It runs when all of these hold, decided from the modules and the step (nothing about a model family):

- a CUDA decode step (no prefill, no piecewise-graph capture) of 1..16 rows whose attention backend exposes the
  step's page table (its decode wrapper's, FlashInfer's or the Triton kernel's), TP 1;
- bf16 / fp16 activations; unquantized weights of that dtype; no bias except the q/k/v projection's;
- RMSNorm step norms (any weight offset); per-head q/k RMSNorm (or none) + neox rotary over the whole head with
  1-D positions; a KV cache of the activation dtype without scales; no soft-cap, sinks, ALiBi or shared KV;
- a silu / gelu gated MLP.

XLLM_LAYER_KERNEL: "1" where it applies, "0" never (the default until it measures faster than the fused-prologue
path: bench/bench_fused_decode.py +nolayer, bench/bench_layer_kernel.py), "staged" the five stages as five launches
(the one-launch form's reference on a GPU). On CPU it runs only when TRITON_INTERPRET=1 and XLLM_LAYER_KERNEL=staged
(the tests), since the interpreter cannot run the grid barriers.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from xllm_gen.runtime.layers import linear as _lin
from xllm_gen.runtime.layers.fused import _act_kind, _fused_rope_args, _norm_args

MODE = os.environ.get("XLLM_LAYER_KERNEL", "0").strip().lower()
MAX_ROWS = 16
CALLS = {"fused": 0}                # launches (tests count them)
_SCRATCH: dict = {}
_PLANS: dict = {}                   # id(attention module) -> the layer's static arguments, or False


def _plain_linear(linear, dtype, bias_ok: bool = False) -> bool:
    w = getattr(linear, "weight", None)
    return (w is not None and w.dim() == 2 and w.dtype == dtype and getattr(linear, "act_quant", None) is None
            and getattr(linear, "tp_size", 1) == 1 and (bias_ok or linear.bias is None)
            and type(linear).forward in (_lin._Linear.forward, _lin.RowParallelLinear.forward)
            and "forward" not in vars(linear))


def _static_plan(norm1, attn_block, norm2, mlp, q_norm, k_norm, dtype):
    """The layer's arguments that do not change between steps, or None where the kernel does not apply."""
    from xllm_gen.runtime.attention.base import FULL
    a = getattr(attn_block, "attn", None)
    rotary = getattr(attn_block, "rotary_emb", None)
    qkv, o, gu, down = (getattr(attn_block, "qkv_proj", None), getattr(attn_block, "o_proj", None),
                        getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
    n1, n2 = _norm_args(norm1), _norm_args(norm2)
    rope = _fused_rope_args(q_norm, k_norm, rotary)
    act = _act_kind(getattr(mlp, "act_fn", None))
    if a is None or None in (qkv, o, gu, down, n1, n2, rope, act) or rotary.kind != "neox":
        return None
    if not (_plain_linear(qkv, dtype, bias_ok=True) and _plain_linear(o, dtype) and _plain_linear(gu, dtype)
            and _plain_linear(down, dtype)):
        return None
    variant = a.variant
    if (variant.logit_softcap is not None or variant.sinks or getattr(variant, "chunk_size", None) is not None
            or getattr(a, "alibi_slopes", None) is not None or a.kv_owner is not None or a.kv_readers
            or a.v_head_dim != a.head_dim or a.num_heads % a.num_kv_heads):
        return None
    if n1[0].dtype != dtype or n2[0].dtype != dtype or a.head_dim & (a.head_dim - 1) or a.head_dim < 16:
        return None
    if rope[0] is not None and (rope[0].dtype != dtype or rope[1].dtype != dtype):
        return None
    H, HK, HD = a.num_heads, a.num_kv_heads, a.head_dim
    D, inter = qkv.weight.shape[1], down.weight.shape[1]
    if (qkv.weight.shape[0] != (H + 2 * HK) * HD or o.weight.shape != (D, H * HD) or gu.weight.shape != (2 * inter, D)
            or down.weight.shape[0] != D or n1[0].shape[0] != D or n2[0].shape[0] != D):
        return None
    return dict(attn=a, rotary=rotary, n1=n1, n2=n2, rope=rope, act=act, qkv=qkv, o=o, gu=gu, down=down,
                dims=(D, H, HK, HD, inter), window=variant.window_left if variant != FULL else -1)


def _mode_allows(x: torch.Tensor) -> Optional[bool]:
    """Whether to run, and staged: None = no."""
    if MODE == "0":
        return None
    if x.is_cuda:
        return MODE == "staged"
    if os.environ.get("TRITON_INTERPRET") == "1" and MODE == "staged":
        return True
    return None


def decoder_layer_kernel(positions: torch.Tensor, hidden_states: torch.Tensor, residual: Optional[torch.Tensor],
                         norm1, attn_block, norm2, mlp, q_norm, k_norm):
    """(out, residual) of the whole layer by the persistent kernel, or None (the caller runs the plain steps)."""
    staged = _mode_allows(hidden_states)
    if staged is None or hidden_states.dim() != 2 or not 0 < hidden_states.shape[0] <= MAX_ROWS:
        return None
    x = hidden_states
    if x.dtype not in (torch.bfloat16, torch.float16) and x.is_cuda:
        return None
    if positions.dim() != 1 or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype)):
        return None
    if torch.compiler.is_compiling():
        return None
    from xllm_gen.runtime.executor.context import get_context
    ctx = get_context()
    if ctx.is_prefill or ctx.graph_break is not None or ctx.backend is None:
        return None
    key = (id(attn_block), x.dtype)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _static_plan(norm1, attn_block, norm2, mlp, q_norm, k_norm, x.dtype) or False
    if not plan:
        return None
    a = plan["attn"]
    kc, vc = a.k_cache, a.v_cache
    if (not kc.numel() or kc.dtype != x.dtype or vc.shape != kc.shape or not kc.is_contiguous()
            or not vc.is_contiguous() or kc.device != x.device):
        return None
    from xllm_gen.runtime.layers.attention import unit_scale
    if not (unit_scale(a.k_scale) and unit_scale(a.v_scale)) or abs(a.scale - getattr(ctx.backend, "sm_scale", a.scale)) > 1e-9:
        return None
    table = ctx.backend.decode_page_table(ctx)
    if table is None:
        return None
    from xllm_gen.runtime.ops import layer_kernel as K
    D, H, HK, HD, inter = plan["dims"]
    dev = x.device
    page = kc.shape[1]
    skey = (dev, x.dtype, D, H, HK, HD, inter, page)
    scratch = _SCRATCH.get(skey)
    if scratch is None:
        programs = torch.cuda.get_device_properties(dev).multi_processor_count if x.is_cuda else 8
        small = {} if x.is_cuda else dict(tile_budget=512, num_warps=4)    # the interpreter: small tiles
        scratch = _SCRATCH[skey] = K.LayerScratch(K.LayerDims(D, H, HK, HD, inter, page), programs, x.dtype, dev,
                                                  **small)
    rotary = plan["rotary"]
    rotary._to(dev)
    (g1, eps1, off1), (g2, eps2, off2) = plan["n1"], plan["n2"]
    qw, kw, qk_eps = plan["rope"]
    indptr, indices, last = table
    CALLS["fused"] += 1
    return K.decoder_layer(x.contiguous(), None if residual is None else residual.contiguous(), g1, off1, eps1,
                           plan["qkv"].weight, plan["qkv"].bias, qw, kw, qk_eps, positions, rotary.cos_sin_cache,
                           ctx.slot_mapping, kc, vc, indptr, indices, last, a.scale, plan["window"],
                           plan["o"].weight, g2, off2, eps2, plan["gu"].weight, plan["act"], plan["down"].weight,
                           scratch, staged=staged)
