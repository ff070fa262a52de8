"""Vocabulary-parallel embedding and LM head (vocab padded to a multiple of 64 * tp).

Weight loader (both): this rank's rows [vocab_start, vocab_end) of the padded vocabulary from the
checkpoint's [vocab, dim] tensor; rows past the vocabulary are zeroed. A tied head shares the embedding's
parameter (and so its loader): the weight plan has no rule for it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xllm_gen.runtime.executor.distributed import all_gather, all_reduce, get_tp_rank, get_tp_size
from xllm_gen.runtime.executor.sharding import ParamSplit, SegmentSlice, attach, padded_vocab, vocab_range


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
    [vocab] bias split over ranks as the weight's rows are (padding entries zeroed), never tied."""

    def __init__(self, vocab: int, dim: int, bias: bool = False):
        super().__init__(vocab, dim)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start))
            seg = SegmentSlice("vocab", vocab, self.vocab_start, self.vocab_end)
            attach(self.bias, ParamSplit("vocab", 0, (seg,), tuple(self.bias.shape), self.tp_size, self.tp_rank,
                                         type(self).__name__))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight, self.bias)
        logits = all_gather(logits, -1)
        return logits[..., : self.vocab_size].float()

    def extra_repr(self) -> str:
        return (f"vocab={self.vocab_size} (padded {self.padded_vocab}), dim={self.dim}"
                + (", bias=True" if self.bias is not None else ""))
