"""Per-shape choice between the weight-only decode kernels of packed low-precision layers, measured at start.

For every distinct (form, N, K, group / block, dtype) of a model's packed layers (quant_linear.PackedInt4 /
PackedFp8 on CUDA) and every decode row count up to quant_splitk.SPLITK_MAX_M: the tensor-core tile
(quant_gemv's launch table) against the split-K GEMV in its table config and a few neighbours
(quant_splitk.splitk_candidates), and, for int4 layers, the tensor cores over the raw codes (ops/quant_int4_codes.py)
and, with bf16 activations and its layout, tinygemm (ops/quant_tinygemm.py); for fp8 layers up to 8 rows the skinny
GEMM streaming the float8 weight in a few launch configs (ops/skinny_fma.py fp8_skinny_gemm); each over all the
layers' weights of that shape in turn (repeated to about 96 MB, so they stream from HBM as in a decode step), in a
CUDA graph. Another kernel is taken over the tensor-core tile when it beats `margin` x the best time so far; the decision goes to quant_gemv.QUANT_GEMV_CHOICE (every later call of the
process) and to ops/tuning_cache.py's file (every later start on this GPU and software). Row counts between
measured ones take the next measured count's decision (the bucket they are padded to: eager and graph decode run
the same kernel). Only under XLLM_QUANT_GEMV=auto; a kernel that fails to build or run is logged and the
tensor-core kernel kept.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger("xllm_gen")
CANDIDATES = 4          # split-K configs timed per shape: the table's and the first neighbours (each a compile)
# rows up to which split-K is timed at all: on the H200 it lost every 8B shape from 4 rows on (int4 24-77 us against
# the tile's 18-55, 871 us on down at 16: ARCHITECTURE.md), and each timed config is a Triton compile at start-up
# (~190 s for int4 on a fresh host before this bound)
SPLITK_TUNE_MAX_M = 2
CODES_CANDIDATES = 2    # configs of the int4 raw-code tensor-core kernel timed per shape (the table's and one more)


def _call(p, x, b, kernel, cfg):
    from xllm_gen.runtime.ops import quant_gemv as Q
    if hasattr(p, "qweight"):
        return Q.int4_gemm(x, p.qweight, p.scales, p.zeros, p.group, b, cfg, kernel, p.locks, p.tinygemm)
    return Q.fp8_gemm(x, p.weight, p.scale, p.block, b, cfg, kernel, p.locks)


@torch.inference_mode()
def tune_quant_gemvs(model: nn.Module, rows, margin: float = 0.95, stream_bytes: int = 96 << 20) -> dict:
    """Returns {(kind, M, N, K, s_cols): (tensor-core us, best split-K us, decision)} of what it measured now."""
    from xllm_gen.runtime.layers.linear import _Linear, graph_time_ms
    from xllm_gen.runtime.layers.quant_linear import PackedInt4
    from xllm_gen.runtime.ops import quant_gemv as Q
    from xllm_gen.runtime.ops import quant_int4_codes, tuning_cache
    from xllm_gen.runtime.ops import quant_splitk as S
    from xllm_gen.runtime.ops.skinny_fma import SKINNY_MAX_M, fp8_fits, skinny_gemm_candidates
    if Q.QUANT_GEMV_MODE != "auto":
        return {}
    shapes: dict = {}
    for m in model.modules():
        p = getattr(m, "packed", None) if isinstance(m, _Linear) else None
        locks = getattr(p, "locks", None)          # PackedInt4 / PackedFp8 on CUDA (other packed forms: not ours)
        if locks is None or not locks.is_cuda or m.weight.dtype not in (torch.bfloat16, torch.float16):
            continue
        kind, s_cols = ("int4", p.group) if isinstance(p, PackedInt4) else ("fp8", p.block[1])
        shapes.setdefault((kind, p.out_features, p.in_features, s_cols, m.weight.dtype), []).append((p, m.bias))
    report: dict = {}
    if not shapes:
        return report
    dev = next(iter(shapes.values()))[0][0].locks.device
    path = tuning_cache.cache_path(dev)
    cached, new = tuning_cache.load(path), {}
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    tuned = sorted({int(r) for r in rows if 1 <= r <= S.SPLITK_MAX_M})
    for (kind, N, K, s_cols, dt), layers in shapes.items():
        per_layer = N * K // (2 if kind == "int4" else 1)
        seq = (layers * max(1, -(-stream_bytes // (len(layers) * per_layer))))[:max(64, len(layers))]
        chosen = {}
        for M in tuned:
            key = (kind, M, N, K, s_cols, dt)
            ckey = tuning_cache.key(f"quant_{kind}_{s_cols}", M, N, K, dt)
            if key not in Q.QUANT_GEMV_CHOICE and ckey in cached:
                Q.QUANT_GEMV_CHOICE[key] = cached[ckey]
            if key not in Q.QUANT_GEMV_CHOICE:
                x = torch.randn(M, K, device=dev, dtype=dt)
                try:
                    t_mma = graph_time_ms(lambda: [_call(p, x, b, "mma", None) for p, b in seq]) / len(seq)
                    timed = [(graph_time_ms(lambda: [_call(p, x, b, "splitk", cfg) for p, b in seq]) / len(seq), cfg)
                             for cfg in (S.splitk_candidates(M, N, K, kind == "int4", s_cols, sms)[:CANDIDATES]
                                         if M <= SPLITK_TUNE_MAX_M else ())]
                    t_splitk, cfg = min(timed) if timed else (float("inf"), None)
                    best, t_best = (cfg, t_splitk) if t_splitk < margin * t_mma else ("mma", t_mma)
                    if kind == "int4" and dt == torch.bfloat16 and all(p.tinygemm is not None for p, _ in layers):
                        t_tiny = graph_time_ms(lambda: [_call(p, x, b, "tinygemm", None) for p, b in seq]) / len(seq)
                        if t_tiny < margin * t_best:
                            best, t_best = "tinygemm", t_tiny
                    if kind == "int4" and quant_int4_codes.fits(M, K, s_cols, dt):
                        for cfg in quant_int4_codes.codes_candidates(M, N, K, s_cols, sms)[:CODES_CANDIDATES]:
                            t_codes = graph_time_ms(lambda: [_call(p, x, b, "codes", cfg) for p, b in seq]) / len(seq)
                            if t_codes < margin * t_best:
                                best, t_best = ("codes", *cfg), t_codes
                    if kind == "fp8" and M <= SKINNY_MAX_M and fp8_fits(K, (1, s_cols)):
                        for cfg in skinny_gemm_candidates(M, N, K, 1)[:CANDIDATES]:
                            t_fma = graph_time_ms(lambda: [_call(p, x, b, "fma", cfg) for p, b in seq]) / len(seq)
                            if t_fma < margin * t_best:
                                best, t_best = ("fma", *cfg), t_fma
                    Q.QUANT_GEMV_CHOICE[key] = best
                    report[key[:5]] = (1e3 * t_mma, 1e3 * t_splitk, Q.QUANT_GEMV_CHOICE[key])
                except Exception as e:  # noqa: BLE001 - keep the tensor-core kernel, say why
                    logger.warning("split-K GEMV %s M %d N %d K %d not measured (%s: %s): tensor-core kernel", kind,
                                   M, N, K, type(e).__name__, str(e)[:200])
                    Q.QUANT_GEMV_CHOICE[key] = "mma"
                new[ckey] = Q.QUANT_GEMV_CHOICE[key]
            chosen[M] = Q.QUANT_GEMV_CHOICE[key]
        prev = 0
        for M in sorted(chosen):          # rows between measured counts: the next measured count's decision
            for m in range(prev + 1, M):
                Q.QUANT_GEMV_CHOICE.setdefault((kind, m, N, K, s_cols, dt), chosen[M])
            prev = M
    tuning_cache.save(path, new)
    return report
