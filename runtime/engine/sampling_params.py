"""SamplingParams with vLLM's names. Invalid values raise ValueError at construction, and again at admission:
the engine re-validates (`problems()`) and serves a normalized copy (`validated()`), so fields changed after
construction cannot bypass the checks and later changes do not reach a running request."""
from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from xllm_gen.runtime.engine.structured_outputs import StructuredOutputsParams

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): 1e-38 must not divide logits into inf - inf.
GREEDY_EPS = 1e-5
SEED_MOD = 2 ** 64             # torch.Generator takes seeds in [-(2**63), 2**64); larger ones are reduced mod 2**64
MAX_LOGPROBS = 20              # as OpenAI's top_logprobs (vLLM's default max_logprobs)
MAX_N = 128


_INT_FIELDS = ("n", "max_tokens", "top_k", "min_tokens", "seed", "logprobs", "prompt_logprobs", "best_of")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def _plain(v, kind):
    """A numpy / other numbers.Integral (kind int) or numbers.Real (kind float) scalar as the Python number it
    holds (np.int64(5) is an integer >= 1, which the checks would call "got np.int64(5)"); anything else as is."""
    if isinstance(v, bool) or type(v) in (int, float):
        return v
    if isinstance(v, numbers.Integral):
        return int(v)
    if kind is float and isinstance(v, numbers.Real):
        return float(v)
    return v


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite(v) -> bool:
    return _is_num(v) and math.isfinite(v)


@dataclass
class SamplingParams:
    n: int = 1                           # completions per prompt (seed s gives child i the seed s + i)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                      # -1 (or 0): no top-k
    min_p: float = 0.0                   # drop tokens below min_p * p(top token)
    presence_penalty: float = 0.0        # OpenAI: - penalty once per token present in the output
    frequency_penalty: float = 0.0       # OpenAI: - penalty * count in the output
    repetition_penalty: float = 1.0      # HF/CTRL: over prompt and output, logit / p if > 0 else logit * p
    logit_bias: Optional[Dict[int, float]] = None   # token id -> added to its logit (clamped to [-100, 100])
    max_tokens: Optional[int] = 16       # None: up to the end of the context (vLLM's)
    ignore_eos: bool = False
    stop_token_ids: List[int] = field(default_factory=list)     # None: none (vLLM's)
    stop: List[str] = field(default_factory=list)    # stop strings (excluded from .text, as in vLLM); None: none
    include_stop_str_in_output: bool = False
    min_tokens: int = 0                  # EOS and stop tokens cannot be sampled before this many tokens
    seed: Optional[int] = None           # per-request generator: same output whatever the batch around it
    logprobs: Optional[int] = None       # top-N logprobs per generated token (the sampled one is always added)
    prompt_logprobs: Optional[int] = None  # top-N logprobs per prompt token (None for the first one)
    skip_special_tokens: bool = True
    # constrained decoding (json schema / json_object / regex / choice / EBNF grammar); a dict is converted
    structured_outputs: Optional[StructuredOutputsParams] = None
    # vLLM's older name, kept so its scripts say what to do: only None or n (no ranking of extra samples here)
    best_of: Optional[int] = None

    def __post_init__(self):
        self._plain_numbers()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        problems = self.problems()
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))

    def _plain_numbers(self) -> None:
        """numpy (any numbers.Integral / numbers.Real) scalars in the numeric fields become Python's."""
        for name in _INT_FIELDS:
            setattr(self, name, _plain(getattr(self, name), int))
        for name in _FLOAT_FIELDS:
            setattr(self, name, _plain(getattr(self, name), float))
        if isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = [_plain(t, int) for t in self.stop_token_ids]
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {_plain(k, int): _plain(v, float) for k, v in self.logit_bias.items()}

    def problems(self) -> list[str]:
        """Every problem, each naming its field; never raises whatever the fields hold."""
        p: list[str] = []
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            p.append(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            p.append(f"max_tokens must be an integer >= 1 or None (the rest of the context), got {self.max_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            p.append(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _finite(self.top_p) or not (0.0 < self.top_p <= 1.0):
            p.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            p.append(f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if not _finite(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            p.append(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _finite(v) or not -2.0 <= v <= 2.0:
                p.append(f"{name} must be in [-2, 2], got {v!r}")
        if not _finite(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 100.0:
            p.append(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty!r}")
        lb = self.logit_bias
        if lb is not None:
            if not isinstance(lb, dict):
                p.append(f"logit_bias must be a dict of token id -> bias, got {type(lb).__name__}")
            elif not all(_is_int(k) and k >= 0 for k in lb):
                p.append("logit_bias keys must be token ids (integers >= 0)")
            elif not all(_finite(v) for v in lb.values()):
                p.append("logit_bias values must be finite numbers")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                p.append(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        if self.seed is not None and not _is_int(self.seed):
            p.append(f"seed must be an integer, got {self.seed!r}")
        sti = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(sti, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in sti):
            p.append("stop_token_ids must be a list of token ids (integers >= 0)")
        stop = [] if self.stop is None else self.stop
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(t, str) and t for t in stop):
            p.append("stop must be a non-empty string or a list of them")
        elif not all(_utf8(s) for s in stop):
            p.append("stop strings must be valid Unicode (no lone surrogates)")
        if not _is_int(self.min_tokens) or self.min_tokens < 0 or (
                _is_int(self.max_tokens) and self.min_tokens > self.max_tokens):
            p.append(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                p.append(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.best_of is not None and self.best_of != self.n:
            p.append(f"best_of={self.best_of!r} is not supported (only best_of == n): for the best of k samples, "
                     "ask for n=k with logprobs=0 and keep the completion with the highest cumulative_logprob")
        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, StructuredOutputsParams):
                p.append(f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}")
            else:
                p.extend(so.problems())
        return p

    def validated(self) -> "SamplingParams":
        """A checked, normalized, private copy (raises ValueError naming the fields)."""
        c = copy.copy(self)
        try:
            c._plain_numbers()
        except Exception:                   # a field holding something odd: problems() names it
            c = copy.copy(self)
        problems = c.problems()
        if problems:
            raise ValueError("; ".join(problems))
        c.stop = [c.stop] if isinstance(c.stop, str) else list(c.stop or ())
        c.stop_token_ids = list(c.stop_token_ids or ())
        c.logit_bias = dict(c.logit_bias) if c.logit_bias else None
        c.temperature = float(c.temperature)
        if c.temperature < GREEDY_EPS:
            c.temperature = 0.0
        if c.seed is not None:
            c.seed %= SEED_MOD
        if c.structured_outputs is not None:
            c.structured_outputs = copy.deepcopy(c.structured_outputs)
        return c

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def needs_processing(self) -> bool:
        """Whether logits change before greedy/sampling (penalties, bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


# generation_config.json fields a checkpoint ships as its sampling defaults, and the SamplingParams field each sets
# (vLLM's --generation-config auto): used where a request leaves the field unset; max_new_tokens is the default
# max_tokens
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
GENERATION_CONFIG_OPTIONS = "'auto' (the checkpoint's generation_config.json), 'vllm' (none: vLLM's built-in " \
                            "defaults) or a directory holding a generation_config.json"


def generation_defaults(gen: dict, where: str = "generation_config.json") -> dict:
    """{SamplingParams field: value} of the sampling defaults in a generation config (read_generation_config's
    dict); a value SamplingParams refuses is a ValueError naming `where` and the field."""
    out = {param: gen[key] for key, param in GENERATION_DEFAULTS.items() if gen.get(key) is not None}
    try:
        SamplingParams(**out)
    except ValueError as e:
        key_of = {param: key for key, param in GENERATION_DEFAULTS.items()}
        parts = str(e).removeprefix("invalid SamplingParams: ").split("; ")
        raise ValueError(f"{where}: " + "; ".join(
            f"field '{key_of[p.split()[0]]}'{p[len(p.split()[0]):]}" if p.split()[0] in key_of else p
            for p in parts)) from None
    return out


def sampling_defaults(option, model_dir, generation_config: dict, vocab_size: Optional[int] = None) -> dict:
    """The default SamplingParams fields for `option` (LLM's / the server's generation_config): 'auto' reads the
    checkpoint's (`generation_config`, already read from `model_dir`), 'vllm' none, a directory its own file."""
    from pathlib import Path

    from xllm_gen.runtime.loading.checkpoint_files import read_generation_config
    if option in ("vllm", None):
        return {}
    if option == "auto":
        return generation_defaults(generation_config, f"{model_dir}/generation_config.json")
    path = Path(str(option))
    if not isinstance(option, (str, Path)) or not (path / "generation_config.json").is_file():
        raise ValueError(f"generation_config={option!r}: {GENERATION_CONFIG_OPTIONS}")
    return generation_defaults(read_generation_config(path, vocab_size), str(path / "generation_config.json"))
