"""Loads an HF checkpoint dir into a generated model by executing its weight plan.

The plan names tensors only; each parameter's own `weight_loader(param, loaded, shard_id)` (attached by
its layer, runtime.executor.sharding) decides which rows this rank reads from the lazy safetensors slice,
so each rank reads only its slices, never the whole tensor. Strict: a missing, unexpected, mis-shaped or
non-float tensor, a missing or unreadable file, and a parameter loaded twice or never are errors that
name the tensor, parameter or file.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Iterable, Optional

import torch
from safetensors import safe_open

from xllm_gen.runtime.executor.sharding import WeightLoadError, default_weight_loader
from xllm_gen.runtime.loading.checkpoint_files import CheckpointFileError, read_json
from xllm_gen.runtime.loading.kv_scales import KVScaleError, load_kv_scales
from xllm_gen.runtime.loading.quant_config import QuantConfig
from xllm_gen.runtime.loading.quant_load import QuantLoad, QuantLoadError
from xllm_gen.runtime.loading.weights import StackedRows, WeightRule

# safetensors dtype names (get_dtype()) that hold floating-point values
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"}


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


def _check_dtype(sl, name: str, param: torch.Tensor, pname: str, where: Path) -> None:
    try:
        dtype = sl.get_dtype()
    except AttributeError:
        return
    if param.is_floating_point() and dtype not in _FLOAT_DTYPES:
        raise CheckpointError(f"tensor {name!r}: dtype {dtype} cannot fill the floating-point parameter "
                              f"{pname!r} ({param.dtype}) (file {where})")


def get_tp_rank_safe() -> int:
    try:
        from xllm_gen.runtime.executor.distributed import get_tp_rank
        return get_tp_rank()
    except Exception:
        return 0


def _check_tp(params: dict, tp_size: Optional[int], tp_rank: Optional[int]) -> None:
    """The model's layers were built for one TP rank; loading it as another would read the wrong rows."""
    for name, p in params.items():
        split = getattr(p, "tp_split", None)
        if split is None or split.dim is None:
            continue
        if (tp_size is not None and split.tp_size != tp_size) or (tp_rank is not None and split.tp_rank != tp_rank):
            raise CheckpointError(f"parameter {name!r} was built for tp rank {split.tp_rank}/{split.tp_size}, "
                                  f"but the loader was asked for rank {tp_rank}/{tp_size}")
        return


def _check_tied_copies(model: torch.nn.Module, params: dict, ckpt, qload, model_dir) -> set[str]:
    """A checkpoint tensor named after a parameter that the model shares with another (a head tied to the
    embedding by config.json) must hold the same values: transformers does NOT tie the two when both tensors are
    present and differ (it serves the stored head), so tying would serve another model. Equal copies are used (read
    and compared, this rank's slice); a different one is an error naming both. Returns the names checked."""
    checked = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in params or name not in ckpt.file_of:
            continue
        owner = next(n for n, q in params.items() if q is p)
        split = getattr(p, "tp_split", None)
        copy = torch.empty_like(p.data)
        try:
            (split.load if split is not None else default_weight_loader)(copy, qload.open(name), None)
        except WeightLoadError as e:
            raise CheckpointError(f"{model_dir}: tensor {name!r} (tied to {owner!r} by config.json): {e}") from None
        if not torch.equal(copy, p.data):
            raise CheckpointError(
                f"{model_dir}: tensor {name!r} differs from {owner!r}, which config.json ties it to "
                "(tie_word_embeddings): transformers then does not tie them and serves the stored tensor. Set "
                "tie_word_embeddings to false in config.json to serve it, or remove the tensor to tie")
        checked.add(name)
    return checked


def _check_finite(param: torch.Tensor, rule: WeightRule, ckpt) -> None:
    """A NaN or infinite value in a loaded weight (a corrupted file, a bad conversion) is an error naming the
    tensor: served, it turns every logit NaN and the greedy tokens into token 0, silently. One float32-accumulated
    sum per chunk (NaN and inf propagate; finite bf16 / fp16 weights cannot overflow it), no copy of the weight."""
    if not param.dtype.is_floating_point or param.numel() == 0 or param.is_meta:      # (meta: a shapes-only load)
        return
    flat = param.detach().reshape(-1)
    if all(bool(torch.isfinite(c.sum(dtype=torch.float32))) for c in flat.split(1 << 26)):
        return
    bad = int((~torch.isfinite(flat)).sum())
    if bad == 0:                 # finite values whose float32 sum overflowed: nothing wrong
        return
    # the stored tensors (a quantized weight's packed parts: a NaN scale is named, not the dequantized weight)
    sources = [m for n in rule.sources for m in ckpt.stored_parts(n)]
    culprits = []
    for n in sources:            # which stored tensor (re-read on the host: only on this error path)
        try:
            t = ckpt.slice(n)[:]
        except Exception:        # noqa: BLE001 - a source that cannot be read whole here: named with the others
            culprits = []
            break
        if t.dtype.is_floating_point and not bool(torch.isfinite(t if t.element_size() > 1 else t.float()).all()):
            culprits.append(n)
    names = ", ".join(repr(n) for n in (culprits or rule.sources))
    where = sorted({str(ckpt.path_of(n)) for n in (culprits or sources)})
    raise CheckpointError(f"tensor {names} -> parameter {rule.param!r}: {bad} NaN / infinite value(s) of "
                          f"{flat.numel()} (file {', '.join(where) or '?'}): the checkpoint is corrupted")


def load_weights(model: torch.nn.Module, plan: list[WeightRule], model_dir: str | Path, *,
                 tp_size: Optional[int] = None, tp_rank: Optional[int] = None, ignored: Iterable[str] = (),
                 quant: Optional[QuantConfig] = None, kv_cache_dtype: str = "auto",
                 renames: Iterable[tuple[str, str]] = ()) -> set[str]:
    """Fills `model`'s parameters from the checkpoint; returns the set of loaded parameter names.
    `quant` (runtime.loading.quant_config): how float8 weights are dequantized and which layers quantize their
    activations (runtime.loading.quant_load); a float8 tensor without it is an error.
    `kv_cache_dtype`: "fp8" / "fp8_e4m3" gives the attention layers the checkpoint's per-tensor KV-cache scales
    (runtime.loading.kv_scales); "auto" leaves them unused. `renames`: the generated module's CHECKPOINT_RENAMES
    ((regex, replacement) pairs applied to the checkpoint's tensor names before anything reads them).

    The TP rank is the one the model's layers were built for (get_tp_rank() at build time); `tp_size` /
    `tp_rank`, when given, must agree with it."""
    ckpt = Checkpoint(model_dir, renames)
    ckpt.adopt_base_prefix(n for rule in plan for n in rule.sources)
    qload = QuantLoad(model, ckpt, quant)
    params = dict(model.named_parameters())
    # the device of the model's real parameters (a meta one, layers/moe.py experts_on_meta, is made real there);
    # None for a shapes-only load (every parameter on meta): nothing is made real
    device = next((p.device for p in params.values() if not p.is_meta), None)
    _check_tp(params, tp_size, tp_rank)
    loaded: set[str] = set()
    used_sources: set[str] = set()
    progress = LoadProgress(len(plan), model_dir, enabled=tp_rank in (None, 0) and (get_tp_rank_safe() == 0))
    for rule in plan:
        if rule.param not in params:
            raise CheckpointError(f"weight plan names parameter {rule.param!r}, which the model does not have")
        if rule.param in loaded:
            raise CheckpointError(f"parameter {rule.param!r} is loaded twice by the weight plan")
        param = params[rule.param]
        loader = getattr(param, "weight_loader", default_weight_loader)
        shard_ids = rule.segments or (None,)
        quantized = []                    # (source view, shard_id) of a quantized layer's weight (to repack)
        deferred = []                     # a meta-device parameter's sources (experts_on_meta): filled packed, or
                                          # into the parameter once it is made real
        def fill(dst, sl, name, shard_id):
            try:
                if rule.stored is not None:                    # stored transposed / segments interleaved
                    stored = rule.stored
                    if stored.transpose and getattr(sl, "packed_along_input", False):
                        stored = dataclasses.replace(stored, transpose=False)      # MXFP4: [.., out, in] always
                    sl = stored.view(sl)
                if rule.layout is not None:       # per-head / per-KV-group rows, seen blocked before sharding
                    split = getattr(param, "tp_split", None)
                    if split is None or split.dim != 0 or len(split.segments) < 2:
                        raise WeightLoadError(f"row layout per {rule.layout.per}: the parameter is not a fused "
                                              f"column-parallel one")
                    sl = rule.layout.view(sl, split.segments)
                loader(dst, sl, shard_id)
            except WeightLoadError as e:
                seg = f" (segment {shard_id!r})" if shard_id is not None and "segment" not in str(e) else ""
                raise CheckpointError(f"tensor {name!r} -> parameter {rule.param!r}{seg}: {e} "
                                      f"(file {ckpt.path_of(name)})") from None
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - a read that fails mid-tensor (file truncated after its header)
                raise CheckpointError(f"tensor {name!r}: cannot be read from {ckpt.path_of(name)}: "
                                      f"{type(e).__name__}: {e}") from None

        for name, shard_id in zip(rule.sources, shard_ids):
            if "{h}" in name:           # one tensor per row (head) of the parameter: h = 0, 1, ... while present
                rows = list(itertools.takewhile(lambda n: n in ckpt.file_of,
                                                (name.replace("{h}", str(h)) for h in itertools.count())))
                if not rows:
                    raise CheckpointError(f"{model_dir}: missing tensor {name.replace('{h}', '0')!r} (row 0 of "
                                          f"{name!r}, stacked into parameter {rule.param!r})")
                used_sources.update(rows)
                sl, name = StackedRows([qload.open(n) for n in rows]), rows[0]
            else:
                try:
                    sl = qload.open(name)
                except QuantLoadError as e:       # a quantized weight's parts: named with their file
                    raise CheckpointError(f"{model_dir}: {e} (file {ckpt.path_of(name)})") from None
            try:
                sl = qload.source(rule.param, name, sl)
            except QuantLoadError as e:
                raise CheckpointError(f"{model_dir}: {e}") from None
            _check_dtype(sl, name, param, rule.param, ckpt.path_of(name))
            if param.is_meta and device is not None:
                deferred.append((sl, name, shard_id))
            else:
                fill(param, sl, name, shard_id)
            if hasattr(sl, "with_component"):
                quantized.append((sl, name, shard_id))
        packed = False
        if quantized and len(quantized) == len(rule.sources) and qload.packs(rule.param, param):      # this rank's codes / scales, read the same way
            parts = {}
            for comp in quantized[0][0].COMPONENTS:
                parts[comp] = torch.empty(param.shape, dtype=torch.float32, device=device or param.device)
                for sl, name, shard_id in quantized:
                    fill(parts[comp], sl.with_component(comp), name, shard_id)
            packed = qload.pack(rule.param, param, parts)
        if deferred and not packed:       # not packed after all: the parameter made real and filled
            mod_name, _, attr = rule.param.rpartition(".")
            param = params[rule.param] = qload.materialize(mod_name, attr, param, device)
            for sl, name, shard_id in deferred:
                fill(param, sl, name, shard_id)
        split = getattr(param, "tp_split", None)
        if rule.segments and split is not None:
            filled = set()
            for s in rule.segments:      # a stacked expert parameter's bare segment name fills it for every expert
                filled.update(split.segment_indices(s) if hasattr(split, "segment_indices") else (split.segment_index(s),))
            left = [n for i, n in enumerate(split.segment_names) if i not in filled]
            if left:
                raise CheckpointError(f"parameter {rule.param!r}: the weight plan fills segments "
                                      f"{', '.join(map(str, rule.segments))} but not {', '.join(left)}")
        _check_finite(param, rule, ckpt)
        loaded.add(rule.param)
        used_sources.update(rule.sources)
        last = rule.sources[-1] if rule.sources else ""
        progress.step(next((ckpt.file_of[n] for n in (last, last + "_blocks", last[: -len("weight")] + "qweight")
                            if n in ckpt.file_of), "?"))       # a quantized source: the file of its packed tensor
    progress.close()
    try:
        used_sources |= qload.finish()
    except QuantLoadError as e:
        raise CheckpointError(f"{model_dir}: {e}") from None
    used_sources |= _check_tied_copies(model, params, ckpt, qload, model_dir)
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"{model_dir}: no checkpoint tensor for parameter(s) {', '.join(missing[:8])}"
                              + (" ..." if len(missing) > 8 else ""))
    patterns = [re.compile(p) for p in ignored]
    left = [n for n in ckpt.names() if n not in used_sources and not any(p.fullmatch(n) for p in patterns)]
    try:
        used_sources |= load_kv_scales(model, plan, ckpt, left, kv_fp8=kv_cache_dtype != "auto",
                                       scheme=quant.kv_scheme if quant is not None else None,
                                       tp_rank=get_tp_rank_safe() if tp_rank is None else tp_rank)
    except KVScaleError as e:
        raise CheckpointError(f"{model_dir}: {e}") from None
    unexpected = sorted(n for n in left if n not in used_sources)
    if unexpected:
        raise CheckpointError(f"{model_dir}: unexpected tensor(s) in the checkpoint: {', '.join(unexpected[:8])}"
                              + (" ..." if len(unexpected) > 8 else ""))
    return loaded
