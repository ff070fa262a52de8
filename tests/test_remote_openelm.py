"""OpenELM (OpenELMForCausalLM, model_type "openelm"; remote code: transformers ships no class) served by
specs/openelm.yaml, against a plain-PyTorch reference written from apple/OpenELM's configuration_openelm.py and
modeling_openelm.py: `OpenELMConfig.__post_init__`'s layer-wise scaling (np.linspace of qkv_multipliers /
ffn_multipliers rounded by numpy's round(v, 2), `make_divisible`, query heads = width / head_dim, KV heads = query
heads // num_gqa_groups unless config.json stores num_kv_heads, which PretrainedConfig sets after __post_init__),
`qkv_proj` reshaped `[q_h + k_h + v_h, head_dim]` and split by heads, per-head `q_norm` / `k_norm` (OpenELMRMSNorm,
eps 1e-6), rotate_half rotary with `freq_constant`, `repeat_interleave` GQA, `ffn.proj_2(act(y1) * y2)` with
`proj_1(x).chunk(2)`, RMSNorms `attn_norm` / `ffn_norm` / `norm`, the head tied to `token_embeddings`."""
from __future__ import annotations

import json

import numpy as np
import pytest
import remote_ref as R
import torch
import torch.nn.functional as F

H, D, GQA, V, L, DIV = 64, 8, 2, 128, 4, 16
EPS = 1e-6
CONFIG = {
    "architectures": ["OpenELMForCausalLM"], "model_type": "openelm",
    "auto_map": {"AutoConfig": "configuration_openelm.OpenELMConfig",
                 "AutoModelForCausalLM": "modeling_openelm.OpenELMForCausalLM"},
    "activation_fn_name": "swish", "bos_token_id": 1, "eos_token_id": 2, "ffn_dim_divisor": DIV,
    "ffn_with_glu": True, "head_dim": D, "initializer_range": 0.02, "max_context_length": 64, "model_dim": H,
    "normalization_layer_name": "rms_norm", "normalize_qk_projections": True, "num_gqa_groups": GQA,
    "num_transformer_layers": L, "qkv_multipliers": [0.5, 1.0], "rope_freq_constant": 500,
    "rope_max_length": 128, "share_input_output_layers": True, "torch_dtype": "float32",
    "transformers_version": "4.39.3", "use_cache": True, "vocab_size": V,
}


# ---- configuration_openelm.py (the reference's own reading of the config) ----------------------------------
def _make_divisible(v, divisor=8, min_value=None):
    min_value = divisor if min_value is None else min_value
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


def _post_init(cfg):
    """OpenELMConfig.__post_init__, then PretrainedConfig setting the remaining kwargs (num_kv_heads)."""
    n, dim, hd, g = cfg["num_transformer_layers"], cfg["model_dim"], cfg["head_dim"], cfg["num_gqa_groups"]
    qkv, ffn = cfg["qkv_multipliers"], cfg["ffn_multipliers"]
    if isinstance(qkv, (int, float)):
        dims = [int(_make_divisible(dim * qkv, divisor=hd * g))] * n
    else:
        assert len(qkv) == 2
        dims = [int(_make_divisible(dim * m, divisor=hd * g))
                for m in [round(v, 2) for v in np.linspace(qkv[0], qkv[1], num=n, dtype=float)]]
    q_heads = [q // hd for q in dims]
    kv_heads = cfg.get("num_kv_heads", [q // g for q in q_heads])
    if isinstance(ffn, (int, float)):
        ffn = [ffn] * n
    elif len(ffn) == 2:
        ffn = [round(v, 2) for v in np.linspace(ffn[0], ffn[1], num=n, dtype=float)]
    inter = [int(_make_divisible(m * dim, divisor=cfg["ffn_dim_divisor"])) for m in ffn]
    return q_heads, kv_heads, inter


def _release_config(**edit):
    """config.json as the releases store it: the expanded ffn_multipliers and both head lists."""
    cfg = {**CONFIG, "ffn_multipliers": [0.5, 4.0], **edit}
    n = cfg["num_transformer_layers"]
    if isinstance(cfg["ffn_multipliers"], list) and len(cfg["ffn_multipliers"]) == 2:
        cfg["ffn_multipliers"] = [float(round(v, 2)) for v in np.linspace(*cfg["ffn_multipliers"], num=n)]
    q_heads, kv_heads, _ = _post_init(cfg)
    return {"num_query_heads": q_heads, "num_kv_heads": kv_heads, **cfg}


RELEASE = _release_config()
Q_HEADS, KV_HEADS, INTER = _post_init(RELEASE)


def test_the_fixture_scales_layer_wise():
    assert (Q_HEADS, KV_HEADS, INTER) == ([4, 6, 6, 8], [2, 3, 3, 4], [32, 112, 176, 256])
    assert RELEASE["ffn_multipliers"] == [0.5, 1.67, 2.83, 4.0]          # numpy's round(v, 2) at work


def _tensors(cfg, seed=3, untied=False):
    q_heads, kv_heads, inter = _post_init(cfg)
    g = torch.Generator().manual_seed(seed)
    t = {"transformer.token_embeddings.weight": R.rand(g, V, H, std=1.0), "transformer.norm.weight": R.norm_weight(g, H)}
    for i in range(L):
        p = f"transformer.layers.{i}."
        t |= {p + "attn_norm.weight": R.norm_weight(g, H), p + "ffn_norm.weight": R.norm_weight(g, H),
              p + "attn.qkv_proj.weight": R.rand(g, (q_heads[i] + 2 * kv_heads[i]) * D, H),
              p + "attn.q_norm.weight": R.norm_weight(g, D), p + "attn.k_norm.weight": R.norm_weight(g, D),
              p + "attn.out_proj.weight": R.rand(g, H, q_heads[i] * D),
              p + "ffn.proj_1.weight": R.rand(g, 2 * inter[i], H), p + "ffn.proj_2.weight": R.rand(g, H, inter[i])}
    if untied:       # OpenELMForCausalLM.lm_head, beside OpenELMModel's own unused `classifier`
        t |= {"lm_head.weight": R.rand(g, V, H), "transformer.classifier.weight": R.rand(g, V, H)}
    return t


def reference(t, cfg, qk_norm=None, swap_halves=False):
    """modeling_openelm.py's forward (no cache: the whole sequence each step). `qk_norm` overrides
    normalize_qk_projections and `swap_halves` activates y2 instead of y1 (wrong readings, for the fixture's
    sensitivity checks)."""
    q_heads, kv_heads, _ = _post_init(cfg)
    qk_norm = cfg["normalize_qk_projections"] if qk_norm is None else qk_norm
    theta = cfg["rope_freq_constant"]
    head = t["transformer.token_embeddings.weight"] if cfg["share_input_output_layers"] else t["lm_head.weight"]

    def forward(ids):
        n = len(ids)
        pos = torch.arange(n)
        x = t["transformer.token_embeddings.weight"][ids]
        for i in range(L):
            p = f"transformer.layers.{i}."
            h = R.rms_norm(x, t[p + "attn_norm.weight"], EPS)
            qkv = (h @ t[p + "attn.qkv_proj.weight"].T).view(n, q_heads[i] + 2 * kv_heads[i], D)
            q, k, v = qkv.split([q_heads[i], kv_heads[i], kv_heads[i]], dim=1)
            if qk_norm:
                q, k = R.rms_norm(q, t[p + "attn.q_norm.weight"], EPS), R.rms_norm(k, t[p + "attn.k_norm.weight"], EPS)
            q, k = R.rope_neox(q, pos, theta), R.rope_neox(k, pos, theta)
            x = x + R.causal_attention(q, k, v, D ** -0.5) @ t[p + "attn.out_proj.weight"].T
            h = R.rms_norm(x, t[p + "ffn_norm.weight"], EPS)
            y1, y2 = (h @ t[p + "ffn.proj_1.weight"].T).chunk(2, dim=-1)
            y = F.silu(y2) * y1 if swap_halves else F.silu(y1) * y2
            x = x + y @ t[p + "ffn.proj_2.weight"].T
        return R.rms_norm(x, t["transformer.norm.weight"], EPS) @ head.T
    return forward


def _write(root, cfg, tensors):
    return R.write_checkpoint(root, cfg, tensors)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("openelm"), RELEASE, _tensors(RELEASE))


def test_openelm_matches_reference(ckpt):
    t = _tensors(RELEASE)
    ref = reference(t, RELEASE)
    assert R.distinct(ref, reference(t, RELEASE, qk_norm=False)), "fixture: the q/k norms matter"
    assert R.distinct(ref, reference(t, RELEASE, swap_halves=True)), "fixture: which proj_1 half is activated matters"
    R.assert_matches(R.engine_greedy(ckpt), ref, what="openelm")


def test_openelm_config_reads_as_the_config_class():
    """The spec's Config derives the per-layer heads and widths as __post_init__ does: from the release's stored
    lists, from the two-number forms, from a single number."""
    import importlib
    model = importlib.import_module("xllm_gen.generated.openelm.model")
    for cfg in (RELEASE, {**CONFIG, "ffn_multipliers": [0.5, 4.0]},
                {**CONFIG, "qkv_multipliers": 0.75, "ffn_multipliers": 2.5},
                {**CONFIG, "num_transformer_layers": 7, "qkv_multipliers": [0.25, 1.0], "ffn_multipliers": [0.5, 3.0]}):
        c = model.Config.from_hf(cfg)
        q_heads, kv_heads, inter = _post_init(cfg)
        assert (list(c.num_query_heads), list(c.num_kv_heads), list(c.intermediate_sizes)) == (q_heads, kv_heads, inter)


def test_openelm_real_config_reads_as_the_config_class():
    """apple/OpenELM-1_1B's config.json (its stored lists, as __post_init__ wrote them)."""
    import importlib
    model = importlib.import_module("xllm_gen.generated.openelm.model")
    real = {**CONFIG, "model_dim": 2048, "head_dim": 64, "num_gqa_groups": 4, "num_transformer_layers": 28,
            "max_context_length": 2048, "rope_freq_constant": 10000, "rope_max_length": 4096, "vocab_size": 32000,
            "ffn_dim_divisor": 256, "torch_dtype": "bfloat16",
            "ffn_multipliers": [0.5, 0.63, 0.76, 0.89, 1.02, 1.15, 1.28, 1.41, 1.54, 1.67, 1.8, 1.93, 2.06, 2.19,
                                2.31, 2.44, 2.57, 2.7, 2.83, 2.96, 3.09, 3.22, 3.35, 3.48, 3.61, 3.74, 3.87, 4.0],
            "num_kv_heads": [4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 8, 8, 8, 8],
            "num_query_heads": [16, 16, 16, 20, 20, 20, 20, 20, 20, 20, 24, 24, 24, 24, 24, 24, 24, 24, 28, 28, 28, 28,
                                28, 28, 32, 32, 32, 32]}
    c = model.Config.from_hf(real)
    q_heads, kv_heads, inter = _post_init(real)
    assert list(c.num_query_heads) == q_heads == real["num_query_heads"]
    assert (list(c.num_kv_heads), list(c.intermediate_sizes)) == (kv_heads, inter)
    assert inter[:3] == [1024, 1280, 1536] and inter[-1] == 8192


def test_openelm_untied_head_and_two_number_multipliers(tmp_path):
    """share_input_output_layers false: lm_head (OpenELMModel's unused classifier ignored); ffn_multipliers as the
    two-number form [0.5, 4.0], which __post_init__ expands (the same widths as the stored list)."""
    cfg = {**RELEASE, "share_input_output_layers": False, "ffn_multipliers": [0.5, 4.0]}
    t = _tensors(cfg, untied=True)
    ref = reference(t, cfg)
    assert R.distinct(ref, reference(t, {**cfg, "share_input_output_layers": True})), "fixture: the head matters"
    R.assert_matches(R.engine_greedy(_write(tmp_path / "c", cfg, t), prompts=R.PROMPTS[:2]), ref,
                     prompts=R.PROMPTS[:2], what="openelm untied")


@pytest.mark.parametrize("edit, named", [
    ({"num_kv_heads": [2, 2, 3, 4]}, "qkv_proj"),                    # a wrong per-layer list: weights of another shape
    ({"ffn_multipliers": [0.5, 1.67, 2.9, 4.0]}, "proj_1"),            # layer 2 would be 192 wide, stored 176
    ({"num_query_heads": [4, 6, 8, 8]}, "num_query_heads_agree"),      # not what __post_init__ derives
    ({"qkv_multipliers": [0.5, 0.75, 1.0]}, "qkv_multipliers_form"),   # __post_init__ raises NotImplementedError
    ({"ffn_multipliers": [1.0, 2.0, 3.0]}, "ffn_multipliers_form"),    # its assert: one per layer
    ({"ffn_with_glu": False}, "ffn_with_glu"),
    ({"normalization_layer_name": "layer_norm"}, "normalization_layer_name"),
    ({"activation_fn_name": "gelu_new"}, "activation_fn_name"),
])
def test_openelm_refuses_what_it_does_not_model(ckpt, tmp_path, edit, named):
    from xllm_gen import LLM
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**RELEASE, **edit}))
    (bad / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    with pytest.raises(Exception, match=named):
        LLM(model=str(bad), device="cpu", dtype="float32")


def test_round_in_spec_expressions_is_numpys_on_linspace():
    """`round` (added to the expression language for this family): Python's, so `round(v * 100) / 100` is numpy's
    `round(np.float64(v), 2)` (rint(v * 100) / 100) where Python's decimal round(v, 2) may differ; halves to even."""
    from xllm_gen.codegen.expr import ExprError, parse
    e = parse("[round((i * ((b - a) / (n - 1)) + a) * 100) / 100 for i in range(n)]")
    for a, b, n in ((0.5, 4.0, 16), (0.5, 1.0, 28), (0.0, 0.25, 3), (0.1, 3.3, 37)):
        want = [float(round(v, 2)) for v in np.linspace(a, b, num=n)]
        got = e.eval({"a": a, "b": b, "n": n})
        assert got[:-1] == want[:-1], (a, b, n)        # the last is `stop` itself in numpy (the spec says so)
    assert parse("round(x)").eval({"x": 2.5}) == 2 and parse("round(x, 1)").eval({"x": 0.26}) == 0.3
    with pytest.raises(ExprError, match="out of range"):
        parse("round(x)").eval({"x": float("inf")})
