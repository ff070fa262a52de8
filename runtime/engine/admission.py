"""Admission: one request validated into its Sequence(s), or a ValueError("request {index}: ...") naming the field
(prompt form, Unicode, tokenization, vocabulary, context and KV-cache fit, logit_bias / stop ids, multimodal data,
structured outputs). A mixin of LLMEngine (engine.py), which owns the tokenizer, the scheduler and the processors."""
from __future__ import annotations

import copy
import logging
import numbers
import time
from typing import Any, Optional

from xllm_gen.runtime.engine.sampling_params import SEED_MOD, SamplingParams
from xllm_gen.runtime.engine.sequence import Sequence

logger = logging.getLogger(__name__)


def _check_unicode(where: str, text: Any) -> None:
    if not isinstance(text, str):
        raise ValueError(f"{where}: 'prompt' must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where}: prompt is not valid Unicode (lone surrogate at character {e.start})") from None


class EngineAdmission:
    """LLMEngine's admission (reads self.tokenizer, self.vocab_size, self.max_model_len, self.scheduler,
    self.block_manager, self.mm_processor, self.structured; numbers sequences with self._next_id)."""

    def make_sequence(self, index: Any, prompt: Any, params: SamplingParams) -> Sequence:
        """Validates one request; raises ValueError("request {index}: ...") naming the field when it cannot
        be served. The sequence gets a validated private copy of `params`."""
        where = f"request {index}"
        try:
            return self._make_sequence(where, index, prompt, params)
        except ValueError as e:
            msg = str(e)
            raise ValueError(msg if msg.startswith(where) else f"{where}: {msg}") from None
        except Exception as e:             # whatever the input holds, admission answers with a ValueError
            raise ValueError(f"{where}: invalid request ({type(e).__name__}: {e})") from None

    def _make_sequence(self, where: str, index: Any, prompt: Any, params: SamplingParams) -> Sequence:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"{where}: sampling params must be a SamplingParams, got {type(params).__name__}")
        try:
            params = params.validated()
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        except Exception as e:         # an attribute deleted or replaced by something odd
            raise ValueError(f"{where}: sampling params are malformed ({type(e).__name__}: {e})") from None
        if params.max_tokens is None:  # vLLM's: up to the end of the context (the private copy's bound)
            params.max_tokens = self.max_model_len
        text, mm_inputs = None, None
        if isinstance(prompt, str):
            text, token_ids = prompt, None
        elif isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs",
                                     "add_special_tokens", "max_tokens_must_fit"}
            if unknown:
                raise ValueError(f"{where}: unknown prompt key(s) {sorted(map(str, unknown))}")
            text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            if (text is None) == (token_ids is None):
                raise ValueError(f"{where}: give exactly one of 'prompt' and 'prompt_token_ids'")
            if text is not None and not isinstance(text, str):
                raise ValueError(f"{where}: 'prompt' must be a string, got {type(text).__name__}")
            if isinstance(text, str):
                _check_unicode(where, text)
            mm_data = prompt.get("multi_modal_data")
            kwargs = prompt.get("mm_processor_kwargs") or {}
            if not isinstance(kwargs, dict):
                raise ValueError(f"{where}: mm_processor_kwargs must be a dict, got {type(kwargs).__name__}")
            if mm_data is not None and not isinstance(mm_data, dict):
                raise ValueError(f"{where}: multi_modal_data must be a dict, got {type(mm_data).__name__}")
            if mm_data:
                if self.mm_processor is None:
                    raise ValueError(f"{where}: multi_modal_data given, but this checkpoint is text-only")
                mm_inputs = self.mm_processor.process(index, text, token_ids, mm_data, kwargs)
                token_ids = list(mm_inputs.prompt_token_ids)
        else:
            raise ValueError(f"{where}: a prompt is a str or a dict, got {type(prompt).__name__}")
        if token_ids is None:
            _check_unicode(where, text)
            if self.tokenizer is None:
                raise ValueError(f"{where}: text prompt, but the checkpoint has no tokenizer")
            # the tokenizer's own special tokens (a BOS where it adds one) as vLLM and HF tokenize a text prompt; a
            # rendered chat prompt already holds them: "add_special_tokens": False (LLM.chat, the server's chat)
            special = prompt.get("add_special_tokens", True) if isinstance(prompt, dict) else True
            if not isinstance(special, bool):
                raise ValueError(f"{where}: 'add_special_tokens' must be true or false, got {special!r}")
            try:
                token_ids = self.tokenizer.encode(text, add_special_tokens=special) if text else []
            except Exception as e:
                raise ValueError(f"{where}: prompt cannot be tokenized ({type(e).__name__}: {e})") from None
        # checked per distinct type and by min / max (C loops): a Python generator over every token cost ~1 ms a
        # 1k-token prompt, on the host while the GPU waited for the first step
        types = set(map(type, token_ids)) if isinstance(token_ids, (list, tuple)) else None
        if types is None or not all(issubclass(t, numbers.Integral) and not issubclass(t, bool) for t in types):
            raise ValueError(f"{where}: prompt_token_ids must be a list of ints")      # (numpy's ints are ints)
        token_ids = list(token_ids) if types <= {int} else [int(t) for t in token_ids]
        if len(token_ids) == 0:
            raise ValueError(f"{where}: empty prompt")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            bad = next(t for t in token_ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"{where}: prompt_token_ids: token id {bad} out of vocabulary (size {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"{where}: prompt of {len(token_ids)} tokens does not fit the model's context "
                             f"of {self.max_model_len} tokens (max_model_len)")
        # the server's rule for a max_tokens the client set (vLLM's 400): prompt + max_tokens must fit the context;
        # the key names the body field. LLM.generate runs to the context's end instead (finish_reason "length")
        must_fit = prompt.get("max_tokens_must_fit") if isinstance(prompt, dict) else None
        if must_fit and len(token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"{must_fit}: {params.max_tokens} is too large: this model's context is "
                             f"{self.max_model_len} tokens and the prompt has {len(token_ids)}, so at most "
                             f"{self.max_model_len - len(token_ids)} can follow (without {must_fit} a request gets "
                             "the rest of the context)")
        if must_fit and not self.scheduler.fits_at_all(len(token_ids) + params.max_tokens - 1):
            bm = self.block_manager             # a reply the KV cache cannot hold would end early ("length")
            room = bm.num_blocks * bm.block_size - len(token_ids) + 1
            raise ValueError(f"{must_fit}: {params.max_tokens} is too large: the KV cache holds {bm.num_blocks} "
                             f"blocks of {bm.block_size} tokens, {bm.num_blocks * bm.block_size} tokens of one "
                             f"request, and the prompt has {len(token_ids)}, so at most {max(room, 0)} can follow")
        if not self.scheduler.fits_at_all(len(token_ids) + 1):
            raise ValueError(f"{where}: prompt of {len(token_ids)} tokens needs more KV blocks than the cache "
                             f"holds ({self.block_manager.num_blocks} blocks of {self.block_manager.block_size})")
        if params.stop and self.tokenizer is None:      # no text to find them in: never silently ignored
            raise ValueError(f"{where}: stop: stop strings need a tokenizer and this checkpoint has none; use "
                             "stop_token_ids")
        if params.logit_bias and any(t >= self.vocab_size for t in params.logit_bias):
            raise ValueError(f"{where}: logit_bias: token id {max(params.logit_bias)} out of vocabulary "
                             f"(size {self.vocab_size})")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"{where}: stop_token_ids: token id {max(params.stop_token_ids)} out of vocabulary "
                             f"(size {self.vocab_size})")
        eos = () if params.ignore_eos else tuple(getattr(self, "eos_token_ids", None) or ())
        # min_tokens bans these until it is reached (a grammar lifts the bans where it can only end)
        if params.min_tokens and params.structured_outputs is None and \
                len(params.stop_token_ids) + len(eos) >= self.vocab_size:
            if len(set(params.stop_token_ids) | set(eos)) >= self.vocab_size:
                raise ValueError(f"{where}: min_tokens: no token can be sampled before min_tokens tokens: "
                                 f"stop_token_ids{'' if params.ignore_eos else ' and EOS'} (which min_tokens bans) "
                                 f"cover the whole vocabulary (size {self.vocab_size})")
        if mm_inputs is None and self.mm_processor is not None:
            self.mm_processor.check_no_placeholders(index, token_ids)
        compiled = None
        if params.structured_outputs is not None:
            compiled = self.structured.compile(params.structured_outputs)    # cached; GrammarError names it
        seq = Sequence(self._next_id, token_ids, params, prompt=text, mm_inputs=mm_inputs)
        if compiled is not None:
            seq.gate = self._reasoning_gate(params.structured_outputs, token_ids)
            seq.grammar, seq.compiled_grammar = self.structured.matcher(compiled, seq.gate), compiled
        seq.no_prefix_cache = params.prompt_logprobs is not None     # needs every prompt row computed
        self._next_id += 1
        seq.arrival_time = time.monotonic()
        return seq

    def _reasoning_gate(self, so, token_ids) -> Optional[tuple]:
        """The grammar's reasoning gate (structured_outputs.reasoning_gate), or None: no reasoning_tags, or a tag
        that is not one token of this tokenizer (logged once; the constraint then holds from the first token)."""
        if so.reasoning_tags is None:
            return None
        from xllm_gen.runtime.engine.structured_outputs import reasoning_gate
        gate = reasoning_gate(self.tokenizer, so.reasoning_tags, token_ids)
        if gate is None and not getattr(self, "_gate_warned", False):
            self._gate_warned = True
            logger.warning("structured outputs: the reasoning tags %s are not single tokens of this tokenizer; the "
                           "constraint holds from the first token", list(so.reasoning_tags))
        return gate

    def make_sequences(self, index: Any, prompt: Any, params: SamplingParams) -> list[Sequence]:
        """The `params.n` sequences of one request (a seed s gives completion i the seed s + i)."""
        first = self.make_sequence(index, prompt, params)
        seqs = [first]
        for i in range(1, first.params.n):
            p = copy.copy(first.params)
            if p.seed is not None:
                p.seed = (p.seed + i) % SEED_MOD
            s = Sequence(self._next_id, first.token_ids, p, prompt=first.prompt, mm_inputs=first.mm_inputs)
            self._next_id += 1
            s.index, s.arrival_time, s.no_prefix_cache = i, first.arrival_time, first.no_prefix_cache
            if first.grammar is not None:          # each completion walks the grammar on its own
                s.gate = first.gate
                s.grammar = self.structured.matcher(first.compiled_grammar, s.gate)
            seqs.append(s)
        return seqs
