"""Fused decode prologues of linear layers, as generated code calls them (`L.norm_linear`, `L.act_linear`).

The compiler emits one of these calls where the spec's dataflow has the pattern (a norm step before a block whose
first op is a linear; a gated MLP's down projection); each call means exactly its plain ops, written beside it in
the generated source:

    norm_linear(norm, linear, x, residual) == (linear(norm(x, residual)[0]), norm(x, residual)[1])
    act_linear(act, linear, x)             == linear(act(x))

On a CUDA decode batch (<= 64 rows, bf16 / fp16, an unquantized weight, norm an RMSNorm without bias, act silu or
gelu) the pair runs as ONE kernel (ops/fused_gemv.py: the skinny GEMV computing its x chunk from the norm's or the
activation's input as it streams the weight); so does a packed fp8 layer's (quant_linear.PackedFp8) up to 8 rows,
its input bf16 / fp16 or quantized to fp8 per token and group inside the prologue (ops/fused_gemv_fp8.py: the
roundings that differ from the unfused path); everywhere else (CPU, prefill, other quantized forms or input
quantizations, other norms and activations) the plain ops run, so CPU results are unchanged.

XLLM_FUSED_DECODE: "auto" (the default; measured on an H200, graph decode of a 0.6B model (28 layers, hidden 1024): TPOT 0.90-0.93x of "0" at
batch 1, 0.97-0.98x at batch 16, 10.1 -> 6.1 kernel launches per layer at batch 1, bench/results/h200_fused_decode.md, h200_fused_pdl_call2.md, h200_fused_pdl.md)
fuses a GEMV prologue for a (rows, N, K) where tune_fused_gemvs (run by
tune_decode_gemms when the runner starts) measured the fused kernel faster than the plain op + GEMM (a shape never
measured stays plain), and the rotary + KV-cache store on every CUDA decode step; "1" fuses every call where the
kernels apply (also on CPU when TRITON_INTERPRET=1: the tests); "0" never. Both an eager step and a graph replay of the same rows
take the same choice and launch config, so graph == eager stays bit for bit.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from xllm_gen.runtime import ops
from xllm_gen.runtime.executor.distributed import all_reduce
from xllm_gen.runtime.layers import linear as _lin
from xllm_gen.runtime.layers.activation import GeluAndMul, SiluAndMul
from xllm_gen.runtime.layers.norm import RMSNorm
from xllm_gen.runtime.ops.reference import unit_scale

logger = logging.getLogger("xllm_gen")
_SETTING = os.environ.get("XLLM_FUSED_DECODE", "auto").strip().lower()
MODE = "" if _SETTING == "auto" else _SETTING      # "" auto (default) | "1" force | "0" off
_CPU_KERNELS = os.environ.get("TRITON_INTERPRET") == "1"
# prologue ("norm" | "act") -> {(rows, N, K, dtype): (the fused GEMV's fastest launch config, whether it beat the
# plain prologue op + GEMM)}, measured by tune_fused_gemvs (from tune_decode_gemms, once per process); FUSED_TUNING:
# {(prologue, rows, N, K): (plain us, fused us, config)} of what it measured
FUSED_GEMV_CHOICE: dict = {"norm": {}, "act": {}}
# the fused GEMVs: the FMA skinny GEMM's up to 8 rows, the tensor-core one's up to 64 (ops/skinny_fma.py
# SKINNY_MAX_M, ops/skinny_mma.py SKINNY_MMA_MAX_M); XLLM_FUSED_MMA=0 keeps 9..64 rows unfused (the benchmark's baseline)
# XLLM_ATTENTION_ROPE: "1" (the default) runs a decode step's q/k norm + rotary + KV-cache store inside the Triton
# decode-attention kernel where a layer's attention takes that kernel (qk_norm_rope_store's `into_attention`); "0" in
# their own kernel before it. H100, graph decode of a 0.6B model: TPOT 1.106 -> 1.048 ms at batch 1, 2.093 -> 2.016 ms at
# batch 16 (bench/results/h100_2026-12-06_session32.md)
ATTENTION_ROPE = os.environ.get("XLLM_ATTENTION_ROPE", "1").strip() != "0"
_FUSED_MAX_ROWS = 8 if os.environ.get("XLLM_FUSED_MMA", "1") == "0" else 64
FUSED_TUNING: dict = {}


def _fused_ops():
    from xllm_gen.runtime.ops import fused_gemv
    return fused_gemv


def _weight_form(linear, x: torch.Tensor, prologue: str) -> Optional[tuple]:
    """(weight, the fused GEMV's weight keywords, its choice-key suffix) of linear as the fused GEMV takes it, or None:
    an unquantized weight of x's dtype ({}, ()), or a packed fp8 layer (layers/quant_linear.py PackedFp8, up to 8
    rows: ops/fused_gemv_fp8.py) with its scales, whose input is bf16 / fp16 (act_quant None) or quantized per token
    and group (ActQuant "group"; power-of-two scales for the act prologue only) where the scale geometry fits."""
    p = linear.packed
    if p is None:
        w = linear.weight
        if linear.act_quant is not None or w.dim() != 2 or not w.dtype.is_floating_point or x.dtype != w.dtype:
            return None
        return w, {}, ()
    from xllm_gen.runtime.layers.quant_linear import PackedFp8
    from xllm_gen.runtime.ops import fused_gemv_fp8 as F8
    if not isinstance(p, PackedFp8) or not x.dtype.is_floating_point or x.dim() != 2:
        return None
    group = F8.quant_group(linear.act_quant, prologue)
    if group is None or not F8.fits(x.shape[0], p.in_features, p.block, group):
        return None
    pow2 = bool(group) and linear.act_quant.pow2
    kw = dict(scale=p.scale, block=p.block, group=group, **(dict(pow2=pow2) if prologue == "act" else {}))
    return p.weight, kw, ("fp8", p.block[1], group, pow2)


def gemv_config(linear, x: torch.Tensor, prologue: str, form: Optional[tuple] = None):
    """The launch config of the fused GEMV for linear(x) with the prologue "norm" or "act" (None: the launch
    table's), or False where the fused kernel does not apply or was not chosen. form: _weight_form's (computed
    when not given)."""
    if MODE == "0" or x.dim() != 2 or not 0 < x.shape[0] <= min(_FUSED_MAX_ROWS, _lin._SKINNY_MAX_ROWS):
        return False
    if x.is_cuda and not _lin.decode_step():      # prefill: the plain ops (cuBLAS: row-count invariant, _lin._linear)
        return False
    form = form or _weight_form(linear, x, prologue)
    if form is None:
        return False
    w, kw, suffix = form
    if not isinstance(linear, (_lin.ReplicatedLinear, _lin.ColumnParallelLinear, _lin.MergedColumnParallelLinear,
                               _lin.QKVParallelLinear, _lin.RowParallelLinear)):
        return False
    if type(linear).forward not in (_lin._Linear.forward, _lin.RowParallelLinear.forward) or "forward" in vars(linear):
        return False            # a layer whose forward was replaced (e.g. a quantized kernel) runs as itself
    if not x.is_cuda:      # the tests: the interpreter runs programs one by one, so few wide ones
        if MODE == "1" and _CPU_KERNELS and x.device == w.device:
            if x.shape[0] <= 8:
                return min(64, 1 << (w.shape[0] - 1).bit_length()), max(64, kw.get("group", 0)), 1, 1
            if x.dtype == torch.float32 and not kw:     # (the interpreter's bf16 tl.dot is wrong: fp32 tensor cores)
                return 16 if x.shape[0] <= 16 else 32 if x.shape[0] <= 32 else 64, 64, 64, 1, 1, 2
        return False
    if x.dtype not in _lin._SKINNY_DTYPES or ops._FORCE_TORCH or torch.compiler.is_compiling():
        return False
    choice = FUSED_GEMV_CHOICE[prologue].get((x.shape[0], w.shape[0], w.shape[1], x.dtype) + suffix)
    if MODE == "1" or _lin._FORCE:
        return choice[0] if choice else None
    if _lin._FORCE is False or not choice:
        return False
    return choice[0] if choice[1] else False


def fused_candidates(M: int, N: int, K: int, elem_size: int = 2, group: int = 0) -> list:
    """Launch configs timed for a fused GEMV: the skinny GEMM's measured alternatives (its launch table's own config
    is rarely the fastest), and for more than 2 rows one with 8 output rows per program: each program computes its
    x chunk (the norm / activation of all rows) itself, so fewer, wider programs read less of it. A float8 weight
    (elem_size 1; group: its input's quantization group, 0 none): ops/fused_gemv_fp8.py `candidates`."""
    from xllm_gen.runtime.ops.skinny_fma import SKINNY_MAX_M, skinny_gemm_candidates
    from xllm_gen.runtime.ops.skinny_mma import skinny_mma_candidates
    if elem_size == 1:
        from xllm_gen.runtime.ops.fused_gemv_fp8 import candidates
        return candidates(M, N, K, group)
    if M > SKINNY_MAX_M:        # the tensor-core form: its GEMM's candidates
        return skinny_mma_candidates(M, N, K)
    cands = skinny_gemm_candidates(M, N, K, elem_size)
    out = cands[1:] or cands
    wide = (8, min(512, cands[0][1]), 4, 1)
    return out + [wide] if M > 2 and wide not in out else out


def packed_shape(linear) -> Optional[tuple]:
    """The key (N, K, activation dtype, form) under which tune_decode_gemms collects a packed fp8 layer for
    tune_fused_gemvs (form: ("fp8", scale columns, input group or 0, power-of-two scales), _weight_form's
    choice-key suffix: never mixed with an unquantized weight of the same N, K), or None where the fused GEMV
    cannot take the layer."""
    from xllm_gen.runtime.layers.quant_linear import PackedFp8
    from xllm_gen.runtime.ops import fused_gemv_fp8 as F8
    p, dt = linear.packed, linear.weight.dtype
    if not isinstance(p, PackedFp8) or not p.weight.is_cuda or dt not in _lin._SKINNY_DTYPES:
        return None
    group = F8.quant_group(linear.act_quant, "act")
    if group is None or not F8.fits(1, p.in_features, p.block, group):
        return None
    return p.out_features, p.in_features, dt, ("fp8", p.block[1], group, bool(group) and linear.act_quant.pow2)


@torch.inference_mode()
def tune_fused_gemvs(shapes: dict, rows, cache: Optional[tuple] = None, packed: Optional[dict] = None) -> None:
    """For every (rows, N, K) of the model's decode GEMMs (shapes: {(N, K, dtype): [(weight, bias), ...]}, as
    tune_decode_gemms collects them) not decided yet: times the plain pair (fused_add_rms_norm, resp. silu_and_mul,
    then the GEMM as the layer runs it) against the fused GEMV in each candidate launch config, over all the
    layers' weights of the shape (CUDA-graph replays, weights streamed from HBM), and keeps the fastest config and
    whether it beat the plain pair. `packed`: {packed_shape: [(float8 weight, bias, PackedFp8, act_quant), ...]},
    up to 8 rows: the plain pair is the norm / activation kernel (ending in the input's fp8 round trip where the
    layer quantizes its input) then the packed layer's own decode GEMM (PackedFp8.forward: as tune_quant_gemvs
    chose it, when that ran first). `cache`: (decisions read from ops/tuning_cache.py's file, those measured now:
    filled here)."""
    from xllm_gen.runtime.ops import tuning_cache
    from xllm_gen.runtime.ops.skinny_fma import SKINNY_MAX_M
    cache = cache if cache is not None else ({}, {})
    if MODE == "0":
        return
    jobs = [(N, K, dt, (), ws) for (N, K, dt), ws in shapes.items()]
    jobs += [(N, K, dt, form, ws) for (N, K, dt, form), ws in (packed or {}).items()]
    for N, K, dt, form, ws in jobs:
        seq = _lin.timing_sequence(ws, N, K)
        tag = f"_fp8_{form[1]}_g{form[2]}" + ("_pow2" if form[3] else "") if form else ""
        for prologue in ("norm", "act"):
            if form and form[3] and prologue == "norm":     # power-of-two scales: the act prologue only
                continue
            table, chosen = FUSED_GEMV_CHOICE[prologue], {}
            for M in (r for r in rows if not form or r <= SKINNY_MAX_M):
                key, ckey = (M, N, K, dt) + form, tuning_cache.key(f"fused_{prologue}{tag}", M, N, K, dt)
                if key not in table and ckey in cache[0]:
                    table[key] = cache[0][ckey]
                if key not in table:
                    try:
                        table[key] = cache[1][ckey] = _measure(prologue, M, N, K, dt, form, seq)
                    except Exception as e:  # noqa: BLE001 - a fused form that cannot run here: the plain ops serve
                        logger.warning("fused %s GEMV not measured for rows %d, N %d, K %d%s (%s: %s): plain ops",
                                       prologue, M, N, K, tag, type(e).__name__, str(e)[:200])
                        table[key] = (None, False)
                chosen[M] = table[key]
            _lin.fill_row_choices(chosen, N, K, dt, table, form)


def _measure(prologue: str, M: int, N: int, K: int, dt, form: tuple, seq: list) -> tuple:
    """(the fused GEMV's fastest config, whether it beat the plain pair) for tune_fused_gemvs; recorded in
    FUSED_TUNING."""
    from xllm_gen.runtime.ops import fused_gemv as FG
    from xllm_gen.runtime.ops import norm_act_kernels as NK
    dev = seq[0][0].device
    group, pow2 = (form[2], form[3]) if form else (0, False)
    quant = (group, None, pow2) if group else None
    epilogue = quant is not None and NK.quant_fits(quant, K, prologue == "act")
    aq = seq[0][3] if form else None

    def gemm(h, item):          # the layer's own product (its input already quantized: Linear.forward's order)
        return item[2](h, item[1], item[3]) if form else _lin._linear(h, item[0], item[1])

    def kw(item):
        return dict(scale=item[2].scale, block=item[2].block, group=group,
                    **(dict(pow2=pow2) if prologue == "act" else {})) if form else {}

    if prologue == "norm":
        x, r = torch.randn(M, K, device=dev, dtype=dt), torch.randn(M, K, device=dev, dtype=dt)
        g = torch.randn(K, device=dev, dtype=dt)

        def pro():
            if epilogue:
                return NK.fused_add_rms_norm(x, r, g, 1e-6, quant=quant)[0]
            h = ops.fused_add_rms_norm(x, r, g, 1e-6)[0]
            return h if aq is None else aq(h)

        def fused(cfg):
            return lambda: [FG.norm_gemv(x, r, g, 1e-6, 0.0, it[0], it[1], config=cfg, **kw(it)) for it in seq]
    else:
        x = torch.randn(M, 2 * K, device=dev, dtype=dt)

        def pro():
            if epilogue:
                return NK.silu_and_mul(x, quant=quant)
            h = ops.silu_and_mul(x)
            return h if aq is None else aq(h)

        def fused(cfg):
            return lambda: [FG.act_gemv(x, it[0], it[1], "silu", config=cfg, **kw(it)) for it in seq]
    t_plain = _lin.graph_time_ms(lambda: [gemm(pro(), it) for it in seq]) / len(seq)
    t_fused, cfg = min((_lin.graph_time_ms(fused(c)) / len(seq), c)
                       for c in fused_candidates(M, N, K, seq[0][0].element_size(), group))
    FUSED_TUNING[(prologue, M, N, K) + form] = (1e3 * t_plain, 1e3 * t_fused, cfg)
    return cfg, t_fused < t_plain


def _norm_args(norm) -> Optional[tuple]:
    if type(norm) is RMSNorm and norm.bias is None:
        return norm.weight, norm.eps, norm.weight_offset
    return None


_ACT_KINDS = {(SiluAndMul, None): "silu", (GeluAndMul, "tanh"): "gelu_tanh", (GeluAndMul, "none"): "gelu"}


def _act_kind(act) -> Optional[str]:
    return _ACT_KINDS.get((type(act), getattr(act, "approximate", None)))


def _row_parallel_tail(linear, y: torch.Tensor) -> torch.Tensor:
    """A row-parallel layer's partial output summed over the ranks, then its bias (RowParallelLinear.forward)."""
    if linear.reduce:
        y = all_reduce(y)
    return y if linear.bias is None else y + linear.bias


def _split_bias(linear):
    """The bias the kernel adds, and whether the row-parallel tail (all-reduce, then bias) follows."""
    tail = isinstance(linear, _lin.RowParallelLinear) and linear.tp_size > 1
    return (None if tail else linear.bias), tail


def _quant_epilogue(linear, x: torch.Tensor, width: int, gated: bool):
    """The fp8 round trip of linear's input as the producing op's epilogue (ops/norm_act_kernels.py `quant`):
    (group, static scale, power-of-two scales), or None where the op and the quantization stay two launches (no per-token / group /
    static ActQuant, a replaced forward, a width the epilogue cannot tile, torch ops)."""
    aq = linear.act_quant
    if aq is None or aq.kind not in ("group", "token", "static") or MODE == "0":
        return None
    if not (x.is_cuda and ops._direct() or not x.is_cuda and MODE == "1" and _CPU_KERNELS):
        return None
    if type(linear).forward not in (_lin._Linear.forward, _lin.RowParallelLinear.forward) or "forward" in vars(linear):
        return None
    quant = (aq.group if aq.kind == "group" else None, aq.scale if aq.kind == "static" else None, aq.pow2)
    from xllm_gen.runtime.ops.norm_act_kernels import quant_fits
    return quant if quant_fits(quant, width, gated) else None


def _norm_quant_linear(norm, linear, x: torch.Tensor, residual: Optional[torch.Tensor], quant):
    """norm_linear with the norm's output quantized in the norm's kernel (one launch fewer)."""
    from xllm_gen.runtime.ops import norm_act_kernels as K
    weight, eps, offset = norm.weight, norm.eps, norm.weight_offset
    if residual is None:
        h = K.rms_norm(x, weight, eps, offset, quant=quant)
    else:
        h, residual = K.fused_add_rms_norm(x, residual, weight, eps, offset, quant=quant)
    return linear(h, quantized=True), (x if residual is None else residual)


def norm_linear(norm, linear, x: torch.Tensor, residual: Optional[torch.Tensor]):
    """(linear(norm(x + residual)), x + residual); residual None: (linear(norm(x)), x)."""
    args = _norm_args(norm)
    form = _weight_form(linear, x, "norm") if args is not None else None
    cfg = gemv_config(linear, x, "norm", form) if form is not None else False
    if (cfg is False or norm.weight.dtype != x.dtype or norm.weight.shape[0] != x.shape[-1]
            or (residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape))):
        quant = (_quant_epilogue(linear, x, x.shape[-1], False) if args is not None and norm.residual_float32 is None
                 and (residual is None or residual.shape == x.shape) else None)
        if quant is not None:
            return _norm_quant_linear(norm, linear, x, residual, quant)
        h, residual = norm(x, residual)
        return linear(h), residual
    weight, eps, offset = args
    bias, tail = _split_bias(linear)
    y, residual = _fused_ops().norm_gemv(x, residual, weight, eps, offset, form[0], bias, config=cfg, **form[1])
    return (_row_parallel_tail(linear, y) if tail else y), residual


def act_linear(act, linear, x: torch.Tensor) -> torch.Tensor:
    """linear(act(x)) for a gated activation act (x: gate | up halves)."""
    kind = _act_kind(act)
    fits = kind is not None and x.dim() == 2 and x.shape[-1] == 2 * linear.in_features
    form = _weight_form(linear, x, "act") if fits else None
    cfg = gemv_config(linear, x, "act", form) if form is not None else False
    if cfg is False:
        quant = _quant_epilogue(linear, x, x.shape[-1] // 2, True) if kind is not None else None
        if quant is not None:       # the activation's kernel ends in linear's input quantization
            from xllm_gen.runtime.ops import norm_act_kernels as K
            h = (K.silu_and_mul(x, quant=quant) if kind == "silu" else
                 K.gelu_and_mul(x, "tanh" if kind == "gelu_tanh" else "none", quant=quant))
            return linear(h, quantized=True)
        return linear(act(x))
    bias, tail = _split_bias(linear)
    y = _fused_ops().act_gemv(x, form[0], bias, kind, config=cfg, **form[1])
    return _row_parallel_tail(linear, y) if tail else y


def _fused_rope_args(q_norm, k_norm, rotary):
    """(q weight, k weight, eps) when qk_norm_rope's Triton kernel covers the norms and rotary, else None."""
    if rotary is None or not rotary.whole:
        return None
    if q_norm is None and k_norm is None:
        return None, None, 0.0
    if (type(q_norm) is not RMSNorm or type(k_norm) is not RMSNorm or q_norm.eps != k_norm.eps
            or q_norm.weight_offset or k_norm.weight_offset or q_norm.bias is not None or k_norm.bias is not None):
        return None
    return q_norm.weight, k_norm.weight, q_norm.eps


def qk_norm_rope_store(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm, k_norm,
                       rotary, attn, into_attention: bool = True):
    """L.qk_norm_rope(positions, q, k, q_norm, k_norm, rotary) -> (q, k, kv_stored). On a CUDA decode step the same
    kernel also writes k (normed, rotated) and v into attn's paged KV cache at the step's slots, and kv_stored is
    True: the attention layer then skips its store_kvcache (`attn(q, k, v, kv_stored=True)`). Prefill (and the
    piecewise prefill-graph capture), CPU and the norms / rotary the kernel does not cover: the plain
    qk_norm_rope, kv_stored False.

    With XLLM_ATTENTION_ROPE on (ATTENTION_ROPE, the default) and `into_attention` (the generated code passes False where it
    changes q between this call and the attention), the kernel is not launched here: q and k come back as given and
    kv_stored is an ops.fused_rope_store.RopeStore, which the attention hands to its Triton decode kernel (that
    kernel then norms, rotates and stores in its own launch: one launch fewer a layer) or runs first itself
    (`RopeStore.apply`, this same kernel) where its kernel is another."""
    from xllm_gen.runtime.executor.context import get_context
    from xllm_gen.runtime.layers.rotary import qk_norm_rope
    args = None
    if MODE != "0" and (q.is_cuda and not ops._FORCE_TORCH and not torch.compiler.is_compiling()
                        or not q.is_cuda and MODE == "1" and _CPU_KERNELS):
        ctx = get_context()
        kc, vc = attn.k_cache, attn.v_cache
        if (not ctx.is_prefill and ctx.graph_break is None and attn.model_head_dim is None     # (not padded heads)
                and kc.numel() and vc.numel() and kc.device == q.device
                and kc.shape == vc.shape and kc.dtype == k.dtype == v.dtype and vc.dtype == v.dtype and kc.is_contiguous()
                and vc.is_contiguous()):
            args = _fused_rope_args(q_norm, k_norm, rotary)
    if args is None:
        q, k = qk_norm_rope(positions, q, k, q_norm, k_norm, rotary)
        return q, k, False
    from xllm_gen.runtime.ops.fused_rope_store import RopeStore
    from xllm_gen.runtime.ops.fused_rope_store import qk_norm_rope_store as kernel
    rotary._check_positions(positions)
    rotary._to(q.device)
    qw, kw, eps = args
    D = q.shape[-1]
    if (ATTENTION_ROPE and into_attention and not attn.kv_readers
            and attn.kv_owner is None and D & (D - 1) == 0 and k.shape[-1] == D and v.numel() == k.numel()
            and unit_scale(attn.k_scale) and unit_scale(attn.v_scale)):
        return q, k, RopeStore(k, v.view(k.shape), qw, kw, eps, positions, rotary.cos_sin_cache, get_context().slot_mapping,
                               q=q, axis_map=rotary.axis_map)
    q, k = kernel(q, k, v.view(k.shape), qw, kw, eps, positions, rotary.cos_sin_cache, rotary.axis_map,
                  attn.k_cache, attn.v_cache, get_context().slot_mapping)
    return q, k, True
