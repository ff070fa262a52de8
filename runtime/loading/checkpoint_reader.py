"""The checkpoint side of loading: a checkpoint dir's safetensors files (one file, or shards through the index) read
lazily, tensor by tensor, with the renames a spec declares; errors name the tensor and its file (CheckpointError)."""
from __future__ import annotations

import collections
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Iterable, Optional

from safetensors import safe_open

from xllm_gen.runtime.loading.checkpoint_files import CheckpointFileError, read_json


class CheckpointError(ValueError):
    pass


# the tensors a quantized `<layer>.weight` is stored as (AWQ / GPTQ, compressed-tensors pack-quantized)
_QUANT_PARTS = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale", "weight_shape",
                "weight_zero_point", "weight_g_idx", "weight_scale_inv")


logger = logging.getLogger("xllm_gen.loading")
PROGRESS_ENV = "XLLM_PROGRESS"          # 0: no load progress; 1: progress lines even without a terminal


class LoadProgress:
    """Weight-loading progress on stderr: a tqdm bar over the weight plan when stderr is a terminal, else an
    INFO log line per file started and every 25% (shown by the server's log; quiet where logging is not set
    up, e.g. under tests and in the Python API). XLLM_PROGRESS=0 silences it; =1 forces the lines to stderr."""

    def __init__(self, total: int, model_dir, enabled: bool = True):
        mode = os.environ.get(PROGRESS_ENV, "")
        self.total, self.done, self.file, self.mark = total, 0, None, 0
        self.t0 = time.monotonic()
        self.bar = None
        self.enabled = enabled and mode != "0" and total > 0
        self.force = mode == "1"
        if self.enabled and not self.force and sys.stderr is not None and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=f"loading {Path(model_dir).name}", unit="param", leave=False,
                            file=sys.stderr)

    def _line(self, msg: str) -> None:
        if self.force:
            print(f"xllm-gen: {msg}", file=sys.stderr, flush=True)
        else:
            logger.info("%s", msg)

    def step(self, file: str) -> None:
        if not self.enabled:
            return
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
            return
        pct = 100 * self.done // self.total
        if file != self.file:
            self.file = file
            self._line(f"loading weights: {pct}% ({self.done}/{self.total} parameters), reading {file}")
        elif pct >= self.mark + 25:
            self.mark = pct - pct % 25
            self._line(f"loading weights: {pct}% ({self.done}/{self.total} parameters)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.enabled and self.bar is None:
            self._line(f"loaded {self.done} parameters in {time.monotonic() - self.t0:.1f} s")


def _open(path: Path):
    """safe_open, or a CheckpointError naming the file (empty, truncated, garbage header)."""
    if path.is_dir():
        raise CheckpointError(f"{path}: is a directory, not a safetensors file")
    try:
        return safe_open(str(path), framework="pt")
    except FileNotFoundError:
        raise
    except Exception as e:             # safetensors raises SafetensorError / OSError for a bad file
        size = path.stat().st_size if path.exists() else 0
        raise CheckpointError(f"{path}: not a readable safetensors file ({size} bytes): {e}") from None


class Checkpoint:
    """Lazy view of a checkpoint's safetensors files: tensor name -> file, opened on demand."""

    def __init__(self, model_dir: str | Path, renames: Iterable[tuple[str, str]] = ()):
        # renames: (regex, replacement) pairs; each tensor is known by its name rewritten by the first pattern that
        # matches (re.sub, once), as transformers' conversion mapping renames an original release's tensors
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        self.file_of: dict[str, str] = {}
        self._handles: dict[str, object] = {}
        self.stored_name: dict[str, str] = {}          # renamed -> the name in the file
        if index.exists():
            self.file_of = self._read_index(index)
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.dir}: no *.safetensors files and no model.safetensors.index.json")
            for f in files:
                h = self._handles[f.name] = _open(f)
                for name in h.keys():
                    if name in self.file_of:      # which copy is served would depend on the files' order
                        raise CheckpointError(
                            f"{self.dir}: tensor {name!r} is stored in two files, {self.file_of[name]} and {f.name} "
                            f"(and no model.safetensors.index.json says which to read): remove the stray file")
                    self.file_of[name] = f.name
        # a replacement that is a tuple of n names splits the tensor into n equal chunks of its first dim (transformers'
        # Chunk(dim=0) conversion): name k reads chunk k (lazily, only the rows asked for)
        self.chunk_of: dict[str, tuple[int, int]] = {}
        renames = [(re.compile(a), b) for a, b in renames]
        if renames:
            file_of: dict[str, str] = {}
            for name, fname in self.file_of.items():
                rule = next(((rx, to) for rx, to in renames if rx.search(name)), None)
                targets = ([name] if rule is None else [rule[0].sub(to, name, count=1) for to in rule[1]]
                           if isinstance(rule[1], (tuple, list)) else [rule[0].sub(rule[1], name, count=1)])
                for k, new in enumerate(targets):
                    if new in file_of:
                        other = self.stored_name.get(new, new)
                        raise CheckpointError(f"{self.dir}: tensors {other!r} and {name!r} both read as {new!r} after "
                                              f"the spec's checkpoint_renames")
                    file_of[new] = fname
                    if new != name:
                        self.stored_name[new] = name
                    if len(targets) > 1:
                        self.chunk_of[new] = (k, len(targets))
            self.file_of = file_of

    def adopt_base_prefix(self, expected: Iterable[str]) -> Optional[str]:
        """transformers' base_model_prefix rule: a checkpoint saved from the base model (the hub files of GPT-2 and
        BLOOM: 'h.0.attn.c_attn.weight', 'wte.weight'; OPT's: 'decoder.layers.0...') holds the names that the
        causal-LM class reads under '<prefix>.' ('transformer.', 'model.'). Where no checkpoint name starts with the
        prefix that most expected names share, but some start with a second component of it ('h', 'wte', 'decoder'),
        those are read as '<prefix>.<name>'. Returns the prefix adopted, or None."""
        heads = [n.split(".", 1) for n in expected if "." in n]
        if not heads:
            return None
        prefix = collections.Counter(first for first, _ in heads).most_common(1)[0][0]
        seconds = {rest.split(".", 1)[0] for first, rest in heads if first == prefix}
        if any(n.startswith(prefix + ".") for n in self.file_of):
            return None
        moved = {n: f"{prefix}.{n}" for n in self.file_of if n.split(".", 1)[0] in seconds}
        if not moved or any(new in self.file_of for new in moved.values()):
            return None
        for old, new in moved.items():
            self.file_of[new] = self.file_of.pop(old)
            self.stored_name[new] = self.stored_name.pop(old, old)
            if old in self.chunk_of:
                self.chunk_of[new] = self.chunk_of.pop(old)
        return prefix

    @staticmethod
    def _read_index(index: Path) -> dict[str, str]:
        try:
            data = read_json(index, index.name)
        except CheckpointFileError as e:            # not UTF-8, not JSON (line / column), unreadable, too large
            raise CheckpointError(str(e)) from None
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object (tensor name -> file name)")
        bad = [k for k, v in wm.items() if not isinstance(v, str) or not v]
        if bad:
            raise CheckpointError(f"{index}: weight_map entry {bad[0]!r} does not name a file")
        for name, fname in wm.items():     # a shard is a file of the checkpoint dir (as the hub stores them)
            parts = Path(fname).parts
            if Path(fname).is_absolute() or ".." in parts:
                raise CheckpointError(f"{index}: weight_map names {fname!r} for {name!r}, a path outside the "
                                      f"checkpoint dir: shards are named relative to it")
        return dict(wm)

    def names(self) -> Iterable[str]:
        return self.file_of.keys()

    def _layer_hint(self, name: str) -> str:
        """Why a per-layer tensor is missing when its whole layer is: config.json asks for more layers than the
        checkpoint holds (num_hidden_layers too large, or the files of the last layers missing)."""
        m = re.search(r"\.(\d+)\.", name)
        if m is None:
            return ""
        head = name[:m.start()]
        present = {int(x.group(1)) for n in self.file_of
                   if n.startswith(head + ".") and (x := re.match(r"\.(\d+)\.", n[len(head):]))}
        layer = int(m.group(1))
        if not present or layer in present:
            return ""
        return (f": the checkpoint holds {head}.* for {len(present)} layers ({min(present)}..{max(present)}), not "
                f"layer {layer}; config.json asks for more layers (num_hidden_layers) than these files hold")

    def stored_parts(self, name: str) -> list[str]:
        """The checkpoint tensors that hold tensor `name`: itself, or a quantized weight's packed parts (AWQ / GPTQ
        `<layer>.qweight`, `.qzeros`, `.scales`, `.g_idx`; compressed-tensors `<layer>.weight_packed`, ...; MXFP4
        `<name>_blocks`, `<name>_scales`)."""
        if name in self.file_of:
            return [name]
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        return sorted(n for n in self.file_of if n.startswith(name + "_") or (
            base is not None and n.startswith(base + ".") and n.rpartition(".")[2] in _QUANT_PARTS))

    def path_of(self, name: str) -> Path:
        """The file that holds tensor `name` (for messages; a quantized weight: the file of its packed parts)."""
        parts = self.stored_parts(name)
        return self.dir / (self.file_of[parts[0]] if parts else "?")

    def slice(self, name: str):
        if name not in self.file_of:
            raise CheckpointError(f"{self.dir}: missing tensor {name!r}{self._layer_hint(name)}")
        fname = self.file_of[name]
        if fname not in self._handles:
            path = self.dir / fname
            if not path.exists():
                raise CheckpointError(f"{self.dir}: index names {fname!r} for {name!r}, but the file is missing")
            self._handles[fname] = _open(path)
        try:
            sl = self._handles[fname].get_slice(self.stored_name.get(name, name))
        except Exception as e:
            raise CheckpointError(f"{self.dir / fname}: cannot read tensor {name!r} (the index names this "
                                  f"file for it): {e}") from None
        if name in self.chunk_of:
            k, n = self.chunk_of[name]
            rows = int(sl.get_shape()[0]) if sl.get_shape() else 0
            if rows % n:
                raise CheckpointError(f"{self.dir / fname}: tensor {self.stored_name[name]!r} has {rows} rows, which "
                                      f"do not split into the {n} equal chunks the spec's checkpoint_renames name")
            sl = ChunkView(sl, k * rows // n, rows // n)
        return sl


class ChunkView:
    """Rows [start, start + rows) of a lazy safetensors slice: get_shape() / get_dtype() and basic slicing, reading only
    the rows asked for (a checkpoint_renames split)."""

    def __init__(self, base, start: int, rows: int):
        self.base, self.start, self.rows = base, start, rows

    def get_shape(self) -> list[int]:
        return [self.rows] + [int(s) for s in self.base.get_shape()[1:]]

    def get_dtype(self):
        return self.base.get_dtype()

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        first = idx[0] if idx else slice(None)
        if not isinstance(first, slice) or first.step not in (None, 1):
            raise TypeError("ChunkView supports plain slices of its first dim only")
        a, b, _ = first.indices(self.rows)
        return self.base[(slice(self.start + a, self.start + max(a, b)),) + tuple(idx[1:])]
