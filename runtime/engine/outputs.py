"""Request outputs, shaped like vLLM's (RequestOutput.outputs[0].token_ids/.text/.finish_reason/.logprobs)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union


@dataclass
class Logprob:
    logprob: float
    rank: int                       # 1 = most likely
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: List[int]
    finish_reason: Optional[str]    # "stop" (EOS / stop token / string), "length", "abort", None (running, or error)
    logprobs: Optional[List[Dict[int, Logprob]]] = None
    cumulative_logprob: Optional[float] = None
    stop_reason: Union[int, str, None] = None   # the stop string or stop token id that ended it (None: EOS, length)


@dataclass
class RequestOutput:
    request_id: int                 # index of the request in the generate() call
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    error: Optional[str] = None     # set when the request was rejected or failed; the others are still served
    prompt_logprobs: Optional[List[Optional[Dict[int, Logprob]]]] = None   # None for the first prompt token
    num_cached_tokens: int = 0      # prompt tokens whose KV came from the prefix cache
