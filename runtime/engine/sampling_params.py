"""SamplingParams with vLLM's names. Invalid values raise ValueError at construction."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                      # -1 (or 0): no top-k
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: List[int] = field(default_factory=list)
    stop: List[str] = field(default_factory=list)    # stop strings (excluded from .text, as in vLLM)
    include_stop_str_in_output: bool = False
    min_tokens: int = 0                  # EOS and stop tokens cannot be sampled before this many tokens
    seed: Optional[int] = None           # per-request generator: same output whatever the batch around it
    logprobs: Optional[int] = None       # top-N logprobs per generated token (the sampled one is always added)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        problems = self.problems()
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))

    def problems(self) -> list[str]:
        p = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            p.append(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0 or self.temperature != self.temperature:
            p.append(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            p.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (0, -1)):
            p.append(f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            p.append(f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            p.append(f"seed must be an integer, got {self.seed!r}")
        if not all(isinstance(t, int) for t in self.stop_token_ids):
            p.append("stop_token_ids must be integers")
        if not all(isinstance(t, str) and t for t in self.stop):
            p.append("stop must be non-empty strings")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0 or (
                isinstance(self.max_tokens, int) and self.min_tokens > self.max_tokens):
            p.append(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        return p

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
