"""Sampling on rank 0, outside any captured graph.

Per row, in vLLM's order: min_tokens (EOS and stop tokens banned), logit_bias, repetition_penalty (HF/CTRL,
over prompt and output), frequency and presence penalties (OpenAI, over the output), then greedy argmax or
temperature -> min_p -> top-k -> top-p -> a draw from the request's own generator when it has a seed.
Logprobs are those of the model's distribution (before any processing, as vLLM reports them by default).

Structured outputs: the rows with a grammar matcher are masked first (only the tokens their grammar allows
stay finite; runtime/engine/structured_outputs.py), then follow the same path; a grammar that can only end
overrides min_tokens' EOS ban.

A row that fails (whatever the cause) fails its request alone: its token is None and `seq.error` says why."""
from __future__ import annotations

import logging
from typing import Iterable, Optional

import torch

from xllm_gen.runtime.engine.outputs import Logprob
from xllm_gen.runtime.engine.sampling_params import SEED_MOD
from xllm_gen.runtime.engine.sequence import Sequence
from xllm_gen.runtime.engine.structured_outputs import dead_end_error

logger = logging.getLogger("xllm_gen")


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k and top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p; the top token is always kept (explicitly: a
        # top_p below float32's range, e.g. 1e-308, rounds to 0 in the comparison and would drop it too)
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drops tokens whose probability is below min_p times the top token's (as HF's MinPLogitsWarper)."""
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """logit_bias, repetition, frequency and presence penalties on one row (a new tensor)."""
    p = seq.params
    vocab = logits.shape[-1]
    logits = logits.clone()
    if p.logit_bias:
        ids = [t for t in p.logit_bias if t < vocab]
        if ids:
            bias = torch.tensor([max(-100.0, min(100.0, float(p.logit_bias[t]))) for t in ids], dtype=logits.dtype)
            logits[ids] += bias.to(logits.device)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
        seen = seen[seen < vocab]
        vals = logits[seen]
        # a penalty below float32's range would round to 0 (and -inf * 0 is NaN): the smallest normal instead
        rp = max(p.repetition_penalty, torch.finfo(logits.dtype).tiny)
        logits[seen] = torch.where(vals > 0, vals / rp, vals * rp)
    if p.frequency_penalty or p.presence_penalty:
        out = seq.completion_token_ids
        if out:
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=vocab)[:vocab]
            counts = counts.to(device=logits.device, dtype=logits.dtype)
            logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def process_row(logits: torch.Tensor, seq: Sequence, banned: Iterable[int] = ()) -> torch.Tensor:
    """The logits the request samples from (float32, one row): min_tokens bans, bias, penalties."""
    p = seq.params
    vocab = logits.shape[-1]
    if seq.num_completion_tokens < p.min_tokens:
        ids = [t for t in banned if 0 <= t < vocab]
        if ids:
            logits = logits.clone()
            logits[ids] = float("-inf")
    if p.needs_processing:
        logits = apply_penalties(logits, seq)
    return logits


def generator_of(seq: Sequence, default_generator: torch.Generator) -> torch.Generator:
    """The request's own generator when it has a seed (made on first use), else the engine's."""
    if seq.params.seed is not None and seq.generator is None:
        seq.generator = torch.Generator().manual_seed(seq.params.seed % SEED_MOD)
    return seq.generator if seq.generator is not None else default_generator


def row_probs(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The distribution a sampled (non-greedy) row draws from: temperature -> min_p -> top-k -> top-p over the
    processed logits of one row (float32 [vocab]); what sample_row draws from, for speculative decoding's
    rejection sampling (runtime/engine/spec_decode.py)."""
    p = seq.params
    finfo = torch.finfo(logits.dtype)
    logits = logits.clamp(max=finfo.max)
    row = (logits - logits.max()) / min(p.temperature, finfo.max)
    row = apply_min_p(row, p.min_p)
    row = _filter_top_k_top_p(row, p.top_k, p.top_p)
    return torch.softmax(row, dim=-1)


def nonfinite_error(position: int) -> str:
    """A request's error when the model's logits for its next token are not finite."""
    return (f"the model's logits for completion token {position} are not finite (NaN or inf): the request fails "
            "rather than return a token chosen from them (overflow in the weights or activations; float32 or a "
            "checked checkpoint may help)")


def greedy_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax on the device [B] (a valid id: a next step's input), and the same with -1 for a row whose
    logits are not finite (a NaN anywhere, or an infinite maximum): a model fault the engine reports, where a plain
    argmax would return a token chosen from garbage (all-NaN rows give token 0)."""
    vals, idx = logits.max(dim=-1)                  # NaN propagates into the row's maximum
    return idx, torch.where(torch.isfinite(vals), idx, -1)


def sample_row(logits: torch.Tensor, seq: Sequence, default_generator: torch.Generator) -> int:
    p = seq.params
    if p.greedy:
        return int(torch.argmax(logits).item())
    # In float32 valid parameters can leave the finite range: a tiny repetition_penalty overflows a logit to +inf,
    # a temperature above float32's max rounds to inf (and -inf / inf is NaN). So +inf becomes the largest finite
    # value (NaN stays: a model fault is reported, not hidden) and the temperature is capped at it; then
    # subtracting the max first keeps every value finite or -inf (no inf - inf). (row_probs)
    probs = row_probs(logits, seq)
    return int(torch.multinomial(probs, 1, generator=generator_of(seq, default_generator)).item())


class Sampler:
    def __init__(self, seed: int = 0):
        self.default_generator = torch.Generator().manual_seed(seed % SEED_MOD)
        self.grammar = None          # structured_outputs.GrammarBackend (set by the engine on first use)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence],
                 eos_token_ids: Iterable[int] = ()) -> list[Optional[int]]:
        """logits [B, vocab] float32 for the last token of each sequence; returns one token id each (None
        for a row that failed: its sequence's `.error` is set)."""
        logits = logits.float()
        raw = logits                                  # logprobs are the model's, before any constraint
        for i, ok in enumerate(torch.isfinite(raw.amax(dim=-1)).tolist()):   # a model fault fails its row alone
            if not ok and not seqs[i].error:
                seqs[i].error = nonfinite_error(seqs[i].num_completion_tokens)
        matchers = [s.grammar for s in seqs]
        constrained = [i for i, m in enumerate(matchers) if m is not None]
        if constrained:                               # structured outputs: mask those rows in place
            logits = logits.clone()
            try:
                for i in self.grammar.apply(logits, matchers):     # dead ends: nothing to sample, the row fails
                    seqs[i].error = dead_end_error(seqs[i].num_completion_tokens)
            except Exception as e:
                logger.exception("structured outputs: masking failed")
                for i in constrained:
                    seqs[i].error = f"structured outputs failed: {type(e).__name__}: {e}"
        plain = [i for i, s in enumerate(seqs)
                 if s.params.greedy and not s.params.needs_processing
                 and s.num_completion_tokens >= s.params.min_tokens]
        tokens: list[Optional[int]] = [None] * len(seqs)
        if plain:
            for i, t in zip(plain, logits[plain].argmax(dim=-1).tolist()):
                tokens[i] = None if seqs[i].error else int(t)
        rest = [i for i in range(len(seqs)) if tokens[i] is None and not seqs[i].error]
        if rest:
            eos = list(eos_token_ids)
            cpu_logits = logits[rest].cpu()
            for row, i in enumerate(rest):
                seq = seqs[i]
                try:
                    banned = list(seq.params.stop_token_ids) + ([] if seq.params.ignore_eos else eos)
                    row_logits = process_row(cpu_logits[row], seq, banned)
                    if seq.grammar is not None and banned and not bool(torch.isfinite(row_logits).any()):
                        row_logits = process_row(cpu_logits[row], seq, ())   # the grammar can only end here:
                    tokens[i] = sample_row(row_logits, seq, self.default_generator)  # min_tokens yields to it
                except Exception as e:           # this request fails alone
                    logger.exception("sampling failed for sequence %s", seq.seq_id)
                    seq.error = f"sampling failed: {type(e).__name__}: {e}"
        for i in constrained:                         # advance each row's grammar with its token
            if tokens[i] is not None and not seqs[i].error and not matchers[i].accept_token(tokens[i]):
                seqs[i].error = f"structured outputs: token {tokens[i]} does not fit the grammar"
                tokens[i] = None
        try:
            self._record_logprobs(raw, seqs, tokens)
        except Exception as e:
            for i, s in enumerate(seqs):
                if tokens[i] is not None and s.params.logprobs is not None:
                    s.error, tokens[i] = f"logprobs failed: {type(e).__name__}: {e}", None
        return tokens

    @staticmethod
    def _topn(lp: torch.Tensor, n: int, chosen: int) -> dict[int, Logprob]:
        entry: dict[int, Logprob] = {}
        if n > 0:
            vals, ids = torch.topk(lp, min(n, lp.numel()))
            for r, (v, t) in enumerate(zip(vals.tolist(), ids.tolist())):
                entry[t] = Logprob(v, r + 1)
        if chosen not in entry:
            rank = int((lp > lp[chosen]).sum().item()) + 1
            entry[chosen] = Logprob(float(lp[chosen]), rank)
        return entry

    def _record_logprobs(self, logits: torch.Tensor, seqs: list[Sequence], tokens: list[Optional[int]]) -> None:
        wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None and tokens[i] is not None]
        if not wanted:
            return
        logp = torch.log_softmax(logits[wanted].float(), dim=-1).cpu()
        for row, i in enumerate(wanted):
            seq, tok = seqs[i], tokens[i]
            seq.logprobs.append(self._topn(logp[row], seq.params.logprobs, tok))
            seq.cumulative_logprob += float(logp[row][tok])

    def record_prompt_logprobs(self, rows: torch.Tensor, seq: Sequence, start: int) -> None:
        """rows [m, vocab]: logits of prompt positions start .. start+m-1; row j scores prompt token start+j+1."""
        n = seq.params.prompt_logprobs
        if not seq.prompt_logprobs:
            seq.prompt_logprobs = [None]
        m = min(rows.shape[0], seq.num_prompt_tokens - 1 - start)
        if m <= 0 or start + 1 != len(seq.prompt_logprobs):      # recomputed after preemption: already there
            return
        logp = torch.log_softmax(rows[:m].float(), dim=-1).cpu()
        for j in range(m):
            seq.prompt_logprobs.append(self._topn(logp[j], n, seq.token_ids[start + j + 1]))
