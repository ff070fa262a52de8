"""Programmatic dependent launch (PDL; CUDA capability 9.0 and later) for our Triton kernels.

A decode step is a chain of small kernels (at batch 1 about six per decoder layer), each only a few microseconds
long, so the gap between one kernel's end and the next one's start is a large part of the step. A kernel
launched with PDL may be scheduled while the kernel before it in the stream is still finishing; its first
instruction is `griddepcontrol.wait`, which returns once that kernel has completed and its memory is visible.
So the launch and the block scheduling of kernel n+1 overlap the tail of kernel n, and nothing else changes:
every read and every write of a PDL kernel comes after its wait, so no read sees stale data and no write races a
read of the previous kernel. A kernel that does not use PDL (cuBLAS, FlashInfer) orders as always. CUDA graph
capture records the programmatic edges.

In the `late` mode the weight GEMVs also prefetch their weight rows into L2 before the wait (weights are never
written, so this is safe before the previous kernel ends).

Measured on an H200 (graph decode of a 0.6B model, fused prologues on, bench/results/h200_fused_pdl.md): batch-1 TPOT
`wait` 0.960 ms vs 0.979 without PDL (call 1), `1` 1.154 (the early-launched blocks take the running kernel's
slots), `wait` + L2 prefetch 1.024 vs 0.993 and `late` + prefetch 1.038 (call 2); batch 16 within noise. Run-to-run
noise is 1-2 %, so PDL is no measured gain yet and stays off; the weight prefetch cost more than it saved.

XLLM_PDL (read at import; `MODE` can be set before an engine is built):
  0     off (the default: no measured gain yet; bench/bench_fused_decode.py --modes auto,auto+pdlwait,auto+pdllate);
  wait  launch with PDL, wait at the top of each kernel (the next kernel may launch once this one's blocks exit);
  1     as wait, and each kernel also signals its dependents right after its wait (`griddepcontrol.launch_dependents`),
        so the next kernel's blocks can be resident and waiting while this one runs;
  late  as wait; small kernels signal right after their wait, the GEMVs and the decode attention after their main
        loop (their blocks fill the GPU: waiting blocks of the next kernel would take their slots), and the GEMVs
        prefetch their weights into L2 before the wait;
  auto  wait on capability >= 9, else off.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

MODE = os.environ.get("XLLM_PDL", "0").strip().lower()
_LEVEL = {"0": 0, "off": 0, "wait": 1, "auto": 1, "1": 2, "on": 2, "late": 3}


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def level(t: torch.Tensor) -> int:
    """0 (no PDL), 1 (wait only), 2 (wait + early trigger) or 3 (wait + late trigger in large kernels) for a kernel
    launched on t's device."""
    if MODE not in _LEVEL:
        raise ValueError(f"XLLM_PDL={MODE!r}: expected one of 0, wait, 1, late, auto")
    lv = _LEVEL[MODE]
    if lv == 0 or not t.is_cuda or not _capable(t.device.index if t.device.index is not None else 0):
        return 0
    return lv


def launch(t: torch.Tensor) -> dict:
    """Keyword arguments for a launch of a kernel taking the `PDL` constexpr (see pdl_enter)."""
    lv = level(t)
    return {"PDL": lv, "launch_pdl": True} if lv else {"PDL": 0}


@triton.jit
def pdl_enter(PDL: tl.constexpr, LARGE: tl.constexpr = False):
    """The first statement of a PDL-aware kernel: wait for the previous kernel (PDL >= 1), then let the next one
    launch (PDL 2; PDL 3 unless LARGE: a large kernel calls pdl_trigger after its main loop). A no-op for PDL 0
    (CPU interpreter, pre-Hopper GPUs, XLLM_PDL=0)."""
    if PDL >= 1:
        tl.extra.cuda.gdc_wait()
    if PDL == 2 or (PDL == 3 and not LARGE):
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_trigger(PDL: tl.constexpr):
    """In a LARGE kernel, after its main loop: let the next kernel launch (PDL 3)."""
    if PDL == 3:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_rows_l2(PDL: tl.constexpr, w_ptr, rows, stride_w, K, KP: tl.constexpr, LINE: tl.constexpr):
    """Before pdl_enter in a GEMV (PDL 3): ask L2 for the weight rows `rows` [BLOCK_N], K elements each, one
    `prefetch.global.L2` per LINE elements (a 128-byte line); KP = next_power_of_2(cdiv(K, LINE))."""
    if PDL == 3:
        offs = tl.minimum(tl.arange(0, KP) * LINE, K - 1)
        ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_w + offs[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


def prefetch_meta(K: int, elem_size: int) -> dict:
    line = max(1, 128 // elem_size)
    return {"KP": triton.next_power_of_2(max(1, triton.cdiv(K, line))), "LINE": line}
