"""Loads an HF checkpoint dir into a generated model by executing its weight plan.

The plan names tensors only; each parameter's own `weight_loader(param, loaded, shard_id)` (attached by
its layer, runtime.executor.sharding) decides which rows this rank reads from the lazy safetensors slice,
so each rank reads only its slices, never the whole tensor. Strict: a missing, unexpected, mis-shaped or
non-float tensor, a missing or unreadable file, and a parameter loaded twice or never are errors that
name the tensor, parameter or file.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path
from typing import Iterable, Optional

import torch

from xllm_gen.runtime.executor.sharding import WeightLoadError, default_weight_loader
from xllm_gen.runtime.loading.checkpoint_reader import Checkpoint, CheckpointError, ChunkView, LoadProgress  # noqa: F401 (re-exported)
from xllm_gen.runtime.loading.kv_scales import KVScaleError, load_kv_scales
from xllm_gen.runtime.loading.quant_config import QuantConfig
from xllm_gen.runtime.loading.quant_load import QuantLoad, QuantLoadError
from xllm_gen.runtime.loading.weights import StackedRows, WeightRule

# safetensors dtype names (get_dtype()) that hold floating-point values
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"}


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
        fused_of = dict(zip(rule.segments, rule.fused))     # segment -> the FusedSource of the tensor holding it
        fused_views: dict = {}            # (id of the source slice, its segments) -> its blocked view: k and v of a
                                          # `key_value` read through one view (one read of a rank's groups for both)

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
                part = fused_of.get(shard_id)
                if part is not None:              # a tensor holding several segments: this segment's rows of it
                    split = getattr(param, "tp_split", None)
                    if split is None or split.dim != 0 or len(split.segments) < 2:
                        raise WeightLoadError(f"segments {'+'.join(part.segments)} of one tensor: the parameter is "
                                              f"not a fused column-parallel one")
                    key = (id(sl), part.segments)
                    if key not in fused_views:
                        fused_views[key] = (sl, part.view(sl, split.segments))   # (sl kept alive: ids stay unique)
                    sl = part.segment_view(fused_views[key][1], shard_id)
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

        opened: dict = {}                 # a tensor that fills several segments (fused_of): opened once
        for name, shard_id in zip(rule.sources, shard_ids):
            if fused_of.get(shard_id) is not None and name in opened:
                sl = opened[name]
            else:
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
                if fused_of.get(shard_id) is not None:
                    opened[name] = sl
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
