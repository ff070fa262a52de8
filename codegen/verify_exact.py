"""verify's float32 yardstick: transformers' own float32 error against its float64 run. Each layer and each
log-probability of the engine may be EXACT_YARDSTICK times as far from transformers' float32 as that is, at least the
floors and at most the caps (verify_report.py: the 16-bit fixed bounds; a float32 run that far from its float64 one
measures something else than precision, and 10x of it would pass anything). Where the float64 run cannot be had, the fixed DEFAULT_TOL / LOGPROB_TOL apply, with a note.

`--dtype float64` (wide_bounds): transformers' float64 run is the reference and the engine runs in float64 too, both
with their float32 steps promoted (verify_float64.py). A stage's rounding error is, to first order, its conditioning
times the unit round-off, so transformers' float32 error on a stage scaled by EPS_RATIO (float64's eps over float32's,
2**-29) is its own float64 error there: each stage and the log-probabilities may be EXACT_YARDSTICK times that, at
least the floors scaled the same way (as many float64 ulps as float32's floors are float32 ulps), and never more than
float32's own bound. A spec constant slightly off (a norm eps 10x too large moves a stage by ~1e-6) hides under
float32's bounds and stands ~1e6x above these.
"""
from __future__ import annotations

from pathlib import Path

from .verify_compare import _own_logprob_error, _rel_error
from .verify_report import (
    DEFAULT_TOL,
    EXACT_CAP,
    EXACT_FLOOR,
    EXACT_LOGPROB_CAP,
    EXACT_LOGPROB_FLOOR,
    EXACT_MAX_BYTES,
    EXACT_YARDSTICK,
    LOGPROB_TOL,
    Report,
)

EPS_RATIO = 2.0 ** -29         # torch.finfo(float64).eps / torch.finfo(float32).eps
WIDE_NOTE = (f"bounds: float64 (transformers' float64 run the reference, the engine in float64, float32 steps promoted "
             f"on both): {EXACT_YARDSTICK}x transformers' own float32 error against float64, scaled by float64's eps / "
             f"float32's (2**-29), on each layer / log-probability (at least {EXACT_FLOOR * EPS_RATIO:.1e} / "
             f"{EXACT_LOGPROB_FLOOR * EPS_RATIO:.1e})")
USED_NOTE = (f"bounds: {EXACT_YARDSTICK}x transformers' own float32 error against its float64 run, on each layer / "
             f"log-probability (at least {EXACT_FLOOR:g} / {EXACT_LOGPROB_FLOOR:g})")


def fixed_bounds_note(report: Report, why: str, e: BaseException | None = None) -> None:
    """The note that the fixed float32 bounds apply, and why (the error's first line where there is one)."""
    err = "" if e is None else f": {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    report.notes.append(f"bounds: the fixed {DEFAULT_TOL['float32']:g} / {LOGPROB_TOL['float32']:g} ({why}{err})")


def float64_reference(cls, ckpt: Path, hf, kwargs: dict, report: Report):
    """transformers' `cls` in float64, or None with a note: its weights over EXACT_MAX_BYTES, or a class that cannot
    build in float64."""
    import torch
    size = 8 * sum(p.numel() for p in hf.parameters())
    if size > EXACT_MAX_BYTES:
        fixed_bounds_note(report, f"transformers in float64 would take {size / 2**30:.1f} GiB, over "
                                  f"{EXACT_MAX_BYTES / 2**30:.0f}")
        return None
    try:        # the eager experts: transformers' grouped-GEMM MoE experts (its default) have no float64 kernel
        hf64 = cls.from_pretrained(str(ckpt), dtype=torch.float64, attn_implementation="eager",
                                   experts_implementation="eager", **kwargs).eval()
    except Exception as e:      # noqa: BLE001 - a class that cannot build in float64: the fixed bounds
        fixed_bounds_note(report, f"transformers cannot build {cls.__name__} in float64", e)
        return None
    # the float32 model's own values, so that the two runs differ by precision alone: a tensor transformers did not
    # find in the checkpoint is random per load, and two loads would measure that difference as "its own error"
    # (a 10x bound of it passed an engine 4 nats off)
    with torch.no_grad():
        held = hf.state_dict()
        for name, t in hf64.state_dict().items():
            if name in held and t.is_floating_point() and t.shape == held[name].shape:
                t.copy_(held[name].to(device=t.device, dtype=t.dtype))
    return hf64


def exact_bounds(logits64, logits32, layers64: list, layers32: list) -> tuple:
    """(log-probability bound, per-layer bounds or None) from transformers' float64 and float32 runs of a sequence."""
    lp_tol = min(max(EXACT_YARDSTICK * _own_logprob_error(logits64, logits32), EXACT_LOGPROB_FLOOR),
                 EXACT_LOGPROB_CAP)
    layer_tols = ([min(max(EXACT_YARDSTICK * _rel_error(a, a64), EXACT_FLOOR), EXACT_CAP)
                   for a, a64 in zip(layers32, layers64)] if len(layers64) == len(layers32) else None)
    return lp_tol, layer_tols


def wide_bounds(logits32, logits64, layers32: list, layers64: list, rtol: float | None = None) -> tuple:
    """--dtype float64's (log-probability bound, per-layer bounds or None) from transformers' float32 and float64 runs
    of a sequence (the float64 one the reference): float32's own error scaled to float64's eps, within float32's bounds
    (module doc); with `rtol` (--atol) the fixed per-layer bound instead."""
    lp32, tols32 = exact_bounds(logits64, logits32, layers64, layers32)
    lp_tol = min(max(EXACT_YARDSTICK * _own_logprob_error(logits64, logits32) * EPS_RATIO,
                     EXACT_LOGPROB_FLOOR * EPS_RATIO), lp32)
    if rtol is not None or tols32 is None:
        return lp_tol, None
    return lp_tol, [min(max(EXACT_YARDSTICK * _rel_error(a, a64) * EPS_RATIO, EXACT_FLOOR * EPS_RATIO), t32)
                    for a, a64, t32 in zip(layers32, layers64, tols32)]
