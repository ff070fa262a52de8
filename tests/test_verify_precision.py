"""`xllm-gen verify --dtype float64`: both sides in float64 throughout (codegen/verify_float64.py), each stage bounded
by transformers' own float32 error scaled to float64's eps (codegen/verify_exact.py wide_bounds).

The sensitivity arm: a final-norm eps 10x too large (rms_norm_eps * 10 on the spec's final norm only; the checkpoint's
1e-6) moves the final norm's output by ~1e-6 relative and the log-probabilities by ~2e-5 nats on a tiny Qwen3. float32
verify passes it (its bounds: 10x transformers' own float32 error, at least 2e-6 / 2e-5); float64 verify fails it at
the final norm, ~1e8x over its bound, while the right spec agrees to ~1e-15.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
QWEN3 = ROOT / "specs" / "qwen3.yaml"
FINAL_NORM = "\n  norm: {kind: rmsnorm, dim: hidden_size, eps: rms_norm_eps}"


def _variant(tmp: Path, old: str, new: str, src: Path = QWEN3) -> Path:
    text = src.read_text()
    assert text.count(old) == 1, old
    out = tmp / src.name
    out.write_text(text.replace(old, new))
    return out


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("Qwen3ForCausalLM")


def test_float64_catches_a_final_norm_eps(ckpt, tmp_path):
    """The final norm's eps 10x too large: float64 verify fails at the final norm, ~1e8x over its bound, every layer
    before it within ~1e-15 (the right spec's OK and float32's miss: the slow test below)."""
    from xllm_gen.codegen.verify import verify
    bad_spec = _variant(tmp_path, FINAL_NORM, FINAL_NORM.replace("eps: rms_norm_eps", "eps: rms_norm_eps * 10"))
    bad = verify(bad_spec, ckpt, dtype="float64", max_tokens=2, prompt_lens=[5])
    assert not bad.ok and "bounds: float64" in bad.text(), bad.text()
    _, _, e = bad.first_divergence()
    assert bad.stage(e.layer) == "norm" and e.max_rel > 1e-7 > 1e3 * e.tol, bad.text()
    assert "first divergence: the final norm, position 0" in bad.text(), bad.text()
    assert all(l.max_rel < 1e-13 for p in bad.prompts for l in p.layers[:-1]), bad.text()


@pytest.mark.slow       # three verifies (~15 s)
def test_float64_passes_the_right_spec_where_float32_misses_the_wrong_one(ckpt, tmp_path):
    """The right spec agrees to ~1e-15 in float64; float32 (the default) passes the final-norm eps 10x too large,
    under its floors: what float64 is for."""
    from xllm_gen.codegen.verify import verify
    ok = verify(QWEN3, ckpt, dtype="float64", max_tokens=2, prompt_lens=[5])
    assert ok.ok and max(e.max_rel for p in ok.prompts for e in p.layers) < 1e-13, ok.text()
    bad_spec = _variant(tmp_path, FINAL_NORM, FINAL_NORM.replace("eps: rms_norm_eps", "eps: rms_norm_eps * 10"))
    r32 = verify(bad_spec, ckpt, dtype="float32", max_tokens=2, prompt_lens=[5])
    assert r32.ok and r32.prompts[0].layers[-1].max_rel > 1e-7, r32.text()


def test_float64_mode_promotes_float32_steps():
    """The torch function mode: `.float()`, `.to(torch.float32)` and dtype=torch.float32 compute in float64 while
    active (a reinterpreting view keeps its dtype); paused, the code runs as written; what still returns float32 is
    counted and named."""
    from xllm_gen.codegen.verify_float64 import Float64
    x = torch.randn(4, 8, dtype=torch.float64)
    mode = Float64()
    with mode.active():
        assert x.float().dtype == torch.float64
        assert x.to(torch.float32).dtype == torch.float64
        assert torch.softmax(x, -1, dtype=torch.float32).dtype == torch.float64
        assert torch.zeros(2, dtype=torch.float32).dtype == torch.float64
        assert torch.arange(3).float().dtype == torch.float64
        assert x.view(torch.int64).dtype == torch.int64
        assert mode.residue == {}
        with mode.paused():
            assert x.float().dtype == torch.float32
        assert x.float().dtype == torch.float64
        torch.ones(2, dtype=torch.bfloat16).to(torch.float16)     # no float32 result: nothing counted
        torch.tensor([1.5])                               # the default dtype: float32, counted
    assert x.float().dtype == torch.float32               # outside: untouched
    assert len(mode.residue) == 1 and "float32" in mode.residue_note()[0], mode.residue


def test_wide_bounds_scale_float32s_own_error_to_float64():
    """A stage's bound: 10x transformers' own float32 error on it times 2**-29 (float64's eps over float32's), at
    least the float32 floor scaled the same way, at most float32's own bound; --atol: the fixed bound instead."""
    from xllm_gen.codegen.verify_exact import EPS_RATIO, wide_bounds
    from xllm_gen.codegen.verify_report import EXACT_FLOOR, EXACT_YARDSTICK
    torch.manual_seed(0)
    a64 = [torch.randn(5, 16, dtype=torch.float64) for _ in range(2)]
    a32 = [a64[0] * (1 + 1e-5), a64[1].float().double()]          # a badly conditioned stage, a well conditioned one
    logits64 = torch.randn(5, 32, dtype=torch.float64)
    lp, tols = wide_bounds(logits64.float().double(), logits64, a32, a64)
    assert tols[0] == pytest.approx(EXACT_YARDSTICK * 1e-5 * EPS_RATIO, rel=1e-3)
    assert tols[1] == pytest.approx(EXACT_FLOOR * EPS_RATIO)
    assert 0 < lp < 1e-12
    assert wide_bounds(logits64.float().double(), logits64, a32, a64, rtol=1e-9)[1] is None


def test_float64_refuses_cuda_and_tensor_parallel(ckpt):
    from xllm_gen.codegen.verify import VerifyError, verify
    with pytest.raises(VerifyError, match="float64 runs on the CPU at TP 1 only"):
        verify(QWEN3, ckpt, dtype="float64", tensor_parallel_size=2)


@pytest.mark.slow       # three verifies, a config copy (~20 s)
def test_float64_catches_an_eps_read_as_a_literal(ckpt, tmp_path):
    """The spec's final norm with a literal 1e-6 where the checkpoint's config says 1e-5 (a norm eps read from the
    wrong place, the blind Jais2 case): float64 fails at the final norm; the spec reading the field passes."""
    from fixtures.tiny_hf import edit_config

    from xllm_gen.codegen.verify import verify
    edited = edit_config(ckpt, tmp_path / "eps1e-5", lambda c: c.update(rms_norm_eps=1e-5))
    literal = _variant(tmp_path, FINAL_NORM, FINAL_NORM.replace("eps: rms_norm_eps", "eps: 1.0e-6"))
    assert verify(QWEN3, edited, dtype="float64", max_tokens=2, prompt_lens=[5, 17]).ok
    bad = verify(literal, edited, dtype="float64", max_tokens=2, prompt_lens=[5, 17])
    assert not bad.ok and bad.stage(bad.first_divergence()[2].layer) == "norm", bad.text()
