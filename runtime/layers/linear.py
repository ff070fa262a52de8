"""Tensor-parallel linear layers. Sizes given to constructors are global; parameters are per rank."""
from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from xllm_gen.runtime.ops import skinny_gemm
from xllm_gen.runtime.executor.distributed import all_reduce, get_tp_rank, get_tp_size
from xllm_gen.runtime.executor.sharding import Segment, ShardingError, check_segment, heads_per_rank


# Decode-sized GEMMs (<= 8 rows, bf16/fp16 weights) through the skinny-GEMM Triton kernel (ops.skinny_gemm)
# instead of cuBLAS. Off by default until a GPU benchmark shows it faster: XLLM_SKINNY_GEMM=1 turns it on.
SKINNY_GEMM = os.environ.get("XLLM_SKINNY_GEMM", "0") == "1"
_SKINNY_MAX_ROWS = 8
_SKINNY_DTYPES = (torch.bfloat16, torch.float16)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear, or the skinny-GEMM kernel for a CUDA decode batch of at most 8 rows (when SKINNY_GEMM)."""
    if (SKINNY_GEMM and x.is_cuda and x.dim() == 2 and x.shape[0] <= _SKINNY_MAX_ROWS
            and weight.dtype in _SKINNY_DTYPES and x.dtype == weight.dtype):
        return skinny_gemm(x, weight, bias)
    return F.linear(x, weight, bias)


def _split(size: int, tp: int, what: str) -> int:
    msg = check_segment(Segment(what, size), tp)
    if msg:
        raise ShardingError(msg)
    return size // tp


class _Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.tp_size = get_tp_size()
        self.tp_rank = get_tp_rank()
        self.in_features = in_features        # per rank
        self.out_features = out_features      # per rank
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (per rank), bias={self.bias is not None}, "
                f"tp={self.tp_size}")


class ReplicatedLinear(_Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias)


class ColumnParallelLinear(_Linear):
    """Output features split over ranks; no gather (the next row-parallel layer consumes the shard)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, _split(out_features, get_tp_size(), "out_features"), bias)


class MergedColumnParallelLinear(_Linear):
    """Several column-parallel outputs fused along dim 0 (e.g. gate | up); each one split over ranks.
    `out_sizes` holds the per-rank sizes."""

    def __init__(self, in_features: int, out_sizes: Sequence[int], bias: bool = False):
        tp = get_tp_size()
        sizes = [_split(o, tp, f"out_sizes[{i}]") for i, o in enumerate(out_sizes)]
        super().__init__(in_features, sum(sizes), bias)
        self.out_sizes = sizes


class QKVParallelLinear(_Linear):
    """Fused q | k | v projection, split by heads. KV heads are replicated when num_kv_heads < tp
    (rank r holds KV head r // (tp // num_kv_heads)). Attributes are per rank."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = get_tp_size()
        for seg in (Segment("q", num_heads, head_dim), Segment("k", num_kv_heads, head_dim, replicate_ok=True)):
            msg = check_segment(seg, tp)
            if msg:
                raise ShardingError(msg)
        h, hk = heads_per_rank(num_heads, tp), heads_per_rank(num_kv_heads, tp)
        super().__init__(hidden, (h + 2 * hk) * head_dim, bias)
        self.head_dim = head_dim
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = h
        self.num_kv_heads = hk
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim

    def segments(self) -> tuple[Segment, Segment, Segment]:
        """The global q/k/v segments of dim 0 (what a weight rule shards by)."""
        D = self.head_dim
        return (Segment("q", self.total_num_heads, D), Segment("k", self.total_num_kv_heads, D, True),
                Segment("v", self.total_num_kv_heads, D, True))


class RowParallelLinear(_Linear):
    """Input features split over ranks; partial outputs are summed with an all-reduce (reduce=True).
    The bias is added once, after the reduction."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce: bool = True):
        super().__init__(_split(in_features, get_tp_size(), "in_features"), out_features, bias)
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return _linear(x, self.weight, self.bias)
        y = _linear(x, self.weight)
        if self.reduce:
            y = all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
