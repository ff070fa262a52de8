"""A config switch between the router's score functions, for `xllm-gen draft` (codegen/draft_routing.py), read from the
router's / MoE block's source, never from a family's name:

    if self.<attr> == "softmax":  ... softmax(...) ...
    elif self.<attr> == "sigmoid": ... sigmoid(...) ...

with `self.<attr>` translated to the config field its `__init__` assigns (Cohere 2 MoE's `expert_selection_fn`): the
field becomes a `str` symbol whose `values` are the strings the branches test, and the moe's `scoring` that symbol
(the spec language passes it to the runtime). Each branch's renormalization is read on its own: a softmax over the
top-k logits (`topk` before the softmax) sums to 1 (renormalized), a division by the sum unconditional or under `if
self.<flag>:` inside the branch; where the branches differ, `norm_topk_prob` is a derived bool symbol
(`"expert_selection_fn == 'softmax' or norm_topk_prob"`). Strings other than `softmax` / `sigmoid` in the tests, or a
branch calling neither, leave the checklist item naming the field.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field

from .draft_source import add_symbol, translate

SCORES = ("softmax", "sigmoid")


@dataclass
class Switch:
    field: str                                   # the config field the branches test
    renorm: dict = field(default_factory=dict)   # score function -> "true" | "false" | a bool field
    defaults: dict = field(default_factory=dict)    # the config class's defaults (for the flags' symbols)
    config_cls: object = None


def _calls(stmts) -> set:
    out = set()
    for s in stmts:
        for n in ast.walk(s):
            if isinstance(n, ast.Call):
                f = n.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if name in SCORES:
                    out.add(name)
    return out


def _chain(node: ast.If) -> tuple[ast.expr, list] | None:
    """(the tested expression, [(string, branch statements)] + [(None, else statements)]) of an if / elif chain of
    `X == "string"` tests on one X."""
    subject, branches = None, []
    while True:
        t = node.test
        if not (isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq)
                and isinstance(t.comparators[0], ast.Constant) and isinstance(t.comparators[0].value, str)):
            return None
        if subject is not None and ast.dump(t.left) != ast.dump(subject):
            return None
        subject = t.left
        branches.append((t.comparators[0].value, node.body))
        if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
            node = node.orelse[0]
            continue
        if node.orelse:
            branches.append((None, node.orelse))
        return subject, branches


def _renorm(stmts, fn: str, topk_vars: set, attrs: dict, fields: set) -> str | None:
    """How branch `stmts` (scoring by fn) renormalizes the top-k weights: "true", "false" or a bool config field (None:
    under another condition)."""
    if fn == "softmax":
        for n in (x for s in stmts for x in ast.walk(s)):
            if isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", None)) == "softmax" and \
                    n.args and isinstance(n.args[0], ast.Name) and n.args[0].id in topk_vars:
                return "true"       # a softmax over the top-k logits sums to 1

    def divides(node) -> bool:
        return any(isinstance(x, ast.BinOp) and isinstance(x.op, ast.Div) and any(
            isinstance(c, ast.Call) and getattr(c.func, "attr", getattr(c.func, "id", None)) == "sum"
            for c in ast.walk(x.right)) for x in ast.walk(node))

    for s in stmts:
        if isinstance(s, ast.If) and divides(s) and not any(divides(b) for b in s.orelse):
            t = translate(s.test, attrs, fields)
            return t[0] if t and t[0] in fields else None
        if divides(s):
            return "true"
    return "false"


def scoring_switch(d, src: str, attrs: dict, fields: set, defaults: dict, config_cls) -> Switch | None:
    """The config field choosing softmax or sigmoid scores (its symbol added to d), else None."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return None
    topk_vars = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and \
                getattr(n.value.func, "attr", getattr(n.value.func, "id", None)) == "topk":
            t = n.targets[0]
            first = t.elts[0] if isinstance(t, ast.Tuple) else t
            if isinstance(first, ast.Name):
                topk_vars.add(first.id)
    for node in ast.walk(tree):
        if not isinstance(node, ast.If):
            continue
        found = _chain(node)
        if found is None:
            continue
        subject, branches = found
        fns = {value: _calls(stmts) for value, stmts in branches}
        if not any(c for c in fns.values()) or not all(len(c) <= 1 for c in fns.values()):
            continue
        t = translate(subject, attrs, fields)
        if t is None or t[0] not in fields:
            continue
        f = t[0]
        tested = {v: c.pop() for v, c in fns.items() if v is not None and c}
        if set(tested) != set(tested.values()) or set(tested.values()) != set(SCORES):
            d.checklist.append(f"routing: `{f}` chooses the score function ({', '.join(f'{v!r} -> {c}' for v, c in tested.items())}"
                               f"): the spec's `scoring` symbol takes `softmax` / `sigmoid` only; map it by hand")
            return None
        dv = defaults.get(f, "softmax")
        d.symbols[f] = f"{{type: str, from: {f}, default: {dv}, values: [{', '.join(SCORES)}]}}"
        sw = Switch(f, defaults=defaults, config_cls=config_cls)
        for value, stmts in branches:
            if value in SCORES:
                sw.renorm[value] = _renorm(stmts, value, topk_vars, attrs, fields)
        d.checklist[:] = [c for c in d.checklist if not c.startswith("routing: both sigmoid and softmax")]
        return sw
    return None


def switch_renormalization(d, sw: Switch, out: dict, what: list) -> None:
    """norm_topk_prob from each branch's own renormalization (a derived bool where they differ)."""
    soft, sig = sw.renorm.get("softmax"), sw.renorm.get("sigmoid")
    if soft is None or sig is None:
        d.checklist.append(f"routing: the renormalization under `{sw.field}` was not read: set `norm_topk_prob`")
        return
    for r in (soft, sig):
        if r not in ("true", "false"):
            add_symbol(d, r, sw.defaults, sw.config_cls)
    if soft == sig:
        out["norm_topk_prob"] = soft
    else:
        terms = [f"{sw.field} == '{fn}'" + ("" if r == "true" else f" and {r}") for fn, r in (("softmax", soft),
                                                                                                 ("sigmoid", sig))
                 if r != "false"]
        d.symbols["renormalize"] = f'{{type: bool, expr: "{" or ".join(terms)}"}}'
        out["norm_topk_prob"] = "renormalize"
    what.append(f"renormalized: softmax {soft}, sigmoid {sig}")
    d.checklist[:] = [c for c in d.checklist if not c.startswith(("routing: the top-k weights are renormalized under",
                                                                   "routing: renormalized where"))]
