"""Checkpoint tensors transformers drops at load, the spec drops too.

A model class's `_keys_to_ignore_on_load_unexpected` names the subtrees of released checkpoints that its modeling
code does not use: a multi-token-prediction head (`mtp.*`, DeepSeek-V3's `model.layers.61.*`), a vision tower beside
the language model that a text class serves. The engine refuses a checkpoint with tensors no parameter takes (so a
misnamed tensor is never silently left out); a spec that does not list such a subtree in
`ignore_checkpoint_tensors` refuses the real release (K-EXAONE's `mtp.*`, found by a blind exercise).

For every served class, each such pattern anchored at the start of a name (a subtree; unanchored fragments name
buffers, `inv_freq`, `attn.causal_mask`) is turned into a tensor name under it, which the spec's patterns must
match whole, as the loader matches them.
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _probe(pattern: str) -> str | None:
    """A tensor name under the subtree `pattern` names (None: not a subtree anchored at the start)."""
    if not (pattern.startswith("^") or pattern.startswith("(^|\\.)") or re.match(r"(model|mtp)\\?\.", pattern)):
        return None
    s = pattern.replace("(^|\\.)", "").lstrip("^").rstrip("$")
    s = re.sub(r"\([^()]*\)\?", "", s)                     # optional groups left out
    s = re.sub(r"\\d\+|\[0-9\]\+", "0", s).replace("\\.", "<D>")
    s = s.replace("<D>.*", "<D>x").replace(".*", ".x").replace("<D>", ".")
    return s if s.endswith(".x") else s.rstrip(".") + ".x.weight"


def _served():
    for path in sorted((ROOT / "specs").glob("*.yaml")):
        try:
            model = importlib.import_module(f"xllm_gen.generated.{path.stem}.model")
        except ImportError:
            continue
        yield path.stem, model


def test_probe_names_a_tensor_under_the_subtree():
    assert _probe(r"^mtp.*") == "mtp.x"
    assert _probe(r"model\.layers\.61.*") == "model.layers.61.x"
    assert _probe(r"^model\.(language_model\.)?mtp\.") == "model.mtp.x.weight"
    assert _probe(r"^model\.vision_tokenizer\.") == "model.vision_tokenizer.x.weight"
    assert _probe("inv_freq") is None


def test_specs_skip_the_tensors_transformers_skips():
    import transformers
    missing = []
    for name, model in _served():
        patterns = getattr(model, "IGNORED_CHECKPOINT_TENSORS", ())
        for arch in model.ARCHITECTURES:
            for pat in getattr(getattr(transformers, arch, None), "_keys_to_ignore_on_load_unexpected", None) or ():
                probe = _probe(pat)
                if probe is None:
                    continue
                if not any(re.fullmatch(p, probe) for p in patterns):
                    missing.append(f"specs/{name}.yaml ({arch}): transformers skips {pat!r} (e.g. {probe}); "
                                   f"ignore_checkpoint_tensors has {list(patterns)}")
    assert not missing, "\n".join(missing)
