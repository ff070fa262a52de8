"""Tensor-parallel linear layers. Sizes given to constructors are global; parameters are per rank.

Each layer is the single source of its sharding: it computes this rank's split of every parameter
(runtime.executor.sharding.ParamSplit) and attaches it with its weight loader, `param.weight_loader(param,
loaded, shard_id=None)`: replicated (full copy), column (this rank's rows), row (this rank's columns; the
bias is not split), merged column (per named segment), QKV (per q/k/v segment; KV heads replicated when
num_kv_heads < tp: rank r holds KV head r // (tp // num_kv_heads)). `shard_id=None` on a fused layer
means the checkpoint tensor holds all its segments stacked (e.g. a fused q|k|v), split before sharding.
`pad=True` (column, merged column, row): a width of plain rows that the TP size does not divide is padded with zero
rows (columns of a row-parallel layer) instead of refused (sharding.split_segment): what an MLP's intermediate width
asks, where zero gate/up rows and zero down columns leave the output exact."""
from __future__ import annotations

import logging
import os
import statistics
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from xllm_gen.runtime.executor import context as _context
from xllm_gen.runtime.executor.distributed import all_reduce, get_tp_rank, get_tp_size
from xllm_gen.runtime.executor.sharding import ParamSplit, Segment, attach, raise_or_defer, replicated, split_segment
from xllm_gen.runtime.ops import skinny_gemm

logger = logging.getLogger("xllm_gen")

# Decode-sized GEMMs (<= 64 rows, bf16/fp16): cuBLAS or a skinny-GEMM Triton kernel (ops.skinny_gemm: an FMA weight
# stream up to 8 rows, a split-K tensor-core one from 9 to 64), whichever a measurement on this GPU found faster for
# the shape (tune_decode_gemms, before the decode graphs are captured).
# On an H200, cuBLAS reads a short, wide weight (N 1024, K 2048: a 1024-wide model's o_proj) at a third of HBM bandwidth
# with one row and the kernel 3.5x faster, while cuBLAS wins on the tall ones (bench/bench_gemv.py).
# XLLM_SKINNY_GEMM=1 / 0 forces the kernel / cuBLAS for every decode GEMM instead.
_FORCE = {"1": True, "0": False}.get(os.environ.get("XLLM_SKINNY_GEMM", ""))
# XLLM_SKINNY_MMA=0: decode GEMMs of more than 8 rows always on cuBLAS (the tensor-core kernel's baseline in bench/)
_SKINNY_MAX_ROWS = 8 if os.environ.get("XLLM_SKINNY_MMA", "1") == "0" else 64
_SKINNY_DTYPES = (torch.bfloat16, torch.float16)
# (rows, N, K, dtype) -> the Triton kernel's launch config (BLOCK_N, BLOCK_K, warps, stages; True: the launch
# table's) or False (cuBLAS), decided once per process: every engine of the process then runs a shape with the
# same kernel (so two engines' outputs compare bit for bit)
DECODE_GEMM_CHOICE: dict = {}


def decode_step() -> bool:
    """Whether the running forward is a decode step (or none is set: the tunings' timing calls). A prefill step of
    a few tokens stays on cuBLAS, whose result for a row does not depend on the row count: a prompt of 17 tokens
    prefilled eagerly and one replayed in a prefill graph's 64-token bucket must agree (the skinny kernels' launch
    config, and so their summation order, follows the rows; tests/gpu/test_gpu_prefill_graphs.py)."""
    ctx = _context._CONTEXT
    return ctx is None or not ctx.is_prefill


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear, or a skinny-GEMM kernel for a CUDA decode batch of at most 64 rows where it was measured faster."""
    if (x.is_cuda and x.dim() == 2 and x.shape[0] <= _SKINNY_MAX_ROWS and weight.dtype in _SKINNY_DTYPES
            and x.dtype == weight.dtype and decode_step()):
        use = _FORCE if _FORCE is not None else DECODE_GEMM_CHOICE.get(
            (x.shape[0], weight.shape[0], weight.shape[1], weight.dtype), False)
        if use:
            return skinny_gemm(x, weight, bias, config=use if isinstance(use, tuple) else None)
    return F.linear(x, weight, bias)


def graph_time_ms(fn, reps: int = 5) -> float:
    """GPU ms of fn() replayed in a CUDA graph (no launch overhead), median of reps."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del g
    return statistics.median(times)


@torch.inference_mode()
def tune_decode_gemms(model: nn.Module, rows, margin: float = 0.9) -> dict:
    """For every distinct (rows, N, K) of the model's linear layers not decided yet in this process: times cuBLAS
    against the skinny-GEMM kernel in each of its candidate launch configs (skinny_fma.skinny_gemm_candidates),
    each over all the layers' weights of that shape in turn (repeated to at least 96 MB, so that they stream from
    HBM as in a decode step, not from L2), and takes the fastest config when it is faster than `margin` x cuBLAS.
    Decisions a previous process measured on this GPU and software are read from ops/tuning_cache.py's file instead.
    Packed fp8 layers (layers/quant_linear.py PackedFp8) have no cuBLAS GEMM to weigh: their shapes go to the
    fused-prologue tuning only (layers/fused.py packed_shape, tune_fused_gemvs; run tune_quant_gemvs first so that
    its plain pair times the layer's tuned GEMM).
    Returns {(M, N, K): (cuBLAS us, best Triton us, config chosen or False)} of what it measured."""
    from xllm_gen.runtime.ops import tuning_cache
    from xllm_gen.runtime.ops.skinny_fma import SKINNY_MAX_M, skinny_gemm_candidates
    from xllm_gen.runtime.ops.skinny_mma import skinny_mma_candidates
    if _FORCE is not None:
        return {}
    from xllm_gen.runtime.layers.fused import packed_shape
    shapes: dict = {}
    packed: dict = {}           # packed fp8 layers the fused-prologue GEMVs take (their own key: never mixed with shapes)
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(m, _Linear) and w is not None and w.is_cuda and w.dtype in _SKINNY_DTYPES and w.dim() == 2:
            shapes.setdefault((w.shape[0], w.shape[1], w.dtype), []).append((w, m.bias))
        elif isinstance(m, _Linear) and m.packed is not None and (key := packed_shape(m)) is not None:
            packed.setdefault(key, []).append((m.packed.weight, m.bias, m.packed, m.act_quant))
    report: dict = {}
    if not shapes and not packed:
        return report
    path = tuning_cache.cache_path(next(iter((shapes or packed).values()))[0][0].device)
    cache = (tuning_cache.load(path), {})          # (read from the file, measured now)
    tuned = sorted({int(r) for r in rows if 1 <= r <= _SKINNY_MAX_ROWS})
    for (N, K, dt), ws in shapes.items():
        seq = timing_sequence(ws, N, K)
        chosen = {}
        for M in tuned:
            key, ckey = (M, N, K, dt), tuning_cache.key("gemm", M, N, K, dt)
            if key not in DECODE_GEMM_CHOICE:      # the probe input of the checks and the timings
                x = torch.randn(M, K, device=ws[0][0].device, dtype=dt)
            if key not in DECODE_GEMM_CHOICE and ckey in cache[0]:
                c = cache[0][ckey]          # a file's decision: still checked against cuBLAS on this weight
                DECODE_GEMM_CHOICE[key] = c if not c or _agrees(x, *ws[0], c) else False
            if key not in DECODE_GEMM_CHOICE:
                t_cublas = graph_time_ms(lambda: [F.linear(x, w, b) for w, b in seq]) / len(seq)
                timed = [(graph_time_ms(lambda: [skinny_gemm(x, w, b, config=cfg) for w, b in seq]) / len(seq), cfg)
                         for cfg in (skinny_gemm_candidates(M, N, K, ws[0][0].element_size()) if M <= SKINNY_MAX_M
                                     else skinny_mma_candidates(M, N, K)) if _agrees(x, *ws[0], cfg)]
                t_triton, cfg = min(timed, key=lambda t: t[0]) if timed else (float("inf"), False)
                DECODE_GEMM_CHOICE[key] = cache[1][ckey] = cfg if t_triton < margin * t_cublas else False
                report[(M, N, K)] = (1e3 * t_cublas, 1e3 * t_triton, DECODE_GEMM_CHOICE[key])
            chosen[M] = DECODE_GEMM_CHOICE[key]
        fill_row_choices(chosen, N, K, dt)
    from xllm_gen.runtime.layers.fused import tune_fused_gemvs  # the fused-prologue GEMVs of the same shapes
    tune_fused_gemvs(shapes, tuned, cache, packed)
    tuning_cache.save(path, cache[1])
    return report


def _agrees(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], config) -> bool:
    """Whether the skinny kernel in `config` gives cuBLAS's product on this weight, up to the 16-bit rounding of the
    output (both accumulate in float32): a launch config that computes something else is never chosen however fast
    (logged). A wrong result is off by the output's own scale, a right one by a rounding step or two."""
    ref = F.linear(x, w, b).float()
    try:
        y = skinny_gemm(x, w, b, config=config if isinstance(config, tuple) else None).float()
    except Exception as e:      # noqa: BLE001 - a config this GPU cannot run: not a candidate
        logger.warning("skinny GEMM config %s for %s x %s failed (%s: %s): not used", config, tuple(x.shape),
                       tuple(w.shape), type(e).__name__, str(e)[:200])
        return False
    err = ((y - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
    if not err <= 2.0 ** -6:
        logger.warning("skinny GEMM config %s for %s x %s differs from cuBLAS (relative %.3g): not used", config,
                       tuple(x.shape), tuple(w.shape), err)
        return False
    return True


def timing_sequence(ws: list, N: int, K: int, stream_bytes: int = 96 << 20, max_calls: int = 256) -> list:
    """The layers' weights of one shape repeated so that one timed replay streams about `stream_bytes` from HBM (as a
    decode step does, not from L2), at most `max_calls` calls: the tiny weights of a routing or dt projection (a few KB)
    would otherwise make graphs of tens of thousands of launches per candidate (a tiny MoE or Mamba checkpoint spent
    minutes of its start-up in them) and their time is launch latency whichever kernel runs."""
    reps = max(1, -(-stream_bytes // (len(ws) * N * K * ws[0][0].element_size())))
    return (ws * reps)[:max(max_calls, len(ws))]


def fill_row_choices(chosen: dict, N: int, K: int, dtype, table: Optional[dict] = None, suffix: tuple = ()) -> None:
    """Row counts between measured ones take the choice of the next measured count above: the decode-graph bucket
    they are padded to. An eager step of 3 rows then runs the kernel the bucket of 4 does (with the same launch
    configuration, so each row's result is the same), and graph and eager decode agree bit for bit. suffix: the
    rest of the table's key after (rows, N, K, dtype) (layers/fused.py: a packed weight's form)."""
    prev = 0
    for M in sorted(chosen):
        for m in range(prev + 1, M + 1):
            (DECODE_GEMM_CHOICE if table is None else table).setdefault((m, N, K, dtype) + suffix, chosen[M])
        prev = M


class _Linear(nn.Module):
    kind = "replicated"
    # the input's quantization (runtime.layers.quant.ActQuant), set at load for a quantized checkpoint's layers
    act_quant = None

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.tp_size = get_tp_size()
        self.tp_rank = get_tp_rank()
        self.in_features = in_features        # per rank
        self.out_features = out_features      # per rank
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # a quantized checkpoint's packed weight (runtime/layers/quant_linear.py), set at load: then it computes the
        # product and `weight` is empty
        self.packed = None

    def _attach(self, dim: Optional[int] = None, segments: tuple = ()) -> None:
        """Attaches each parameter's split and weight loader; the bias of a row-parallel layer is replicated."""
        owner = type(self).__name__
        if dim is None:
            replicated(self.weight, owner)
        else:
            attach(self.weight, ParamSplit(self.kind, dim, tuple(segments), tuple(self.weight.shape),
                                           self.tp_size, self.tp_rank, owner))
        if self.bias is not None:
            if dim == 0:
                attach(self.bias, ParamSplit(self.kind, 0, tuple(segments), tuple(self.bias.shape),
                                             self.tp_size, self.tp_rank, owner))
            else:
                replicated(self.bias, owner)

    def forward(self, x: torch.Tensor, quantized: bool = False) -> torch.Tensor:
        """quantized: x already went through act_quant (fused into the op that made it, layers/fused.py)."""
        if self.act_quant is not None and not quantized:
            x = self.act_quant(x)
        if self.packed is not None:
            return self.packed(x, self.bias, self.act_quant)
        return _linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (per rank), bias={self.bias is not None}, "
                f"tp={self.tp_size}" + (f", act_quant={self.act_quant!r}" if self.act_quant is not None else ""))


class ReplicatedLinear(_Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, float32: bool = False):
        super().__init__(in_features, out_features, bias)
        if float32:     # a router kept in float32 whatever the model dtype (transformers' _keep_in_fp32_modules): a
            # float32 checkpoint tensor is not rounded to bfloat16 at load
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float32))
            self.bias = nn.Parameter(torch.empty(out_features, dtype=torch.float32)) if bias else None
        self._attach()


class ColumnParallelLinear(_Linear):
    """Output features split over ranks; no gather (the next row-parallel layer consumes the shard)."""
    kind = "column"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, unit: int = 1, pad: bool = False):
        # unit: rows per indivisible group (a head's width): the split keeps each group on one rank
        problems: list = []
        seg = split_segment(Segment("out_features", out_features // unit, unit), get_tp_size(), get_tp_rank(),
                            problems, pad=pad)
        super().__init__(in_features, seg.rows, bias)
        raise_or_defer(self, problems)
        self._attach(0, (seg,))


class MergedColumnParallelLinear(_Linear):
    """Several column-parallel outputs fused along dim 0 (e.g. gate | up); each one split over ranks.
    `out_sizes` holds the per-rank sizes. A checkpoint tensor fills one segment, named by `segment_names`
    (e.g. ("gate", "up")) or by its index; shard_id None means all segments stacked in one tensor."""
    kind = "column"

    def __init__(self, in_features: int, out_sizes: Sequence[int], bias: bool = False,
                 segment_names: Optional[Sequence[str]] = None, units: Optional[Sequence[int]] = None,
                 replicate: Optional[Sequence[bool]] = None, pad: bool = False):
        # replicate: per segment, whether a segment of fewer units than ranks is replicated (rank r serves unit
        # r // (tp / units)), as KV heads are
        # units: rows per indivisible group of each segment (a head's width): the split keeps each group on one rank
        out_sizes = list(out_sizes)
        units = [1] * len(out_sizes) if units is None else [int(u) for u in units]
        if segment_names is None:
            names = [f"out_sizes[{i}]" for i in range(len(out_sizes))]
        else:
            names = [str(n) for n in segment_names]
            if len(names) != len(out_sizes) or len(set(names)) != len(names):
                raise ValueError(f"MergedColumnParallelLinear: segment_names {names} must be {len(out_sizes)} "
                                 f"distinct names, one per out_sizes entry")
        tp, rank = get_tp_size(), get_tp_rank()
        problems: list = []
        rep = [False] * len(out_sizes) if replicate is None else [bool(r) for r in replicate]
        segs = tuple(split_segment(Segment(n, o // u, u, r), tp, rank, problems, pad=pad)
                     for n, o, u, r in zip(names, out_sizes, units, rep))
        super().__init__(in_features, sum(s.rows for s in segs), bias)
        raise_or_defer(self, problems)
        self.out_sizes = [s.rows for s in segs]
        self.segment_names = tuple(names)
        self._attach(0, segs)


class QKVParallelLinear(_Linear):
    """Fused q | k | v projection, split by heads; segments "q", "k", "v". KV heads are replicated when
    num_kv_heads < tp (rank r holds KV head r // (tp // num_kv_heads)). Attributes are per rank."""
    kind = "column"

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 q_gate: bool = False, v_head_dim: Optional[int] = None, values_from_keys: bool = False,
                 q_only: bool = False):
        # q_gate: each q head's rows are followed by as many rows of an output gate ([heads, 2 * head_dim]): q_size
        # counts both, and the split keeps a head's q and gate rows together. v_head_dim: the value heads' width
        # (default head_dim): v_size = kv heads * v_head_dim. values_from_keys: no v segment (the attention takes its values
        # from the keys; v_size 0). q_only: neither k nor v (a layer reading another layer's KV cache)
        tp, rank = get_tp_size(), get_tp_rank()
        problems: list = []
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        q = split_segment(Segment("q", num_heads, head_dim * (2 if q_gate else 1)), tp, rank, problems)
        k = split_segment(Segment("k", num_kv_heads, head_dim, replicate_ok=True), tp, rank, problems)
        v = split_segment(Segment("v", num_kv_heads, v_head_dim, replicate_ok=True), tp, rank, [])  # as k
        self.values_from_keys = values_from_keys or q_only
        self.q_only = q_only
        super().__init__(hidden, q.rows + (0 if q_only else k.rows) + (0 if self.values_from_keys else v.rows), bias)
        raise_or_defer(self, problems)
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.q_gate = q_gate
        self.num_heads = q.rows // (head_dim * (2 if q_gate else 1))
        self.num_kv_heads = k.rows // head_dim
        self.q_size = q.rows
        self.kv_size = self.num_kv_heads * head_dim
        self.v_size = 0 if self.values_from_keys else self.num_kv_heads * v_head_dim
        self.k_size = 0 if q_only else self.kv_size
        self._attach(0, (q,) if q_only else (q, k) if self.values_from_keys else (q, k, v))

    def segments(self) -> tuple[Segment, Segment, Segment]:
        """The global q/k/v segments of dim 0."""
        D = self.head_dim
        segs = (Segment("q", self.total_num_heads, D * (2 if self.q_gate else 1)),
                Segment("k", self.total_num_kv_heads, D, True),
                Segment("v", self.total_num_kv_heads, self.v_head_dim, True))
        return segs[:1] if self.q_only else segs[:2] if self.values_from_keys else segs


class RowParallelLinear(_Linear):
    """Input features split over ranks; partial outputs are summed with an all-reduce (reduce=True).
    The bias is added once, after the reduction (and loaded whole on every rank)."""
    kind = "row"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce: bool = True,
                 unit: int = 1, pad: bool = False, input_is_parallel: bool = True):
        # unit: input columns per indivisible group (a head's width): the split keeps each group on one rank
        # input_is_parallel False: the input is whole on every rank (a residual step's normed stream), and each rank
        # multiplies its own columns of it [start, stop) by its columns of the weight before the all-reduce
        problems: list = []
        seg = split_segment(Segment("in_features", in_features // unit, unit), get_tp_size(), get_tp_rank(),
                            problems, pad=pad)
        super().__init__(seg.rows, out_features, bias)
        raise_or_defer(self, problems)
        self.reduce = reduce
        if pad and not input_is_parallel:
            raise ValueError("RowParallelLinear: a padded split reads a sharded input (input_is_parallel=True)")
        self.input_cols = None if input_is_parallel or self.tp_size == 1 else (seg.start, seg.stop)
        self._attach(1, (seg,))

    def forward(self, x: torch.Tensor, quantized: bool = False) -> torch.Tensor:
        if self.input_cols is not None:     # this rank's columns of a whole input
            x = x[..., self.input_cols[0]:self.input_cols[1]].contiguous()
        if self.act_quant is not None and not quantized:
            x = self.act_quant(x)
        if self.packed is not None:
            y = self.packed(x, self.bias if self.tp_size == 1 else None, self.act_quant)
            if self.tp_size == 1:
                return y
        elif self.tp_size == 1:
            return _linear(x, self.weight, self.bias)
        else:
            y = _linear(x, self.weight)
        if self.reduce:
            y = all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y


def segment_scale(linear: nn.Module, scales: dict) -> torch.Tensor:
    """A [this rank's output rows] vector for a fused column-parallel projection's output: the rows of each segment
    named in `scales` hold its multiplier, the others 1 (muP multipliers per segment, FalconH1's `ssm_multipliers` on
    in_proj's z | x | B | C | dt, its `key_multiplier` on k). Built in the default dtype (the model's, at build) on
    the default device; the generated block registers it as a non-persistent buffer and multiplies the projection's
    output by it (x * 1.0 is exact, so the unscaled segments are unchanged)."""
    if isinstance(linear, QKVParallelLinear):
        names, sizes = ("q", "k", "v"), (linear.q_size, linear.kv_size, linear.kv_size)
    elif isinstance(linear, MergedColumnParallelLinear):
        names, sizes = linear.segment_names, linear.out_sizes
    else:
        raise TypeError(f"segment_scale: {type(linear).__name__} has no named output segments")
    unknown = [n for n in scales if n not in names]
    if unknown:
        raise ValueError(f"segment_scale: no segment {unknown[0]!r} in {type(linear).__name__} (segments: "
                         f"{', '.join(names)})")
    return torch.cat([torch.full((size,), float(scales.get(name, 1.0))) for name, size in zip(names, sizes)])
