"""`xllm-gen verify`'s results: the tolerances, per-layer and per-prompt results and the report's text
(codegen/verify.py runs the comparison)."""
from __future__ import annotations

import dataclasses


class VerifyError(Exception):
    """The check could not run (bad checkpoint, architecture not claimed by the spec, ...)."""


DEFAULT_TOL = {"float32": 1e-4, "float64": 1e-4 * 2.0 ** -29, "bfloat16": 5e-2, "float16": 5e-2}
# absolute, in nats (float64: the engine's log-probabilities leave its sampler in float32, so float32's)
LOGPROB_TOL = {"float32": 1e-3, "float64": 1e-3, "bfloat16": 0.25, "float16": 0.25}
LOGPROB_TOP = 5
YARDSTICK = 3          # 16-bit: the engine's error may be this many times transformers' own (GPU spec tests' bound)
# float32 on the CPU: transformers' own float32 error against its float64 run is the yardstick where that run works
# (a fixed 1e-4 let an erf GELU for a tanh one pass at 6e-5; a chaotic tiny checkpoint is 2e-4 off in float32 itself):
# the engine may be EXACT_YARDSTICK times as far from transformers' float32 as that is (measured over 55 families'
# GPU-test fixtures: at most 1.2x on the logits), and never need be closer than the floors
EXACT_YARDSTICK = 10
EXACT_FLOOR = 2e-6             # relative, per layer
EXACT_LOGPROB_FLOOR = 2e-5     # nats
EXACT_CAP, EXACT_LOGPROB_CAP = 5e-2, 0.25      # the float32 yardstick's bounds at most (the 16-bit fixed ones)
EXACT_MAX_BYTES = 8 * 2**30    # the float64 reference's weights at most (a real 8B model's would take 64 GiB)
NEAR_TIE = 0.02        # 16-bit: the least float32 log-probability margin of a differing greedy token that is a tie


@dataclasses.dataclass
class LayerError:
    layer: int
    max_rel: float                 # max |engine - hf| / max |hf| over positions and features
    max_abs: float
    first_bad_position: int | None  # first position over the tolerance (None: within)
    tol: float | None = None        # the bound applied to this layer (None: the report's tolerance)


@dataclasses.dataclass
class PromptResult:
    prompt_len: int
    hf_tokens: list
    engine_tokens: list
    layers: list                   # [LayerError] teacher-forced over prompt + hf continuation
    logprob_err: float = 0.0       # max |engine - hf| log-probability over the compared entries
    logprob_bad_position: int | None = None   # first position over LOGPROB_TOL (None: within)
    step_logprob_err: float = 0.0  # the same over the greedy decode steps (while the tokens agree)
    step_logprob_bad: int | None = None       # first decode step over LOGPROB_TOL (None: within)
    near_tie: tuple | None = None  # 16-bit: (step, float32 margin, bound) of a first differing token at a near-tie
    routing_ties: int = 0          # 16-bit MoE: positions the decode steps set aside (verify_routing: near a tie or after a flip)
    routing_error: str | None = None   # 16-bit: experts that differ from float32's beyond that noise
    logprob_tol: float | None = None   # the log-probability bound applied (None: LOGPROB_TOL of the dtype)
    own_forward: tuple | None = None   # (step, generate's token, forward's token): transformers' cached generate
                                       # leaves its own uncached forward there, and the engine follows the forward

    @property
    def first_token_diff(self) -> int | None:
        for i, (a, b) in enumerate(zip(self.hf_tokens, self.engine_tokens)):
            if a != b:
                return i
        return None if len(self.hf_tokens) == len(self.engine_tokens) else min(len(self.hf_tokens),
                                                                                 len(self.engine_tokens))


@dataclasses.dataclass
class Report:
    spec: str
    checkpoint: str
    architecture: str
    dtype: str
    tol: float
    refused: str | None = None
    prompts: list = dataclasses.field(default_factory=list)
    defaults: list = dataclasses.field(default_factory=list)   # absent / null fields read unlike transformers
    reference: str = ""            # the transformers class compared with (a note where model_type chose it)
    tp: int = 1                    # the engine's tensor parallel size
    defaults_checked: str = ""     # the config class the defaults were checked against ("" : not checked)
    notes: list = dataclasses.field(default_factory=list)   # what this run could not exercise (never a failure)
    final_norm: bool = False       # the last compared stage is the final norm's output, after the layers

    def stage(self, index: int) -> str:
        """The name of compared stage `index`: a layer's number, or `norm` (the final norm, after the last layer)."""
        n = len(self.prompts[0].layers) if self.prompts else 0
        return "norm" if self.final_norm and index == n - 1 else str(index)

    @property
    def ok(self) -> bool:
        return self.refused is None and not self.defaults and all(
            (p.first_token_diff is None or p.near_tie is not None or p.own_forward is not None)
            and p.logprob_bad_position is None
            and p.routing_error is None
            and p.step_logprob_bad is None
            and all(e.first_bad_position is None for e in p.layers) for p in self.prompts)

    def first_divergence(self) -> tuple[int, PromptResult, LayerError] | None:
        """(prompt index, prompt, layer error) of the earliest layer over the tolerance over all prompts."""
        best = None
        for i, p in enumerate(self.prompts):
            for e in p.layers:
                if e.first_bad_position is not None:
                    if best is None or (e.layer, e.first_bad_position) < (best[2].layer, best[2].first_bad_position):
                        best = (i, p, e)
                    break
        return best

    def text(self) -> str:
        own = any(e.tol not in (None, self.tol) for p in self.prompts for e in p.layers)
        head = (f"verify {self.spec} on {self.checkpoint} ({self.architecture}, {self.dtype}"
                + (f", TP {self.tp}" if self.tp > 1 else "")
                + (", tolerance per layer: see the bounds note)" if own else f", tolerance {self.tol:g})"))
        if self.refused:
            return f"{head}\nREFUSED: {self.refused}\nFAIL"
        lines = [head] + ([self.reference] if self.reference else [])
        lines += [f"default DIFFERS: {d}" for d in self.defaults]
        if self.defaults_checked and not self.defaults:
            lines.append(f"defaults: the fields read absent and null agree with {self.defaults_checked}")
        lines += [f"note: {n}" for n in self.notes]
        n_layers = len(self.prompts[0].layers) if self.prompts else 0
        worst = [max((p.layers[l].max_rel for p in self.prompts), default=0.0) for l in range(n_layers)]
        if n_layers:
            lines.append("per-layer max relative error (teacher-forced, all prompts): "
                         + " ".join(f"{self.stage(l)}:{w:.1e}" for l, w in enumerate(worst)))
        for i, p in enumerate(self.prompts):
            d = p.first_token_diff
            lines.append(f"prompt {i} ({p.prompt_len} tokens): greedy tokens "
                         + ("agree" if d is None else
                            f"agree with transformers' own forward (uncached, argmax at every step); its generate "
                            f"(cached) gives {p.own_forward[1]} where that forward gives {p.own_forward[2]} at step {d}: "
                            f"transformers' cache disagrees with its own forward there" if p.own_forward else
                            f"differ from step {d}, a position whose MoE routing is within {self.dtype} rounding of "
                            f"a tie" if p.near_tie and len(p.near_tie) > 3 else
                            f"differ at a near-tie from step {d} (float32 margin {p.near_tie[1]:.3f} < "
                            f"{p.near_tie[2]:.3f}, within transformers' own {self.dtype} noise)" if p.near_tie else
                            f"DIFFER at step {d}: engine {p.engine_tokens[d:d + 4]} vs transformers {p.hf_tokens[d:d + 4]}")
                         + f"; log-probabilities max error {p.logprob_err:.1e}"
                         + ("" if p.logprob_bad_position is None else
                            f" DIFFER from position {p.logprob_bad_position} (> {p.logprob_tol or LOGPROB_TOL[self.dtype]:.2g}"
                            + ("" if any(e.first_bad_position is not None for e in p.layers) else
                               ": every layer agrees, so after the last layer: final norm, lm_head, logit scale / "
                               "soft-cap" if p.layers else ": no layer was compared, so it is not located") + ")")
                         + f"; decode steps' log-probabilities max error {p.step_logprob_err:.1e}"
                         + ("" if p.step_logprob_bad is None else
                            f" DIFFER from step {p.step_logprob_bad} (> {p.logprob_tol or LOGPROB_TOL[self.dtype]:.2g}: the decode path "
                            f"(paged attention over the cache, decode-only kernels), since the prefill's agree)"
                            if p.logprob_bad_position is None else
                            f" DIFFER from step {p.step_logprob_bad}")
                         + (f"; {p.routing_ties} positions set aside from the decode steps (MoE routing within "
                            f"{self.dtype} rounding of a tie, or after a position routed otherwise; the teacher-"
                            f"forced comparison routes as float32)" if p.routing_ties else "")
                         + (f"; ROUTING ERROR: {p.routing_error}" if p.routing_error else ""))
        first = self.first_divergence()
        if first is not None:
            i, p, e = first
            lines.append(f"first divergence: {'the final norm' if self.stage(e.layer) == 'norm' else f'layer {e.layer}'}, "
                         f"position {e.first_bad_position} (prompt {i}, "
                         f"{p.prompt_len} prompt tokens + continuation): max error {e.max_abs:.3e} "
                         f"(relative {e.max_rel:.3e} > {e.tol or self.tol:.2g})")
        lines.append("OK" if self.ok else "FAIL")
        return "\n".join(lines)

