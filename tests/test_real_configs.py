"""Real config.json files of published checkpoints (tests/data/real_configs/, sources in MANIFEST.md) are read by
their spec's generated Config as the loader reads them: accepted, or refused for a documented reason (REFUSED
below). What is read is checked against the file as transformers reads it (its config class, no model built):
layers, heads, sizes, tie, rope theta and scaling type, per-layer windows. Our other tests build tiny configs from
transformers' config classes; these are the fields, nulls, legacy names and leftovers of the configs people serve.
At real size (meta device, nothing allocated): our model built from each file takes exactly the tensors, with
exactly the shapes, of the checkpoint transformers' model of the same file would save.
"""
from __future__ import annotations

import copy
import importlib
import json
import re
from pathlib import Path

import pytest
from spec_sample import in_default

from xllm_gen.runtime.loading import registry
from xllm_gen.runtime.loading.hf_config import ConfigError

DATA = Path(__file__).parent / "data" / "real_configs"
FILES = sorted(DATA.glob("*.json"))

# file stem -> a regex of the refusal: a feature the spec deliberately does not model, named by its field, or a
# checkpoint kind no spec claims (refused at load by its `architectures`, naming them)
REFUSED: dict[str, str] = {
    # Qwen3.5 and Devstral Small 2 (Ministral 3) are published as vision-language checkpoints only: the text decoder
    # under text_config and model.language_model.*; specs/qwen3_5.yaml and ministral3.yaml serve the text-only
    # *ForCausalLM form. A VL spec's vision tower (see Qwen3-VL) is the way to serve them: not written yet
    "qwen3_5__Qwen3.5-9B": r"architectures \['Qwen3_5ForConditionalGeneration'\] are not served",
    "ministral3__Devstral-Small-2-24B-Instruct-2512":
        r"architectures \['Mistral3ForConditionalGeneration'\] are not served",
    # Qwen4-Exp's attention layers carry the QSA token indexer, not modelled (specs/qwen4_exp.yaml serves the
    # DeltaNet + MoE layers on hyper-connections): refused naming the guard symbol
    "qwen4_exp__Qwen4-Exp": r"indexed_attention_layers",
    # Zamba2-7B's config.json in Zyphra's own (pre-transformers) names: state_size, expansion_factor, ffn_hidden_size,
    # lora_rank, mamba_headdim 64 (112 heads). transformers' Zamba2Config reads none of them and would build 8 Mamba
    # heads (n_mamba_heads' default), which the weights do not fit: refused naming the fields
    "zamba2__Zamba2-7B-zyphra-format": r"ffn_hidden_size",
    # state-spaces/mamba2-2.7b is a mamba_ssm checkpoint (d_model, n_layer, ssm_cfg; backbone.* tensors), no
    # transformers config (no model_type, no architectures): transformers cannot load it either
    "mamba2__mamba2-2.7b": r"architectures",
    # Ring-*-linear-2.0 (lightning attention + MoE, remote code BailingMoeLinearV2ForCausalLM) and MiniMax-Text-01's
    # remote-code file: no spec claims the class (transformers 5.25 cannot load their model_type either)
    "bailing_hybrid__Ring-mini-linear-2.0": r"architectures \['BailingMoeLinearV2ForCausalLM'\] are not served",
    "bailing_hybrid__Ring-flash-linear-2.0": r"architectures \['BailingMoeLinearV2ForCausalLM'\] are not served",
    "minimax__MiniMax-Text-01": r"architectures \['MiniMaxText01ForCausalLM'\] are not served",
    # the ternary BitNet release's quantization (packed 2-bit weights) is not modelled; its master weights are served
    "bitnet__bitnet-b1.58-2B-4T": r"quantization_config: quant_method='bitnet' is not supported",
}

DROP = object()        # an AS_TRANSFORMERS edit that removes the field

# file stem -> (edit, why): where transformers 5 cannot read the release as published, the same settings written the way
# it reads them; our spec reads the file as published, transformers the edited copy (checked equal below)
AS_TRANSFORMERS: dict[str, tuple[dict, str]] = {
    # MiMo-V2-Flash's `rope_scaling: null` makes transformers 5.25 drop its per-layer-type rope (it then cannot build
    # the model); without the null it derives them from rope_theta / swa_rope_theta / partial_rotary_factor
    "mimo_v2_flash__MiMo-V2-Flash": ({"rope_scaling": DROP}, "rope_scaling: null"),
    # its strict config class wants a bool; the release's 4 meant on (transformers 4.51 and vLLM test it by truth)
    "llama4__Llama-4-Scout-17B-16E": ({"attn_temperature_tuning": True}, "attn_temperature_tuning: 4"),
    # DbrxConfig 5.x reads the rope base from rope_parameters only, and drops attn_config.rope_theta (10000 then)
    "dbrx__dbrx-instruct": ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
                            "attn_config.rope_theta"),
    # xLSTMConfig (without the xlstm package) accepts only its native kernels; the engine never reads the choice
    "xlstm__xLSTM-7b": ({"chunkwise_kernel": "chunkwise--native_autograd", "sequence_kernel": "native_sequence__native",
                         "step_kernel": "native"}, "chunkwise_kernel / sequence_kernel / step_kernel"),
}

# file stem -> {field: why}: a field the spec reads differently on purpose (a documented limit it serves within)
LIMITS: dict[str, dict[str, str]] = {
    "kolibri1_1__documented-defaults": {"max_position_embeddings": "served up to the indexer's dense budget "
                                        "(docs/coverage.md, limit): longer requests are refused"},
}

# file stem -> why the real-size check cannot build transformers' checkpoint for it
HARNESS_CANNOT_BUILD: dict[str, str] = {
    "olmo_hybrid__documented-defaults": "transformers' save splits the fused conv1d into three equal q / k / v "
    "tensors (the reverse of its load-time Concatenate), which a model whose value heads are twice the key heads' "
    "width (these defaults) does not have; OLMo-core's own checkpoints store them at their sizes",
}

# (our layer kind, transformers' label) read as the same layer: Zamba's Mamba layers are "linear_attention" there
LAYER_KIND_LABELS = {("mamba", "linear_attention"): "linear_attention"}

# symbols compared with transformers' config attribute of the same name, where both exist
FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
          "intermediate_size", "tie_word_embeddings", "max_position_embeddings", "layer_types")
ROPE_NAMES = {"frequency_bands": "llama3"}        # the rotary's scaling kind -> transformers' rope_type


def _as_transformers(hf: dict, path: Path) -> dict:
    edit = AS_TRANSFORMERS.get(_stem(path), ({},))[0]
    return {k: v for k, v in {**hf, **edit}.items() if v is not DROP}


def _stem(path: Path) -> str:
    return path.name[:-len(".json")]


def _spec(path: Path) -> str:
    return _stem(path).split("__")[0]


def _read(path: Path):
    hf = json.loads(path.read_text())
    model = importlib.import_module(f"xllm_gen.generated.{_spec(path)}.model")
    return hf, model


def test_every_file_names_a_spec_and_is_in_the_manifest():
    manifest = (DATA / "MANIFEST.md").read_text()
    assert FILES
    for path in FILES:
        assert (Path(__file__).parents[1] / "specs" / f"{_spec(path)}.yaml").is_file(), path.name
        assert f"`{path.name}`" in manifest, f"{path.name}: no source in MANIFEST.md"
    for stem in (*REFUSED, *SLOW_AT_SIZE, *AS_TRANSFORMERS, *LIMITS, *HARNESS_CANNOT_BUILD):
        assert (DATA / f"{stem}.json").is_file(), stem


@pytest.mark.parametrize("path", FILES, ids=_stem)
def test_real_config_is_read(path):
    hf, model = _read(path)
    if _stem(path) in REFUSED:                    # refused at load, by resolve or by the config guard
        with pytest.raises(ValueError, match=REFUSED[_stem(path)]):
            resolved, _ = registry.resolve(hf)
            resolved.Config.from_hf(hf)
        if "quantization_config" not in REFUSED[_stem(path)]:
            return
        hf = {k: v for k, v in hf.items() if k != "quantization_config"}     # the model itself is read
    resolved, _ = registry.resolve(hf)            # its `architectures` reach this spec, as at load
    assert resolved is model, f"{path.name}: resolves to {resolved.__name__}"
    config = model.Config.from_hf(hf)
    transformers = pytest.importorskip("transformers")
    cls = transformers.CONFIG_MAPPING[hf["model_type"]]
    top = cls.from_dict(_as_transformers(hf, path))
    ref = getattr(top, "text_config", None) or top
    wrong = []
    for name in FIELDS:
        try:
            if not (hasattr(config, name) and hasattr(ref, name)):
                continue
            ours, want = getattr(config, name), getattr(ref, name)
            if name == "tie_word_embeddings" and ref is not top:
                want = top.tie_word_embeddings    # a composite model (Qwen3-VL) ties by the top-level flag
        except Exception as e:  # noqa: BLE001 - transformers 5's per-layer attributes (Gemma 4's full layers' KV
            if "per-layer attribute" not in str(e):      # heads) refuse a global read: the per-layer values differ
                raise
            continue
        if want is None and name == "head_dim":   # transformers derives it where the file has none
            continue
        if name in LIMITS.get(_stem(path), {}):
            continue
        if want is None and name == "intermediate_size" and hf.get("model_type") == "gpt_neo":
            continue                              # GPT-Neo's block derives 4 * hidden_size from a null field
        if isinstance(want, list):
            ours, want = list(ours), list(want)
            if name == "layer_types":             # transformers 5.25 labels a recurrent layer "linear_attention"
                ours = [LAYER_KIND_LABELS.get((o, w), o) for o, w in zip(ours, want)] + ours[len(want):]
        if ours != want:
            wrong.append(f"{name}: read {ours!r}, transformers {want!r}")
    rope = getattr(ref, "rope_parameters", None)
    if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
        rope = rope["full_attention"]             # per layer type (Gemma 3, OLMo 3): the global layers' rotary
    if isinstance(rope, dict) and "rope_theta" in rope and hasattr(config, "rope_theta"):
        if float(config.rope_theta) != float(rope["rope_theta"]):
            wrong.append(f"rope_theta: read {config.rope_theta}, transformers {rope['rope_theta']}")
    if isinstance(rope, dict) and isinstance(getattr(config, "rope_scaling", None), dict):
        kind = config.rope_scaling["rope_type"]
        if ROPE_NAMES.get(kind, kind) != rope.get("rope_type", "default"):
            wrong.append(f"rope type: read {kind}, transformers {rope.get('rope_type')}")
    assert not wrong, f"{path.name}: {wrong}"


def test_a_field_that_changes_the_math_is_still_refused():
    """The accepted leftovers are declared one by one: the same files with a value the spec does not build in, or an
    unknown field, are refused by name."""
    cases = [
        ("llama__SmolLM2-360M", {"rope_interleaved": True}, r"rope_interleaved=False.*has rope_interleaved=True"),
        ("qwen2__Qwen2.5-7B", {"use_mrope": True}, r"use_mrope"),
        ("starcoder2__starcoder2-15b", {"norm_type": "rms_norm"}, r"norm_type"),
        ("phi3__Phi-4-mini-instruct", {"attention_bias": True}, r"attention_bias"),
        ("gemma3__gemma-3-1b-it", {"some_new_field": 2}, r"some_new_field=2"),
        ("gpt2__gpt2", {"transformers.js_config": None, "n_inner": 1234, "scale_attn_weights": "yes"},
         r"scale_attn_weights"),
        ("mamba__mamba-130m-hf", {"rms_norm": False}, r"rms_norm=True.*has rms_norm=False"),
        ("qwen3_next__Qwen3-Next-80B-A3B-Thinking", {"use_sliding_window": True}, r"use_sliding_window"),
        ("nemotron_h__NVIDIA-Nemotron-3-Nano-30B-A3B", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
         r"rope_scaling"),
        ("glm4_moe_lite__GLM-4.7-Flash", {"first_k_dense_replace": 3}, r"first_k_dense_replace"),
    ]
    for stem, change, msg in cases:
        hf, model = _read(DATA / f"{stem}.json")
        with pytest.raises(ConfigError, match=msg):
            model.Config.from_hf({**hf, **change})


def test_the_manifest_lists_only_files_that_exist():
    names = set(re.findall(r"`([^`/]+__[^`/]+\.json)`", (DATA / "MANIFEST.md").read_text()))
    assert names == {p.name for p in FILES}, names ^ {p.name for p in FILES}


# ------------------------------------------------------------------------------------------------ at real size
# Reading the fields right is not enough: the spec's derived sizes, its per-layer patterns and its weight mapping
# must fit the checkpoint transformers would write at these settings. Both models are built at their REAL size on
# the meta device (no memory): transformers' from the file (its state dict is the checkpoint's tensor names and
# shapes), ours from the same file through the spec; our loader then fills every parameter from a checkpoint of
# those names and shapes (meta tensors behind a fake safetensors handle: shapes, sharding views and layouts are
# checked as at a real load, nothing is read). A size the spec derives differently from transformers fails here
# (a parameter that the tensor does not fit, a tensor no parameter takes, a parameter no tensor fills).


class _MetaHandle:
    """safe_open's interface over {name: meta tensor}."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def keys(self):
        return list(self.tensors)

    def get_slice(self, name):
        return _MetaSlice(self.tensors[name])


class _MetaSlice:
    """safe_open's slice interface (get_shape, get_dtype, indexing) over a meta tensor."""

    def __init__(self, t):
        self.t, self.shape, self.dtype = t, t.shape, t.dtype

    def get_shape(self):
        return list(self.t.shape)

    def get_dtype(self):
        return {"torch.bfloat16": "BF16", "torch.float16": "F16", "torch.float32": "F32"}.get(str(self.t.dtype), "F32")

    def __getitem__(self, idx):
        return self.t[idx]


def _hf_tensors(hf: dict) -> dict:
    """transformers' checkpoint tensors at this config: {name: meta tensor}, tied weights left out as save_pretrained
    leaves them out."""
    import torch
    transformers = pytest.importorskip("transformers")
    hf = copy.deepcopy({k: v for k, v in hf.items() if k != "quantization_config"})   # (transformers edits nested dicts)
    cfg = transformers.AutoConfig.for_model(**hf)
    # the release's own class where transformers has it (a vision-language checkpoint: its vision tower too)
    arch = getattr(transformers, (hf.get("architectures") or [""])[0], None)
    with torch.device("meta"):
        if arch is not None and "ForConditionalGeneration" in arch.__name__:
            model = arch._from_config(cfg, torch_dtype=torch.bfloat16)
        else:
            model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    state = model.state_dict()
    try:        # the names save_pretrained writes (transformers' conversion mapping reverted, e.g. GPT-NeoX embed_out)
        from transformers.core_model_loading import revert_weight_conversion
        state = revert_weight_conversion(model, state)
    except ImportError:
        pass
    tied = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}
    tie = getattr(cfg, "tie_word_embeddings", None)     # a composite model (Qwen3-VL) ties by its top-level flag
    if tie if tie is not None else getattr(cfg.get_text_config(), "tie_word_embeddings", False):
        for key in (tied if isinstance(tied, dict) else {k: None for k in tied}):
            state.pop(key, None)
    return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.items()}


def _load_at_size(model, hf: dict, tensors: dict, tmp_path, monkeypatch) -> set:
    """Our model built from `hf` at its size on the meta device, filled by our loader from `tensors`."""
    import torch

    from xllm_gen.runtime.executor import tp_check
    from xllm_gen.runtime.loading import checkpoint_reader
    from xllm_gen.runtime.loading import loader as LD
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "model.safetensors" for k in tensors}}))
    monkeypatch.setattr(checkpoint_reader, "_open", lambda p: _MetaHandle(tensors))
    config = model.Config.from_hf(hf)
    with torch.device("meta"), tp_check._default_dtype(torch.bfloat16):     # every tensor (float32 ones too)
        ours = model.Model(config)
    loaded = LD.load_weights(ours, model.weight_plan(ours), tmp_path, tp_size=1, tp_rank=0,
                             ignored=getattr(model, "IGNORED_CHECKPOINT_TENSORS", ()),
                             renames=getattr(model, "CHECKPOINT_RENAMES", ()))
    assert loaded == {n for n, _ in ours.named_parameters()}
    return loaded


# files whose real-size check takes more than ~5 s on CPU (tens of thousands of per-expert tensors each loaded through
# the loader): run with --runslow
SLOW_AT_SIZE = {
    "qwen3_next__Qwen3-Next-80B-A3B-Thinking",      # 48 layers x 512 experts: 74k tensors, ~25 s
    "glm4_moe__GLM-4.6",                            # 89 MoE layers x 160 experts: 43k tensors, ~15 s
    "apertus__Apertus-70B-Instruct-2509",           # 80 layers of 8192: ~8 s
}


# above this many (layer x routed expert) weight groups a release's real-size check takes ~2-3 s on CPU (10^4 - 10^5
# per-expert tensors through the loader): its spec's real size is checked with --runslow only (the loader's per-expert
# path is the same for the smaller MoE releases the default run builds)
HEAVY_EXPERT_GROUPS = 12000


def _expert_groups(path: Path) -> int:
    """layers x routed experts of a release (layers for a dense one): what its real-size check's time grows with."""
    c = json.loads(path.read_text())
    c = {**c, **(c.get("text_config") or {})}
    layers = next((c[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if isinstance(c.get(k), int)), 1)
    experts = [c[k] for k in ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts", "n_experts")
               if isinstance(c.get(k), int)]
    return layers * max(experts or [1])


def _at_size_default(path: Path) -> bool:
    """The default run builds one release per spec at real size (its smallest, by layers x experts); the others, the
    slowest and those over HEAVY_EXPERT_GROUPS are `slow` (~1-3 s each: 200 releases would add minutes to the default
    suite)."""
    mine = [p for p in FILES if _spec(p) == _spec(path) and _stem(p) not in SLOW_AT_SIZE and _stem(p) not in REFUSED]
    return bool(mine) and path == min(mine, key=lambda p: (_expert_groups(p), p.name)) \
        and _expert_groups(path) <= HEAVY_EXPERT_GROUPS


@pytest.mark.parametrize("path", [p if _at_size_default(p) and in_default("real_size", _spec(p))
                                  else pytest.param(p, marks=pytest.mark.slow)
                                  for p in FILES], ids=_stem)
def test_real_config_fits_transformers_checkpoint_at_real_size(path, tmp_path, monkeypatch):
    hf, model = _read(path)
    if _stem(path) in REFUSED and "quantization_config" not in REFUSED[_stem(path)]:
        pytest.skip("refused at load")
    if _stem(path) in HARNESS_CANNOT_BUILD:
        pytest.skip(HARNESS_CANNOT_BUILD[_stem(path)])
    hf = {k: v for k, v in hf.items() if k != "quantization_config"}   # transformers' from_config is unquantized
    _load_at_size(model, hf, _hf_tensors(_as_transformers(hf, path)), tmp_path, monkeypatch)


def test_real_size_check_fails_on_a_wrong_size_or_a_lost_tensor(tmp_path, monkeypatch):
    """The check above can fail: our model read with another MLP width than transformers' checkpoint has, or a
    checkpoint missing one tensor, or holding one tensor more, is refused by the loader, naming the tensor."""
    from xllm_gen.runtime.loading.loader import CheckpointError
    hf, model = _read(DATA / "llama__SmolLM2-360M.json")
    tensors = _hf_tensors(hf)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.(gate|up)_proj\.weight"):
        _load_at_size(model, {**hf, "intermediate_size": hf["intermediate_size"] + 64}, tensors, tmp_path / "a",
                      monkeypatch)
    lost = {k: v for k, v in tensors.items() if k != "model.layers.3.self_attn.k_proj.weight"}
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.3\.self_attn\.k_proj\.weight'"):
        _load_at_size(model, hf, lost, tmp_path / "b", monkeypatch)
    extra = {**tensors, "model.layers.0.self_attn.q_norm.weight": tensors["model.norm.weight"]}
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*q_norm"):
        _load_at_size(model, hf, extra, tmp_path / "c", monkeypatch)
