"""The rotary primitives of the spec language (attention.rotary `fraction` / `dim`, `layout`, `enabled`, per-layer
`theta` / `scaling`) and lm_head.bias.

- layer level: Rotary against transformers' own rotary functions (GPT-J's rotate_every_two on part of the head,
  Phi's partial rotate_half, partial rotary with yarn), and the CUDA kernel's composition under TRITON_INTERPRET;
- sensitivity arms on the tiny checkpoints of the specs that use them: changing the feature in config.json
  (partial_rotary_factor, rotary_dim, no_rope_layers) changes transformers' greedy tokens, and the engine still
  agrees; a child spec with the other layout disagrees with transformers (the layout is live);
- the config guard: a partial rotary factor no symbol reads is refused by name;
- the compiler: each axis' errors are located.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STEPS = 10


# ------------------------------------------------------------------------------------------------ layer level
def _undo(x, rot):
    """Rotary output back in the head's own dim order (interleaved keeps the gathered evens-then-odds order)."""
    if rot.gather is None:
        return x
    out = x.clone()
    out[..., rot.gather] = x[..., : rot.head_dim]
    return out


def test_interleaved_partial_matches_gptj():
    from transformers.models.gptj import modeling_gptj as G

    from xllm_gen.runtime import layers as L

    N, H, D, rd = 7, 3, 16, 8
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(N, H, D, generator=g), torch.randn(N, 2, D, generator=g)
    pos = torch.randint(0, 64, (N,), generator=g)
    rot = L.Rotary(D, 10000.0, 64, rotary_dim=rd, layout="interleaved")
    got_q, got_k = rot(pos, q, k)
    sincos = G.create_sinusoidal_positions(64, rd)[pos][None]            # [1, N, rd]
    sin, cos = torch.split(sincos, rd // 2, dim=-1)

    def hf(x):                                                           # GPTJAttention.forward, [B, N, H, D]
        x = x[None]
        x_rot = G.apply_rotary_pos_emb(x[..., :rd], sin, cos)
        return torch.cat([x_rot, x[..., rd:]], -1)[0]

    g_q = torch.cat((_undo(got_q[..., :rd], rot), got_q[..., rd:]), -1)
    g_k = torch.cat((_undo(got_k[..., :rd], rot), got_k[..., rd:]), -1)
    torch.testing.assert_close(g_q, hf(q), atol=1e-6, rtol=0)
    torch.testing.assert_close(g_k, hf(k), atol=1e-6, rtol=0)
    # attention reads only q.k: the gathered order gives the same scores
    torch.testing.assert_close(got_q @ got_k[:, :1].transpose(1, 2), hf(q) @ hf(k)[:, :1].transpose(1, 2),
                               atol=1e-5, rtol=0)
    # and it is not the neox rotation
    neox = L.Rotary(D, 10000.0, 64, rotary_dim=rd)(pos, q, k)[0]
    assert not torch.allclose(neox, hf(q), atol=1e-3)


@pytest.mark.parametrize("rope_type", ["default", "linear", "yarn"])
def test_partial_frequencies_match_transformers(rope_type):
    """Partial rotary composes with rope scaling as transformers computes it: inv_freq over the rotary dims."""
    from transformers import PhiConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from xllm_gen.runtime.layers.rotary import rope_parameters

    params = {"rope_type": rope_type, "rope_theta": 10000.0, "partial_rotary_factor": 0.4}
    if rope_type != "default":
        params.update(factor=4.0)
    if rope_type == "yarn":
        params.update(original_max_position_embeddings=64)
    cfg = PhiConfig(hidden_size=160, num_attention_heads=2, max_position_embeddings=256, rope_parameters=params)
    if rope_type == "default":
        from transformers.models.phi.modeling_phi import PhiRotaryEmbedding
        want, want_af = PhiRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        want, want_af = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    got, af = rope_parameters(32, 10000.0, 256, scaling, full_dim=80)        # int(80 * 0.4) = 32 dims rotate
    assert got.shape == want.shape == (16,)
    torch.testing.assert_close(got, want.float(), atol=0, rtol=1e-6)
    assert af == pytest.approx(float(want_af or 1.0))
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        rope_parameters(40, 10000.0, 256, scaling, full_dim=80)             # 0.4 of 80 is not 40


def test_rotary_axes_refused_when_invalid():
    from xllm_gen.runtime import layers as L

    with pytest.raises(ValueError, match="even"):
        L.Rotary(16, 1e4, 64, rotary_dim=6 + 1)
    with pytest.raises(ValueError, match="0..head_dim"):
        L.Rotary(16, 1e4, 64, rotary_dim=32)
    # no rotating dim (transformers: int(head_dim * partial_rotary_factor) == 0): q and k pass unchanged
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    for layout in ("neox", "interleaved"):
        out = L.Rotary(16, 1e4, 64, rotary_dim=0, layout=layout)(torch.arange(3), q, k)
        assert torch.equal(out[0], q) and torch.equal(out[1], k)
    with pytest.raises(ValueError, match="layout"):
        L.Rotary(16, 1e4, 64, layout="gptj")
    with pytest.raises(ValueError, match="kind 'neox' only"):
        L.Rotary(16, 1e4, 64, kind="mrope_blocked", mrope_section=[4, 2, 2], layout="interleaved")


_KERNEL_CHECK = r"""
import torch
from xllm_gen.runtime import layers as L, ops
from xllm_gen.runtime.ops import triton_kernels as T
from xllm_gen.runtime.layers import rotary as R
g = torch.Generator().manual_seed(0)
worst = 0.0
for rd, layout in ((6, "interleaved"), (8, "neox"), (16, "interleaved"), (10, "neox")):
    rot = L.Rotary(16, 1e4, 128, rotary_dim=rd, layout=layout, scaling={"rope_type": "linear", "factor": 2.0})
    q, k = torch.randn(5, 4, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    pos = torch.randint(0, 128, (5,), generator=g)
    want = rot(pos, q, k)                                   # CPU reference op
    # the CUDA path: the same composition around the Triton kernel (which reads the [max_pos, rd] table)
    R.ops = type("ops", (), {"rope": staticmethod(
        lambda q, k, p, inv, cache, axis, af: T.qk_norm_rope(q, k, None, None, 0.0, p, cache, axis))})
    got = rot(pos, q, k)
    R.ops = ops
    worst = max(worst, max((a - b).abs().max().item() for a, b in zip(got, want)))
print(worst)
"""


def test_partial_interleaved_rotary_through_the_triton_kernel():
    """The CUDA path of partial / interleaved rotary (the rope kernel on the [N, H, rotary_dim] slice, its
    table as wide as the rotary dims, half widths 3 and 5 not powers of 2) equals the CPU reference."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert float(p.stdout.strip().splitlines()[-1]) < 1e-5


# ------------------------------------------------------------------------------------------------ engine arms
def _engine(ckpt, prompts):
    from xllm_gen import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=4) as llm:
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(0, 400, n).tolist() for n in (5, 23)]


def _arm(tiny_checkpoint, tmp_path, arch, edit, what):
    """HF's tokens change when `edit` is applied to the tiny checkpoint's config.json, and the engine agrees
    with HF before and after."""
    from fixtures.tiny_hf import edit_config
    from hf_ref import hf_greedy

    ckpt = tiny_checkpoint(arch)
    prompts = _prompts()
    base = hf_greedy(ckpt, prompts, STEPS)
    assert _engine(ckpt, prompts) == base, f"{arch}: engine differs from transformers as built"
    arm = edit_config(ckpt, tmp_path / "arm", edit)
    want = hf_greedy(arm, prompts, STEPS)
    assert want != base, f"{what} changes nothing in transformers' output on the tiny checkpoint: no arm"
    assert _engine(arm, prompts) == want, f"{arch} with {what}: engine differs from transformers"


@pytest.mark.engine
def test_partial_fraction_matters(tiny_checkpoint, tmp_path):
    def whole(cfg):
        assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.5
        cfg["rope_parameters"]["partial_rotary_factor"] = 1.0
    _arm(tiny_checkpoint, tmp_path, "PhiForCausalLM", whole, "partial_rotary_factor 0.5 -> 1.0")


@pytest.mark.engine
def test_rotary_dim_matters(tiny_checkpoint, tmp_path):
    def wider(cfg):
        assert cfg["rotary_dim"] == 8
        cfg["rotary_dim"] = 16                    # the whole head (interleaved)
    _arm(tiny_checkpoint, tmp_path, "GPTJForCausalLM", wider, "rotary_dim 8 -> 16")


@pytest.mark.engine
def test_nope_layers_matter(tiny_checkpoint, tmp_path):
    def all_rope(cfg):
        assert cfg["no_rope_layers"] == [1, 0, 1]
        cfg["no_rope_layers"] = [1, 1, 1]
    _arm(tiny_checkpoint, tmp_path, "SmolLM3ForCausalLM", all_rope, "no_rope_layers [1, 0, 1] -> [1, 1, 1]")


@pytest.mark.engine
def test_per_layer_theta_matters(tiny_checkpoint, tmp_path):
    """Gemma 3: the global layer's theta (1e6) set to the local layers' (1e4) changes transformers' tokens; the
    engine, which picks each layer's theta from layer_types, agrees before and after."""
    def same_theta(cfg):
        assert cfg["layer_types"][1] == "full_attention"
        assert cfg["rope_parameters"]["full_attention"]["rope_theta"] != 10000.0
        cfg["rope_parameters"]["full_attention"]["rope_theta"] = 10000.0
    _arm(tiny_checkpoint, tmp_path, "Gemma3ForCausalLM", same_theta, "full_attention rope_theta -> 10000")


@pytest.mark.engine
def test_nope_interval_default(tiny_checkpoint, tmp_path):
    """Without no_rope_layers, transformers' default (every no_rope_layer_interval-th layer without rope) is the
    spec's default_expr: served alike."""
    def interval(cfg):
        del cfg["no_rope_layers"]
        cfg["no_rope_layer_interval"] = 2         # layer 1 has no rope; [1, 0, 1] again, from the interval
    from fixtures.tiny_hf import edit_config
    from hf_ref import hf_greedy

    arm = edit_config(tiny_checkpoint("SmolLM3ForCausalLM"), tmp_path / "arm", interval)
    prompts = _prompts()
    assert _engine(arm, prompts) == hf_greedy(arm, prompts, STEPS)


@pytest.mark.engine
@pytest.mark.parametrize("spec,arch", [("cohere.yaml", "CohereForCausalLM"), ("gptj.yaml", "GPTJForCausalLM")])
def test_layout_is_live(spec, arch, tiny_checkpoint, tmp_path, tmp_path_factory, monkeypatch):
    """The same spec with `layout: neox` instead of interleaved, compiled into a user generated/ dir, serves
    the tiny checkpoint differently from transformers (the interleaved spec agrees: the spec battery)."""
    from fixtures.tiny_hf import edit_config
    from hf_ref import hf_greedy

    from xllm_gen.codegen.cli import main as cli_main

    blocks = "attn" if arch.startswith("GPTJ") else "self_attn"
    name = f"neox_{spec.split('.')[0]}"              # one module name per spec: the registry imports it once
    child = tmp_path / "child.yaml"
    child.write_text(f"spec_version: 2\nextends: {ROOT / 'specs' / spec}\nname: {name}\n"
                     f"class_prefix: Neox\narchitectures: [{name}ForCausalLM]\n"
                     f"decoder:\n  layers:\n    blocks:\n      {blocks}:\n        rotary: {{layout: neox}}\n")
    assert cli_main([str(child), "--out", str(tmp_path / "generated")]) == 0
    monkeypatch.setenv("XLLM_GEN_PATH", str(tmp_path / "generated"))
    ckpt = tiny_checkpoint(arch)
    renamed = edit_config(ckpt, tmp_path_factory.mktemp(name),
                          lambda cfg: cfg.__setitem__("architectures", [f"{name}ForCausalLM"]))
    prompts = _prompts()
    assert _engine(renamed, prompts) != hf_greedy(ckpt, prompts, STEPS), \
        f"{spec}: the neox layout serves the interleaved checkpoint like transformers: the layout is not live"


# ------------------------------------------------------------------------------------------------ config guard
def test_unread_partial_rotary_factor_is_refused():
    """A spec without partial rotary (llama) refuses a rope mapping whose partial_rotary_factor is not 1; one that
    reads it (phi) serves it."""
    from fixtures.tiny_hf import tiny_config

    from xllm_gen.runtime.loading import registry
    from xllm_gen.runtime.loading.hf_config import ConfigError

    cfg = tiny_config("LlamaForCausalLM").to_dict()
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    model_module, _ = registry.resolve(cfg)
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        model_module.Config.from_hf(cfg)
    cfg["rope_parameters"]["partial_rotary_factor"] = 1.0
    model_module.Config.from_hf(cfg)
    phi = tiny_config("PhiForCausalLM").to_dict()
    phi["rope_parameters"]["partial_rotary_factor"] = 0.25
    model_module, _ = registry.resolve(phi)
    assert model_module.Config.from_hf(phi).partial_rotary_factor == 0.25
    del phi["rope_parameters"]["partial_rotary_factor"]
    assert model_module.Config.from_hf(phi).partial_rotary_factor == 0.5      # transformers' Phi default


@pytest.mark.engine
def test_short_no_rope_layers_is_refused_by_name(tiny_checkpoint, tmp_path):
    """no_rope_layers shorter than the layers: a load error naming config.json and the field, not an IndexError."""
    from fixtures.tiny_hf import edit_config

    from xllm_gen import LLM

    bad = edit_config(tiny_checkpoint("SmolLM3ForCausalLM"), tmp_path / "short",
                      lambda cfg: cfg.__setitem__("no_rope_layers", [1, 0]))
    with pytest.raises(ValueError, match="no_rope_layers") as e:
        LLM(model=str(bad), device="cpu", dtype="float32", block_size=4)
    assert "config.json" in str(e.value)


# ------------------------------------------------------------------------------------------------ compiler
def _compile_child(tmp_path, body: str, base: str = "llama.yaml"):
    from xllm_gen.codegen.compiler import compile_spec

    p = tmp_path / "child.yaml"
    p.write_text(f"spec_version: 2\nextends: {ROOT / 'specs' / base}\nname: child\n" + textwrap.dedent(body))
    return compile_spec(p)


def _rotary(body: str) -> str:
    return "decoder:\n  layers:\n    blocks:\n      self_attn:\n        rotary: " + body + "\n"


@pytest.mark.parametrize("body,match", [
    ("{fraction: 0.5, dim: 64}", "not both"),
    ("{fraction: 1.5}", r"fraction: must be in \(0, 1\]"),
    ("{dim: 63}", "even"),
    ("{dim: 256}", "head_dim"),
    ("{fraction: 0.3}", "even int"),                        # int(64 * 0.3) = 19 for Llama-3.2-1B
    ("{layout: gptj}", "layout"),
    ("{enabled: no_such_symbol}", "unknown config symbol"),
    ("{enabled: rope_theta}", "is float, expected bool"),
    ("{enabled: \"rope_theta\"}", "is float, expected bool"),
    ("{scaling: \"rope_theta if layer else None\"}", "reads none"),
    ("{theta: \"rope_theta if layer % 2 else -1.0\"}", "must be > 0"),
])
def test_rotary_errors_are_located(tmp_path, body, match):
    from xllm_gen.codegen.errors import SpecError, SpecErrors

    with pytest.raises((SpecError, SpecErrors), match=match) as e:
        _compile_child(tmp_path, _rotary(body))
    assert "child.yaml:" in str(e.value) or "llama.yaml:" in str(e.value)


def test_per_layer_theta_and_scaling_render(tmp_path):
    """theta and scaling may read `layer` (Gemma 3's local / global layers): decided per layer in the generated
    source, and each layer's Rotary gets its own."""
    out = _compile_child(tmp_path, _rotary(
        "{theta: \"rope_theta if layer % 2 else 1000.0\", "
        "scaling: \"rope_scaling if layer % 2 else None\", enabled: \"layer != 2\"}"))
    src = out.files["model.py"]
    assert "(config.rope_theta if layer_idx % 2 else 1000.0)" in src
    assert "scaling=(config.rope_scaling if layer_idx % 2 else None)" in src
    assert "if (layer_idx != 2):" in src
