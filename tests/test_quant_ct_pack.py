"""compressed-tensors `pack-quantized` checkpoints (llm-compressor's W4A16 / W8A16, what RedHatAI's *-quantized.w4a16
releases are), written and decompressed by the compressed-tensors library itself (tests/quant_ckpt.py write_ct_pack),
against transformers run on the library's decompressed weights (float32, CPU): greedy tokens identical, logits within
float32 rounding.

- int4 group 32 symmetric and asymmetric (packed zero points), int8 per channel, int8 group asymmetric, act-order
  (`weight_g_idx`); transformers' own compressed-tensors loading of a symmetric checkpoint agrees with the reference;
- the packed path (XLLM_PACKED_QUANT=1, what CUDA runs): int4 layers packed for the int4 GEMM, the same tokens;
- sensitivity: the zero points dropped (read as symmetric) or two layers' scales swapped: no longer transformers';
- faults: a missing / mis-shaped tensor is named; unsupported settings (2 bits, activations, tensor strategy) refused
  by name;
- TP 2 (slow): column splits cut packed words and row splits follow groups.
"""
from __future__ import annotations

import json

import pytest
import torch
from hf_ref import hf_greedy, hf_prefill_logits
from safetensors.torch import load_file

from tests.fixtures.tiny_hf import make_tiny_qwen3

pytest.importorskip("compressed_tensors")
from quant_ckpt import edit_ckpt, write_ct_pack  # noqa: E402

pytestmark = pytest.mark.engine

PROMPTS = [[97, 11, 187, 0, 57, 67], [3, 17, 99, 102, 7, 7, 300, 41, 5]]
N_NEW = 12
OPTS = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=8, max_model_len=256,
            enforce_eager=True)
VARIANTS = {"w4_g32_sym": dict(bits=4, group=32, sym=True), "w4_g32_asym": dict(bits=4, group=32, sym=False),
            "w8_channel": dict(bits=8, strategy="channel", sym=True), "w8_g64_asym": dict(bits=8, group=64, sym=False),
            "w4_actorder": dict(bits=4, group=32, sym=True, act_order=True)}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("ctp") / "base", hidden_size=128, intermediate_size=256,
                           head_dim=32, tie_word_embeddings=False)


class _Ckpts(dict):
    """variant -> (checkpoint, reference), each written on first use."""

    def __init__(self, base, root):
        super().__init__()
        self.base, self.root = base, root

    def __missing__(self, k):
        self[k] = write_ct_pack(self.base, self.root / k, self.root / f"{k}_ref", **VARIANTS[k])
        return self[k]


@pytest.fixture(scope="module")
def ckpts(base, tmp_path_factory):
    return _Ckpts(base, tmp_path_factory.mktemp("ctp_ckpts"))


def _llm(path, **kw):
    from xllm_gen import LLM
    return LLM(model=str(path), **{**OPTS, **kw})


def _greedy(llm, prompts=PROMPTS, n=N_NEW):
    from xllm_gen import SamplingParams
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("variant", ["w4_g32_asym", "w8_channel", "w4_actorder",
                                     *(pytest.param(v, marks=pytest.mark.slow) for v in ("w4_g32_sym", "w8_g64_asym"))])
def test_matches_transformers_on_decompressed(ckpts, variant):
    ckpt, ref = ckpts[variant]
    cfg = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "pack-quantized" and "model.layers.0.mlp.down_proj.weight_packed" in \
        load_file(str(ckpt / "model.safetensors"))
    llm = _llm(ckpt)
    try:
        assert _greedy(llm) == hf_greedy(ref, PROMPTS, N_NEW)
        err = (llm.prefill_logits(PROMPTS[1]) - hf_prefill_logits(ref, PROMPTS[1])).abs().max().item()
        assert err < 1e-4, err
    finally:
        llm.shutdown()


def test_transformers_reads_the_checkpoint_as_the_reference_does(ckpts):
    """transformers' own compressed-tensors loading (decompressing at load) gives the reference's logits: the
    reference is the format's meaning, not ours."""
    from transformers import AutoModelForCausalLM
    ckpt, ref = ckpts["w4_g32_sym"]
    direct = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    with torch.no_grad():
        got = direct(torch.tensor([PROMPTS[1]])).logits[0]
    assert (got - hf_prefill_logits(ref, PROMPTS[1])).abs().max().item() < 1e-5


def test_packed_path_same_tokens(ckpts, monkeypatch):
    monkeypatch.setenv("XLLM_PACKED_QUANT", "1")
    for variant in ("w4_g32_asym",):
        ckpt, ref = ckpts[variant]
        llm = _llm(ckpt)
        try:
            down = llm.engine.runner.model.model.layers[0].mlp.down_proj
            assert type(down.packed).__name__ == "PackedInt4" and down.weight.numel() == 0 and down.packed.group == 32
            assert _greedy(llm) == hf_greedy(ref, PROMPTS, N_NEW)
        finally:
            llm.shutdown()


@pytest.mark.parametrize("edit", ["no_zero_points", pytest.param("swapped_scales", marks=pytest.mark.slow)])
def test_dropped_zero_points_or_swapped_scales_break_parity(ckpts, tmp_path, edit):
    ckpt, ref = ckpts["w4_g32_asym"]
    want = hf_greedy(ref, PROMPTS, N_NEW)

    def no_zp(sd):          # read as symmetric: every zero at the storage offset
        for k in [k for k in sd if k.endswith("weight_zero_point")]:
            del sd[k]

    def swap(sd):
        a, b = "model.layers.0.mlp.up_proj.weight_scale", "model.layers.0.mlp.gate_proj.weight_scale"
        sd[a], sd[b] = sd[b].clone(), sd[a].clone()

    d = edit_ckpt(ckpt, tmp_path / "e", tensors=no_zp if edit == "no_zero_points" else swap)
    llm = _llm(d)
    try:
        got = _greedy(llm)
        err = (llm.prefill_logits(PROMPTS[1]) - hf_prefill_logits(ref, PROMPTS[1])).abs().max().item()
    finally:
        llm.shutdown()
    assert got != want or err > 1e-2, (edit, err)


@pytest.mark.parametrize("edit,needle", [
    (lambda sd: sd.pop("model.layers.1.self_attn.k_proj.weight_scale"),
     r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.weight_scale'"),
    (lambda sd: sd.__setitem__("model.layers.0.mlp.up_proj.weight_scale",
                               sd["model.layers.0.mlp.up_proj.weight_scale"][:, :2].contiguous()),
     r"tensor 'model\.layers\.0\.mlp\.up_proj\.weight_scale' has shape \(256, 2\), expected \(256, 4\)"),
    (lambda sd: sd.__setitem__("model.layers.0.mlp.up_proj.weight_packed",
                               sd["model.layers.0.mlp.up_proj.weight_packed"].float()),
     r"tensor 'model\.layers\.0\.mlp\.up_proj\.weight_packed': dtype F32, expected I32"),
])
def test_faulty_tensors_named(ckpts, tmp_path, edit, needle):
    with pytest.raises(ValueError, match=needle):
        _llm(edit_ckpt(ckpts["w4_g32_sym"][0], tmp_path / "x", tensors=edit))


@pytest.mark.parametrize("actorder", ["group", "dynamic"])
def test_actorder_group_without_g_idx_refused(ckpts, tmp_path, actorder):
    """actorder "group" (and its alias "dynamic") promises a `weight_g_idx` per layer; one stripped would be read as
    groups in order (wrong tokens, silently): refused naming the tensor. The alias serves as "group" does."""
    ckpt, ref = ckpts["w4_actorder"]
    name = "model.layers.0.self_attn.o_proj.weight_g_idx"
    set_order = lambda qc: qc["config_groups"]["group_0"]["weights"].__setitem__("actorder", actorder)  # noqa: E731
    with pytest.raises(ValueError, match=rf"missing tensor '{name}': compressed-tensors actorder 'group'"):
        _llm(edit_ckpt(ckpt, tmp_path / "x", tensors=lambda sd: sd.pop(name), qc=set_order))
    if actorder == "dynamic":
        llm = _llm(edit_ckpt(ckpt, tmp_path / "d", qc=set_order))
        try:
            assert _greedy(llm) == hf_greedy(ref, PROMPTS, N_NEW)
        finally:
            llm.shutdown()


@pytest.mark.parametrize("edit,needle", [
    (lambda qc: qc["config_groups"]["group_0"]["weights"].__setitem__("num_bits", 2), r"num_bits=2 is not supported"),
    (lambda qc: qc["config_groups"]["group_0"].__setitem__(
        "input_activations", {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}),
     r"input_activations is not supported with format 'pack-quantized'"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].__setitem__("strategy", "tensor"),
     r"strategy='tensor' is not supported with format 'pack-quantized'"),
    (lambda qc: qc.__setitem__("format", "marlin-24"), r"format='marlin-24' is not supported"),
])
def test_unsupported_settings_refused(ckpts, tmp_path, edit, needle):
    with pytest.raises(ValueError, match=needle):
        _llm(edit_ckpt(ckpts["w4_g32_sym"][0], tmp_path / "x", qc=edit))


@pytest.mark.slow
@pytest.mark.parametrize("pack", [False, True], ids=["dequantized", "packed"])
def test_tp2(ckpts, monkeypatch, pack):
    monkeypatch.setenv("XLLM_PACKED_QUANT", "1" if pack else "0")
    for variant in ("w4_g32_asym", "w8_channel", "w4_actorder"):
        ckpt, ref = ckpts[variant]
        llm = _llm(ckpt, tensor_parallel_size=2)
        try:
            assert _greedy(llm) == hf_greedy(ref, PROMPTS, N_NEW), variant
        finally:
            llm.shutdown()
