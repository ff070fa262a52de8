"""A quantized vision-language checkpoint (Qwen3-VL in the Qwen3-*-FP8 block format), every transformers nn.Linear
but the lm_head quantized: the text decoder's projections, and the vision tower's attention / MLP and its mergers
(recipes that quantize the vision encoder, e.g. ModelOpt's FP8 vision recipes; the official releases differ in
what they leave out, and the loader follows the tensors). Prefill logits of an image request match transformers on
the dequantized weights with the same activation quantization hooked onto the same modules (float32, CPU);
leaving the vision tower's activation quantization out of the reference moves it (the engine quantizes there).
"""
from __future__ import annotations

import pytest
import torch
from hf_ref import hf_model, hf_vl_prefill_logits
from quant_ckpt import emulate, hf_linear_tensors, write_fp8_block
from test_parity_qwen3_vl import REQUESTS, _hf_inputs

pytestmark = pytest.mark.vl

BLOCK = (16, 16)


@pytest.fixture(scope="module")
def quantized_vl(qwen3_vl_tied, tmp_path_factory):
    d = tmp_path_factory.mktemp("vl_fp8")
    linears = hf_linear_tensors(qwen3_vl_tied)
    ckpt, ref = write_fp8_block(qwen3_vl_tied, d / "ckpt", d / "ref", BLOCK, linears=set(linears))
    return ckpt, ref, linears


def _reference(ref, linears, only=lambda module: True):
    mods = dict(hf_model(ref).named_modules())
    handles = [mods[m].register_forward_pre_hook(
        lambda mod, args: (emulate(args[0], "group", BLOCK[1]),) + tuple(args[1:]))
        for ms in linears.values() for m in ms if only(m)]
    try:
        return hf_vl_prefill_logits(ref, _hf_inputs(ref, REQUESTS["image"]))
    finally:
        for h in handles:
            h.remove()


@pytest.mark.engine
def test_fp8_block_vl_vision_and_text(quantized_vl, make_llm):
    ckpt, ref, linears = quantized_vl
    vision = [t for t in linears if "visual" in t]
    assert vision and len(vision) < len(linears), sorted(linears)
    llm = make_llm(ckpt)
    got = torch.as_tensor(llm.prefill_logits(REQUESTS["image"])).float().cpu()
    want = _reference(ref, linears)
    text_only = _reference(ref, linears, only=lambda m: "visual" not in m)
    err = ((got - want).abs().max() / want.abs().max()).item()
    err_text_only = ((got - text_only).abs().max() / text_only.abs().max()).item()
    print(f"\n[vl fp8] relative logit error {err:.2e}; reference without the vision tower's quantization "
          f"{err_text_only:.2e}")
    assert err < 2e-3 and err_text_only > 10 * max(err, 1e-6), (err, err_text_only)
