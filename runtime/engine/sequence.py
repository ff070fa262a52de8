"""One request's state while it is served: tokens, KV blocks, sampling state."""
from __future__ import annotations

from enum import Enum, auto
from typing import Any, Optional

from xllm_gen.runtime.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: Optional[str] = None, mm_inputs: Any = None):
        self.seq_id = seq_id
        self.prompt = prompt
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.mm_inputs = mm_inputs              # runtime.multimodal.MultiModalInputs for VL requests
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0            # tokens whose KV is in the cache
        self.chunk_len = 0                      # tokens this step computes (prefill chunk, or 1 in decode)
        self.num_pending = 0                    # tokens sampled on the device, not yet read back (async decode)
        self.finish_reason: Optional[str] = None
        self.logprobs: list[dict] = []
        self.cumulative_logprob = 0.0
        self.num_preemptions = 0
        self.generator = None                   # per-request torch.Generator when params.seed is set
        self.grammar = None                     # xgrammar GrammarMatcher when params.structured_outputs is set
        self.gate = None                        # (start id, end id, open): its reasoning gate (ReasoningGate)
        self.vision_cache = None                # (embeds, deepstack) while the prompt's visual rows are prefilled
        self.stop_reason = None                 # the stop string or stop token id that ended it
        self.stop_token_hidden = False          # it ended on EOS / a stop_token_ids id: in token_ids, not in the text
        self.error: Optional[str] = None        # set when the request failed after admission
        self.prompt_logprobs: Optional[list] = None
        self.state_slot: Optional[int] = None   # the recurrent-state pool slot it holds (models with recurrent layers)
        self.num_hashed_blocks = 0              # leading full blocks registered in the prefix cache
        self.no_prefix_cache = False            # never looks up nor registers cached blocks
        self.num_cached_tokens = 0              # prompt tokens found in the prefix cache at first admission
        self.index = 0                          # completion index within its request (n > 1)
        self.detok = None                       # engine.IncrementalDetokenizer
        self.num_emitted_tokens = 0             # tokens / logprobs already reported in deltas
        self.num_emitted_chars = 0
        self.arrival_time = 0.0
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """The length the next decode step sees: known tokens plus those still on the device; its input is the
        last of them (at position num_tokens_with_pending - 1)."""
        return len(self.token_ids) + self.num_pending

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def text_token_ids(self) -> list[int]:
        """The completion tokens its text is decoded from: all but the stop token that ended it (vLLM's rule:
        EOS or a stop_token_ids id is returned in token_ids, its text only with include_stop_str_in_output)."""
        ids = self.completion_token_ids
        return ids[:-1] if self.stop_token_hidden and ids else ids

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
