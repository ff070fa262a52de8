"""What the engine hands back: the text of each completion, decoded incrementally (IncrementalDetokenizer), stop
strings, finish reasons, and the RequestOutput / CompletionOutput of a request (final, or the delta since the last
one for streaming). A mixin of LLMEngine (engine.py), which owns the tokenizer and the sequences."""
from __future__ import annotations

from typing import Any, Optional

from xllm_gen.runtime.engine.outputs import CompletionOutput, RequestOutput
from xllm_gen.runtime.engine.sequence import Sequence


def _backend_decode(tokenizer):
    """The `tokenizers` library's decode of a transformers fast tokenizer whose decode is exactly that call (its
    decode and _decode not overridden, no clean-up of tokenization spaces): the same text without the wrapper's
    argument handling, a quarter of the time (two decodes a streamed token); else None."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or cls.decode is not PreTrainedTokenizerBase.decode or \
            cls._decode is not TokenizersBackend._decode or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    return getattr(backend, "decode", None)


class IncrementalDetokenizer:
    """Text of a growing list of completion token ids, emitted only when whole characters are complete (a
    multi-byte character split over tokens is held back until its last byte), as vLLM and TGI do: decode a
    short window of context plus the new tokens and keep what the new tokens add."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self._backend = _backend_decode(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._backend is not None:
            return self._backend(ids, skip_special_tokens=self.skip)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def step(self, ids: list[int], final: bool = False) -> str:
        prefix = self._decode(ids[self.prefix_offset:self.read_offset])
        new = self._decode(ids[self.prefix_offset:])
        if len(new) > len(prefix) and (final or not new.endswith("\ufffd")):
            delta = new[len(prefix):]
            self.text += delta
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            return delta
        return ""

    def flush(self, ids: list[int]) -> str:
        return self.step(ids, final=True) if self.read_offset < len(ids) else ""


class EngineOutputs:
    """LLMEngine's detokenization and outputs (reads self.tokenizer, self.detokenize, self._stream_text,
    self.eos_token_ids, self.max_model_len)."""

    def _detok(self, seq: Sequence) -> Optional["IncrementalDetokenizer"]:
        if self.tokenizer is None or (not self.detokenize and not seq.params.stop):
            return None
        if seq.detok is None:
            seq.detok = IncrementalDetokenizer(self.tokenizer, seq.params.skip_special_tokens)
        return seq.detok

    def _flush(self, seq: Sequence) -> None:
        d = self._detok(seq)
        if d is not None:
            try:
                d.flush(seq.text_token_ids)
            except Exception as e:
                seq.error = f"detokenization failed: {type(e).__name__}: {e}"

    def _finish_reason(self, seq: Sequence, tok: int) -> Optional[str]:
        p = seq.params
        d = self._detok(seq)
        old_len = 0
        eos = not p.ignore_eos and tok in self.eos_token_ids
        if (eos or tok in p.stop_token_ids) and not p.include_stop_str_in_output:
            seq.stop_token_hidden = True        # the token that ends it: in token_ids, its text left out (vLLM's)
        # text is needed every step only for stop strings or streamed deltas; otherwise it is decoded once at
        # the finish (_flush): two tokenizer calls per request per step cost ~30% of a batch-100 decode step
        if d is not None and (p.stop or self._stream_text):
            old_len = len(d.text)
            d.step(seq.text_token_ids)
        if eos:
            return "stop"
        if tok in p.stop_token_ids:
            seq.stop_reason = tok
            return "stop"
        # stop strings, like EOS and stop_token_ids (banned by the sampler), end no completion shorter than
        # min_tokens (vLLM's rule: checked once more than min_tokens tokens are out)
        if p.stop and d is not None and seq.num_completion_tokens > p.min_tokens:
            hits = []
            for s in p.stop:
                at = d.text.find(s, max(0, old_len - len(s) + 1))
                if at >= 0:
                    hits.append((at, s))
            if hits:
                at, s = min(hits)
                d.text = d.text[:at + len(s)] if p.include_stop_str_in_output else d.text[:at]
                seq.stop_reason = s
                return "stop"
        if seq.grammar is not None and seq.grammar.is_terminated():
            return "stop"                    # the structured output is complete (and ignore_eos is set)
        if seq.num_completion_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def decode_text(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _decorate(self, entries):
        """Fills decoded_token on logprob entries (in place); returns them."""
        if self.tokenizer is not None and entries and self.detokenize:
            for entry in entries:
                for tid, lp in (entry or {}).items():
                    if lp.decoded_token is None:
                        lp.decoded_token = self.tokenizer.decode([tid])
        return entries

    def _text_of(self, seq: Sequence, final: bool) -> str:
        d = self._detok(seq)
        if d is None:
            return ""
        if final or seq.is_finished:
            return d.text
        p = seq.params
        hold = max(len(s) for s in p.stop) - 1 if p.stop and not p.include_stop_str_in_output else 0
        return d.text[:max(0, len(d.text) - hold)]

    @staticmethod
    def _error_of(seqs: list[Sequence]) -> Optional[str]:
        errors = [s.error for s in seqs if s.error]
        return "; ".join(errors) if errors else None

    def _completion(self, seq: Sequence) -> CompletionOutput:
        want_lp = seq.params.logprobs is not None
        return CompletionOutput(seq.index, self._text_of(seq, True), seq.completion_token_ids,
                                None if seq.finish_reason == "error" else seq.finish_reason,
                                self._decorate(seq.logprobs) if want_lp else None,
                                seq.cumulative_logprob if want_lp else None, seq.stop_reason)

    def _delta_of(self, seq: Sequence) -> Optional[CompletionOutput]:
        """What is new in `seq` since its last delta; None when nothing is."""
        ids = seq.completion_token_ids
        text = self._text_of(seq, False)
        new_ids = ids[seq.num_emitted_tokens:]
        new_text = text[seq.num_emitted_chars:]
        ending = seq.is_finished and not getattr(seq, "_end_sent", False)
        if not new_ids and not new_text and not ending:
            return None
        want_lp = seq.params.logprobs is not None
        lps = self._decorate(seq.logprobs[seq.num_emitted_tokens:]) if want_lp else None
        seq.num_emitted_tokens, seq.num_emitted_chars = len(ids), max(seq.num_emitted_chars, len(text))
        if seq.is_finished:
            seq._end_sent = True
        return CompletionOutput(seq.index, new_text, new_ids,
                                None if seq.finish_reason == "error" else seq.finish_reason,
                                lps, seq.cumulative_logprob if want_lp else None, seq.stop_reason)

    def request_output(self, request_id: Any, seqs: list[Sequence]) -> RequestOutput:
        """The final output of a request (all its completions, in index order)."""
        first = seqs[0]
        plp = self._decorate(first.prompt_logprobs) if first.params.prompt_logprobs is not None else None
        return RequestOutput(request_id, first.prompt, first.token_ids[:first.num_prompt_tokens],
                             [self._completion(s) for s in seqs], True, self._error_of(seqs), plp,
                             first.num_cached_tokens)

    def output_of(self, index: Any, seq: Sequence) -> RequestOutput:
        """The final output of one sequence (kept for drivers that queue sequences directly)."""
        return self.request_output(index, [seq])
