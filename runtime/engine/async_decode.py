"""Async scheduling of greedy decode steps: step n+1 is launched before step n's tokens are read back, so the
host's work between two steps (reading tokens, stop checks, detokenizing, scheduling, preparing and planning
the next step) overlaps the GPU's step instead of leaving the GPU idle.

A launched step leaves its argmax tokens on the device and starts their copy into pinned host memory; each of
its sequences has one more computed token and one pending token (Sequence.num_pending). The next step is
launched at once when it can be decided without those tokens: a decode of the running sequences, nothing
waiting, free KV blocks for all (no preemption). It takes the pending tokens as its inputs on the device. Then
the engine reads step n's tokens and finishes sequences as usual. A sequence that ended there (EOS, a stop
token or string) was also computed in the step in flight; that row is dropped when it is read. Sequences
certain to end (max_tokens, max_model_len) are left out of the next step.

Only plain greedy sequences qualify: sampling, penalties, logprobs and min_tokens read the logits on the host.
Greedy rows with structured outputs qualify too: a step with such rows is launched without its argmax (its
logits stay on the device); once step n's tokens are read and accepted by the rows' grammars, their masks for
step n+1 are filled on the host while the device still runs step n+1, applied to those rows, and the argmax
taken (`finish_masked`). So each mask matches its row's real state.
The runner needs `decode_greedy` (one process; TP ranks receive their inputs from rank 0's host)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from xllm_gen.runtime.engine.sampler import greedy_argmax
from xllm_gen.runtime.engine.sequence import Sequence
from xllm_gen.runtime.engine.structured_outputs import dead_end_error


@dataclass
class InFlight:
    """A launched decode step whose tokens are not read yet."""
    seqs: list[Sequence]
    tokens: torch.Tensor                      # [B] int64 argmax, on the device (the next step's inputs)
    host: torch.Tensor                        # [B] view of a pinned buffer the tokens are copied into (-1: a row
                                              # whose logits were not finite, sampler.greedy_argmax)
    event: Optional[torch.cuda.Event]         # recorded after that copy (None on a CPU)
    logits: Optional[torch.Tensor] = None     # a step with grammar rows: its logits until finish_masked


class AsyncDecode:
    def __init__(self, runner, max_num_seqs: int, device: torch.device):
        self.runner = runner
        pin = device.type == "cuda"
        # two buffers: the step in flight copies into one while the host reads the other
        self._host = [torch.zeros(max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        self.inflight: Optional[InFlight] = None

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        p = seq.params
        return (p.greedy and not p.needs_processing and p.logprobs is None and not seq.error
                and seq.num_completion_tokens + seq.num_pending >= p.min_tokens)

    def can_launch(self, seqs: list[Sequence]) -> bool:
        return bool(seqs) and all(self.eligible(s) for s in seqs)

    def next_batch(self, scheduler, max_model_len: int) -> Optional[list[Sequence]]:
        """The decode batch to launch before the step in flight is read, with its KV slots allocated; None when
        the next step needs those tokens first (a sequence not from that step, one that no longer qualifies,
        a waiting request, too few free blocks)."""
        seqs = [s for s in scheduler.running
                if s.num_completion_tokens + s.num_pending < s.params.max_tokens
                and s.num_tokens_with_pending < max_model_len]
        if not seqs or any(s.num_pending != 1 or not self.eligible(s) for s in seqs):
            return None
        return seqs if scheduler.schedule_ahead(seqs) else None

    def launch(self, seqs: list[Sequence], prev: Optional[InFlight] = None) -> InFlight:
        """Runs the decode step of `seqs` (inputs: `prev`'s device tokens, else their last tokens) and starts
        the copy of its tokens to the host; returns without waiting for the GPU."""
        prev_tokens, rows = None, None
        if prev is not None:
            prev_tokens = prev.tokens
            if len(seqs) != len(prev.seqs) or any(a is not b for a, b in zip(seqs, prev.seqs)):
                row_of = {id(s): i for i, s in enumerate(prev.seqs)}
                rows = [row_of[id(s)] for s in seqs]
        with torch.inference_mode():
            if any(s.grammar is not None for s in seqs):      # masked and reduced by finish_masked
                ids = prev_tokens
                if prev_tokens is not None and rows is not None:
                    ids = prev_tokens.index_select(
                        0, torch.tensor(rows, dtype=torch.int64).to(prev_tokens.device, non_blocking=True))
                step = InFlight(seqs, None, None, None, logits=self.runner.run(seqs, False, input_ids=ids))
            else:
                step = self._send(seqs, self.runner.decode_greedy(seqs, prev_tokens, rows))
        for s in seqs:
            s.num_computed_tokens += 1
            s.num_pending += 1
        return step

    def _send(self, seqs: list[Sequence], tokens: tuple[torch.Tensor, torch.Tensor]) -> InFlight:
        """Starts the copy of a step's device tokens to the host (tokens: sampler.greedy_argmax's pair)."""
        tokens, report = tokens
        host = self._host[self._turn][:len(seqs)]
        self._turn ^= 1
        host.copy_(report, non_blocking=True)
        event = None
        if tokens.is_cuda:
            event = torch.cuda.Event()
            event.record()
        return InFlight(seqs, tokens, host, event)

    def finish_masked(self, step: InFlight, grammar) -> None:
        """For a step launched with grammar rows, once their grammars have accepted every earlier token: fills
        their masks (host), applies them to the step's logits, takes the argmax on the device and starts its
        copy. Rows that ended meanwhile are left unmasked (they are dropped when the step is read)."""
        with torch.inference_mode():
            logits = step.logits.float()
            matchers = [None if (s.is_finished or s.error or s.grammar is None or s.grammar.is_terminated())
                        else s.grammar for s in step.seqs]
            for i in grammar.apply(logits, matchers):          # dead ends fail alone (the argmax is dropped)
                step.seqs[i].error = dead_end_error(step.seqs[i].num_completion_tokens)
            done = self._send(step.seqs, greedy_argmax(logits))
        step.tokens, step.host, step.event, step.logits = done.tokens, done.host, done.event, None

    def read(self, step: InFlight) -> list[int]:
        """Waits for the step's tokens on the host; they are no longer pending. A row whose logits were not finite
        reads -1."""
        if step.event is not None:
            step.event.synchronize()
        for s in step.seqs:
            s.num_pending -= 1
        return step.host.tolist()
