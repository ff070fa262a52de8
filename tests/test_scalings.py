"""Scalings of the spec language on Granite's tiny checkpoint (specs/granite.yaml): the embedding `scale`, the
attention `scale`, a residual step's `scale` and the lm_head's `logit_scale`. Each arm sets one config field
back to 1 (Granite's default, a no-op): transformers' greedy tokens or log-probabilities must change (a logit
scale alone cannot change a greedy argmax), and the engine's must still agree with them, so each scaling is live
in the compiled model (the spec battery checks greedy parity with all four away from 1)."""
from __future__ import annotations

import numpy as np
import pytest

ARCH = "GraniteForCausalLM"
STEPS = 10


def _engine(ckpt, prompt):
    """(greedy tokens, the log-probability of each)."""
    from xllm_gen import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=4) as llm:
        out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
    return out.token_ids, [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]


def _hf(ckpt, prompt):
    from hf_ref import hf_greedy_logprobs

    tokens, logprobs = hf_greedy_logprobs(ckpt, prompt, STEPS)
    return tokens, [float(lp[t]) for t, lp in zip(tokens, logprobs)]


def _agree(engine, hf, what):
    assert engine[0] == hf[0], f"{what}: greedy tokens differ from transformers'"
    assert np.allclose(engine[1], hf[1], atol=1e-4), f"{what}: log-probabilities differ: {engine[1]} vs {hf[1]}"


@pytest.mark.engine
@pytest.mark.parametrize("field", ["embedding_multiplier", "attention_multiplier", "residual_multiplier",
                                   "logits_scaling"])
def test_each_scaling_matters(field, tiny_checkpoint, tmp_path):
    from fixtures.tiny_hf import edit_config

    ckpt = tiny_checkpoint(ARCH)
    prompt = np.random.default_rng(5).integers(0, 400, 11).tolist()
    base = _hf(ckpt, prompt)
    _agree(_engine(ckpt, prompt), base, "as built")

    def neutral(cfg):
        assert cfg[field] != 1.0
        cfg[field] = 1.0

    arm = edit_config(ckpt, tmp_path / field, neutral)
    want = _hf(arm, prompt)
    assert want[0] != base[0] or not np.allclose(want[1], base[1], atol=1e-3), \
        f"{field} = 1 changes nothing in transformers' output on the tiny checkpoint: no arm"
    _agree(_engine(arm, prompt), want, f"{field} = 1")
