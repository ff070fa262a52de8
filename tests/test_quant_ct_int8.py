"""compressed-tensors `int-quantized` checkpoints (llm-compressor's W8A8 / W8A16 int8, what RedHatAI's
*-quantized.w8a8 releases are), written and decompressed by the compressed-tensors library (tests/quant_ckpt.py
write_ct_int8), against transformers on the library's decompressed weights (float32, CPU), with the int8 activation
quantization emulated by forward pre-hooks written apart from the runtime (quant_ckpt.emulate_int8: vLLM's int8
semantics, scale amax / 127 per token or the checkpoint's static input_scale, round half to even).

- W8A16 per channel: greedy tokens identical; W8A8 dynamic per token (per-tensor weights too) and static per tensor:
  greedy tokens identical and logits within float rounding of the hooked reference;
- sensitivity: the same W8A8 checkpoint against transformers without the activation hooks differs (the engine
  quantizes its activations), and weight scales dropped to 1 break it;
- faults: a missing weight_scale / input_scale is named; asymmetric activations and 4-bit int-quantized weights are
  refused by name.
"""
from __future__ import annotations

import pytest
import torch
from hf_ref import hf_greedy, hf_model, hf_prefill_logits
from safetensors.torch import load_file

from tests.fixtures.tiny_hf import make_tiny_qwen3

pytest.importorskip("compressed_tensors")
from quant_ckpt import calibrate_input_scales, edit_ckpt, int8_act_hooks, write_ct_int8  # noqa: E402

pytestmark = pytest.mark.engine

PROMPTS = [[97, 11, 187, 0, 57, 67], [3, 17, 99, 102, 7, 7, 300, 41, 5]]
N_NEW = 12
TOL_SAME = 1e-3     # the reference quantizes the same linear inputs the same way: float rounding only
OPTS = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=8, max_model_len=256,
            enforce_eager=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("cti8") / "base", hidden_size=128, intermediate_size=256,
                           head_dim=32, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def w8a8(base, tmp_path_factory):
    d = tmp_path_factory.mktemp("w8a8")
    return write_ct_int8(base, d / "ckpt", d / "ref", strategy="channel", act="token")


def _llm(path, **kw):
    from xllm_gen import LLM
    return LLM(model=str(path), **{**OPTS, **kw})


def _greedy(llm):
    from xllm_gen import SamplingParams
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _reference(ref, kind, scales=None):
    """transformers' greedy tokens and the second prompt's logits, its linear inputs quantized (kind) or not."""
    handles = int8_act_hooks(hf_model(ref), kind, scales) if kind else []
    try:
        return hf_greedy(ref, PROMPTS, N_NEW), hf_prefill_logits(ref, PROMPTS[1])
    finally:
        for h in handles:
            h.remove()


def _check(ckpt, ref, kind, scales=None, act_repr=None):
    want, logits = _reference(ref, kind, scales)
    llm = _llm(ckpt)
    try:
        if act_repr is not None:
            assert repr(llm.engine.runner.model.model.layers[0].mlp.down_proj.act_quant).startswith(act_repr)
        got = _greedy(llm)
        err = (llm.prefill_logits(PROMPTS[1]) - logits).abs().max().item() / logits.abs().max().item()
    finally:
        llm.shutdown()
    assert got == want and err < TOL_SAME, err


def test_w8a16_channel(base, tmp_path):
    ckpt, ref = write_ct_int8(base, tmp_path / "c", tmp_path / "r", strategy="channel", act=None)
    assert load_file(str(ckpt / "model.safetensors"))["model.layers.0.mlp.up_proj.weight"].dtype == torch.int8
    _check(ckpt, ref, None, act_repr="None")


def test_w8a8_dynamic_per_token(w8a8):
    _check(*w8a8, "token", act_repr="ActQuant(int8_token)")


@pytest.mark.slow
def test_w8a8_tensor_weights(base, tmp_path):
    ckpt, ref = write_ct_int8(base, tmp_path / "c", tmp_path / "r", strategy="tensor", act="token")
    _check(ckpt, ref, "token")


def test_w8a8_static_input_scales(base, tmp_path):
    scales = {n: s * 448.0 / 127.0 for n, s in           # amax / 127 over a calibration pass
              calibrate_input_scales(hf_model(base), torch.tensor([PROMPTS[0] + PROMPTS[1]])).items()}
    ckpt, ref = write_ct_int8(base, tmp_path / "c", tmp_path / "r", strategy="channel", act="static",
                              input_scales=scales)
    _check(ckpt, ref, "static", scales, act_repr="ActQuant(int8_static")


def test_activations_and_scales_matter(w8a8, tmp_path):
    """Against transformers without the activation hooks the engine's logits differ (it quantizes its inputs);
    weight scales of 1 break the tokens."""
    ckpt, ref = w8a8
    _, plain = _reference(ref, None)
    want, _ = _reference(ref, "token")
    llm = _llm(ckpt)
    try:
        assert (llm.prefill_logits(PROMPTS[1]) - plain).abs().max().item() > 10 * TOL_SAME * plain.abs().max().item()
    finally:
        llm.shutdown()

    def unit_scales(sd):
        for k in [k for k in sd if k.endswith("weight_scale")]:
            sd[k] = torch.ones_like(sd[k])

    llm = _llm(edit_ckpt(ckpt, tmp_path / "u", tensors=unit_scales))
    try:
        assert _greedy(llm) != want
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tensors,qc,needle", [
    (lambda sd: sd.pop("model.layers.1.mlp.down_proj.weight_scale"), None,
     r"missing tensor 'model\.layers\.1\.mlp\.down_proj\.weight_scale': the scale of the int8 weight"),
    (None, lambda qc: qc["config_groups"]["group_0"]["input_activations"].__setitem__("symmetric", False),
     r"input_activations\.symmetric=False is not supported"),
    (None, lambda qc: qc["config_groups"]["group_0"]["weights"].__setitem__("num_bits", 4),
     r"weights\.num_bits=4 is not supported"),
])
def test_faults_named(w8a8, tmp_path, tensors, qc, needle):
    with pytest.raises(ValueError, match=needle):
        _llm(edit_ckpt(w8a8[0], tmp_path / "x", tensors=tensors, qc=qc))


@pytest.mark.slow
def test_tp2(base, w8a8, tmp_path):
    """TP 2: weight-only int8 gives transformers' tokens; W8A8's row-parallel layers quantize each rank's own input
    columns per token (as vLLM's kernels), so it stays within the activation-quantization tolerance of the hooked
    reference, not bit for bit."""
    ckpt, ref = write_ct_int8(base, tmp_path / "c", tmp_path / "r", strategy="channel", act=None)
    llm = _llm(ckpt, tensor_parallel_size=2)
    try:
        assert _greedy(llm) == hf_greedy(ref, PROMPTS, N_NEW)
    finally:
        llm.shutdown()
    _, logits = _reference(w8a8[1], "token")
    llm = _llm(w8a8[0], tensor_parallel_size=2)
    try:
        err = (llm.prefill_logits(PROMPTS[1]) - logits).abs().max().item() / logits.abs().max().item()
    finally:
        llm.shutdown()
    assert err < 0.1, err
