"""The norms of a decoder layer for `xllm-gen draft` (codegen/draft.py), read from the decoder layer's forward: which norm
runs before each block (its step's `norm`) and which after it, before the residual add (its `post_norm`): OLMo 2's
post-norms only, Gemma 2 / 3's sandwich (pre and post norms around both blocks); and a `(1 + w)` scale in the norm
class's source (`weight_offset: 1`, Gemma).

The forward is read as a sequence of `self.<module>(` calls and residual adds (`residual + ...`): in each span between
two adds, the norms called before the block are its pre-norm, those after it its post-norm. A layer whose spans do not
hold one block each (a parallel residual: both blocks in one span) is left to the names (draft.py)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from .draft_attention import _method
from .draft_flow import read_flow
from .draft_source import class_source, meta_model

OFFSET = r"1(\.0)? \+ self\.weight|self\.weight(\.float\(\))? \+ 1(\.0)?\b"


@dataclass
class Roles:
    attn_pre: str | None          # full module names ("model.layers.{i}.input_layernorm")
    attn_post: str | None
    mlp_pre: str | None
    mlp_post: str | None
    offset: bool = False            # the layer norms scale by (1 + w)
    parallel: bool = False          # both blocks read one norm's output and join the residual together (Cohere)
    mean_free_layernorm: bool = False   # a LayerNorm (mean subtracted) without a bias parameter
    flow: object = None             # the dataflow read as data flow, where it says more (draft_flow.Flow)

    @property
    def sandwich(self) -> bool:
        return bool(self.attn_post or self.mlp_post)


def norm_roles(cls, config, prefix: str, norms: list, attn: str, mlp: str) -> Roles | None:
    """The pre- / post-norm of the attention (`attn`, the block's attribute name) and of the MLP (`mlp`) among the layer's
    norms `norms` (full module names), from the decoder layer's forward; None where the forward does not read so. The
    residual adds' reading below answers where the data-flow reading (draft_flow.py) says no more than it (one form,
    no parallel step over two norms) or cannot read the forward."""
    roles = _add_roles(cls, config, prefix, norms, attn, mlp)
    try:
        defaults = type(config)().to_dict()
    except Exception:  # noqa: BLE001 - a class that cannot build with its defaults
        defaults = config.to_dict()
    flow = read_flow(cls, config, prefix, attn, mlp, defaults, set(defaults) | set(config.to_dict()))
    if flow is None or not (flow.rich or roles is None):
        return roles
    short = {n.rsplit(".", 1)[1]: n for n in norms}
    # the form the layer built with the defaults runs: the one whose norms are the norms it built
    form = next((f for f in flow.members or flow.forms if set(_norms_of(f)) == set(short)), None)
    if form is None:
        return roles
    steps = [b for stp in form for b in stp]
    if len(steps) != 2 or len(form) not in (1, 2):
        return roles
    (ap, _, apost), (mp, _, mpost) = steps
    model = meta_model(cls, config)
    layer = model.get_submodule(prefix.replace("{i}", "0").rstrip("."))
    nsrc = class_source(type(layer.get_submodule(next(iter(short)))))
    full = {k: short.get(k) for k in (ap, apost, mp, mpost)}
    return Roles(full[ap], full[apost], full[mp], full[mpost], offset=bool(re.search(OFFSET, nsrc)),
                 parallel=len(form) == 1, flow=flow,
                 mean_free_layernorm=bool(re.search(r"\(hidden_states - mean\)|- *\w*\.mean\(", nsrc))
                 and "self.bias" not in nsrc)


def _norms_of(form) -> list:
    return [n for stp in form for pre, _, post in stp for n in (pre, post) if n]


def _add_roles(cls, config, prefix: str, norms: list, attn: str, mlp: str) -> Roles | None:
    """norm_roles read from the residual adds (`residual + ...`) of the forward."""
    model = meta_model(cls, config)
    if model is None:
        return None
    try:
        layer = model.get_submodule(prefix.replace("{i}", "0").rstrip("."))
    except AttributeError:
        return None
    src = _method(type(layer), "forward")
    short = {n.rsplit(".", 1)[1]: n for n in norms}
    spans, cur = [], []
    for m in re.finditer(r"self\.(\w+)\(|\bresidual\s*\+|\+\s*residual\b", src):
        if m.group(1) is None:
            spans.append(cur)
            cur = []
        elif m.group(1) in short or m.group(1) in (attn, mlp):
            cur.append(m.group(1))
    roles = {}
    norm_cls = type(layer.get_submodule(norms[0].rsplit(".", 1)[1])) if norms and "." in norms[0] else None
    nsrc = class_source(norm_cls) if norm_cls is not None else ""
    layernorm = bool(re.search(r"\(hidden_states - mean\)|- *\w*\.mean\(", nsrc)) and "self.bias" not in nsrc
    for span in spans:
        blocks = [x for x in span if x in (attn, mlp)]
        if sorted(blocks) == sorted((attn, mlp)) and len(span) == 3 and span[0] in short and len(spans) == 1:
            return Roles(short[span[0]], None, short[span[0]], None, offset=bool(re.search(OFFSET, nsrc)),
                         parallel=True, mean_free_layernorm=layernorm)   # one norm, both blocks, one add
        if len(blocks) != 1:
            continue
        i = span.index(blocks[0])
        pre, post = span[:i], span[i + 1:]
        if len(pre) > 1 or len(post) > 1:
            return None
        roles[blocks[0]] = (short[pre[0]] if pre else None, short[post[0]] if post else None)
    if set(roles) != {attn, mlp} or len({n for r in roles.values() for n in r if n}) != len(norms):
        return None
    return Roles(*roles[attn], *roles[mlp], offset=bool(re.search(OFFSET, nsrc)), mean_free_layernorm=layernorm)


def step(rel, pre: str | None, block: str, post: str | None, extra: str = "") -> str:
    """A dataflow step's flow mapping."""
    parts = ([f"norm: {rel(pre)}"] if pre else []) + [f"block: {block}"] + (
        [f"post_norm: {rel(post)}"] if post else [])
    return "{" + ", ".join(parts) + extra + "}"


def final_softcap(d, cls, defaults: dict) -> None:
    """The causal-LM head's soft-cap of the logits (`logits / C; tanh; * C`, C a config field: Gemma 2 / 3's
    final_logit_softcapping) -> d.scales["softcap"] and an optional symbol (null: none)."""
    src = _method(cls, "forward")
    m = re.search(r"logits\s*=\s*logits\s*/\s*self\.config\.(\w+)\s*\n\s*logits\s*=\s*torch\.tanh\(logits\)", src)
    if m is None or m.group(1) not in defaults:
        return
    f, dv = m.group(1), defaults.get(m.group(1))
    d.symbols[f] = "{type: float, from: " + f + ", optional: true" + (
        f", default: {float(dv)!r}" if isinstance(dv, (int, float)) else "") + ", min: 0.0}"
    d.scales["softcap"] = f
