"""MXFP4 checkpoints (`quant_method: mxfp4`, gpt-oss's published form): `<tensor>_blocks` (uint8 e2m1 pairs, groups of
32 along the input dim) and `<tensor>_scales` (e8m0), read generically by the loader (runtime/layers/mxfp4.py) and
dequantized at load.

The tiny gpt-oss checkpoint is written in the real MXFP4 layout by tests/quant_ckpt.py (its packing checked against
transformers' own dequantizer, the independent reference); transformers loads the same MXFP4 checkpoint (on CPU it
dequantizes) and the engine must give its greedy tokens. intermediate_size = hidden_size, as in gpt-oss-20b: the
experts' down_proj is square, so a layout mix-up cannot hide behind a shape check. Sensitivity arms: nibbles
swapped within each byte, every scale one power of two off; refusals name the field or tensor.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from quant_ckpt import dequant_mxfp4, quantize_mxfp4, write_mxfp4_experts
from safetensors.torch import load_file, save_file

ARCH = "GptOssForCausalLM"
PROMPTS = [[5, 17, 300, 41, 9], [97, 11, 187, 0, 57, 67, 3, 9, 22, 101, 6]]
N_NEW = 12


@pytest.fixture(scope="module")
def mxfp4(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint(ARCH, overrides={"intermediate_size": 64})
    d = tmp_path_factory.mktemp("mxfp4")
    ckpt, ref = write_mxfp4_experts(src, d / "mx", d / "ref")
    return src, ckpt, ref


def _engine(ckpt, tp=1, **kw):
    from xllm_gen import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=4, tensor_parallel_size=tp, **kw) as llm:
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def test_packing_matches_transformers_dequantizer():
    """The test's writer packs as the released checkpoints do: transformers' own dequantizer reads it back."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from xllm_gen.runtime.layers.mxfp4 import dequantize

    w = torch.randn(3, 96, 64, generator=torch.Generator().manual_seed(0)) * 0.3     # [E, out, in]
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 96, 2, 16) and scales.shape == (3, 96, 2) and blocks.dtype == torch.uint8
    want = dequant_mxfp4(blocks, scales)
    hf = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)               # [E, in, out]
    assert torch.equal(hf.transpose(1, 2), want)
    assert torch.equal(dequantize(blocks, scales), want)
    assert torch.equal(want.to(torch.bfloat16).float(), want)                         # exact in bf16 too
    assert (want - w).abs().max() < 0.25 * w.abs().max()                               # it is w, quantized


def test_view_reads_any_window(mxfp4, tmp_path):
    """Any window of the dequantized tensor, also one that cuts a group of 32, reads as the whole one does."""
    from xllm_gen.runtime.layers.mxfp4 import Mxfp4View
    from xllm_gen.runtime.loading.loader import Checkpoint

    _, ckpt, ref = mxfp4
    name = "model.layers.1.mlp.experts.gate_up_proj"
    view = Mxfp4View.open(Checkpoint(ckpt), name)
    full = load_file(str(ref / "model.safetensors"))[name].transpose(1, 2)             # [E, out, in]
    assert view.get_shape() == list(full.shape) == [4, 128, 64]
    assert torch.equal(view[:], full)
    assert torch.equal(view[1:3, 5:77, 13:50], full[1:3, 5:77, 13:50])
    assert torch.equal(view[2:3, :, 31:33], full[2:3, :, 31:33])
    assert view[0:0, :, :].shape == (0, 128, 64)


@pytest.mark.engine
def test_gpt_oss_mxfp4_matches_transformers(mxfp4):
    """transformers loading the MXFP4 checkpoint (dequantized on CPU) and the engine give the same greedy tokens.
    (transformers on the dequantized float twin gives them too, and the float checkpoint before quantization other
    tokens: checked when this was written, left out of the default run for time.)"""
    from hf_ref import hf_greedy

    _, ckpt, _ = mxfp4
    assert _engine(ckpt) == hf_greedy(ckpt, PROMPTS, N_NEW)


@pytest.mark.slow
def test_gpt_oss_mxfp4_reference_is_sound(mxfp4):
    """transformers on the MXFP4 checkpoint = on its dequantized float twin; the quantization shows in the tokens."""
    from hf_ref import hf_greedy

    src, ckpt, ref = mxfp4
    want = hf_greedy(ckpt, PROMPTS, N_NEW)
    assert want == hf_greedy(ref, PROMPTS, N_NEW)
    assert want != hf_greedy(src, PROMPTS, N_NEW), "MXFP4 rounding does not show in the tokens: a weak test"


@pytest.mark.engine
@pytest.mark.parametrize("arm", [pytest.param("nibbles_swapped", marks=pytest.mark.slow), "scale_plus_one"])
def test_mxfp4_sensitivity(mxfp4, tmp_path, arm):
    """Swapping the two values of each byte, or every e8m0 scale one power of two up, changes the engine's tokens
    (and they still match transformers reading the same bytes)."""
    from hf_ref import hf_greedy

    src, ckpt, _ = mxfp4
    kw = {"swap_nibbles": True} if arm == "nibbles_swapped" else {"scale_shift": 1}
    bad, _ = write_mxfp4_experts(src, tmp_path / "bad", tmp_path / "bad_ref", **kw)
    got = _engine(bad)
    assert got != hf_greedy(ckpt, PROMPTS, N_NEW)
    assert got == hf_greedy(bad, PROMPTS, N_NEW)


@pytest.mark.slow
@pytest.mark.engine
def test_gpt_oss_mxfp4_tp2(mxfp4):
    """TP 2: each rank dequantizes its own rows of gate_up_proj (interleaved gate / up) and columns of down_proj."""
    from hf_ref import hf_greedy

    _, ckpt, _ = mxfp4
    assert _engine(ckpt, tp=2) == hf_greedy(ckpt, PROMPTS, N_NEW)


def _edit(ckpt: Path, dst: Path, edit_sd=None, edit_cfg=None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in ckpt.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(ckpt / "model.safetensors"))
    if edit_sd:
        edit_sd(sd)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if edit_cfg:
        cfg = json.loads((dst / "config.json").read_text())
        edit_cfg(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _load_error(path) -> str:
    from xllm_gen import LLM

    with pytest.raises(Exception) as e:
        LLM(model=str(path), device="cpu", dtype="float32", block_size=4)
    return str(e.value)


G = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.mark.parametrize("case, edit_sd, edit_cfg, needle", [
    ("missing_scales", lambda sd: sd.pop(G + "_scales"), None, f"missing tensor '{G}_scales'"),
    ("scales_misshaped", lambda sd: sd.__setitem__(G + "_scales", sd[G + "_scales"][..., :1].contiguous()), None,
     f"tensor '{G}_scales' has shape (4, 128, 1), expected (4, 128, 2)"),
    ("group_of_64", lambda sd: sd.__setitem__(G + "_blocks", sd[G + "_blocks"].reshape(4, 128, 1, 32)), None,
     f"tensor '{G}_blocks' has shape (4, 128, 1, 32): MXFP4 blocks are [..., rows, groups, 16]"),
    ("blocks_int8", lambda sd: sd.__setitem__(G + "_blocks", sd[G + "_blocks"].to(torch.int8)), None,
     f"tensor '{G}_blocks': dtype I8, expected U8"),
    ("nan_scale", lambda sd: sd[G + "_scales"].view(-1).__setitem__(0, 255), None, f"tensor '{G}_scales': an e8m0 "
     f"scale of 255"),
    ("no_quant_config", None, lambda cfg: cfg.pop("quantization_config"),
     f"tensor '{G}_blocks' is an MXFP4 weight, but config.json's quantization_config is missing"),
    ("unknown_field", None, lambda cfg: cfg["quantization_config"].__setitem__("group_size", 64),
     "quant_method 'mxfp4' with unsupported field(s) group_size"),
    ("ct_mxfp4_pack", None, lambda cfg: cfg.__setitem__("quantization_config", {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "config_groups": {}}),
     "compressed-tensors format='mxfp4-pack-quantized' is not supported"),
])
def test_mxfp4_faults_refused_by_name(mxfp4, tmp_path, case, edit_sd, edit_cfg, needle):
    _, ckpt, _ = mxfp4
    assert needle in _load_error(_edit(ckpt, tmp_path / case, edit_sd, edit_cfg))


def test_released_gpt_oss_config_is_accepted():
    """gpt-oss's released config.json, its `quantization_config` ({modules_to_not_convert, quant_method: mxfp4})
    included, is read by the spec's config and parsed as MXFP4."""
    from test_gpt_oss import RELEASED_CONFIG

    from xllm_gen.generated.gpt_oss.model import Config
    from xllm_gen.runtime.loading.quant_config import parse_quant_config

    Config.from_hf(dict(RELEASED_CONFIG))
    qc = parse_quant_config(RELEASED_CONFIG)
    assert qc.method == "mxfp4" and qc.ignore == ("model.layers.*.self_attn",)


@pytest.fixture(scope="module")
def mxfp4_dense(tiny_checkpoint, tmp_path_factory):
    """A dense model's decoder linear weights in MXFP4 (`<layer>.weight_blocks` / `_scales`): not a form transformers
    loads (its MXFP4 path is gpt-oss's experts), so the reference is its dequantized float twin."""
    from quant_ckpt import LINEAR_SUFFIXES

    src = tiny_checkpoint("Qwen3ForCausalLM")
    d = tmp_path_factory.mktemp("mxfp4_dense")
    return write_mxfp4_experts(src, d / "mx", d / "ref", suffixes=LINEAR_SUFFIXES, transposed=False,
                               modules_to_not_convert=())


@pytest.mark.engine
def test_any_spec_linear_weights_in_mxfp4(mxfp4_dense):
    """The loader's MXFP4 reading is generic: a dense spec's fused q|k|v and gate|up and its o / down projections
    (down_proj's 160 inputs: 5 groups of 32) load dequantized and decode as transformers on the float twin."""
    from hf_ref import hf_greedy

    ckpt, ref = mxfp4_dense
    assert _engine(ckpt) == hf_greedy(ref, PROMPTS, N_NEW)


@pytest.mark.slow
@pytest.mark.engine
def test_any_spec_linear_weights_in_mxfp4_tp2(mxfp4_dense):
    """TP 2 splits down_proj's 160 input columns 80 / 80: each rank's columns cut a group of 32."""
    from hf_ref import hf_greedy

    ckpt, ref = mxfp4_dense
    assert _engine(ckpt, tp=2) == hf_greedy(ref, PROMPTS, N_NEW)
