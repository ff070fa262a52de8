"""The conformance battery over transformers: every decoder-only family that transformers ships and a spec in
specs/ claims (found by enumeration and globbing, nothing listed per family) is checked with its features ON.

For each served family (tests/conformance/families.py):
  - every feature toggle the spec's config guard refuses must be refused by name (the message names the
    field): recorded as "refused" in docs/coverage.md, not a failure;
  - a tiny checkpoint with every accepted toggle ON: greedy parity with transformers (float32, CPU; the spec
    battery's prompts of 3, 9, 17, 30 tokens (by default 3 and 30: the rest with `--runslow`), 16 new tokens, block
    size 4) at TP 1, and TP 2 (`--runslow`), and
    the same log-probabilities at every step (the engine's top 5 against HF's log_softmax, 1e-3 nats);
    and the features must matter: transformers' own tokens differ from the default tiny checkpoint's;
  - slow: each accepted toggle alone (a sensitivity arm per feature): transformers' tokens change (a toggle
    that does not change them fails: the fixture would test nothing; a monotone map of the final logits, which
    greedy tokens cannot show, must change transformers' log-probabilities instead), and the engine still agrees,
    tokens and log-probabilities.
The default tiny configs are the spec battery's business (tests/test_spec_battery.py).
"""
from __future__ import annotations

import os

import pytest
from test_spec_battery import DEFAULT_PROMPT_LENS, Tokens, _assert_same, engine_or_tp_refusal

from conformance import families as F

PLANS = F.served_plans()


@pytest.fixture(scope="module")
def tokens(request) -> Tokens:
    """Every served family keeps its features-ON parity in the default run, over two of the four prompts."""
    full = request.config.getoption("--runslow") or os.environ.get("XLLM_RUN_SLOW") == "1"
    return Tokens() if full else Tokens(DEFAULT_PROMPT_LENS)


def _id(p: F.Plan) -> str:
    return p.spec.name if p.spec else p.family.architecture


def test_enumeration_finds_decoder_families():
    """The enumeration is transformers', filtered by rules: known decoders in, encoders / seq2seq / VL out."""
    names = {f.architecture for f in F.decoder_families()}
    assert {"LlamaForCausalLM", "GPT2LMHeadModel", "MambaForCausalLM", "Gemma3ForCausalLM"} <= names
    assert not names & {"BertLMHeadModel", "BartForCausalLM", "WhisperForCausalLM", "Gemma3ForConditionalGeneration",
                        "MllamaForCausalLM", "TrOCRForCausalLM"}
    # every spec architecture is either enumerated or listed apart (vision-language / not shipped)
    other = {a for a, _ in F.other_served()}
    for s in F.specs():
        for a in s.architectures:
            assert a in names or a in other


@pytest.mark.parametrize("plan", PLANS, ids=[_id(p) for p in PLANS])
def test_refusals_name_the_field(plan):
    assert plan.error is None, plan.error
    assert plan.base_refused is None or plan.spec.rel.split("/")[-1] in plan.base_refused
    for toggle, msg in plan.refused:
        assert toggle.field in msg, f"{plan.spec.rel}: {toggle.name} refused without naming {toggle.field}: {msg}"


# families whose transformers reference generates without a cache here (minutes at 4 prompts x 16 tokens on two
# cores): their features-ON TP 1 arm is slow, and a short features-ON arm runs by default in the named test
SHORT_ARM_ELSEWHERE = {
    # transformers 5.25 cannot build a cache of DeltaNet layers only: ~200 s under load
    "Qwen4ExpForCausalLM": "tests/test_hyper_connections.py::test_qwen4_exp_features_on_short",
}


def _features_on_cases():
    cases = []
    for p in PLANS:
        slow1 = p.family.architecture in SHORT_ARM_ELSEWHERE
        cases.append(pytest.param(p, 1, id=f"{_id(p)}-tp1", marks=pytest.mark.slow if slow1 else ()))
        cases.append(pytest.param(p, 2, id=f"{_id(p)}-tp2", marks=pytest.mark.slow))
    return cases


@pytest.mark.engine
@pytest.mark.parametrize("plan, tp", _features_on_cases())
def test_features_on_parity(plan, tp, tiny_checkpoint, tokens):
    assert plan.error is None, plan.error
    if plan.status != "served":
        pytest.skip(f"refused by the config guard: {plan.base_refused}")
    if not plan.accepted:
        pytest.skip("no feature toggle accepted: the spec battery covers the default tiny config")
    arch = plan.family.architecture
    ckpt = tiny_checkpoint(arch, overrides=plan.overrides)
    want = tokens.hf(ckpt)
    got = engine_or_tp_refusal(tokens, ckpt, tp, plan.spec)
    if got is not None:
        what = f"{plan.spec.name} ({arch}) features ON {[t.name for t in plan.accepted]} tp={tp}"
        _assert_same(got, want, what)
        tokens.assert_same_distribution(ckpt, tp, what)


@pytest.mark.slow      # a second transformers run per family (the default config): half the battery's time
@pytest.mark.engine
@pytest.mark.parametrize("plan", [pytest.param(p, id=_id(p)) for p in PLANS])
def test_features_on_change_transformers_tokens(plan, tiny_checkpoint, tokens):
    """The battery's own sensitivity: the features ON change transformers' tokens on the tiny checkpoint, so the
    parity above compares something the features decide (each feature alone: test_each_feature_matters_and_agrees)."""
    if plan.error is not None or plan.status != "served" or not plan.accepted:
        pytest.skip("no features-ON parity for this family")
    arch = plan.family.architecture
    assert tokens.hf(tiny_checkpoint(arch, overrides=plan.overrides)) != tokens.hf(tiny_checkpoint(arch)), (
        f"fixture: the features ON ({[t.name for t in plan.accepted]}) do not change transformers' tokens")


# fields whose effect is a monotone map of the final logits: greedy tokens cannot show them, the log-probabilities do
MONOTONE_ON_LOGITS = ("final_logit_softcapping", "logits_soft_cap", "logits_scaling", "logit_scale",
                      "lm_head_multiplier")     # FalconH1's (positive) logit multiplier

# (architecture, field): the field's effect is a per-token positive scale of a block's output that the norm after it
# cancels (an RMSNorm is scale-invariant up to its eps): greedy tokens cannot show it (the engine still applies it)
ERASED_BY_A_NORM = {
    # top-k renormalization scales the routed sum per token; no shared expert, then post_feedforward_layernorm
    ("BeamForCausalLM", "norm_topk_prob"),
    ("FlexOlmoForCausalLM", "norm_topk_prob"),     # the same: post-norm layers, no shared expert
}

SENSITIVITY = [pytest.param(p, t, id=f"{_id(p)}-{t.name.split('=')[0]}") for p in PLANS for t in p.accepted]


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("plan, toggle", SENSITIVITY)
def test_each_feature_matters_and_agrees(plan, toggle, tiny_checkpoint, tokens):
    arch = plan.family.architecture
    ckpt = tiny_checkpoint(arch, overrides=toggle.overrides)
    want = tokens.hf(ckpt)
    if want == tokens.hf(tiny_checkpoint(arch)):
        import fnmatch
        ignored = F.generated_model(plan.spec).CONFIG_IGNORE
        if any(fnmatch.fnmatchcase(toggle.field, pat) for pat in ignored):
            # transformers itself ignores the field (Gemma 3's attn_logit_softcapping) and so does the spec,
            # declared in its config_ignore: the engine must not change either
            _assert_same(tokens.engine(ckpt, 1), want, f"{plan.spec.name} ({arch}) {toggle.name} (ignored) tp=1")
            return
        if toggle.field in MONOTONE_ON_LOGITS:
            # greedy tokens cannot show it, the log-probabilities must: HF's change, and the engine's follow
            import torch
            pairs = [(a, b) for ra, rb in zip(tokens.hf_logprobs(ckpt), tokens.hf_logprobs(tiny_checkpoint(arch)))
                     if ra is not None for a, b in zip(ra, rb)]
            assert pairs and any(not torch.allclose(a, b, atol=1e-3) for a, b in pairs), \
                f"{toggle.name} alone changes neither transformers' tokens nor its log-probabilities"
            tokens.assert_same_distribution(ckpt, 1, f"{plan.spec.name} ({arch}) {toggle.name} tp=1")
            return
        if (arch, toggle.field) in ERASED_BY_A_NORM:
            pytest.xfail(f"{toggle.name}: a per-token scale that the next RMSNorm cancels cannot change greedy tokens")
        pytest.fail(f"{toggle.name} alone does not change transformers' tokens on the tiny checkpoint")
    _assert_same(tokens.engine(ckpt, 1), want, f"{plan.spec.name} ({arch}) {toggle.name} tp=1")
    tokens.assert_same_distribution(ckpt, 1, f"{plan.spec.name} ({arch}) {toggle.name} tp=1")
