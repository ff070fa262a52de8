"""The routing of a mixture of experts and its sparse layers, read from the modeling source (`xllm-gen draft`,
codegen/draft_moe.py finds the modules; this reads what they compute), never from the family's name:

  - from the router class's and the MoE block's source (the classes of the modules the meta model holds): the score
    function (`sigmoid` / `softmax` of the router logits), a float32 router (the linear on `.float()` /
    `torch.float32` inputs), where a selection-only correction bias is added (`scores + bias` or the logits), grouped
    top-k (`.view(-1, self.<groups>, ...)`, the group score `topk(2).sum` -> top2_sum or `max`, the groups kept by
    `topk(group_scores, k=self.<top>)`, the others masked to -inf or 0), a routed scale (`weights * self.<scale>`),
    renormalization (`if self.<flag>:` before the division, an unconditional division, a `clamp(sum, min=...)`); each
    `self.<attr>` translated to the config field its `__init__` assigns (draft_source.translate);
  - the sparse layers' condition: the decoder layer's `__init__` chooses the MoE block by a Python condition over
    `config` and `layer_idx` (`layer_idx >= config.first_k_dense_replace`, `config.mlp_layer_types[layer_idx] ==
    "sparse"`, ERNIE's interval / start / end): translated into the dataflow's `if`, checked against the layers
    built, its fields read as symbols (a list the class computes from the layer count as its `default_expr`).
"""
from __future__ import annotations

import ast
import re

from .draft_scoring import scoring_switch, switch_renormalization
from .draft_source import add_symbol, class_source, self_assignments, translate


def _no_docstrings(src: str) -> str:
    src = re.sub(r'"""(.*?)"""', "", src, flags=re.S)
    return "\n".join(l.split("#", 1)[0].rstrip() for l in src.splitlines())


def _field_of(attr: str, attrs: dict, fields: set) -> str | None:
    """The config field `self.<attr>` holds (its __init__ assigns config.<field>), else None."""
    t = translate(f"self.{attr}", attrs, fields)
    return t[0] if t and re.fullmatch(r"\w+", t[0]) and t[0] in fields else None


def routing_sources(moe, layer_prefix: str) -> tuple[str, dict, list]:
    """(the router's and the block's source, their self attributes, the class names read)."""
    if moe.model is None:
        return "", {}, []
    li = moe.sparse_layers[0]
    block = moe.model.get_submodule(layer_prefix.replace("{i}", str(li)) + moe.module)
    router = block.get_submodule(moe.router)
    classes = [type(block)] + ([type(router)] if not type(router).__module__.startswith("torch.") else [])
    src = "\n".join(class_source(c) for c in classes)
    attrs = {}
    for c in classes:
        attrs.update(self_assignments(class_source(c)))
    return _no_docstrings(src), attrs, [c.__name__ for c in classes]


def find_routing(d, moe, layer_prefix: str, defaults: dict, config_cls, out: dict) -> None:
    """Add the routing the source computes to the block's fields `out` (and its symbols to d.symbols)."""
    src, attrs, names = routing_sources(moe, layer_prefix)
    if not src:
        return
    fields = set(d.config) | set(defaults)
    lines = [l for l in src.splitlines() if "shared" not in l]      # not the shared expert's own sigmoid gate
    body = "\n".join(lines)
    what = []
    sig, soft = re.search(r"\bsigmoid\(", body), re.search(r"\bsoftmax\(", body)
    switch = scoring_switch(d, src, attrs, fields, defaults, config_cls)     # draft_scoring.py
    if switch is not None:
        out["scoring"] = switch.field
        what.append(f"{switch.field} choosing softmax or sigmoid scores")
    elif sig and not soft:
        out["scoring"] = "sigmoid"
        what.append("sigmoid scores")
    elif soft and not sig:
        what.append("softmax scores")
    else:
        d.checklist.append(f"routing: {'both sigmoid and softmax' if sig else 'neither sigmoid nor softmax'} in "
                           f"{', '.join(names)}: set `scoring` by hand (a config switch: a str symbol)")
    if re.search(r"linear\([^\n]*(float32|\.float\(\))", body):
        out["router_float32"] = True
        what.append("a float32 router")
    # the selection-only correction bias: added to the scores or to the logits
    if moe.selection_bias:
        logits = set(re.findall(r"(\w+)\s*=\s*[^\n]*(?:linear\(|self\.weight|self\.gate\(|self\.router\()", body))
        m = re.search(r"(\w+)\s*\+\s*self\.[\w.]*e_score_correction_bias", body)
        if m is None:
            holder = re.search(r"self\.(\w+)\s*=\s*\w+\(config\)", body)
            m = re.search(rf"self\.{holder.group(1)}\((\w+)\)", body) if holder else None
        if m is None:
            d.checklist.append("routing: where the correction bias is added was not found: `selection_bias_on`")
        elif m.group(1) in logits:
            out["selection_bias_on"] = "logits"
            what.append("a correction bias on the logits")
        else:
            what.append("a correction bias on the scores")
    # grouped top-k
    g = re.search(r"\.view\(\s*-1,\s*self\.(\w+),", body)
    if g:
        count = _field_of(g.group(1), attrs, fields)
        t = re.search(r"topk\(\s*\w*group\w*,\s*k=self\.(\w+)", body)
        top = _field_of(t.group(1), attrs, fields) if t else None
        score = "top2_sum" if re.search(r"\.topk\(2,\s*dim=-1\)\[0\]\s*\.sum\(", body) else \
            "max" if re.search(r"\.max\(dim=-1\)", body) else None
        dropped = "zero" if re.search(r"masked_fill\([^\n]*,\s*0(\.0)?\)", body) else "excluded"
        if count and top and score:
            for f in (count, top):
                add_symbol(d, f, defaults, config_cls)
            out["groups"] = f"{{count: {count}, top: {top}, score: {score}" + (
                ", dropped: zero}" if dropped == "zero" else "}")
            what.append(f"grouped top-k ({count}, {top}, {score})")
            if dropped == "excluded":
                d.symbols["group_limit_holds_top_k"] = (
                    f'{{type: int, expr: "1 if {top} >= {count} or ({top} * ({out["experts"]} // {count}) >= '
                    f'{out["top_k"]} and {out["experts"]} // {count} >= 2) else 0", min: 1, guard: true}}')
        else:
            d.checklist.append(f"routing: grouped top-k in {', '.join(names)} not read (groups {count}, top {top}, "
                               f"score {score}): write `groups` by hand")
    # the routed scale
    s = re.search(r"\*=?\s*self\.(\w*scal\w*)", body) or re.search(r"\*=?\s*(?:self\.)?config\.(\w*scal\w*)", body)
    if s:
        f = _field_of(s.group(1), attrs, fields) or (s.group(1) if s.group(1) in fields else None)
        if f:
            add_symbol(d, f, defaults, config_cls)
            out["routed_scale"] = f
            what.append(f"scaled by {f}")
        else:
            d.checklist.append(f"routing: the weights are scaled by `self.{s.group(1)}`: `routed_scale` by hand")
    _renormalization(d, body, attrs, fields, defaults, config_cls, out, what)
    if switch is not None:
        switch_renormalization(d, switch, out, what)
    _shared_width(d, moe, src, attrs, fields, defaults, config_cls, out)
    d.checklist[:] = [c for c in d.checklist if not c.startswith((
        "routing: the draft scores experts by softmax", "the router has an e_score_correction_bias",
        "routing: no `norm_topk_prob` field"))]
    moe.routing_read = f"{', '.join(names)}: {', '.join(what)}"


def _renormalization(d, body, attrs, fields, defaults, config_cls, out, what) -> None:
    """norm_topk_prob from the division of the top-k weights by their sum: under `if self.<flag>:` (that field), or
    unconditional (true); a `clamp(sum, min=self.<x>)`: renormalize_min."""
    lines = [l for l in body.splitlines() if l.strip()]
    for i, l in enumerate(lines):
        near = " ".join(lines[max(i - 1, 0):i + 2])
        if not re.search(r"/=|/ |/\s*torch\.clamp\(", l) or "sum(" not in near or "group" in l:
            continue
        indent = len(l) - len(l.lstrip())
        # the statement that holds the division (the nearest line above it indented less)
        head = next((p.strip() for p in reversed(lines[:i]) if len(p) - len(p.lstrip()) < indent), "")
        flag = re.match(r"if self\.(\w+):", head)
        if flag:
            f = _field_of(flag.group(1), attrs, fields)
            if f:
                add_symbol(d, f, defaults, config_cls)
                out["norm_topk_prob"] = f
                what.append(f"renormalized where {f}")
            else:
                d.checklist.append(f"routing: renormalized where `self.{flag.group(1)}`: set `norm_topk_prob`")
        elif head.startswith(("def ", "with ")):
            out["norm_topk_prob"] = "true"
            what.append("renormalized")
        else:
            d.checklist.append(f"routing: the top-k weights are renormalized under `{head}`: set `norm_topk_prob`")
        clamp = re.search(r"min=self\.(\w+)", " ".join(lines[i:i + 3]))
        if clamp:
            f = _field_of(clamp.group(1), attrs, fields)
            if f:
                add_symbol(d, f, defaults, config_cls)
                out["renormalize_min"] = f
                what.append(f"the sum clamped to at least {f}")
        return


def _shared_width(d, moe, src, attrs, fields, defaults, config_cls, out) -> None:
    """The shared expert's width as the block's __init__ computes it (`intermediate_size=config.moe_intermediate_size *
    config.moe_num_shared_experts`), where its value is the width built."""
    if not moe.shared or not re.fullmatch(r"\d+", str(out.get("shared_intermediate", ""))):
        return
    m = re.search(rf"self\.{re.escape(moe.shared)}\s*=\s*\w+\(([^\n]*(?:\n[^\n]*){{0,3}})", src)
    arg = m and (re.search(r"intermediate_size\s*=\s*([^,()]+(?:\([^()]*\))?[^,()]*)", m.group(1))
                 or re.search(r"^\s*config\s*,\s*([^,()]+)", m.group(1)))
    t = translate(arg.group(1), attrs, fields) if arg else None
    if t is None:
        return
    env = {f: d.config.get(f, defaults.get(f)) for f in t[1]}
    try:
        ok = eval(t[0], {}, env) == moe.shared_intermediate  # noqa: S307 - our own text
    except Exception:  # noqa: BLE001
        ok = False
    if ok:
        for f in sorted(t[1]):
            add_symbol(d, f, defaults, config_cls)
        out["shared_intermediate"] = f'"{t[0]}"' if not re.fullmatch(r"\w+", t[0]) else t[0]
        d.checklist[:] = [c for c in d.checklist if not c.startswith("the shared expert's width")]


def sparse_from_source(d, moe, layer_prefix: str, values: dict, defaults: dict, config_cls) -> str | None:
    """The sparse layers' condition as the decoder layer's __init__ writes it, checked against the layers built; None
    where it is not a condition over config and the layer index."""
    if moe.model is None:
        return None
    layer = moe.model.get_submodule(layer_prefix.replace("{i}", str(moe.sparse_layers[0])).rstrip("."))
    block_cls = type(layer.get_submodule(moe.module)).__name__
    attr = moe.module.split(".")[0]
    try:
        tree = ast.parse(class_source(type(layer).__init__))
    except SyntaxError:
        return None
    attrs = self_assignments(class_source(type(layer).__init__))

    def calls_block(node) -> bool:
        return any(isinstance(c, ast.Call) and getattr(c.func, "id", getattr(c.func, "attr", None)) == block_cls
                   for c in ast.walk(node))

    def builds_moe(stmts) -> bool:     # statements assigning self.<attr> = <the MoE block>(...)
        return any(isinstance(n, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == attr for t in n.targets)
                   and calls_block(n.value) for s in stmts for n in ast.walk(s))

    cond = None
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and builds_moe(n.body) != builds_moe(n.orelse):
            cond = n.test if builds_moe(n.body) else ast.UnaryOp(ast.Not(), n.test)
            break
        if isinstance(n, ast.IfExp) and calls_block(n.body) != calls_block(n.orelse):
            cond = n.test if calls_block(n.body) else ast.UnaryOp(ast.Not(), n.test)
            break
    t = translate(cond, attrs, set(values) | set(defaults)) if cond is not None else None
    if t is None:
        return None
    expr, used = t
    env = {f: (tuple(values[f]) if isinstance(values.get(f), list) else values.get(f)) for f in used}
    try:
        got = [i for i in range(moe.built_layers) if eval(expr, {}, {**env, "layer": i})]  # noqa: S307 - our own text
    except Exception:  # noqa: BLE001 - a field the checkpoint leaves null, a list shorter than the layers built
        return None
    if got != moe.sparse_layers:
        return None
    for f in sorted(used):
        add_symbol(d, f, defaults, config_cls)
    return expr
