"""The mechanical config-flip test (issue 20): every config field a spec reads must reach the computation.

For every spec in specs/ and every config symbol it reads from config.json, the tiny checkpoint of the spec's
architecture is rebuilt with that field flipped to another valid value (bool negated, int doubled, float
scaled, str another admitted value, a tuple edited; the weights follow the new shapes). Then either
  (a) the engine's greedy tokens equal transformers' on the flipped checkpoint, and transformers' tokens
      changed (the field matters and the engine follows it), or
  (b) the engine refuses to load it, naming the field.
A flip that changes nothing in transformers either is accepted only for fields that do not change the math
of these prompts (NO_EFFECT: eos ids under ignore_eos, the context length with the default rope) or whose
value is shadowed (the symbol only feeds the `default_expr` of a symbol the checkpoint states, e.g.
use_sliding_window when config.json lists layer_types); any other is a failure: the spec reads a field and
ignores it. Rope-parameter mappings are flipped by the spec battery's rope arms (test_spec_battery.py).

The default run flips a few fields of one spec; `--runslow` flips every field of every spec.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from test_spec_battery import SPECS, Tokens  # the battery's specs and token runner

from xllm_gen.codegen.loader import load_spec
from xllm_gen.codegen.resolver import resolve

# fields whose flip cannot change greedy tokens of the battery's prompts (16 tokens, ignore_eos, default rope)
NO_EFFECT = {"eos_token_id": "generation stops are ignored (ignore_eos)",
             # the SSD scan's chunk length (Mamba-2 mixers): the same sums in another grouping (rounding only)
             "chunk_size": "the Mamba-2 scan's chunk length changes the rounding only",
             "max_position_embeddings": "the default rope does not depend on it; prompts stay within it",
             # read by the longrope scaling only (Phi-3, PhiMoE; the tiny configs' rope is default): the spec
             # battery's longrope arms and tests/test_longrope.py serve it with longrope against transformers
             "original_max_position_embeddings": "gated by the rope type (longrope)",
             "image_token_id": "text prompts", "video_token_id": "text prompts",
             "vision_start_token_id": "text prompts", "vision_end_token_id": "text prompts",
             # gated by another field: a window applies only on the layers layer_types marks sliding (none in
             # the tiny Qwen configs, use_sliding_window false); the battery's window arm flips it where it applies
             "sliding_window": "gated by layer_types / use_sliding_window",
             # Hunyuan's NTK alpha stretches theta only with rope type dynamic (the tiny config's is default);
             # tests/test_family_primitives.py serves it with dynamic against transformers, and without the alpha
             "rope_alpha": "gated by the rope type (dynamic)",
             # the residual stream in float32 (Mamba, Mamba-2): the float32 runs' stream is float32 either way;
             # tests/test_mamba.py serves it in bfloat16 against transformers, and the bfloat16 stream
             "residual_in_fp32": "float32 serving (the bfloat16 arm is tests/test_mamba.py's)",
             # Falcon-H1: the SSD chunk (as chunk_size); mamba_expand sizes the mixer only where mamba_d_ssm is null
             # (the tiny config gives mamba_d_ssm); the norm's order only where mamba_rms_norm holds (false in the
             # tiny default config): tests/test_falcon_h1.py serves both orders against transformers
             "mamba_chunk_size": "the Mamba-2 scan's chunk length changes the rounding only",
             "mamba_expand": "gated by mamba_d_ssm (null)",
             "mamba_norm_before_gate": "gated by mamba_rms_norm (tests/test_falcon_h1.py flips it with the norm on)"}
# (spec, symbol): fields of one spec whose flip cannot change the battery's tokens, with the test that covers them
NO_EFFECT_IN = {
    # MiMo-V2-Flash's restatements of the sliding layers' shape (read only to be checked against what transformers
    # builds): the flip from absent to 4 lands on the tiny checkpoint's own value (4 heads, 2 x 2 KV heads); other
    # values are refused by name (tests/test_released_settings_hR.py)
    **{("mimo_v2_flash", s): "a restatement checked against the built shape (tests/test_released_settings_hR.py)"
       for s in ("swa_num_attention_heads", "swa_num_key_value_heads")},
    # Kolibri 1.1's context cap (the engine's max_model_len: index_topk + local + sink tokens, at most the checkpoint's
    # max_position_embeddings): outputs within the cap do not depend on it; tests/test_kolibri1_1.py flips each field
    # and checks the cap, the refusal past it, and that transformers selects keys past it
    **{("kolibri1_1", s): "the context cap only (tests/test_kolibri1_1.py)"
       for s in ("max_position_raw", "index_topk", "index_num_local_tokens", "index_num_sink_tokens")},
    # shadowed as a default_expr is, through an expr (an empty no_rope_layers list counts as absent, so the default is
    # the else branch of a derived no_rope_layers): the tiny config states no_rope_layers
    ("llama4", "no_rope_layer_interval"): "only the default of no_rope_layers, which the tiny config states",
}
# (spec, symbol) of the default run: one spec, fields of different kinds (float, str with values, bool)
DEFAULT_ARM = {("qwen3", "rms_norm_eps"), ("qwen3", "hidden_act"), ("qwen3", "attention_bias")}

_MISSING = object()


def _lookup(cfg: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(cfg, dict) or part not in cfg:
            return _MISSING
        cfg = cfg[part]
    return cfg


def _flips(f, value: Any) -> list:
    """Other valid values of symbol `f` to try, in order (empty: no flip for this kind)."""
    if f.type == "str" and f.values and value in f.values and len(f.values) > 1:
        return [v for v in f.values if v != value]       # every admitted alternative (some GELUs are one function)
    flipped = _flip(f, value)
    if f.type == "float" and flipped is not None and isinstance(value, float):
        return [flipped, value * 20 if value else 1.0]   # smaller, then larger
    if f.type == "int" and flipped is not None and isinstance(value, int) and value > 1:
        return [flipped, value * 3]       # a rounding multiple may already divide the size at 2x (LFM2's 32 -> 64)
    return [] if flipped is None else [flipped]


def _flip(f, value: Any) -> Any:
    """Another valid value of symbol `f` (None: no flip for this kind)."""
    t = f.type
    if value is None or value is _MISSING:
        return {"int": 4, "float": 10.0, "bool": True}.get(t) if f.optional or value is _MISSING else None
    if t == "bool":
        return not value
    if t == "int":
        return value * 2 if value else 1
    if t == "float" and isinstance(value, int) and not isinstance(value, bool):
        return value * 2                   # an int-valued field (transformers may type it int)
    if t == "float":
        return min(value * 1e5, 0.5) if 0 < value < 1e-2 else value * 0.05
    if t == "str":
        others = [v for v in (f.values or ()) if v != value]
        if f.values and not others:        # one admitted value: another activation must be refused by name
            return "gelu" if value != "gelu" else "relu"
        return others[0] if others else None
    if t.endswith("_tuple") and not isinstance(value, (list, tuple)):
        value = [value]                    # a scalar is a 1-tuple
    if t == "str_tuple" and value:
        other = next((v for v in value if v != value[0]), None)
        return [other] + list(value[1:]) if other is not None else None
    if t == "int_tuple" and value and all(v in (0, 1) for v in value):   # flags per layer (no_rope_layers)
        return [1 - value[0]] + list(value[1:])
    if t == "int_tuple" and value:
        return [value[0] + 1] + list(value[1:])
    return None


def _logprobs_moved(spec, path: str, base: Path, ckpt: Path) -> bool:
    """Finer than tokens: transformers' prompt log-probabilities of a 30-token prompt on the flipped checkpoint
    differ from the base's (> 1e-4); then the engine's must equal them (1e-4, float32). False when transformers'
    do not move either."""
    import numpy as np
    import torch
    from hf_ref import hf_prefill_logits

    from xllm_gen import LLM, SamplingParams

    ids = np.random.default_rng(0).integers(0, 400, 30).tolist()
    ref = torch.log_softmax(hf_prefill_logits(ckpt, ids), -1)
    if (ref - torch.log_softmax(hf_prefill_logits(base, ids), -1)).abs().max() <= 1e-4:
        return False
    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=4) as llm:
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=1,
                                                                       prompt_logprobs=0))[0]
    got = [out.prompt_logprobs[j][ids[j]].logprob for j in range(1, len(ids))]
    want = [float(ref[j - 1, ids[j]]) for j in range(1, len(ids))]
    err = max(abs(g - w) for g, w in zip(got, want))
    assert err <= 1e-4, f"{spec.name}: {path}: the engine's prompt log-probabilities differ from transformers' by {err}"
    return True


def _cases():
    out = []
    for spec in SPECS:
        ir = resolve(load_spec(spec.path))
        for f in ir.config:
            if f.derived or f.type == "rope":
                continue
            marks = () if (spec.name, f.name) in DEFAULT_ARM else (pytest.mark.slow,)
            out.append(pytest.param(spec, f.name, marks=marks, id=f"{spec.name}-{f.name}"))
    return out


@pytest.fixture(scope="module")
def tokens() -> Tokens:
    return Tokens()


@pytest.mark.engine
@pytest.mark.parametrize("spec, symbol", _cases())
def test_config_flip(spec, symbol, tiny_checkpoint, tokens):
    ir = resolve(load_spec(spec.path))
    fields = {f.name: f for f in ir.config}
    f = fields[symbol]
    base = tiny_checkpoint(spec.architecture)
    cfg = json.loads((base / "config.json").read_text())
    path = next((p for p in f.paths if _lookup(cfg, p) is not _MISSING), f.paths[0])
    value = _lookup(cfg, path)
    if value is _MISSING and f.default is not None:
        value = list(f.default) if isinstance(f.default, tuple) else f.default
    flips = _flips(f, value)
    generated = (Path(spec.path).parent.parent / "generated" / ir.name / "model.py").read_text()
    if not flips and f.type == "str_tuple" and value:   # one value throughout: another the generated code tests
        words = {w for line in generated.splitlines() if f"config.{symbol}" in line
                 for w in re.findall(r"'(\w+)'", line)} - {value[0]}
        flips = [[sorted(words)[0]] + list(value[1:])] if words else []
    if not flips:
        pytest.skip(f"config.{symbol} ({f.type} = {value!r}): no other valid value to flip to")
    # a field gated by another (use_sliding_window by a null sliding_window) is flipped again with the gate open:
    # the optional symbols that share an expression with it and are null in the tiny config get a value
    together = [set(e.names) for g in ir.config for e in (g.default_expr, g.expr) if e is not None]
    together += [set(re.findall(r"\bconfig\.(\w+)", line)) for line in generated.splitlines()]
    gates = {}
    for names in together:
        if symbol not in names:
            continue
        for n in names:
            h = fields.get(n)
            if h is not None and h is not f and h.optional and h.paths and \
                    _lookup(cfg, h.paths[0]) in (None, _MISSING) and _flip(h, None) is not None:
                gates[h.paths[0]] = _flip(h, None)
    candidates = [{path: flipped} for flipped in flips] + ([{path: flips[0], **gates}] if gates else [])
    tried = []
    for overrides in candidates:           # the first flip that changes transformers' output decides
        flipped = overrides[path]
        shown = ", ".join(f"{k}={v!r}" for k, v in overrides.items())
        try:
            ckpt = tiny_checkpoint(spec.architecture, overrides=overrides)
        except Exception as exc:  # noqa: BLE001 - transformers itself rejects the flipped config
            tried.append(f"{shown} (transformers rejects it: {type(exc).__name__})")
            continue
        try:
            got = tokens.engine(ckpt, 1)
        except Exception as exc:  # noqa: BLE001 - (b) a refusal must name the field
            leaf = path.split(".")[-1]
            if leaf in str(exc) or symbol in str(exc):
                return
            try:
                tokens.hf(ckpt)
            except Exception as hf_exc:  # noqa: BLE001 - not a runnable model for transformers either
                tried.append(f"{shown} (transformers cannot run it either: {type(hf_exc).__name__})")
                continue
            pytest.fail(f"{spec.name}: {shown} is refused without naming the field: {type(exc).__name__}: {exc}")
        try:
            want = tokens.hf(ckpt)
        except Exception as hf_exc:  # noqa: BLE001 - not a runnable model for transformers: not a valid flip
            tried.append(f"{shown} (transformers cannot run it: {type(hf_exc).__name__})")
            continue
        assert got == want, f"{spec.name}: {path}: {value!r} -> {flipped!r}: engine {got} != transformers {want}"
        if want != tokens.hf(base) or _logprobs_moved(spec, path, base, ckpt):
            return                         # (a): transformers' tokens (or, where the tokens stay, e.g. under a
                                           # monotone soft-cap, its log-probabilities) move, and the engine follows
        tried.append(f"{shown} (no effect)")
    if all("transformers" in t for t in tried):
        pytest.skip(f"transformers rejects every flip of {path}: {', '.join(tried)}")
    shadowed = [g.name for g in ir.config if g.default_expr is not None and symbol in g.default_expr.names
                and any(_lookup(cfg, p) is not _MISSING for p in g.paths)]
    assert symbol in NO_EFFECT or (spec.name, symbol) in NO_EFFECT_IN or (shadowed and f"config.{symbol}" not in generated), (
        f"{spec.name}: {path}: {value!r} -> {', '.join(tried)}: changes nothing in transformers nor in the engine: "
        f"the spec reads a field that does not reach the computation (or the flip is too small)")
