"""Integer weight-only checkpoints, AWQ (AutoAWQ GEMM) and GPTQ (AutoGPTQ / GPTQModel), against transformers run
on the dequantized weights (float32, CPU): tiny checkpoints in the real formats, written by tests/quant_ckpt.py with
packers of their own (bit loops from the formats' definitions), greedy tokens identical.

- AWQ group 128 and 32; modules_to_not_convert; GPTQ 4-bit symmetric (v1 zeros), asymmetric gptq_v2, 8-bit,
  act-order (desc_act, g_idx), group_size -1;
- the packed path (XLLM_PACKED_QUANT=1: what CUDA runs, here F.linear on the packed weight's dequantized values):
  the same tokens, layers packed where the codes allow it (4-bit, groups in order) and dequantized otherwise;
  fp8 block-wise packed too;
- sensitivity: AWQ's nibbles in plain order, GPTQ v1 zeros read as v2 (off by one), scales of another layer:
  transformers' tokens are no longer reproduced;
- faults: a missing / mis-shaped tensor is named; unsupported settings are refused by name; a non-zero `.bias`
  of a bias-free layer is an unexpected tensor;
- TP 2 (slow): AWQ and GPTQ, dequantized and packed (column splits cut packed words, row splits follow groups).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_ref import hf_greedy
from quant_ckpt import write_awq, write_fp8_block, write_gptq
from safetensors.torch import load_file, save_file

from tests.fixtures.tiny_hf import make_tiny_qwen3

PROMPTS = [[97, 11, 187, 0, 57, 67], [3, 17, 99, 102, 7, 7, 300, 41, 5]]
N_NEW = 12
OPTS = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=8, max_model_len=256,
            enforce_eager=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    # hidden 128, q/o 4 x 32, MLP 256: every input width a multiple of 128 (group 128)
    return make_tiny_qwen3(tmp_path_factory.mktemp("qi") / "base", hidden_size=128, intermediate_size=256,
                           head_dim=32, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def awq128(base, tmp_path_factory):
    d = tmp_path_factory.mktemp("awq")
    return write_awq(base, d / "ckpt", d / "ref", group=128)


@pytest.fixture(scope="module")
def gptq32(base, tmp_path_factory):
    d = tmp_path_factory.mktemp("gptq")
    return write_gptq(base, d / "ckpt", d / "ref", bits=4, group=32, sym=True)


@pytest.fixture
def packed(monkeypatch):
    monkeypatch.setenv("XLLM_PACKED_QUANT", "1")


def _llm(path, **kw):
    from xllm_gen import LLM
    return LLM(model=str(path), **{**OPTS, **kw})


def _greedy(llm, prompts=PROMPTS, n=N_NEW):
    from xllm_gen import SamplingParams
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _layer0(llm):
    return llm.engine.runner.model.model.layers[0]


def test_awq_matches_hf(awq128):
    ckpt, ref = awq128
    assert json.loads((ckpt / "config.json").read_text())["quantization_config"]["version"] == "gemm"
    llm = _llm(ckpt)
    assert _layer0(llm).mlp.down_proj.packed is None            # CPU default: dequantized at load
    assert _greedy(llm) == hf_greedy(ref, PROMPTS, N_NEW)


@pytest.mark.parametrize("kw", [dict(bits=4, group=64, sym=False, fmt="gptq_v2"), dict(bits=8, group=128),
                                dict(bits=4, group=32, sym=False, desc_act=True), dict(bits=4, group=-1)],
                         ids=["asym_v2_g64", "8bit_g128", "desc_act_g32", "per_channel"])
def test_gptq_matches_hf(base, tmp_path, kw):
    ckpt, ref = write_gptq(base, tmp_path / "c", tmp_path / "r", **kw)
    assert _greedy(_llm(ckpt)) == hf_greedy(ref, PROMPTS, N_NEW)


def test_gptq_v1_symmetric_matches_hf(gptq32):
    ckpt, ref = gptq32
    assert _greedy(_llm(ckpt)) == hf_greedy(ref, PROMPTS, N_NEW)


def test_awq_modules_to_not_convert(base, tmp_path):
    ckpt, ref = write_awq(base, tmp_path / "c", tmp_path / "r", group=32, skip=("mlp.down_proj",))
    names = load_file(str(ckpt / "model.safetensors")).keys()
    assert "model.layers.0.mlp.down_proj.weight" in names and "model.layers.0.mlp.up_proj.qweight" in names
    assert _greedy(_llm(ckpt)) == hf_greedy(ref, PROMPTS, N_NEW)


# ---------------------------------------------------------------------------------------------- packed (CUDA's path)
def test_packed_int4_same_tokens(awq128, gptq32, packed):
    for ckpt, ref in (awq128, gptq32):
        llm = _llm(ckpt)
        lay = _layer0(llm)
        assert type(lay.mlp.down_proj.packed).__name__ == "PackedInt4" and lay.mlp.down_proj.weight.numel() == 0
        assert lay.self_attn.qkv_proj.packed.group == (128 if ckpt == awq128[0] else 32)
        assert _greedy(llm) == hf_greedy(ref, PROMPTS, N_NEW)


def test_packed_keeps_dequantized_where_codes_do_not_pack(base, tmp_path, packed):
    """8-bit and act-order layers stay dequantized (the int4 GEMM's layout is 4-bit codes, groups in order)."""
    for i, kw in enumerate((dict(bits=8, group=128), dict(bits=4, group=32, desc_act=True))):
        ckpt, ref = write_gptq(base, tmp_path / f"c{i}", tmp_path / f"r{i}", **kw)
        llm = _llm(ckpt)
        assert _layer0(llm).mlp.down_proj.packed is None
        assert _greedy(llm) == hf_greedy(ref, PROMPTS, N_NEW)


def test_packed_fp8_block_same_tokens(base, tmp_path, monkeypatch):
    ckpt, _ = write_fp8_block(base, tmp_path / "c", tmp_path / "r", (128, 128))
    want = _greedy(_llm(ckpt))
    monkeypatch.setenv("XLLM_PACKED_QUANT", "1")
    llm = _llm(ckpt)
    p = _layer0(llm).mlp.gate_up_proj.packed
    assert type(p).__name__ == "PackedFp8" and p.block == (1, 128)
    assert _greedy(llm) == want


# ---------------------------------------------------------------------------------------------- sensitivity
def test_wrong_pack_order_or_zero_offset_breaks_parity(base, tmp_path):
    _, ref = write_awq(base, tmp_path / "a", tmp_path / "ar", group=32)
    plain, _ = write_awq(base, tmp_path / "p", tmp_path / "pr", group=32, order=tuple(range(8)))
    want = hf_greedy(ref, PROMPTS, 24)
    assert _greedy(_llm(plain), n=24) != want
    _, gref = write_gptq(base, tmp_path / "g", tmp_path / "gr", bits=4, group=32, sym=False)
    v1_as_v2, _ = write_gptq(base, tmp_path / "v", tmp_path / "vr", bits=4, group=32, sym=False,
                             declared_fmt="gptq_v2")
    assert _greedy(_llm(v1_as_v2), n=24) != hf_greedy(gref, PROMPTS, 24)


def test_swapped_scales_break_parity(awq128, tmp_path):
    ckpt, ref = awq128
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    sd = load_file(str(bad / "model.safetensors"))
    a, b = "model.layers.0.mlp.up_proj.scales", "model.layers.0.mlp.gate_proj.scales"
    sd[a], sd[b] = sd[b], sd[a]
    save_file(sd, str(bad / "model.safetensors"))
    assert _greedy(_llm(bad), n=24) != hf_greedy(ref, PROMPTS, 24)


# ---------------------------------------------------------------------------------------------- faults
def _edit(src: Path, dst: Path, edit_sd=None, edit_qc=None) -> Path:
    shutil.copytree(src, dst)
    if edit_sd:
        sd = load_file(str(dst / "model.safetensors"))
        edit_sd(sd)
        save_file(sd, str(dst / "model.safetensors"))
    if edit_qc:
        cfg = json.loads((dst / "config.json").read_text())
        edit_qc(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_missing_or_misshaped_tensors_named(awq128, gptq32, tmp_path):
    ckpt, _ = awq128
    name = "model.layers.1.self_attn.k_proj.qzeros"
    with pytest.raises(ValueError, match=f"missing tensor '{name}'"):
        _llm(_edit(ckpt, tmp_path / "m", edit_sd=lambda sd: sd.pop(name)))
    sname = "model.layers.0.mlp.down_proj.scales"
    with pytest.raises(ValueError, match=rf"'{sname}' has shape \(3, 128\), expected \(2, 128\)"):
        _llm(_edit(ckpt, tmp_path / "s", edit_sd=lambda sd: sd.__setitem__(sname, torch.ones(3, 128).half())))
    gname = "model.layers.0.mlp.up_proj.g_idx"
    with pytest.raises(ValueError, match=rf"'{gname}' has shape \(7,\), expected \(128,\)"):
        _llm(_edit(gptq32[0], tmp_path / "g", edit_sd=lambda sd: sd.__setitem__(gname, torch.zeros(7, dtype=torch.int32))))
    noqc = tmp_path / "noqc"
    shutil.copytree(ckpt, noqc)
    cfg = json.loads((noqc / "config.json").read_text())
    cfg.pop("quantization_config")
    (noqc / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.q_proj.qweight' is a packed integer weight.*"
                                         r"missing"):
        _llm(noqc)


def test_act_order_without_g_idx_refused(gptq32, tmp_path):
    """desc_act=true promises a `.g_idx` per layer (the group of each input row); one stripped would be read as
    groups in order, wrong tokens without a word: refused naming the tensor. AutoGPTQ's static_groups with
    desc_act writes a g_idx of groups in order: served as transformers on the dequantized weights."""
    ckpt, ref = gptq32
    gname = "model.layers.1.mlp.down_proj.g_idx"
    bad = _edit(ckpt, tmp_path / "b", edit_sd=lambda sd: sd.pop(gname), edit_qc=lambda qc: qc.update(desc_act=True))
    with pytest.raises(ValueError, match=rf"missing tensor '{gname}': gptq desc_act=true"):
        _llm(bad)
    static = _edit(ckpt, tmp_path / "s", edit_qc=lambda qc: qc.update(desc_act=True, static_groups=True))
    assert _greedy(_llm(static)) == hf_greedy(ref, PROMPTS, N_NEW)


def test_nonzero_bias_of_bias_free_layer_is_unexpected(gptq32, tmp_path):
    ckpt, _ = gptq32
    name = "model.layers.0.mlp.down_proj.bias"
    assert name in load_file(str(ckpt / "model.safetensors"))             # zeros: consumed
    bad = _edit(ckpt, tmp_path / "b", edit_sd=lambda sd: sd.__setitem__(name, torch.ones(128).half()))
    with pytest.raises(ValueError, match=f"unexpected tensor.*{name}"):
        _llm(bad)


@pytest.mark.parametrize("edit,needle", [
    (lambda qc: qc.update(version="gemv"), "version='gemv'"),
    (lambda qc: qc.update(zero_point=False), "zero_point=false"),
    (lambda qc: qc.update(bits=3), "bits=3"),
    (lambda qc: qc.update(group_size=100), "group_size=100"),
    (lambda qc: qc.update(fuse_everything=True), "fuse_everything"),
])
def test_awq_unsupported_settings_refused(awq128, tmp_path, edit, needle):
    with pytest.raises(ValueError, match=needle):
        _llm(_edit(awq128[0], tmp_path / "x", edit_qc=edit))


@pytest.mark.parametrize("edit,needle", [
    (lambda qc: qc.update(checkpoint_format="marlin"), "checkpoint_format='marlin'"),
    (lambda qc: qc.update(bits=3), "bits=3"),
    (lambda qc: qc.update(lm_head=True), "lm_head=true"),
    (lambda qc: qc.update(desc_act="yes"), "desc_act='yes'"),
])
def test_gptq_unsupported_settings_refused(gptq32, tmp_path, edit, needle):
    with pytest.raises(ValueError, match=needle):
        _llm(_edit(gptq32[0], tmp_path / "x", edit_qc=edit))


# ---------------------------------------------------------------------------------------------- TP 2
@pytest.mark.slow
@pytest.mark.parametrize("pack", [False, True], ids=["dequantized", "packed"])
def test_tp2_awq_gptq(awq128, base, tmp_path, monkeypatch, pack):
    """Column splits cut packed words (k/v 64 rows over 2 ranks: 32 each; AWQ packs 8 output columns a word), row
    splits fall on groups (o_proj / down_proj inputs 128 / 256 over 2 ranks, groups of 32 / 64 / 128 whole or the
    layer dequantized). The packed arm runs in the ranks' processes: XLLM_PACKED_QUANT in the environment."""
    monkeypatch.setenv("XLLM_PACKED_QUANT", "1" if pack else "0")
    cases = [awq128, write_gptq(base, tmp_path / "g", tmp_path / "gr", bits=4, group=32, sym=False),
             write_gptq(base, tmp_path / "d", tmp_path / "dr", bits=4, group=64, desc_act=True)]
    for ckpt, ref in cases:
        llm = _llm(ckpt, tensor_parallel_size=2)
        try:
            assert _greedy(llm) == hf_greedy(ref, PROMPTS, N_NEW), ckpt
        finally:
            llm.shutdown()


# ---------------------------------------------------------------------------------------------- dummy quantization
@pytest.mark.parametrize("kind", ["int4", "fp8", "fp8_block"])
def test_dummy_quantize_for_benchmarks(base, kind):
    """load_format=dummy + _debug dummy_quantize (bench/bench_quant.py --e2e): every linear layer quantized in place;
    packed or dequantized, the same model output."""
    import copy

    from xllm_gen.runtime.layers.quant_linear import quantize_dummy
    llm = _llm(base, load_format="dummy", _debug={"dummy_quantize": kind})
    w = _layer0(llm).mlp.down_proj.weight                       # CPU: written back dequantized
    vals = [len(torch.unique(w[r, g * 128:(g + 1) * 128])) for r in range(4) for g in range(2)]
    assert max(vals) <= (16 if kind == "int4" else 256) and max(vals) > 4
    assert len(_greedy(llm, n=4)[0]) == 4
    llm.shutdown()
    from xllm_gen.runtime.layers.linear import ReplicatedLinear
    lin = torch.nn.Module()
    lin.a = ReplicatedLinear(256, 128)
    torch.nn.init.normal_(lin.a.weight, std=0.02)
    ref = copy.deepcopy(lin)
    assert quantize_dummy(lin, kind, pack=True) == 1 and quantize_dummy(ref, kind, pack=False) == 1
    assert lin.a.packed is not None and lin.a.weight.numel() == 0 and ref.a.packed is None
    if kind == "fp8_block":         # one scale per 128 x 128 block, held per row and 128 columns
        sc = lin.a.packed.scale
        assert lin.a.packed.block == (1, 128) and sc.shape == (128, 2) and torch.equal(sc, sc[:1].expand(128, 2))
        assert sc[0, 0] != sc[0, 1] and lin.a.act_quant is not None and lin.a.act_quant.group == 128
    x = torch.randn(3, 256)
    assert torch.equal(lin.a(x), ref.a(x))
    # a skipped subtree (bench_vl's vision tower, kept bf16 as in the *-FP8 releases) is left as it is
    two = torch.nn.Module()
    two.model = torch.nn.Module()
    two.model.visual, two.model.lm = torch.nn.Module(), ReplicatedLinear(256, 128)
    two.model.visual.proj = ReplicatedLinear(256, 128)
    for m in (two.model.lm, two.model.visual.proj):     # the layers' weights are uninitialized memory (NaN != NaN)
        torch.nn.init.normal_(m.weight, std=0.02)
    before = two.model.visual.proj.weight.clone()
    assert quantize_dummy(two, kind, pack=True, skip=["visual"]) == 1         # model.visual: at any depth
    assert two.model.lm.packed is not None and two.model.visual.proj.packed is None
    assert torch.equal(two.model.visual.proj.weight, before)


@pytest.mark.parametrize("kind", ["fp8", "fp8_block", "int4"])
def test_dummy_quantize_experts(kind):
    """dummy_quantize of a FusedMoE (bench_quant --e2e on an MoE): the stacked experts as float8, a scale per row and
    128 columns (fp8_block: one per 128 x 128 block) or per row (fp8), or 4-bit codes two to a byte with a zero and a
    scale per row and 128 columns (int4); kept packed or written back dequantized, the same output; fp8_block
    quantizes the experts' input and intermediate as the FP8 releases."""
    import copy

    from xllm_gen.runtime import layers as L
    from xllm_gen.runtime.layers.quant_linear import quantize_dummy
    torch.manual_seed(0)
    moe = L.FusedMoE(4, 256, 128, 2, True, "silu")
    for p in (moe.gate_up_proj, moe.down_proj):
        torch.nn.init.normal_(p, std=0.05)
    ref, orig = copy.deepcopy(moe), moe.down_proj.detach().clone()
    assert quantize_dummy(moe, kind, pack=True) == 1 and quantize_dummy(ref, kind, pack=False) == 1
    codes, scale, bk, *zeros = moe.packed["gate_up_proj"]
    assert moe.gate_up_proj.numel() == 0 and ref.packed is None
    assert codes.dtype == (torch.uint8 if kind == "int4" else torch.float8_e4m3fn)
    if kind == "int4":
        assert bk == 128 and codes.shape == (4, 256, 128) and zeros[0].shape == scale.shape == (4, 256, 2)
    elif kind == "fp8_block":
        assert bk == 128 and scale.shape == (4, 256, 2) and torch.equal(scale[:, :128], scale[:, :1].expand(4, 128, 2))
        assert moe.act_quant.group == 128 and moe.act_quant_down.group == 128
    else:
        assert bk == 256 and scale.shape == (4, 256, 1) and moe.act_quant is None
    tol = dict(rtol=0, atol=0.03) if kind == "int4" else dict(rtol=0.07, atol=1e-3)     # half a 4-bit step
    assert not torch.equal(ref.down_proj, orig) and torch.allclose(ref.down_proj, orig, **tol)
    x, logits = torch.randn(5, 256), torch.randn(5, 4)
    assert torch.equal(moe(x, logits), ref(x, logits))
