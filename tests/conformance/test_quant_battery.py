"""Quantization is a property of the layer kinds and the loader, not of a spec: every served family's tiny
checkpoint, its linear layers' weights quantized as llm-compressor writes them (compressed-tensors float-quantized
FP8, per-channel scales; the layers are transformers' `nn.Linear` modules but the lm_head, as its `targets: [Linear]`
picks them), serves the same greedy tokens as transformers on the dequantized weights (float32, CPU):

- W8A16 (weights only) and GPTQ int4 (weights only, where the shapes pack): every family;
- FP8_DYNAMIC (activations quantized per token): transformers' quantized modules get the same quantization of
  their input by forward pre-hooks (tests/quant_ckpt.py emulate), the modules transformers calls (a weight its
  parent reads directly is left unquantized: `_called`); a family whose spec holds one of those weights outside a
  linear layer is refused naming the tensor (its input cannot be quantized there), never served wrong.

Families whose transformers model has no nn.Linear (GPT-2's Conv1D) have nothing llm-compressor would quantize.
Default run: a set of families that together use every runtime layer helper (`_layer_cover`), FP8_DYNAMIC and the
experts arm; all families, W8A16 and GPTQ with --runslow.
"""
from __future__ import annotations

import os

import pytest
import torch
from hf_ref import hf_model
from quant_ckpt import emulate, hf_linear_tensors, write_ct_fp8
from test_spec_battery import DEFAULT_PROMPT_LENS, Tokens, _assert_same

from conformance import families as F

PLANS = [p for p in F.served_plans() if p.error is None and p.status == "served"]


def _layer_cover(plans) -> set[str]:
    """The default arm: families chosen greedily until every runtime layer helper (`L.<name>(` in a generated
    model.py) that any served family uses is used by one of them (19 of 132 families at the time of writing);
    the other families run with --runslow."""
    import re
    from pathlib import Path
    uses = {p.spec.name: set(re.findall(r"\bL\.(\w+)\(", (Path(F.ROOT) / "generated" / p.spec.name / "model.py")
                                        .read_text())) for p in plans}
    left, chosen = set().union(*uses.values()), set()
    while left:
        best = max(sorted(uses), key=lambda n: len(uses[n] & left))
        chosen.add(best)
        left -= uses[best]
    return chosen


_DEFAULT = _layer_cover(PLANS)
CASES = [pytest.param(p, id=p.spec.name, marks=() if p.spec.name in _DEFAULT else pytest.mark.slow) for p in PLANS]


@pytest.fixture(scope="module")
def tokens(request) -> Tokens:
    """The default run compares two of the battery's four prompts (all with --runslow)."""
    full = request.config.getoption("--runslow") or os.environ.get("XLLM_RUN_SLOW") == "1"
    return Tokens() if full else Tokens(DEFAULT_PROMPT_LENS)


def _called(ckpt, linears: dict) -> dict:
    """The entries of `linears` whose transformers modules are all called in a forward pass: a module whose weight the
    parent reads directly (LongCat-Flash's router: F.linear(x.float(), classifier.weight.float())) takes no
    activation quantization in transformers, nor could it take a quantized weight there: left unquantized."""
    from hf_ref import hf_prefill_logits
    from test_spec_battery import _requests
    mods = dict(hf_model(ckpt).named_modules())
    called: set = set()
    handles = [mods[m].register_forward_pre_hook(lambda mod, args, m=m: called.add(m))
               for ms in linears.values() for m in ms]
    try:
        hf_prefill_logits(ckpt, next(r["prompt_token_ids"] for r in _requests(ckpt) if "prompt_token_ids" in r))
    finally:
        for h in handles:
            h.remove()
    return {t: ms for t, ms in linears.items() if set(ms) <= called}


def _quantized(plan, tiny_checkpoint, tmp_path, act):
    base = tiny_checkpoint(plan.family.architecture)
    linears = hf_linear_tensors(base) if act is None else _called(base, hf_linear_tensors(base))
    if not linears:
        pytest.skip(f"{plan.family.architecture}: transformers' model has no nn.Linear weight (nothing to quantize)")
    ckpt, ref = write_ct_fp8(base, tmp_path / "ckpt", tmp_path / "ref", act=act, linears=set(linears))
    return ckpt, ref, linears


@pytest.mark.slow      # by default the FP8_DYNAMIC arm loads the same fp8 weight views
@pytest.mark.engine
@pytest.mark.parametrize("plan", CASES)
def test_w8a16_every_family(plan, tiny_checkpoint, tokens, tmp_path):
    ckpt, ref, linears = _quantized(plan, tiny_checkpoint, tmp_path, None)
    _assert_same(tokens.engine(ckpt, 1), tokens.hf(ref),
                 f"{plan.spec.name} ({plan.family.architecture}) W8A16 fp8, {len(linears)} tensors")


@pytest.mark.slow      # by default tests/test_quant_int.py reads GPTQ through the same IntWeightView
@pytest.mark.engine
@pytest.mark.parametrize("plan", CASES)
def test_gptq_int4_every_family(plan, tiny_checkpoint, tokens, tmp_path):
    """GPTQ int4 (symmetric, group 16, zeros stored minus one) on the linear weights whose shapes GPTQ packs (input
    features a multiple of 16, output features of 8): weights only, greedy tokens equal."""
    from quant_ckpt import write_gptq
    from safetensors import safe_open
    base = tiny_checkpoint(plan.family.architecture)
    with safe_open(str(base / "model.safetensors"), "pt") as f:
        shapes = {k[: -len(".weight")]: f.get_slice(k).get_shape() for k in f.keys() if k.endswith(".weight")}
    linears = {t for t in hf_linear_tensors(base) if shapes[t][1] % 16 == 0 and shapes[t][0] % 8 == 0}
    if not linears:
        pytest.skip(f"{plan.family.architecture}: no nn.Linear weight GPTQ can pack")
    ckpt, ref = write_gptq(base, tmp_path / "ckpt", tmp_path / "ref", group=16, linears=linears)
    _assert_same(tokens.engine(ckpt, 1), tokens.hf(ref),
                 f"{plan.spec.name} ({plan.family.architecture}) GPTQ int4, {len(linears)} tensors")


@pytest.mark.engine
@pytest.mark.parametrize("plan", CASES)
def test_w8a16_experts_every_moe_family(plan, tiny_checkpoint, tokens, tmp_path):
    """An MoE family's per-expert 2-D checkpoint tensors (transformers holds them as stacked 3-D parameters, not
    nn.Linear: the arms above leave them float) quantized weight-only: they load into the stacked experts (any
    layout the spec's weights section reads: per expert, segments, transposed) and serve transformers' tokens."""
    from safetensors import safe_open
    base = tiny_checkpoint(plan.family.architecture)
    covered = set(hf_linear_tensors(base))
    with safe_open(str(base / "model.safetensors"), "pt") as f:
        experts = {k[: -len(".weight")] for k in f.keys() if ".experts." in k and k.endswith(".weight")
                   and len(f.get_slice(k).get_shape()) == 2 and k[: -len(".weight")] not in covered}
    if not experts:
        pytest.skip(f"{plan.family.architecture}: no per-expert 2-D tensor outside transformers' nn.Linear layers")
    ckpt, ref = write_ct_fp8(base, tmp_path / "ckpt", tmp_path / "ref", act=None, linears=experts)
    _assert_same(tokens.engine(ckpt, 1), tokens.hf(ref),
                 f"{plan.spec.name} ({plan.family.architecture}) W8A16 experts, {len(experts)} tensors")


# an fp8 rounding flip: a value one float ulp from an e4m3 rounding boundary (or a row's amax one ulp apart) rounds
# the other way in transformers' and the engine's arithmetic, and that element moves by up to 1/16; after a few
# layers (squared activations, a tiny model's small margins) the logits can move by 1e-2. About one family in ten
# meets one on a given prompt; on two prompts at once, about one in a hundred, while a quantization missing or
# misplaced in the engine shows on every prompt (the error then is that of transformers without it)
PROMPTS_CHECKED = (30, 17, 9)
TOL = 2e-3


@pytest.mark.engine
@pytest.mark.parametrize("plan", CASES)
def test_fp8_dynamic_every_family(plan, tiny_checkpoint, tmp_path):
    """Prefill logits within float rounding of transformers' with the same quantization (on the best of the
    battery's prompts of 30, 17 and 9 tokens: see PROMPTS_CHECKED), and far from transformers' without it (the engine
    does quantize). Prefill, not greedy tokens: a batch's GEMMs, and the decode path's, may round a row differently
    by an ulp, which the fp8 rounding of the next input can turn into another token (vLLM's batch variance too)."""
    from hf_ref import hf_prefill_logits
    from test_spec_battery import _requests

    from xllm_gen import LLM
    ckpt, ref, linears = _quantized(plan, tiny_checkpoint, tmp_path, "token")
    prompts = {len(r["prompt_token_ids"]): r["prompt_token_ids"] for r in _requests(ckpt) if "prompt_token_ids" in r}
    try:
        llm = LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=4)
    except Exception as e:          # noqa: BLE001 - only the named refusal is accepted
        assert "its input cannot be quantized as the format says" in str(e), e
        return
    with llm:
        got = {n: torch.as_tensor(llm.prefill_logits(prompts[n])).float() for n in PROMPTS_CHECKED}
    plain = {n: hf_prefill_logits(ref, prompts[n]) for n in PROMPTS_CHECKED}
    model = hf_model(ref)
    mods = dict(model.named_modules())
    handles = [mods[m].register_forward_pre_hook(lambda mod, args: (emulate(args[0], "token"),) + tuple(args[1:]))
               for ms in linears.values() for m in ms]
    try:
        want = {n: hf_prefill_logits(ref, prompts[n]) for n in PROMPTS_CHECKED}
    finally:
        for h in handles:
            h.remove()

    def rel(a, b):
        return ((a[:, : b.shape[1]] - b).abs().max() / b.abs().max()).item()
    err = {n: rel(got[n], want[n]) for n in PROMPTS_CHECKED}
    err_plain = {n: rel(got[n], plain[n]) for n in PROMPTS_CHECKED}
    best = min(err, key=err.get)
    assert err[best] < TOL and err_plain[best] > 10 * max(err[best], 1e-6), (
        f"{plan.spec.name} ({plan.family.architecture}) FP8_DYNAMIC, {len(linears)} tensors: relative logit error "
        f"per prompt length {err} (against transformers without activation quantization: {err_plain})")
