"""The row layout of a fused q/k/v projection and the attention's KV head count for `xllm-gen draft` (codegen/draft.py),
found by running the attention, never from a family's name:

  - the model is built small on the CPU (a few heads, one layer) and run on one token at position 0 (where rotary turns
    nothing); the fused projection's output is replaced by its row numbers (1, 2, ...) and the query, key and value the
    attention function receives are read back: which rows became which head of which segment. That order is compared
    with the layouts a spec can state (`per: tensor`: [q | k | v]; `head`: [h0: q k v, ...]; `kv_group`: [g0: q *
    (heads / kv_heads), k, v, ...]);
  - every combination of the bool config fields the attention class reads is run (Falcon's `new_decoder_architecture`,
    `multi_query`): the layout drafted is the one every combination agrees with; a combination transformers' own
    attention fails on is left out. Where none fits every combination but one flag splits them into two sets that
    each agree (ChatGLM's `multi_query_attention`: blocked with it, per head without), the layout is chosen by that
    flag (`layout: {if: flag, then: ..., else: ...}`, a `LayoutIf`);
  - the KV head count: `num_attention_heads`, or an attribute of the attention's `__init__` named for KV heads,
    translated into a spec expression, where it equals the keys' head count in every combination.
"""
from __future__ import annotations

import copy
import itertools
import re
import sys
from dataclasses import dataclass

from .draft_source import class_source, self_assignments, translate

PROBE = "xllm_draft_probe"
KV_NAME = re.compile(r"(kv|key_value).*head|head.*(kv|key_value)", re.I)


@dataclass(frozen=True)
class LayoutIf:
    """A layout chosen by a bool config field: `then` where it is true, `else_` where false."""
    flag: str
    then: str
    else_: str


@dataclass
class QKV:
    layout: str | LayoutIf | None   # tensor | head | kv_group, or one chosen by a flag (None: none fits)
    kv_heads: str | None        # the spec expression of the KV heads (None: not found)
    fields: set                 # the config fields kv_heads reads


def _tiny(config, changes: dict):
    cfg = copy.deepcopy(config)
    d = cfg.to_dict()
    small = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 64}
    for k, v in d.items():
        if isinstance(v, int) and not isinstance(v, bool):
            if KV_NAME.search(k):
                small[k] = 2
            elif re.search(r"intermediate|ffn", k):
                small[k] = 64
            elif k == "head_dim":
                small[k] = 8
            elif k.endswith("_token_id"):
                small[k] = 0
    for k, v in {**small, **changes}.items():
        try:
            setattr(cfg, k, v)
        except (AttributeError, TypeError):
            pass
    return cfg


def _expected(layout: str, heads: int, kv: int) -> list | None:
    """(segment, head) of each head-sized row block of the fused output in `layout`."""
    if layout == "tensor":
        return [("q", h) for h in range(heads)] + [(s, h) for s in "kv" for h in range(kv)]
    if layout == "head":
        return [(s, h) for h in range(heads) for s in "qkv"] if heads == kv else None
    if kv == 0 or heads % kv:
        return None
    g = heads // kv
    return [x for j in range(kv) for x in [("q", j * g + i) for i in range(g)] + [("k", j), ("v", j)]]


def _probe(cls, config, qkv_name: str, attn_name: str, changes: dict):
    """(the layouts the fused rows fit, key heads, the config as the model reads it) for one combination, or None."""
    import torch
    from transformers import AttentionInterface

    cfg = _tiny(config, changes)
    seen = {}
    try:
        model = cls(cfg).eval()
        attn = model.get_submodule(attn_name)
        eager = getattr(sys.modules.get(type(attn).__module__), "eager_attention_forward", None)

        def capture(module, q, k, v, *args, **kwargs):
            if module is attn and not seen:
                seen.update(q=q.detach().clone(), k=k.detach().clone(), v=v.detach().clone())
            return eager(module, q, k, v, *args, **kwargs)

        AttentionInterface.register(PROBE, capture)
        model.set_attn_implementation(PROBE)
        hook = model.get_submodule(qkv_name).register_forward_hook(
            lambda m, i, o: torch.arange(1, o.shape[-1] + 1, dtype=torch.float32).expand(o.shape).clone())
        with torch.no_grad():
            model(input_ids=torch.tensor([[1]]), position_ids=torch.tensor([[0]]), use_cache=False)
        hook.remove()
    except Exception:  # noqa: BLE001 - a combination transformers cannot build or run
        return None
    if not seen:
        return None
    q, k, v = (seen[s][0, :, 0, :] for s in "qkv")          # [heads, head_dim]
    dim = q.shape[-1]
    rows = {}
    for s, t in (("q", q), ("k", k), ("v", v)):
        for h in range(t.shape[0]):
            first = int(t[h, 0].item()) - 1
            if not torch.equal(t[h], torch.arange(first + 1, first + 1 + dim, dtype=t.dtype)) or first % dim:
                return None         # not whole rows of the fused output (a norm or scale before the attention)
            rows[first // dim] = (s, h)
    order = [rows.get(i) for i in range(len(rows))]
    fits = {lay for lay in ("tensor", "kv_group", "head") if _expected(lay, q.shape[0], k.shape[0]) == order}
    return fits, k.shape[0], q.shape[0], model.config


def _agreed(fits: list) -> str | None:
    """The layout every combination's rows fit (the plainest where several do), or None."""
    common = set.intersection(*fits) if fits else set()
    return next((lay for lay in ("tensor", "head", "kv_group") if lay in common), None)


def _chosen_by_flag(flags: list, combos: list, fits: list) -> LayoutIf | None:
    """The first flag under which the combinations of each value agree on a layout of their own (two different
    ones, each value run at least once)."""
    for f in flags:
        then = _agreed([x for c, x in zip(combos, fits) if c[f]])
        else_ = _agreed([x for c, x in zip(combos, fits) if not c[f]])
        if then and else_ and then != else_:
            return LayoutIf(f, then, else_)
    return None


def probe_qkv(cls, config, layer_prefix: str, qkv_rel: str, attn_rel: str, fields: set) -> QKV | None:
    """The layout and KV heads of the fused projection `qkv_rel` of the attention `attn_rel` (relative to the layer)."""
    pre = layer_prefix.replace("{i}", "0")
    attn_cls = None
    from .draft_source import meta_model
    base = meta_model(cls, config)
    if base is None:
        return None
    try:
        attn_cls = type(base.get_submodule(pre + attn_rel))
    except AttributeError:
        return None
    src = class_source(attn_cls)
    attrs = self_assignments(src)
    full = config.to_dict()
    flags = sorted({f for f in re.findall(r"config\.(\w+)", src) if isinstance(full.get(f), bool)} |
                   {f for a in attrs.values() for f in (translate(a, attrs, fields) or ("", set()))[1]
                    if isinstance(full.get(f), bool)})[:4]
    runs, combos = [], []
    for vals in itertools.product(*[(full[f], not full[f]) for f in flags]):
        r = _probe(cls, config, pre + qkv_rel, pre + attn_rel, dict(zip(flags, vals)))
        if r is not None:
            runs.append(r)
            combos.append(dict(zip(flags, vals)))
    if not runs:
        return None
    layout = _agreed([r[0] for r in runs]) or _chosen_by_flag(flags, combos, [r[0] for r in runs])
    cands = [("num_attention_heads", {"num_attention_heads"})]
    for a, node in attrs.items():
        t = translate(node, attrs, fields) if KV_NAME.search(a) else None
        if t is not None:
            cands.append(t)
    for expr, used in cands:
        try:
            if all(eval(expr, {"__builtins__": {}}, {f: getattr(c, f) for f in used}) == kv  # noqa: S307
                   for _, kv, _, c in runs):
                return QKV(layout, expr, used)
        except Exception:  # noqa: BLE001 - a translation that does not evaluate on the config
            continue
    return QKV(layout, None, set())
