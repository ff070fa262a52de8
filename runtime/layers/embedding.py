"""Vocabulary-parallel embedding and LM head (vocab padded to a multiple of 64 * tp).

Weight loader (both): this rank's rows [vocab_start, vocab_end) of the padded vocabulary from the
checkpoint's [vocab, dim] tensor; rows past the vocabulary are zeroed. A tied head shares the embedding's
parameter (and so its loader): the weight plan has no rule for it."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from xllm_gen.runtime.executor.distributed import all_gather, all_reduce, get_tp_rank, get_tp_size
from xllm_gen.runtime.executor.sharding import ParamSplit, SegmentSlice, attach, padded_vocab, replicated, vocab_range


class _VocabShard(nn.Module):
    """This rank's rows [vocab_start, vocab_end) of a vocabulary padded to a multiple of 64 * tp."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.tp_size = get_tp_size()
        self.tp_rank = get_tp_rank()
        self.vocab_size = vocab
        self.dim = dim
        self.padded_vocab = padded_vocab(vocab, self.tp_size)
        self.vocab_start, self.vocab_end = vocab_range(vocab, self.tp_size, self.tp_rank)
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, dim))
        seg = SegmentSlice("vocab", vocab, self.vocab_start, self.vocab_end)
        attach(self.weight, ParamSplit("vocab", 0, (seg,), tuple(self.weight.shape), self.tp_size, self.tp_rank,
                                       type(self).__name__))


class VocabParallelEmbedding(_VocabShard):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        mask = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mask, ids - self.vocab_start, torch.zeros_like(ids))
        y = F.embedding(local, self.weight)
        y = y.masked_fill(~mask.unsqueeze(-1), 0)
        return all_reduce(y)

    def extra_repr(self) -> str:
        return (f"vocab={self.vocab_size} (padded {self.padded_vocab}), rows [{self.vocab_start}, "
                f"{self.vocab_end}), dim={self.dim}")


class ParallelLMHead(_VocabShard):
    """forward(hidden [B, dim]) -> logits [B, vocab] float32, gathered over ranks, padding trimmed.
    A tied head shares the embedding's parameter object (`head.weight = embed.weight`). `bias=True` gives it a
    [vocab] bias split over ranks as the weight's rows are (padding entries zeroed), never tied. `normalize=True`:
    each row of the weight is L2-normalized once, after the weights are loaded (`finish_loading`, called by the model
    runner), in the weight's dtype: `F.normalize(w, dim=1)` (a row's norm is its own, so every rank normalizes its
    rows alone; the zero padding rows stay zero); never tied (it would normalize the embedding)."""

    def __init__(self, vocab: int, dim: int, bias: bool = False, normalize: bool = False):
        super().__init__(vocab, dim)
        self.normalize = bool(normalize)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start))
            seg = SegmentSlice("vocab", vocab, self.vocab_start, self.vocab_end)
            attach(self.bias, ParamSplit("vocab", 0, (seg,), tuple(self.bias.shape), self.tp_size, self.tp_rank,
                                         type(self).__name__))

    def finish_loading(self) -> None:
        """After the weights are loaded: the rows L2-normalized where `normalize` (once; the forward reads them)."""
        if self.normalize:
            with torch.no_grad():
                self.weight.data = F.normalize(self.weight.data, dim=1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight, self.bias)
        logits = all_gather(logits, -1)
        return logits[..., : self.vocab_size].float()

    def extra_repr(self) -> str:
        return (f"vocab={self.vocab_size} (padded {self.padded_vocab}), dim={self.dim}"
                + (", bias=True" if self.bias is not None else "") + (", normalize=True" if self.normalize else ""))


class LearnedPositionEmbedding(nn.Module):
    """Absolute positions as a learned table: forward(positions [N]) -> weight[positions + offset] [N, dim].
    The table `[num_positions + offset, dim]` is replicated on every rank (GPT-2's wpe; OPT stores its rows with
    an offset of 2). A position past the table is an error, not a silent wrap."""

    def __init__(self, num_positions: int, dim: int, offset: int = 0):
        super().__init__()
        self.num_positions, self.dim, self.offset = num_positions, dim, offset
        self.weight = nn.Parameter(torch.empty(num_positions + offset, dim))
        replicated(self.weight, type(self).__name__)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions + self.offset, self.weight)

    def extra_repr(self) -> str:
        return f"positions={self.num_positions}, dim={self.dim}, offset={self.offset}"


def transformer_sinusoidal_table(rows: int, dim: int) -> torch.Tensor:
    """The original Transformer's sinusoidal table [rows, dim] in float32, computed as transformers' CTRL computes it:
    angle(p, i) = p / 10000 ** (2 * (i // 2) / dim); row p is sin(angle) of the even columns i, then cos(angle) of
    the odd ones (concatenated, not interleaved)."""
    with torch.device("cpu"):
        i = torch.arange(dim, dtype=torch.int64).float().unsqueeze(0)
        angle = torch.arange(rows, dtype=torch.int64).float().unsqueeze(1) * (1 / torch.pow(10000, (2 * (i // 2)) / dim))
        return torch.cat([torch.sin(angle[:, 0::2]), torch.cos(angle[:, 1::2])], dim=-1)


def sinusoidal_table(rows: int, dim: int) -> torch.Tensor:
    """The fairseq / XGLM sinusoidal table [rows, dim] in float32, computed as transformers computes it: row p is
    sin(p * f_j) for the first dim // 2 columns and cos(p * f_j) for the next (f_j = 10000 ** (-j / (dim // 2 - 1))),
    a zero column last when dim is odd."""
    half = dim // 2
    with torch.device("cpu"):
        step = math.log(10000) / (half - 1)
        freq = torch.exp(torch.arange(half, dtype=torch.int64).float() * -step)
        arg = torch.arange(rows, dtype=torch.int64).float().unsqueeze(1) * freq.unsqueeze(0)
        table = torch.cat([torch.sin(arg), torch.cos(arg)], dim=1).view(rows, -1)
        if dim % 2:
            table = torch.cat([table, torch.zeros(rows, 1)], dim=1)
    return table


class SinusoidalPositionEmbedding(nn.Module):
    """Absolute positions from the fixed sinusoidal table (no parameter): forward(positions [N]) ->
    table[positions + offset] [N, dim] (float32; the caller casts). The table is a plain attribute (not a
    buffer: it is not in the state dict), moved to the positions' device on first use."""

    def __init__(self, num_positions: int, dim: int, offset: int = 0, frequencies: str = "fairseq",
                 zero_row: Optional[int] = None):
        super().__init__()
        if frequencies not in ("fairseq", "transformer"):
            raise ValueError(f"SinusoidalPositionEmbedding: frequencies {frequencies!r} is not fairseq or transformer")
        self.num_positions, self.dim, self.offset, self.frequencies = num_positions, dim, offset, frequencies
        table = sinusoidal_table if frequencies == "fairseq" else transformer_sinusoidal_table
        self.table = table(num_positions + offset, dim)
        self.zero_row = zero_row
        if zero_row is not None:       # transformers' padding_idx row, indexed as it indexes it (a negative one wraps)
            if not -len(self.table) <= zero_row < len(self.table):
                raise ValueError(f"SinusoidalPositionEmbedding: zero_row {zero_row} is outside the table's "
                                 f"{len(self.table)} rows (positions {num_positions} + offset {offset})")
            self.table[zero_row] = 0.0

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        if self.table.device != positions.device:
            self.table = self.table.to(positions.device)
        return F.embedding(positions + self.offset, self.table)

    def extra_repr(self) -> str:
        return (f"positions={self.num_positions}, dim={self.dim}, offset={self.offset}"
                + (f", frequencies={self.frequencies}" if self.frequencies != "fairseq" else "")
                + (f", zero_row={self.zero_row}" if self.zero_row is not None else ""))
