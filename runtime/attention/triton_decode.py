"""The Triton decode-attention kernel (ops/decode_attention.py) behind FlashInfer's decode-wrapper interface
(`plan(indptr, indices, last_page_len, ...)`, `run(q, (k_cache, v_cache))`), so FlashInferBackend can give a
graph bucket (or an eager step) either kernel.

Which kernel a batch size gets: FlashInfer's CUDA-graph decode always splits the KV range and merges the splits in
a second kernel, ~11 us per layer at batch 1 on an H200 for a 1k context (two launches, most of it fixed cost).
The Triton kernel merges in the same launch. It is a candidate for batches whose (rows x KV heads) fill less than
the GPU with one program each, where the split is what fills it (`decode_splits`); larger batches keep
FlashInfer's tensor-core decode, which reads the KV cache near bandwidth there. Which of the two is faster for a
candidate depends on the heads: on an H200 at batch 1 the Triton kernel was 18% faster with 16 query heads over 8
KV heads, and 32% slower with 32 over 4 (bench/results/h200_attention_30b.md). So with "auto" each graph bucket's
kernel (and split count) is measured once per process on the GPU at hand (`measure_decode_kernels`,
`pick_decode_kernel`).
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch

KERNELS = ("auto", "flashinfer", "triton")


def decode_kernel_choice(kernel: Optional[str] = None) -> str:
    """The decode-attention kernel setting: `kernel` if given, else $XLLM_DECODE_ATTENTION, else "auto"."""
    k = (kernel or os.environ.get("XLLM_DECODE_ATTENTION") or "auto").lower()
    if k not in KERNELS:
        raise ValueError(f"decode attention kernel must be one of {KERNELS}, got {k!r} "
                         "(argument decode_kernel or $XLLM_DECODE_ATTENTION)")
    return k


def decode_splits(batch: int, num_kv_heads: int, num_sms: int, kernel: str = "auto", max_splits: int = 32) -> int:
    """How many KV splits the Triton kernel runs a decode batch of `batch` rows with; 0: use FlashInfer.
    Splits aim at two programs per SM (rows x KV heads x splits ~ 2 x SMs), at most `max_splits`."""
    if kernel == "flashinfer" or batch < 1:
        return 0
    programs = batch * max(1, num_kv_heads)
    if kernel == "auto" and programs >= num_sms:
        return 0
    return max(1, min(max_splits, -(-2 * num_sms // programs)))


# (rows, heads, KV heads, head_dim, dtype, KV dtype, page size, contexts) -> the Triton kernel's split count, or 0 for
# FlashInfer: measured once per process, so every backend of the process gives a bucket the same kernel (engines
# then compare bit for bit, as DECODE_GEMM_CHOICE does for the GEMMs)
DECODE_KERNEL_CHOICE: dict = {}
TUNE_CONTEXT = 1024      # the context the kernels are timed at (the engine's max_model_len where shorter); longer
                         # ones favour FlashInfer a little (16 over 8 heads, 16 rows x 8192: 4% faster)
TUNE_MARGIN = 0.97       # the Triton kernel must be 3% faster: a near tie keeps FlashInfer's
LONG_TUNE_CONTEXT = 32768        # the longest context the kernels are also timed at (where the engine admits it)
LONG_TUNE_TOKENS = 1 << 16       # KV tokens (rows x context) that timing holds at most (its caches: 128 KB a token)


def tune_contexts(rows: int, max_model_len: Optional[int]) -> list[int]:
    """The contexts a bucket's kernels are timed at: TUNE_CONTEXT (max_model_len where shorter) and, where the engine
    admits contexts 4x longer, a long one (max_model_len, at most LONG_TUNE_CONTEXT and LONG_TUNE_TOKENS / rows). A
    split count that suits 1k contexts starves long ones: on an H100 (16 over 8 heads of 128, one row at a 32k context, in the
    engine) the count chosen at 1k ran 74 us a layer, FlashInfer 54, 32 splits 55 (kernel alone)."""
    short = min(max_model_len or TUNE_CONTEXT, TUNE_CONTEXT)
    long = min(max_model_len or 0, LONG_TUNE_CONTEXT, LONG_TUNE_TOKENS // max(rows, 1))
    return [short] + ([long] if long >= 4 * short else [])


def combine_timings(per_context: list) -> dict:
    """One figure per kernel from its timings at several contexts ({kernel: us} each): the geometric mean of its
    time over the fastest kernel's at each context (the kernels timed at every context). One context: its times."""
    if len(per_context) == 1:
        return dict(per_context[0])
    keys = set(per_context[0]).intersection(*per_context[1:])
    return {k: math.prod(t[k] / min(t[j] for j in keys) for t in per_context) ** (1 / len(per_context))
            for k in keys}


def split_candidates(batch: int, num_kv_heads: int, num_sms: int, max_splits: int = 32) -> list[int]:
    """Split counts worth timing: decode_splits' (about two programs per SM), and the powers of two from an eighth
    of it to four times it (at most max_splits). On an H200 the best count was up to 2.7x away from the rule's (16
    rows x 8 KV heads, 1k context: 8 splits 25.2 us, the rule's 3 28.2; bench/results/h200_decode_attention_tune.md)."""
    s = decode_splits(batch, num_kv_heads, num_sms, "triton", max_splits)
    return sorted({s} | {p for p in (2 ** i for i in range(6)) if s / 8 <= p <= min(4 * s, max_splits)}, reverse=True)


# (BLOCK_N, num_warps) of the Triton kernel: the default, and those timed at the best split count when
# XLLM_DECODE_LAUNCH_TUNING=1. The kernel alone (bench/results/h200_decode_attention_tune.md, 16 over 8 heads, 1k
# context) ran 16 rows fastest at (16, 2), 25.2 us vs 28+; but in the engine the timing picked (64, 2) and the graph
# decode TPOT did not move (batch 1: 1.027 / 1.028 vs 1.029 / 1.023 ms, batch 16: 1.898 / 1.897 vs 1.890 / 1.896,
# bench/results/h200_attn_launch.md), so it is off by default: three more timings per bucket at start-up for nothing
DEFAULT_LAUNCH = (64, 4)
LAUNCH_CANDIDATES = ((16, 2), (32, 2), (64, 2)) if os.environ.get("XLLM_DECODE_LAUNCH_TUNING") == "1" else ()


def default_launch(kv_dtype: Optional[torch.dtype] = None) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of the default launch for a cache of `kv_dtype`: DEFAULT_LAUNCH's tile for a 16-bit
    cache, and as many bytes a tile for a narrower one (a float8 cache: 128 tokens). The loop's iterations are
    latency-bound, so a tile of the same tokens moved half the bytes in the same time: on an H100 at a 32k context a
    float8 cache streamed at 1.2 TB/s with 64-token tiles, against 2.4 TB/s for bf16; with 128 (batch 1 / 4, 16 over
    8 heads) 57.2 -> 46.5 / 295 -> 140-152 us a layer, FlashInfer's 45.5 / 130.9
    (bench/results/h100_2026-12-06_session29.md). XLLM_DECODE_BLOCK_N overrides the tile."""
    forced = os.environ.get("XLLM_DECODE_BLOCK_N")
    if forced:
        return int(forced), DEFAULT_LAUNCH[1]
    size = kv_dtype.itemsize if kv_dtype is not None else 2
    return DEFAULT_LAUNCH[0] * 2 // min(2, size), DEFAULT_LAUNCH[1]


def launch_of(choice, kv_dtype: Optional[torch.dtype] = None) -> tuple[int, int, int]:
    """(splits, BLOCK_N, num_warps) of a decode-kernel choice: a split count (the default launch for the cache's
    dtype) or such a tuple; 0 (FlashInfer) gives (0, default launch)."""
    return tuple(choice) if isinstance(choice, tuple) else (int(choice), *default_launch(kv_dtype))


def pick_decode_kernel(times: dict, margin: float = TUNE_MARGIN, kv_dtype: Optional[torch.dtype] = None):
    """`times` {splits or (splits, BLOCK_N, num_warps): us per call}, 0 being FlashInfer's: the fastest Triton launch
    as (splits, BLOCK_N, num_warps) if it takes less than `margin` x FlashInfer's time, else 0 (FlashInfer)."""
    triton = {launch_of(k, kv_dtype): t for k, t in times.items() if k != 0}
    if not triton:
        return 0
    best = min(triton, key=triton.get)
    return best if 0 not in times or triton[best] < margin * times[0] else 0


@torch.inference_mode()
def measure_decode_kernels(rows: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                           kv_dtype: torch.dtype, page_size: int, context: int, device: torch.device,
                           workspace: torch.Tensor, tensor_cores: bool, splits: list[int]) -> dict:
    """{0: FlashInfer's CUDA-graph decode, s: the Triton kernel at s splits (DEFAULT_LAUNCH), (s*, BLOCK_N, num_warps):
    the fastest split count s* in each of LAUNCH_CANDIDATES}: us per layer, each timed in a CUDA graph over copies of
    a random KV cache of `rows` x `context` tokens (128 MB at least, so that they stream from HBM as a step's layers
    do). `workspace` is FlashInfer's float workspace (not in use while this runs)."""
    import flashinfer

    from xllm_gen.runtime.layers.linear import graph_time_ms
    per_row = -(-context // page_size)
    npages = rows * per_row
    kv_bytes = 2 * npages * page_size * num_kv_heads * head_dim * torch.empty(0, dtype=kv_dtype).element_size()
    copies = int(max(2, min(64, -(-(128 << 20) // kv_bytes))))
    caches = [tuple(torch.randn(npages, page_size, num_kv_heads, head_dim, device=device).to(kv_dtype)
                    for _ in range(2)) for _ in range(copies)]
    indptr = torch.arange(0, npages + 1, per_row, dtype=torch.int32)
    indices = torch.randperm(npages, device=device).to(torch.int32)
    last = torch.full((rows,), context - (per_row - 1) * page_size, dtype=torch.int32)
    q = torch.randn(rows, num_heads, head_dim, device=device).to(dtype)
    fi = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
        paged_kv_indptr_buffer=indptr.to(device), paged_kv_indices_buffer=indices.clone(),
        paged_kv_last_page_len_buffer=last.to(device))
    fi.plan(indptr, indices, last, num_heads, num_kv_heads, head_dim, page_size, q_data_type=dtype,
            kv_data_type=kv_dtype)
    times = {0: 1e3 * graph_time_ms(lambda: [fi.run(q, kv) for kv in caches]) / copies}

    def timed(s, block_n=default_launch(kv_dtype)[0], num_warps=default_launch(kv_dtype)[1]):
        w = TritonDecodeWrapper(num_heads, num_kv_heads, head_dim, s, rows, device, block_n=block_n,
                                num_warps=num_warps)
        w.plan(indptr, indices, last, num_heads, num_kv_heads, head_dim, page_size)
        return 1e3 * graph_time_ms(lambda: [w.run(q, kv) for kv in caches]) / copies

    for s in splits:
        times[s] = timed(s)
    if splits:
        best = min(splits, key=times.get)
        for block_n, num_warps in LAUNCH_CANDIDATES:
            times[(best, block_n, num_warps)] = timed(best, block_n, num_warps)
    return times


def decode_page_table_of(wrapper) -> Optional[tuple]:
    """A planned decode wrapper's page table on the device in FlashInfer's CSR form (indptr, indices, last-page
    length): the Triton wrapper's, or a FlashInfer decode wrapper's buffers (in CUDA-graph mode the persistent ones a
    capture reads); None before a plan."""
    table = getattr(wrapper, "_table", None)
    if table is not None:
        return table
    bufs = tuple(getattr(wrapper, a, None) for a in ("_paged_kv_indptr_buf", "_paged_kv_indices_buf",
                                                      "_paged_kv_last_page_len_buf"))
    return bufs if all(isinstance(b, torch.Tensor) and b.is_cuda for b in bufs) else None


class TritonDecodeWrapper:
    """One decode wrapper over the Triton kernel for `splits` splits. With `buffers` (a graph bucket's
    persistent indptr / last-page-length buffers, and the backend's shared page-index buffer) `plan` copies the
    step's table into them, so a captured launch reads each step's; without, it moves the table to the device."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, splits: int, max_batch: int,
                 device: torch.device, buffers: Optional[tuple] = None, block_n: int = 64, num_warps: int = 4,
                 num_stages: Optional[int] = None, merge_vec: Optional[bool] = None):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.splits, self.device, self.block_n = splits, device, block_n
        self.num_warps, self.num_stages, self.merge_vec = num_warps, num_stages, merge_vec
        self.scratch = self._scratch(max_batch)
        self.buffers = buffers                      # (indptr [b+1], last_page_len [b], page indices) or None
        self._table = None
        self._kw: dict = {}

    def _scratch(self, rows: int):
        # imported here: triton is loaded only once a wrapper is made
        from xllm_gen.runtime.ops.decode_attention import DecodeScratch

        return DecodeScratch(rows, self.num_heads, self.num_kv_heads, self.head_dim, self.splits, self.device)

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, *, sm_scale: Optional[float] = None,
             window_left: int = -1, logits_soft_cap: Optional[float] = None, chunk_size: Optional[int] = None,
             **_) -> None:
        if (num_qo_heads, num_kv_heads, head_dim) != (self.num_heads, self.num_kv_heads, self.head_dim):
            raise ValueError(f"decode plan for heads {num_qo_heads}/{num_kv_heads} x {head_dim}: the wrapper was "
                             f"built for {self.num_heads}/{self.num_kv_heads} x {self.head_dim}")
        B = last_page_len.numel()
        if self.buffers is not None:
            ip, lp, ix = self.buffers
            if B + 1 > ip.numel():
                raise ValueError(f"decode plan for {B} rows: the graph bucket has {lp.numel()}")
            ip[: B + 1].copy_(indptr, non_blocking=True)
            lp[:B].copy_(last_page_len, non_blocking=True)
            n = indices.numel()
            if n and indices.data_ptr() != ix.data_ptr():
                ix[:n].copy_(indices, non_blocking=True)
        else:
            if B > self.scratch.max_batch:          # eager steps only: grow the scratch
                self.scratch = self._scratch(B)
            ip, lp, ix = (t.to(self.device, torch.int32, non_blocking=True) for t in (indptr, last_page_len, indices))
        self._table = (ip, ix, lp)
        self._kw = dict(sm_scale=self.head_dim ** -0.5 if sm_scale is None else float(sm_scale),
                        window_left=int(window_left), soft_cap=logits_soft_cap, chunk_size=chunk_size)

    def run(self, q: torch.Tensor, kv, *, k_scale=None, v_scale=None,
            sinks: Optional[torch.Tensor] = None, rope=None) -> torch.Tensor:
        """k_scale / v_scale: the scales of a scaled KV cache, per tensor (floats, as FlashInfer's run takes them) or
        per KV head (float32 tensors [Hk, 1]); sinks [H]: attention sinks (the kernel adds them to its softmax
        denominator); rope: the q/k norm + rotary + KV-store prologue (ops/fused_rope_store.RopeStore)."""
        from xllm_gen.runtime.ops.decode_attention import paged_decode_attention
        if self._table is None:
            raise RuntimeError("TritonDecodeWrapper.run before plan")
        k_cache, v_cache = kv
        ip, ix, lp = self._table
        kw = self._kw
        return paged_decode_attention(q, k_cache, v_cache, ip, ix, lp, kw["sm_scale"], self.scratch,
                                      window_left=kw["window_left"], soft_cap=kw["soft_cap"], block_n=self.block_n,
                                      chunk_size=kw["chunk_size"], k_scale=1.0 if k_scale is None else k_scale,
                                      v_scale=1.0 if v_scale is None else v_scale, sinks=sinks,
                                      num_warps=self.num_warps,
                                      num_stages=self.num_stages, merge_vec=self.merge_vec, rope=rope)
