"""GGUF checkpoints (the ggml project's single-file format): `LLM(model="x.gguf")` or a directory holding one.

A GGUF file is turned, once, into the Hugging Face checkpoint it was converted from, in a cache directory
(`$XLLM_GEN_CACHE/gguf/<file stem>-<hash of path, size, mtime>/`, default `~/.cache/xllm_gen`): config.json,
model.safetensors (float32) and the tokenizer. Everything after that is the ordinary path (the config guard, the
spec's weight plan, TP sharding, the tokenizer), so every spec whose architecture transformers' GGUF integration
knows is served from GGUF at once. The conversion reuses transformers' GGUF integration (the `gguf` package reads
and dequantizes Q4_0 / Q4_1 / Q8_0 / K-quants; the GGUF tensor names are mapped to HF names, with the converter's q/k row
permutation undone where it applies), so the reference transformers loads from the same file is, by
construction, what the cache holds.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Optional

CACHE_ENV = "XLLM_GEN_CACHE"
_FORMAT = "1"             # bump when the conversion changes


class GgufError(ValueError):
    pass


def find_gguf(model: str | Path) -> Optional[Path]:
    """The GGUF file `model` names: a *.gguf file, or a directory without config.json that holds exactly one."""
    p = Path(model)
    if p.is_file() and p.suffix == ".gguf":
        return p
    if p.is_dir() and not (p / "config.json").exists():
        files = sorted(p.glob("*.gguf"))
        if len(files) > 1:
            raise GgufError(f"{p}: holds several GGUF files ({', '.join(f.name for f in files)}): name one "
                            f"(LLM(model='{files[0]}'))")
        return files[0] if files else None
    return None


def _cache_dir(gguf: Path) -> Path:
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "xllm_gen") / "gguf"
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}:{_FORMAT}".encode()).hexdigest()[:16]
    return root / f"{gguf.stem}-{key}"


def gguf_to_hf_dir(gguf: str | Path) -> Path:
    """The HF checkpoint directory of a GGUF file (converted on first use, then cached)."""
    gguf = Path(gguf)
    out = _cache_dir(gguf)
    if (out / ".complete").exists():
        return out
    try:
        import gguf as _gguf  # noqa: F401
    except ImportError:
        raise GgufError(f"{gguf}: reading a GGUF file needs the `gguf` package (pip install 'xllm-gen[gguf]' "
                        f"or pip install gguf)") from None
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    d, name = str(gguf.parent), gguf.name
    try:
        config = AutoConfig.from_pretrained(d, gguf_file=name)
    except Exception as e:  # noqa: BLE001 - an unknown architecture / a bad file: named, one line
        raise GgufError(f"{gguf}: cannot be read as a GGUF checkpoint: {type(e).__name__}: {e}") from None
    if not config.architectures:
        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if arch is None:
            raise GgufError(f"{gguf}: GGUF model_type {config.model_type!r} has no causal-LM architecture in "
                            f"transformers")
        config.architectures = [arch]
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)     # names only: GGUF -> HF tensor name map
    try:
        parsed = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=hf)
    except Exception as e:  # noqa: BLE001
        raise GgufError(f"{gguf}: cannot be dequantized: {type(e).__name__}: {e}") from None
    tensors = {k: v.to(torch.float32).contiguous() for k, v in parsed["tensors"].items()}
    if not tensors:
        raise GgufError(f"{gguf}: no tensor of the file maps to a {config.architectures[0]} parameter")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": str(gguf)})
    config.dtype = torch.float32
    config.save_pretrained(tmp)
    try:
        AutoTokenizer.from_pretrained(d, gguf_file=name).save_pretrained(tmp)
    except Exception as e:  # noqa: BLE001 - a GGUF without a usable tokenizer still serves token ids
        (tmp / "TOKENIZER_ERROR.txt").write_text(f"{type(e).__name__}: {e}\n")
    (tmp / ".complete").write_text(str(gguf.resolve()) + "\n")
    if out.exists():                       # another process converted it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out


def resolve_model_path(model: str | Path) -> Path:
    """`model` itself, or the cached HF checkpoint directory of the GGUF file it names."""
    g = find_gguf(model)
    return gguf_to_hf_dir(g) if g is not None else Path(model)
