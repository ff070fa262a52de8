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
    seed: Optional[int] = None           # per-request generator: same output whatever the batch around it
    logprobs: Optional[int] = None       # top-N logprobs per generated token (the sampled one is always added)

    def __post_init__(self):
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
        return p

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
