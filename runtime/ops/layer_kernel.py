"""A whole pre-norm decoder layer at a small decode batch in ONE persistent kernel.

At batch 1 a graph decode step of a 0.6B model was ~6 launches per layer of 3-9 us each, for ~10 us of weight
bytes per layer (bench/results/h200_profile_2026-12-03_before.md): the fixed cost of each kernel (launch, ramp,
tail, the dependent loads at its start) dominates, not the bandwidth. Here one launch of P programs (one per SM,
all resident at once) runs the layer's five stages, separated by grid-wide barriers (a release counter every
program increments, then spins on with acquire loads), so a stage's first loads follow the previous stage's last
stores by one L2 round trip instead of a kernel boundary:

  1. h = x + residual; qkv = W_qkv (rmsnorm(h) * g1) (+ bias)           tiles of qkv's rows
  2. per (row, KV head, split): q/k per-head RMSNorm + neox rotary of the step's token (the split owning the
     token's position also writes its k, v into the paged cache), split-KV attention over the cache, the last
     program of (row, KV head) merging the splits (ops/decode_attention.py's scheme)
  3. r2 = W_o attn + h                                                    split-K, tickets
  4. act = silu(gate) * up with gate | up = W_gu (rmsnorm(r2) * g2)       tiles of the intermediate
  5. out = W_down act                                                     split-K, tickets
returns (out, r2): the layer's (hidden_states, residual), as the unfused ops give them. The GEMM stages' tiles are
in ops/layer_kernel_gemm.py, stage 2 in ops/layer_kernel_attention.py; this module holds the kernel that sequences
them (barriers, tickets), its launch configuration (LayerScratch) and the launcher (decoder_layer).

Rounding: the norm's scale rsqrt(mean(h^2) + eps) is a per-row scalar, factored out of the GEMV (as in
ops/fused_gemv.py); every stage's output is rounded to the activation dtype where the unfused op rounds it. The
split-K sums and attention merges reduce in a fixed order, so a run is deterministic and a graph replay equals
the eager call bit for bit.

The barriers need every program resident: P <= the SM count, one program per SM's resources, nothing else on
the GPU in between (a CUDA-graph decode step). Under TRITON_INTERPRET=1 (the CPU tests) the programs of a launch run
one after another, so a barrier would never open: there the stages run as five launches of the same code
(`staged`), which the GPU can run too (XLLM_LAYER_KERNEL=staged) as the reference for the one-launch form.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from xllm_gen.runtime.ops.layer_kernel_attention import _attention_stage
from xllm_gen.runtime.ops.layer_kernel_gemm import BM, ROWS, _norm_tile, _splitk_first, _splitk_tile, _w_chunk


@triton.jit
def _grid_sync(cnt_ptr, target):
    """All programs' stores before it are visible to all programs' loads after it (loads through L2: .cg)."""
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr, 1, sem="release")
    c = tl.atomic_add(cnt_ptr, 0, sem="acquire")
    while c < target:
        c = tl.atomic_add(cnt_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _layer_kernel(x_ptr, r_ptr, r1_ptr, g1_ptr, g1_off, wqkv_ptr, bqkv_ptr, qkv_ptr,
                  qw_ptr, kw_ptr, qk_eps, pos_ptr, cs_ptr, slot_ptr, kc_ptr, vc_ptr, indptr_ptr, indices_ptr,
                  last_ptr, part_o_ptr, part_lse_ptr, sm_scale, window_left, attn_ptr,
                  wo_ptr, r2_ptr, g2_ptr, g2_off, wgu_ptr, act_ptr, wd_ptr, out_ptr, ws_ptr, cnt_ptr,
                  M, D, NQKV, I, eps1, eps2,
                  H: tl.constexpr, HK: tl.constexpr, HD: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr,
                  G_PAD: tl.constexpr, SPLITS: tl.constexpr, S_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_RES: tl.constexpr, HAS_QKV_BIAS: tl.constexpr, HAS_NORM: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, ACT: tl.constexpr,
                  BN1: tl.constexpr, BK1: tl.constexpr, BN3: tl.constexpr, BK3: tl.constexpr, S3: tl.constexpr,
                  BN4: tl.constexpr, BK4: tl.constexpr, BN5: tl.constexpr, BK5: tl.constexpr, S5: tl.constexpr,
                  IEEE: tl.constexpr, PIPE: tl.constexpr, STAGE: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    ONE: tl.constexpr = STAGE == 0          # all stages in this launch, grid barriers between them
    # counters: [0] the barrier, [1] the exit tickets, [2 : 2 + 16 HK] attention tickets, then split-K tickets of
    # stage 3 (cdiv(D, BN3)) and stage 5
    bar = cnt_ptr
    att_tick = cnt_ptr + 2
    k3_tick = att_tick + BM * HK
    k5_tick = k3_tick + tl.cdiv(D, BN3)
    ws3 = ws_ptr
    ws5 = ws_ptr + S3 * tl.cdiv(D, BN3) * BN3 * BM
    # Each GEMM stage's first weight chunk is loaded before the barrier that precedes the stage (weights do not
    # depend on it), so the wait overlaps the fetch; a program's later tiles load theirs in the loop.
    if ONE | (STAGE == 1):
        # 1. qkv = W_qkv rmsnorm(x + r): column tiles of qkv; tile 0 stores h = x + r
        NT1 = tl.cdiv(NQKV, BN1)
        w = _w_chunk(wqkv_ptr, 0, pid * BN1, 0, tl.where(pid < NT1, D, 0), NQKV, D, BN1, BK1)
        if pid < NT1:
            _norm_tile(pid, w, w, x_ptr, r_ptr, r1_ptr, g1_ptr, g1_off, eps1, wqkv_ptr, bqkv_ptr, qkv_ptr, NQKV, D, M,
                       HAS_RES, False, HAS_QKV_BIAS, ACT, BN1, BK1, IEEE, PIPE)
        for t in range(pid + P, NT1, P):
            w = _w_chunk(wqkv_ptr, 0, t * BN1, 0, D, NQKV, D, BN1, BK1)
            _norm_tile(t, w, w, x_ptr, r_ptr, r1_ptr, g1_ptr, g1_off, eps1, wqkv_ptr, bqkv_ptr, qkv_ptr, NQKV, D, M,
                       HAS_RES, False, HAS_QKV_BIAS, ACT, BN1, BK1, IEEE, PIPE)
    if ONE:
        _grid_sync(bar, P)
    if ONE | (STAGE == 2):
        _attention_stage(qkv_ptr, attn_ptr, kc_ptr, vc_ptr, qw_ptr, kw_ptr, qk_eps, pos_ptr, cs_ptr, slot_ptr,
                         indptr_ptr, indices_ptr, last_ptr, part_o_ptr, part_lse_ptr, att_tick, sm_scale,
                         window_left, pid, P, M, NQKV, H, HK, HD, PAGE, GROUP, G_PAD, SPLITS, S_PAD, BLOCK_N,
                         HAS_NORM, HAS_WINDOW, IEEE)
    if ONE | (STAGE == 3):
        # 3. r2 = W_o attn + h
        KO = H * HD
        NT3 = tl.cdiv(D, BN3) * S3
        w = _splitk_first(pid, wo_ptr, D, KO, S3, BN3, BK3)
        if ONE:
            _grid_sync(bar, 2 * P)
        res = r1_ptr if HAS_RES else x_ptr
        if pid < NT3:
            _splitk_tile(pid, w, attn_ptr, wo_ptr, r2_ptr, res, ws3, k3_tick, D, KO, M, True, S3, BN3, BK3, IEEE, PIPE)
        for t in range(pid + P, NT3, P):
            w = _w_chunk(wo_ptr, 0, (t // S3) * BN3, (t % S3) * tl.cdiv(tl.cdiv(KO, S3), BK3) * BK3, KO, D, KO, BN3,
                         BK3)
            _splitk_tile(t, w, attn_ptr, wo_ptr, r2_ptr, res, ws3, k3_tick, D, KO, M, True, S3, BN3, BK3, IEEE, PIPE)
    if ONE | (STAGE == 4):
        # 4. act = act(gate) * up, gate | up = W_gu rmsnorm(r2)
        NT4 = tl.cdiv(I, BN4)
        k_hi = tl.where(pid < NT4, D, 0)
        w = _w_chunk(wgu_ptr, 0, pid * BN4, 0, k_hi, I, D, BN4, BK4)
        w2 = _w_chunk(wgu_ptr, I, pid * BN4, 0, k_hi, I, D, BN4, BK4)
        if ONE:
            _grid_sync(bar, 3 * P)
        if pid < NT4:
            _norm_tile(pid, w, w2, r2_ptr, r2_ptr, r2_ptr, g2_ptr, g2_off, eps2, wgu_ptr, wgu_ptr, act_ptr, I, D, M,
                       False, True, False, ACT, BN4, BK4, IEEE, PIPE)
        for t in range(pid + P, NT4, P):
            w = _w_chunk(wgu_ptr, 0, t * BN4, 0, D, I, D, BN4, BK4)
            w2 = _w_chunk(wgu_ptr, I, t * BN4, 0, D, I, D, BN4, BK4)
            _norm_tile(t, w, w2, r2_ptr, r2_ptr, r2_ptr, g2_ptr, g2_off, eps2, wgu_ptr, wgu_ptr, act_ptr, I, D, M,
                       False, True, False, ACT, BN4, BK4, IEEE, PIPE)
    if ONE | (STAGE == 5):
        # 5. out = W_down act
        NT5 = tl.cdiv(D, BN5) * S5
        w = _splitk_first(pid, wd_ptr, D, I, S5, BN5, BK5)
        if ONE:
            _grid_sync(bar, 4 * P)
        if pid < NT5:
            _splitk_tile(pid, w, act_ptr, wd_ptr, out_ptr, out_ptr, ws5, k5_tick, D, I, M, False, S5, BN5, BK5, IEEE, PIPE)
        for t in range(pid + P, NT5, P):
            w = _w_chunk(wd_ptr, 0, (t // S5) * BN5, (t % S5) * tl.cdiv(tl.cdiv(I, S5), BK5) * BK5, I, D, I, BN5,
                         BK5)
            _splitk_tile(t, w, act_ptr, wd_ptr, out_ptr, out_ptr, ws5, k5_tick, D, I, M, False, S5, BN5, BK5, IEEE, PIPE)
    if ONE:
        # the last program out resets the barrier for the next launch (every program is past its last wait)
        tl.debug_barrier()
        if tl.atomic_add(cnt_ptr + 1, 1, sem="acq_rel") == P - 1:
            tl.atomic_xchg(bar, 0)
            tl.atomic_xchg(cnt_ptr + 1, 0)


@dataclass(frozen=True)
class LayerDims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    page: int


def _tile_n(N: int, P: int, choices=(16, 32, 64)) -> int:
    """The column tile with the fewest rows per program (rounds of tiles x tile rows), the wider on ties."""
    return min(choices, key=lambda bn: (triton.cdiv(triton.cdiv(N, bn), P) * bn, -bn))


def _split_k(N: int, K: int, P: int, bn: int, quantum: int = 64) -> int:
    """K splits so that (column blocks x splits) is about P tiles (equal ranges of whole quanta)."""
    chunks = triton.cdiv(K, quantum)
    s = max(1, min(chunks, P // triton.cdiv(N, bn)))
    return triton.cdiv(chunks, triton.cdiv(chunks, s))


def _block_k(bn: int, k_range: int, budget: int) -> int:
    """A K chunk of at most `budget` weight elements per tile, no wider than the range (a power of 2, >= 16)."""
    return max(16, min(triton.next_power_of_2(k_range), triton.next_power_of_2(budget // bn + 1) // 2))


class LayerScratch:
    """The launch configuration of a layer shape on `programs` programs, and what a launch writes and later stages
    of the same launch read (shared by every layer of a model: layers run one after another), with the zeroed
    counters (each launch leaves them at 0). `tile_budget`: weight elements per register tile (each stage's K chunk
    is as wide as that allows: few, large loads; the stage's first chunk is fetched before its barrier).
    `pipeline` > 0 instead lets the compiler pipeline each K loop through shared memory with that many chunks in
    flight (more bytes in flight per SM than two register tiles; the pre-barrier fetch is then not used)."""

    def __init__(self, dims: LayerDims, programs: int, dtype: torch.dtype, device, tile_budget: int = 16384,
                 num_warps: int = 8, block_n: int = 32, pipeline: int = 0, **override):
        d = dims
        self.dims, self.programs, self.num_warps, self.block_n = d, programs, num_warps, block_n
        self.pipeline = pipeline      # 0: weights double-buffered in registers; n > 0: n chunks in flight (smem)
        nqkv = (d.heads + 2 * d.kv_heads) * d.head_dim
        ko = d.heads * d.head_dim
        c = {}
        c["bn1"] = _tile_n(nqkv, programs)
        c["bn3"] = _tile_n(d.hidden, programs, (16, 32))
        c["s3"] = _split_k(d.hidden, ko, programs, c["bn3"])
        c["bn4"] = _tile_n(d.intermediate, programs)
        c["bn5"] = _tile_n(d.hidden, programs, (16, 32))
        c["s5"] = _split_k(d.hidden, d.intermediate, programs, c["bn5"])
        c.update({k: v for k, v in override.items() if k in ("bn1", "bn3", "s3", "bn4", "bn5", "s5")})
        c["bk1"] = _block_k(c["bn1"], d.hidden, tile_budget)
        c["bk3"] = _block_k(c["bn3"], triton.cdiv(ko, c["s3"]), tile_budget)
        c["bk4"] = _block_k(c["bn4"], d.hidden, tile_budget // 2)       # two weight tiles (gate, up)
        c["bk5"] = _block_k(c["bn5"], triton.cdiv(d.intermediate, c["s5"]), tile_budget)
        c.update({k: v for k, v in override.items() if k in ("bk1", "bk3", "bk4", "bk5")})
        self.config = c
        self.splits = max(1, min(32, programs // max(1, d.kv_heads)))      # at 1 row; fewer per row at more rows
        e = dict(dtype=dtype, device=device)
        self.r1 = torch.empty(ROWS, d.hidden, **e)
        self.qkv = torch.empty(ROWS, nqkv, **e)
        self.attn = torch.empty(ROWS, ko, **e)
        self.act = torch.empty(ROWS, d.intermediate, **e)
        f = dict(dtype=torch.float32, device=device)
        self.part_o = torch.empty(ROWS * d.heads * self.splits * d.head_dim, **f)
        self.part_lse = torch.empty(ROWS * d.heads * self.splits, **f)
        nb3, nb5 = triton.cdiv(d.hidden, c["bn3"]), triton.cdiv(d.hidden, c["bn5"])
        self.ws = torch.empty(c["s3"] * nb3 * c["bn3"] * ROWS + c["s5"] * nb5 * c["bn5"] * ROWS, **f)
        self.counters = torch.zeros(2 + ROWS * d.kv_heads + nb3 + nb5, dtype=torch.int32, device=device)

    def splits_for(self, rows: int) -> int:
        return max(1, min(self.splits, self.programs // max(1, rows * self.dims.kv_heads)))


ACT_CODES = {"silu": 0, "gelu_tanh": 1, "gelu": 2}


def decoder_layer(x, residual, g1, g1_off, eps1, w_qkv, b_qkv, q_w, k_w, qk_eps, positions, cos_sin, slots,
                  k_cache, v_cache, indptr, indices, last_page_len, sm_scale, window_left, w_o, g2, g2_off, eps2,
                  w_gu, act, w_down, scratch: LayerScratch, staged=False):
    """(out, r2) of one pre-norm attention + gated-MLP decoder layer for x [M <= 16, hidden] (see the module
    docstring): residual [M, hidden] or None; k_cache / v_cache [pages, page, kv_heads, head_dim] (the step's k, v
    are written at `slots`); the page table in FlashInfer's CSR form (indptr, indices, last_page_len); q_w / k_w the
    per-head q / k RMSNorm weights or None; act "silu" | "gelu_tanh" | "gelu". staged: True runs the five stages
    as five launches, a sequence of stage numbers only those (the benchmark's per-stage timing); "compile" returns
    the compiled one-launch kernel without running it."""
    d = scratch.dims
    M = x.shape[0]
    if not 0 < M <= ROWS:
        raise ValueError(f"decoder_layer: {M} rows (1..{ROWS})")
    out = torch.empty_like(x)
    r2 = torch.empty_like(x)
    group = d.heads // d.kv_heads
    splits = scratch.splits_for(M)
    ieee = x.dtype == torch.float32
    s = scratch
    args = (x, x if residual is None else residual, s.r1, g1, float(g1_off), w_qkv, w_qkv if b_qkv is None else b_qkv,
            s.qkv, q_w if q_w is not None else g1, k_w if k_w is not None else g1, float(qk_eps), positions, cos_sin,
            slots, k_cache, v_cache, indptr, indices, last_page_len, s.part_o, s.part_lse, float(sm_scale),
            int(window_left), s.attn, w_o, r2, g2, float(g2_off), w_gu, s.act, w_down, out, s.ws, s.counters,
            M, d.hidden, s.qkv.shape[1], d.intermediate, float(eps1), float(eps2))
    c = s.config
    meta = dict(H=d.heads, HK=d.kv_heads, HD=d.head_dim, PAGE=d.page, GROUP=group,
                G_PAD=max(16, triton.next_power_of_2(group)), SPLITS=splits, S_PAD=max(2, triton.next_power_of_2(splits)),
                BLOCK_N=s.block_n, HAS_RES=residual is not None, HAS_QKV_BIAS=b_qkv is not None,
                HAS_NORM=q_w is not None, HAS_WINDOW=window_left >= 0, ACT=ACT_CODES[act], BN1=c["bn1"], BK1=c["bk1"],
                BN3=c["bn3"], BK3=c["bk3"], S3=c["s3"], BN4=c["bn4"], BK4=c["bk4"], BN5=c["bn5"], BK5=c["bk5"],
                S5=c["s5"], IEEE=ieee, PIPE=s.pipeline, num_warps=s.num_warps, num_stages=1)   # double-buffered by hand
    if staged == "compile":     # compile the one-launch form without running it (occupancy checks)
        return _layer_kernel.warmup(*args, STAGE=0, grid=(s.programs,), **meta)
    if staged:
        for stage in (range(1, 6) if staged is True else staged):
            _layer_kernel[(s.programs,)](*args, STAGE=stage, **meta)
    else:
        _layer_kernel[(s.programs,)](*args, STAGE=0, **meta)
    return out, r2
