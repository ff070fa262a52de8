"""The tiny checkpoint fixture (tests/fixtures/tiny_hf.py): any architecture from its name, shrunk generically,
loadable by transformers, and not flat under greedy decoding (or parity tests would prove little)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures.tiny_hf import make_tiny_checkpoint, tiny_config, tokenizer_size
from hf_ref import hf_greedy
from spec_sample import sampled
from spec_yaml import read_yaml

ROOT = Path(__file__).resolve().parents[1]
KNOWN = {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Gemma2ForCausalLM", "Qwen3ForCausalLM",
         "Qwen3VLForConditionalGeneration"}


def _spec_architectures() -> set[str]:
    out = set()
    for p in (ROOT / "specs").glob("*.yaml"):
        try:
            out.update((read_yaml(p) or {}).get("architectures") or [])
        except Exception:
            pass  # the battery reports an unreadable spec
    return out


def _in_transformers(arch: str) -> bool:
    """A class transformers has: a spec may also claim a remote-code checkpoint's own class name for the same model
    (ERNIE 4.5's published `Ernie4_5_ForCausalLM`), which no tiny checkpoint can be made for."""
    import transformers
    return hasattr(transformers, arch)


ARCHS = sorted(a for a in KNOWN | _spec_architectures() if _in_transformers(a))


def _stored_layers(ckpt) -> int:
    """Distinct layer indices among the checkpoint's tensor names (`...layers.N.` / `...h.N.`)."""
    import re

    from safetensors import safe_open
    found = set()
    for f in ckpt.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            found |= {m.group(1) for k in st.keys() for m in [re.search(r"(?:^|\.)(?:layers|h)\.(\d+)\.", k)] if m}
    return len(found)


@pytest.mark.parametrize("architecture", sampled("tiny_hf", ARCHS))
def test_tiny_checkpoint_loads_and_decodes(architecture, tiny_checkpoint):
    ckpt = tiny_checkpoint(architecture)
    cfg = json.loads((ckpt / "config.json").read_text())
    hf = tiny_config(architecture)
    text = getattr(hf, "text_config", None) or hf            # attribute names (GPT-J's n_embd is hidden_size)
    assert cfg["architectures"] == [architecture]
    assert text.vocab_size == tokenizer_size() and text.hidden_size <= 128     # 64 unless ARCH_DEFAULTS size it
    # 4, or a per-layer pattern of several block kinds (NemotronH: 6); a looped decoder (HRM-Text) executes more
    # layers than it stores: then its stored layers count
    assert text.num_hidden_layers <= 6 or 0 < _stored_layers(ckpt) <= 6, text.num_hidden_layers
    prompts = [list(range(10, 13)), list(range(40, 57))]
    outs = hf_greedy(ckpt, prompts, 16)
    assert outs[0] != outs[1], f"{architecture}: the continuation does not depend on the prompt"
    for o in outs:
        assert len(set(o)) >= 4, f"{architecture}: greedy decoding is flat: {o}"


def test_shrinking_follows_the_config_class():
    mistral = tiny_config("MistralForCausalLM")
    assert (mistral.sliding_window, mistral.head_dim, mistral.num_key_value_heads) == (6, 16, 2)
    assert tiny_config("Qwen2ForCausalLM").sliding_window is None      # a null window stays null
    gemma = tiny_config("Gemma2ForCausalLM", {"num_hidden_layers": 4, "head_dim": 8})
    assert gemma.layer_types == ["sliding_attention", "full_attention"] * 2
    assert gemma.query_pre_attn_scalar == 8                            # follows head_dim
    vl = tiny_config("Qwen3VLForConditionalGeneration", {"text_config.hidden_size": 96})
    assert vl.vision_config.out_hidden_size == 96 and vl.vision_config.depth == 3
    assert vl.vision_config.deepstack_visual_indexes == [0, 1, 2]
    assert vl.text_config.rope_parameters["mrope_section"] == [4, 2, 2]


def test_dict_overrides_merge():
    c = tiny_config("LlamaForCausalLM", {"rope_parameters": {"rope_type": "linear", "factor": 4.0}})
    assert c.rope_parameters == {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    vl = tiny_config("Qwen3VLForConditionalGeneration", {"text_config.rope_parameters": {"rope_theta": 100.0}})
    assert vl.text_config.rope_parameters["mrope_section"] == [4, 2, 2]
    assert vl.text_config.rope_parameters["rope_theta"] == 100.0


def test_same_arguments_same_files(tmp_path):
    kw = dict(overrides={"num_hidden_layers": 2}, seed=3)
    a = make_tiny_checkpoint("MistralForCausalLM", tmp_path / "a", **kw)
    b = make_tiny_checkpoint("MistralForCausalLM", tmp_path / "b", **kw)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "generation_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_unknown_architecture_is_named(tmp_path):
    with pytest.raises(ValueError, match="NoSuchForCausalLM"):
        make_tiny_checkpoint("NoSuchForCausalLM", tmp_path)


def test_checkpoints_are_built_once_per_session(tiny_checkpoint):
    a = tiny_checkpoint("Qwen3ForCausalLM")
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert tiny_checkpoint("Qwen3ForCausalLM") == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    assert tiny_checkpoint("Qwen3ForCausalLM", seed=1) != a
