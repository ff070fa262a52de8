"""GGUF checkpoints (the ggml project's single-file format): `LLM(model="x.gguf")` or a directory holding one.

A GGUF file is turned, once, into the Hugging Face checkpoint it was converted from, in a cache directory
(`$XLLM_GEN_CACHE/gguf/<file stem>-<hash of each file's path, size, mtime>/`, default `~/.cache/xllm_gen`): config.json,
model.safetensors (float32) and the tokenizer. Everything after that is the ordinary path (the config guard, the
spec's weight plan, TP sharding, the tokenizer), so every spec whose architecture transformers' GGUF integration
knows is served from GGUF at once. The conversion reuses transformers' GGUF integration (the `gguf` package reads
and dequantizes Q4_0 / Q4_1 / Q8_0 / K-quants; the GGUF tensor names are mapped to HF names, with the converter's q/k row
permutation undone where it applies), so the reference transformers loads from the same file is, by
construction, what the cache holds. Three things the cache holds beyond what transformers reads from the file:

- a split set (`<name>-00001-of-00003.gguf` ..., the ggml project's gguf-split: metadata in the first file, the
  tensors spread over all) is read as one checkpoint: naming any of its files, or the directory holding it, serves
  the set; a missing file of the set is an error naming it;
- the vocabulary size is the token embedding's rows (transformers takes the tokenizer's token count where the file
  has no `<arch>.vocab_size`; a token list shorter or longer than the embedding could not load);
- `<arch>.attention.key_length`, where the file has it, is the config's `head_dim` (transformers leaves some
  architectures' head_dim at the config class's default, which a model whose heads are of another size breaks).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Optional

CACHE_ENV = "XLLM_GEN_CACHE"
_FORMAT = "2"             # bump when the conversion changes


logger = logging.getLogger(__name__)

_SPLIT = re.compile(r"(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")      # gguf-split's names


class GgufError(ValueError):
    pass


def split_set(gguf: Path) -> list[Path]:
    """The files of the split set `gguf` belongs to, in order ([gguf] itself when it is not one); a missing file of
    the set is an error naming it."""
    m = _SPLIT.fullmatch(gguf.name)
    if m is None:
        return [gguf]
    count = int(m["count"])
    files = [gguf.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing or not 1 <= int(m["no"]) <= count:
        raise GgufError(f"{gguf}: a file of a split GGUF set of {count}, but {', '.join(missing) or gguf.name} "
                        f"{'is' if len(missing) == 1 else 'are'} missing (every file of the set is needed)")
    return files


def find_gguf(model: str | Path) -> Optional[Path]:
    """The GGUF file `model` names: a *.gguf file (of a split set: the set's first file), or a directory without
    config.json that holds exactly one GGUF file or the files of one split set."""
    p = Path(model)
    if p.is_file() and p.suffix == ".gguf":
        return split_set(p)[0]
    if p.is_dir() and not (p / "config.json").exists():
        files = sorted(p.glob("*.gguf"))
        if len(files) > 1:
            sets = {str(split_set(f)[0]) if _SPLIT.fullmatch(f.name) else str(f) for f in files}
            if len(sets) == 1:
                return Path(sets.pop())
            raise GgufError(f"{p}: holds several GGUF files ({', '.join(f.name for f in files)}): name one "
                            f"(LLM(model='{files[0]}'))")
        return split_set(files[0])[0] if files else None
    return None


def _cache_dir(gguf: Path) -> Path:
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "xllm_gen") / "gguf"
    stats = "".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}:" for f in split_set(gguf))
    key = hashlib.sha256(f"{stats}{_FORMAT}".encode()).hexdigest()[:16]
    return root / f"{gguf.stem}-{key}"


class _SetReader:
    """A split set read as one file: the first file's metadata, every file's tensors (what transformers' GGUF
    loader reads of a reader: `fields` and `tensors`)."""

    def __init__(self, first, others):
        self.fields = first.fields
        self.tensors = list(first.tensors) + [t for r in others for t in r.tensors]


_SWAP = threading.Lock()     # _as_one_file swaps a module attribute: one conversion of a split set at a time


@contextlib.contextmanager
def _as_one_file(files: list[Path]):
    """While open, gguf.GGUFReader of the set's first file reads the whole set (transformers' GGUF loader opens
    one file)."""
    import gguf as _gguf
    if len(files) == 1:
        yield
        return
    first = str(files[0].resolve())
    with _SWAP:
        reader_cls = _gguf.GGUFReader

        def reader(path, *args, **kwargs):
            r = reader_cls(path, *args, **kwargs)
            if str(Path(path).resolve()) != first:
                return r
            return _SetReader(r, [reader_cls(str(f)) for f in files[1:]])

        _gguf.GGUFReader = reader
        try:
            yield
        finally:
            _gguf.GGUFReader = reader_cls


def _field(gguf: Path, key: str):
    """One scalar metadata value of a GGUF file (None when absent)."""
    from gguf import GGUFReader
    f = GGUFReader(str(gguf)).fields.get(key)
    return None if f is None or not f.data else f.contents()


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
    files = split_set(gguf)
    try:
        with _as_one_file(files):
            config = AutoConfig.from_pretrained(d, gguf_file=name)
    except Exception as e:  # noqa: BLE001 - an unknown architecture / a bad file: named, one line
        raise GgufError(f"{gguf}: cannot be read as a GGUF checkpoint: {type(e).__name__}: {e}") from None
    arch = _field(gguf, "general.architecture")
    key_length = _field(gguf, f"{arch}.attention.key_length") if arch else None
    if key_length is not None and getattr(config, "head_dim", None) not in (None, int(key_length)):
        logger.info("%s: head_dim %s from %s.attention.key_length (the config's default was %s)", gguf.name,
                    key_length, arch, config.head_dim)
        config.head_dim = int(key_length)
    if not config.architectures:
        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if arch is None:
            raise GgufError(f"{gguf}: GGUF model_type {config.model_type!r} has no causal-LM architecture in "
                            f"transformers")
        config.architectures = [arch]
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)     # names only: GGUF -> HF tensor name map
    try:
        with _as_one_file(files):
            parsed = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=hf)
    except Exception as e:  # noqa: BLE001
        raise GgufError(f"{gguf}: cannot be dequantized: {type(e).__name__}: {e}") from None
    tensors = {k: v.to(torch.float32).contiguous() for k, v in parsed["tensors"].items()}
    if not tensors:
        raise GgufError(f"{gguf}: no tensor of the file maps to a {config.architectures[0]} parameter")
    embed = hf.get_input_embeddings()
    embed_name = next((n for n, p in hf.named_parameters() if embed is not None and p is embed.weight), None)
    rows = tensors[embed_name].shape[0] if embed_name in tensors else None
    if rows is not None and getattr(config, "vocab_size", rows) != rows:
        logger.warning("%s: vocab_size %d from the token embedding's rows (the file's tokenizer lists %d tokens)",
                       gguf.name, rows, config.vocab_size)
        config.vocab_size = rows
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": str(gguf)})
    config.dtype = torch.float32
    config.save_pretrained(tmp)
    try:
        with _as_one_file(files):
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
