"""Sampling on rank 0, outside any captured graph: greedy, temperature, top-k, top-p, per-request seeds,
and logprobs of the model's distribution (before temperature, as vLLM reports them)."""
from __future__ import annotations

from typing import Optional

import torch

from xllm_gen.runtime.engine.outputs import Logprob
from xllm_gen.runtime.engine.sequence import Sequence


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k and top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the top token is always kept)
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


class Sampler:
    def __init__(self, seed: int = 0):
        self.default_generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits [B, vocab] float32 for the last token of each sequence; returns one token id each."""
        logits = logits.float()
        tokens = logits.argmax(dim=-1).tolist()          # greedy rows
        cpu_logits: Optional[torch.Tensor] = None
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.greedy:
                continue
            if cpu_logits is None:
                cpu_logits = logits.cpu()
            row = _filter_top_k_top_p(cpu_logits[i] / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(row, dim=-1)
            if p.seed is not None and seq.generator is None:
                seq.generator = torch.Generator().manual_seed(p.seed)
            gen = seq.generator if seq.generator is not None else self.default_generator
            tokens[i] = int(torch.multinomial(probs, 1, generator=gen).item())
        self._record_logprobs(logits, seqs, tokens)
        return tokens

    @staticmethod
    def _record_logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> None:
        wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not wanted:
            return
        logp = torch.log_softmax(logits[wanted].float(), dim=-1).cpu()
        for row, i in enumerate(wanted):
            seq, tok, n = seqs[i], tokens[i], seqs[i].params.logprobs
            lp = logp[row]
            entry: dict[int, Logprob] = {}
            if n > 0:
                vals, ids = torch.topk(lp, min(n, lp.numel()))
                for r, (v, t) in enumerate(zip(vals.tolist(), ids.tolist())):
                    entry[t] = Logprob(v, r + 1)
            if tok not in entry:
                rank = int((lp > lp[tok]).sum().item()) + 1
                entry[tok] = Logprob(float(lp[tok]), rank)
            seq.logprobs.append(entry)
            seq.cumulative_logprob += float(lp[tok])
