"""fp8 KV-cache scales from the checkpoint, per tensor or per KV head (called by runtime.loading.loader after the
weight plan).

Checkpoints calibrated for an fp8 KV cache hold one scale per attention layer for K and one for V (one value, or one
per KV head: compressed-tensors' `kv_cache_scheme` strategy `attn_head` writes [kv_heads, 1, 1]; [kv_heads] and
[kv_heads, 1] are read too), under the attention block's checkpoint prefix, in the forms vLLM reads:
- `<attn>.k_scale` / `<attn>.v_scale` (llm-compressor / compressed-tensors `kv_cache_scheme`, Quark);
- `<attn>.kv_scale` (older writers: one scale for both);
- `<attn>.k_proj.k_scale` / `<attn>.v_proj.v_scale` (ModelOpt);
- `<attn>.k_proj.output_scale` / `<attn>.v_proj.output_scale` (older compressed-tensors, AutoFP8);
- `<attn>.attn.k_scale` (vLLM-style names).

They are mapped onto the model's attention layers (runtime.layers.Attention) generically, through the weight plan:
the attention layer whose owning module's parameters load tensors under `<attn>.` gets them; no family and no
spec is named. A per-tensor scale is one value, the same on every TP rank; a per-head one is sharded as the K / V
heads are (rank r holds its KV heads' values; replicated heads when TP exceeds them), held by the layer as float32
[kv_heads, 1] (one value per head: a float). With kv_cache_dtype "fp8" each layer stores round(K / k_scale) in
float8 and reads it back times k_scale (V likewise; per head: each head's K by its own scale); a layer without
scales keeps 1.0. With kv_cache_dtype "auto" the scales are not used (logged once). Per-head scales are served by
the torch attention (CPU) and on CUDA: FlashInfer with q multiplied by its KV head's k_scale before the kernel and
the output by v_scale after it (runtime/attention/flashinfer_run.py), the Triton decode and store kernels reading
them per head.

Errors name the tensor: a scale that no attention layer owns, two scales for one layer's K (or V), a K scale without
its V scale, a scale that is neither one value nor one per KV head of its layer, not finite or not > 0 (the last
three only when the cache uses them), and
a config whose `kv_cache_scheme` promises static scales that the checkpoint does not hold.
"""
from __future__ import annotations

import logging
import re
from typing import Iterable, Optional

import torch

logger = logging.getLogger("xllm_gen.loading")


class KVScaleError(ValueError):
    pass


# patterns over a checkpoint tensor name: the attention prefix and which cache it scales ("k", "v" or "kv");
# the first match wins
_PATTERNS = (
    re.compile(r"(?P<pre>.+)\.(?P<w>[kv])_proj\.(?P=w)_scale"),       # ModelOpt
    re.compile(r"(?P<pre>.+)\.(?P<w>[kv])_proj\.output_scale"),       # compressed-tensors (older), AutoFP8
    re.compile(r"(?P<pre>.+)\.(?P<w>k|v|kv)_scale"),                  # llm-compressor, Quark; kv: older writers
)


def kv_scale_kind(name: str) -> Optional[tuple[str, str]]:
    """(attention prefix, "k" | "v" | "kv") of a KV-cache scale tensor name, else None."""
    for pat in _PATTERNS:
        m = pat.fullmatch(name)
        if m is not None:
            return m.group("pre"), m.group("w")
    return None


def _owners(model: torch.nn.Module, plan, attn_layers: list) -> tuple[dict, list]:
    """{checkpoint prefix: {attention index}} over every dotted prefix of the tensors that the parameters of each
    attention layer's owning module load, and each layer's own (module path, common checkpoint prefix)."""
    path_of = {id(m): n for n, m in model.named_modules()}
    by_prefix: dict[str, set] = {}
    info = []
    for i, layer in enumerate(attn_layers):
        path = path_of.get(id(layer), "")
        owner = path.rpartition(".")[0]
        head = owner + "." if owner else ""
        sources = [s for rule in plan if rule.param.startswith(head) for s in rule.sources]
        for s in sources:
            parts = s.split(".")
            for j in range(1, len(parts)):
                by_prefix.setdefault(".".join(parts[:j]), set()).add(i)
        common = _common_prefix(sources)
        info.append((path, common))
    return by_prefix, info


def _common_prefix(names: list) -> str:
    if not names:
        return ""
    parts = [n.split(".")[:-1] for n in names]
    out = []
    for col in zip(*parts):
        if any(c != col[0] for c in col):
            break
        out.append(col[0])
    return ".".join(out)


def _tp_size() -> int:
    try:
        from xllm_gen.runtime.executor.distributed import get_tp_size
        return get_tp_size()
    except Exception:       # noqa: BLE001 - no process group: one rank
        return 1


def _scale_value(name: str, t: torch.Tensor, layer, path: str, tp_size: int, tp_rank: int, device):
    """A KV-cache scale tensor as the layer holds it: a float (one value per tensor, or one per KV head all equal), or
    this rank's KV heads' values, float32 [kv_heads, 1] (per KV head: shape [H], [H, 1] or [H, 1, 1], H the layer's
    KV heads before TP; rank r holds the heads its K / V projection rows hold)."""
    from xllm_gen.runtime.executor.sharding import Segment, ShardingError, segment_range
    t = t.float()
    if not torch.isfinite(t).all() or (t <= 0).any():
        bad = t[~(torch.isfinite(t) & (t > 0))].flatten()[0].item()
        raise KVScaleError(f"tensor {name!r}: a KV-cache scale must be finite and > 0, got {bad!r}")
    if t.numel() == 1:
        return float(t.reshape(()).item())
    heads = t.shape[0] if t.dim() >= 1 else 0
    local = getattr(layer, "num_kv_heads", None)
    try:
        a, b = segment_range(Segment("kv_heads", heads, 1, replicate_ok=True), tp_size, tp_rank) if heads else (0, 0)
    except ShardingError:
        a, b = 0, -1
    if t.shape not in ((heads,), (heads, 1), (heads, 1, 1)) or b - a != local:
        raise KVScaleError(
            f"tensor {name!r} has shape {tuple(t.shape)}: a KV-cache scale is one value per tensor, or one per KV head "
            f"([kv_heads], [kv_heads, 1] or compressed-tensors' attn_head [kv_heads, 1, 1]); attention layer {path!r} "
            f"holds {local} KV heads" + (f" on each of {tp_size} TP ranks" if tp_size > 1 else "")
            + " (per-channel KV scales are not supported)")
    v = t.reshape(heads)
    if bool((v == v[0]).all()):                  # per head but one value: per tensor (the CUDA path runs it)
        return float(v[0].item())
    return v[a:b].reshape(-1, 1).contiguous().to(device)


def load_kv_scales(model: torch.nn.Module, plan, ckpt, names: Iterable[str], kv_fp8: bool,
                   scheme: Optional[str] = None, tp_rank: int = 0) -> set[str]:
    """Finds the KV-cache scale tensors among `names` (the checkpoint tensors the weight plan did not load), maps
    them onto the attention layers and, when `kv_fp8` (kv_cache_dtype fp8), sets each layer's k_scale / v_scale.
    `scheme`: the config's kv_cache_scheme ("tensor" / "head": static per-tensor / per-KV-head scales promised; the
    tensors' shapes decide how each is read). Returns the tensor names
    consumed (the loader's unexpected-tensor check skips them)."""
    from xllm_gen.runtime.layers.attention import Attention
    found = [(n, k) for n in sorted(names) if (k := kv_scale_kind(n)) is not None]
    attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not found:
        if scheme and kv_fp8 and attn_layers:
            _, info = _owners(model, plan, attn_layers[:1])
            pre = info[0][1] or "<attention>"
            raise KVScaleError(f"config.json quantization_config.kv_cache_scheme promises static fp8 "
                               f"KV-cache scales ({'per tensor' if scheme == 'tensor' else 'per KV head'}), but the checkpoint has none: missing tensor {pre + '.k_scale'!r} "
                               f"(and its '.v_scale'), one pair per attention layer")
        return set()
    if not attn_layers:
        raise KVScaleError(f"tensor {found[0][0]!r} is a KV-cache scale, but the model has no attention layer with "
                           f"a KV cache")
    by_prefix, info = _owners(model, plan, attn_layers)
    scales: dict[int, dict[str, str]] = {}
    for name, (pre, which) in found:
        owners = by_prefix.get(pre, set())
        if not owners and pre.endswith(".attn"):         # vLLM-style `<attn>.attn.k_scale`
            owners = by_prefix.get(pre[: -len(".attn")], set())
        if len(owners) != 1:
            what = "no attention layer loads tensors" if not owners else \
                f"{len(owners)} attention layers ({', '.join(info[i][0] for i in sorted(owners)[:3])}) load tensors"
            raise KVScaleError(f"tensor {name!r} looks like a KV-cache scale, but {what} under {pre + '.'!r}: it "
                               f"cannot be mapped onto one attention layer")
        i = next(iter(owners))
        got = scales.setdefault(i, {})
        for w in ("k", "v") if which == "kv" else (which,):
            if w in got:
                raise KVScaleError(f"tensors {got[w]!r} and {name!r} both give the {w.upper()} cache scale of "
                                   f"attention layer {info[i][0]!r}")
            got[w] = name
    for i, got in scales.items():
        for w, other in (("k", "v"), ("v", "k")):
            if w not in got:
                raise KVScaleError(f"missing tensor {info[i][1] + '.' + w + '_scale'!r}: attention layer "
                                   f"{info[i][0]!r} has the {other.upper()} cache scale {got[other]!r} but no "
                                   f"{w.upper()} one")
    used = {n for n, _ in found}
    if not kv_fp8:
        if tp_rank == 0:
            logger.warning("the checkpoint holds fp8 KV-cache scales (%d tensors, e.g. %s); kv_cache_dtype='auto' "
                           "keeps the KV cache in the model's dtype and ignores them (kv_cache_dtype='fp8' uses them)",
                           len(used), found[0][0])
        return used
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    tp_size = _tp_size()
    values: dict[str, object] = {}
    for name, _ in found:
        i = next(i for i, got in scales.items() if name in got.values())
        values[name] = _scale_value(name, ckpt.slice(name)[:], attn_layers[i], info[i][0], tp_size, tp_rank, device)
    for i, got in scales.items():
        attn_layers[i].k_scale = values[got["k"]]
        attn_layers[i].v_scale = values[got["v"]]
    heads = sum(isinstance(values[got[w]], torch.Tensor) for got in scales.values() for w in "kv")
    if heads and tp_rank == 0:
        logger.info("fp8 KV cache: per-KV-head scales on %d of %d K / V caches", heads, 2 * len(scales))
    left = [info[i][0] for i in range(len(attn_layers)) if i not in scales]
    if left and tp_rank == 0:
        logger.warning("fp8 KV cache: the checkpoint has KV-cache scales for %d of %d attention layers; %s keep "
                       "scale 1.0", len(scales), len(attn_layers), ", ".join(left[:4]) + (" ..." if len(left) > 4 else ""))
    return used
