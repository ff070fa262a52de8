"""The request-level API of LLMEngine (what a server drives: add, step, abort): requests queued by id, each with its
`params.n` sequences, and per-step outputs (final outputs, or streamed deltas). A mixin of LLMEngine (engine.py), which
owns the scheduler and the step loop (self.step)."""
from __future__ import annotations

from typing import Any, Optional

from xllm_gen.runtime.engine.outputs import RequestOutput
from xllm_gen.runtime.engine.sampling_params import SamplingParams
from xllm_gen.runtime.engine.sequence import Sequence

_UNKNOWN = object()          # a sequence of no request (aborted, or queued directly on the scheduler)


class EngineRequests:
    """LLMEngine's requests (reads self.scheduler, self._async, self._last_progress; keeps self._requests
    {request id: sequences} and self._request_of {seq_id: request id}; builds sequences with make_sequences and
    outputs with request_output / _delta_of / _error_of / _decorate)."""

    # ---- request-level API (what a server drives: add, step, abort) -----------------------------------
    def add_request(self, request_id: Any, prompt: Any, params: SamplingParams,
                    arrival_time: Optional[float] = None) -> None:
        """Queues one request (its `params.n` completions); raises ValueError("request {request_id}: ...")
        naming the field when it cannot be served."""
        try:
            hash(request_id)
        except TypeError:
            raise ValueError(f"request_id must be hashable, got {type(request_id).__name__}") from None
        if request_id in self._requests:
            raise ValueError(f"request {request_id}: a request with this id is already queued")
        seqs = self.make_sequences(request_id, prompt, params)
        if arrival_time is not None:
            for s in seqs:
                s.arrival_time = arrival_time
        self._requests[request_id] = seqs
        for s in seqs:
            self._request_of[s.seq_id] = request_id
            self.scheduler.add(s)

    def num_requests(self) -> int:
        return len(self._requests)

    def _step_requests(self) -> tuple[list, list]:
        """One step; (request ids with progress, request ids that finished), in order."""
        done = self.step()
        touched, finished = [], []
        for seq in self._last_progress + done:
            rid = self._request_of.get(seq.seq_id, _UNKNOWN)     # any hashable id, None included
            if rid is not _UNKNOWN and rid not in touched:
                touched.append(rid)
        for rid in touched:
            if all(s.is_finished for s in self._requests[rid]):
                finished.append(rid)
        return touched, finished

    def _retire(self, rid: Any) -> list[Sequence]:
        seqs = self._requests.pop(rid)
        for s in seqs:
            self._request_of.pop(s.seq_id, None)
        return seqs

    def step_outputs(self) -> list[RequestOutput]:
        """Runs one step; returns the final outputs of the requests that finished in it."""
        _, finished = self._step_requests()
        return [self.request_output(rid, self._retire(rid)) for rid in finished]

    def step_deltas(self) -> list[RequestOutput]:
        """Runs one step; returns one delta output for every request that made progress in it: each of its
        completions that changed carries only what is new (token ids, text safe for multi-byte characters
        and stop strings, logprobs); `finished` is set on the last one, with the finish and stop reasons
        (and `error` when it failed). The first delta of a request carries its prompt logprobs."""
        self._stream_text = True
        touched, finished = self._step_requests()
        outs = []
        for rid in touched:
            seqs = self._requests[rid]
            done = rid in finished
            comps = [c for c in (self._delta_of(s) for s in seqs) if c is not None]
            first = seqs[0]
            out = RequestOutput(rid, first.prompt, first.token_ids[:first.num_prompt_tokens], comps, done,
                                self._error_of(seqs), None, first.num_cached_tokens)
            if not getattr(first, "_prompt_logprobs_sent", False) and first.params.prompt_logprobs is not None \
                    and first.prompt_logprobs is not None and len(first.prompt_logprobs) >= first.num_prompt_tokens:
                out.prompt_logprobs = self._decorate(first.prompt_logprobs)
                first._prompt_logprobs_sent = True
            outs.append(out)
            if done:
                self._retire(rid)
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_request(self, request_id: Any) -> bool:
        """Drops a queued or running request and frees its KV blocks; False when it is unknown."""
        try:
            seqs = self._requests.pop(request_id, None)
        except TypeError:
            return False
        if seqs is None:
            return False
        for seq in seqs:
            self._request_of.pop(seq.seq_id, None)
            if not seq.is_finished:
                self.scheduler.abort(seq)
        return True

    def abort_all(self) -> list:
        """Aborts every request; returns their ids."""
        ids = list(self._requests)
        if self._async is not None:
            self._async.inflight = None
        for rid in ids:
            self.abort_request(rid)
        for q in (self.scheduler.waiting, self.scheduler.running):      # sequences queued directly
            while q:
                self.scheduler.abort(q[0])
        return ids
