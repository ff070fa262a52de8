"""The small files of a checkpoint dir: config.json, generation_config.json and the tokenizer.

Each fault is one ValueError (CheckpointFileError) that names the file and, where there is one, the field:
unreadable or non-UTF-8 files, invalid JSON (with its line and column), a top level that is not an object,
fields of the wrong type, token ids outside the vocabulary. A tokenizer that is present but cannot be
loaded is an error naming its files (it is never silently dropped); a checkpoint without any tokenizer
file still serves prompt_token_ids.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

MAX_JSON_BYTES = 64 << 20        # config / generation config / index: far above any real one

# files whose presence means the checkpoint ships a tokenizer (transformers' AutoTokenizer reads them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "vocab.txt", "spiece.model", "special_tokens_map.json")
_JSON_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "special_tokens_map.json")

# generation_config.json fields the engine or a user may read, with what they must be
_GEN_NUMBERS = ("temperature", "top_p", "min_p", "typical_p", "repetition_penalty", "length_penalty",
                "presence_penalty", "frequency_penalty")
_GEN_INTS = ("top_k", "max_new_tokens", "max_length", "min_length", "min_new_tokens", "num_beams",
             "num_return_sequences", "no_repeat_ngram_size")
_GEN_TOKEN_IDS = ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id")


class CheckpointFileError(ValueError):
    """A config / generation config / tokenizer file of a checkpoint that cannot be used, named."""


def read_json(path: Path, what: str = "") -> Any:
    """A JSON file's value, or CheckpointFileError naming the file (and the line/column of a syntax error)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise CheckpointFileError(f"{path}: {size} bytes is too large for a {what or 'JSON'} file")
        raw = path.read_bytes()
    except OSError as e:
        raise CheckpointFileError(f"{path}: cannot be read: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise CheckpointFileError(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointFileError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except (ValueError, RecursionError) as e:
        raise CheckpointFileError(f"{path}: not valid JSON: {e}") from None


def read_config_json(model_dir: Path) -> dict:
    """config.json as a dict; a missing file, invalid JSON or a top level that is not an object is named."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointFileError(f"{model_dir}: not a Hugging Face checkpoint dir (no config.json)")
    cfg = read_json(path, "config.json")
    if not isinstance(cfg, dict):
        raise CheckpointFileError(f"{path}: the top level must be an object (field -> value), got "
                                  f"{type(cfg).__name__}")
    return cfg


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_generation_config(model_dir: Path, vocab_size: Optional[int] = None) -> dict:
    """generation_config.json (an empty dict when absent), with its known fields type-checked; token ids
    must lie in [0, vocab_size). Errors name the file and the field."""
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return {}
    gen = read_json(path, "generation_config.json")
    if not isinstance(gen, dict):
        raise CheckpointFileError(f"{path}: the top level must be an object (field -> value), got "
                                  f"{type(gen).__name__}")
    for key in _GEN_NUMBERS:
        v = gen.get(key)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)):
            raise CheckpointFileError(f"{path}: field '{key}' = {v!r} is not a finite number")
    for key in _GEN_INTS:
        v = gen.get(key)
        if v is not None and not _is_int(v):
            raise CheckpointFileError(f"{path}: field '{key}' = {v!r} is not an int")
    for key in _GEN_TOKEN_IDS:
        v = gen.get(key)
        if v is None:
            continue
        ids = v if isinstance(v, list) else [v]
        for t in ids:
            if not _is_int(t):
                raise CheckpointFileError(f"{path}: field '{key}' = {v!r} is not a token id or a list of token ids")
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                bound = f" [0, {vocab_size})" if vocab_size is not None else " >= 0"
                raise CheckpointFileError(f"{path}: field '{key}' has token id {t}, outside the vocabulary{bound}")
    return gen


def generation_eos_ids(gen: dict) -> list[int]:
    e = gen.get("eos_token_id")
    return list(e) if isinstance(e, list) else ([e] if e is not None else [])


def _blame_config(model_dir: Path) -> None:
    """AutoTokenizer reads config.json too: when transformers rejects that (e.g. an unknown layer_types entry),
    the error names config.json and transformers' reason, not the tokenizer."""
    if not (Path(model_dir) / "config.json").is_file():
        return
    try:
        from transformers import AutoConfig
        AutoConfig.from_pretrained(str(model_dir))
    except Exception as e:  # noqa: BLE001 - transformers' reason, shortened
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        why = " ".join(lines[:3])[:400] or type(e).__name__
        raise CheckpointFileError(f"{Path(model_dir) / 'config.json'}: transformers rejects this config: "
                                  f"{type(e).__name__}: {why}") from None


def _field_type_rejected(model_dir: Path) -> bool:
    """Whether transformers' config class refuses config.json for a field's type only (its strict dataclass)."""
    if not (Path(model_dir) / "config.json").is_file():
        return False
    try:
        from huggingface_hub.errors import StrictDataclassFieldValidationError
        from transformers import AutoConfig
    except ImportError:
        return False
    try:
        AutoConfig.from_pretrained(str(model_dir))
    except StrictDataclassFieldValidationError:
        return True
    except Exception:  # noqa: BLE001 - any other rejection is reported as it is
        return False
    return False


def load_tokenizer(tokenizer_dir: Path, *, required: bool = False):
    """AutoTokenizer from `tokenizer_dir`; None when the dir has no tokenizer file at all (and not
    `required`). A tokenizer that is present but cannot be loaded is a CheckpointFileError naming the file:
    the one that is not valid JSON when there is one, else the files present."""
    tokenizer_dir = Path(tokenizer_dir)
    if required and not tokenizer_dir.is_dir():       # transformers would read the path as a hub repo id
        raise CheckpointFileError(f"{tokenizer_dir}: the tokenizer dir "
                                  f"{'is a file' if tokenizer_dir.exists() else 'does not exist'}")
    present = [f for f in TOKENIZER_FILES if (tokenizer_dir / f).is_file()]
    if not present and not required:
        return None
    for name in _JSON_TOKENIZER_FILES:      # a corrupt JSON file is named precisely, before transformers reads it
        if name in present:
            read_json(tokenizer_dir / name, name)
            if (tokenizer_dir / name).stat().st_size == 0:
                raise CheckpointFileError(f"{tokenizer_dir / name}: empty file")
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except Exception as e:  # noqa: BLE001 - whatever transformers raises, the user learns which files failed
        if _field_type_rejected(tokenizer_dir):
            # transformers' strict config class refuses the TYPE of a config.json field (a release's int where the
            # class now wants a bool): the tokenizer does not depend on it, the spec's config guard judges the field
            try:
                from transformers import AutoTokenizer, PretrainedConfig
                return AutoTokenizer.from_pretrained(str(tokenizer_dir), config=PretrainedConfig())
            except Exception:  # noqa: BLE001 - reported below, as without the retry
                pass
        _blame_config(tokenizer_dir)
        files = ", ".join(present) or "no tokenizer files"
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointFileError(f"{tokenizer_dir}: the tokenizer ({files}) cannot be loaded: "
                                  f"{type(e).__name__}: {first[:300]}") from None
