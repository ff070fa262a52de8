"""Per-layer rotary on / off for `xllm-gen draft` (codegen/draft_attention.py): the layers whose attention applies no
position embedding (NoPE), read from the attention class's forward, never from a family's name.

The rotary call of the forward (`apply_rotary_pos_emb(...)`, any `*rotary*` / `*rope*` function) under an `if`: the
condition, translated with the attributes its `__init__` assigns (`self.use_rope = config.no_rope_layers[layer_idx]`
-> `no_rope_layers[layer]`; `self.is_local_attention = config.layer_types[layer_idx] == "sliding_attention"`), is the
rotary's `enabled` (`"bool(no_rope_layers[layer])"`, SmolLM3; `"layer_types[layer] == 'sliding_attention'"`, AFMoE;
`"(sliding_window if ... else None) is not None"`, Cohere 2). A list field it reads gets the default the config class
computes (draft_config_lists.py: SmolLM3's `no_rope_layers` from `no_rope_layer_interval`). A condition that is not
config arithmetic (a forward argument) goes on the checklist.
"""
from __future__ import annotations

import ast
import copy
import re

from .draft_config_lists import add_list_symbol
from .draft_source import add_symbol, translate

ROTARY_CALL = re.compile(r"\w*(?:rotary|rope)\w*$", re.I)


def _rotary_calls(tree) -> list:
    """[(call, [the tests of the ifs around it, a test negated where the call is in the else branch])]."""
    out = []

    def walk(node, conds):
        if isinstance(node, ast.If):
            walk(node.test, conds)
            for s in node.body:
                walk(s, conds + [node.test])
            for s in node.orelse:
                walk(s, conds + [ast.UnaryOp(ast.Not(), node.test)])
            return
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            # the rotary applied to q / k (not the module computing cos / sin: `self.rotary_emb(x, position_ids)`)
            if ROTARY_CALL.match(name) and not (isinstance(f, ast.Attribute) and name.endswith(("_emb", "_embedding"))):
                out.append((node, conds))
        for c in ast.iter_child_nodes(node):
            walk(c, conds)
    walk(tree, [])
    return out


def with_locals(init_src: str, attrs: dict) -> dict:
    """attrs with the `__init__`'s local names substituted (EXAONE 4's `layer_type = config.layer_types[layer_idx]`
    before `self.is_sliding = layer_type == "sliding_attention"`): each plain `name = expr` assignment, the last
    before use."""
    try:
        tree = ast.parse(init_src)
    except SyntaxError:
        return attrs
    fn = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)), None)
    local = {}
    for s in fn.body if fn else []:
        if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
            local[s.targets[0].id] = s.value

    class Sub(ast.NodeTransformer):
        def visit_Name(self, n):
            return copy.deepcopy(local[n.id]) if n.id in local and n.id != "config" else n
    return {k: Sub().visit(copy.deepcopy(v)) for k, v in attrs.items()} if local else attrs


def _boolean(expr: str) -> str:
    """expr as a flag: a comparison, `and` / `or`, `not` or bool() kept, anything else wrapped in bool()."""
    top = ast.parse(expr, mode="eval").body
    if isinstance(top, (ast.Compare, ast.BoolOp)) or (isinstance(top, ast.UnaryOp) and isinstance(top.op, ast.Not)) or (
            isinstance(top, ast.Call) and getattr(top.func, "id", None) == "bool"):
        return expr
    return f"bool({expr})"


def rotary_enabled(d, a, fwd_src: str, attrs: dict, fields: set, defaults: dict, config_cls, layer_types=None) -> None:
    """Set a.rope_enabled (the rotary's per-layer `enabled` expression) where the forward applies rotary under an `if`;
    `layer_types`: the callable that reads that field as a symbol (draft_attention's, with its patterns)."""
    try:
        tree = ast.parse(fwd_src)
    except SyntaxError:
        return
    calls = _rotary_calls(tree)
    if not calls:
        return
    tests = {ast.unparse(ast.BoolOp(ast.And(), c)) if len(c) > 1 else ast.unparse(c[0]) if c else "" for _, c in calls}
    if len(tests) != 1:
        d.checklist.append(f"the attention's forward applies rotary under different conditions ({', '.join(sorted(tests))})"
                           f": write `rotary.enabled` by hand")
        return
    conds = calls[0][1]
    if not conds:
        return
    cond = conds[0] if len(conds) == 1 else ast.BoolOp(ast.And(), conds)
    t = translate(cond, attrs, fields)
    if t is None:
        d.checklist.append(f"the attention applies rotary only where `{ast.unparse(cond)}`: not config arithmetic the "
                           f"draft reads; write `rotary.enabled` (per layer: may read `layer`) by hand")
        return
    expr, used = t
    for f in sorted(used):
        if f in d.symbols:
            continue
        v = d.config.get(f, defaults.get(f))
        if f == "layer_types" and layer_types is not None:
            layer_types()
        elif isinstance(v, list):
            add_list_symbol(d, f, defaults, config_cls)
        elif f == "sliding_window" or v is None:
            d.symbols[f] = f"{{type: int, from: {f}, optional: true, min: 1}}"
        else:
            add_symbol(d, f, defaults, config_cls)
    a.rope_enabled = _boolean(expr)
    a.answered.add("nope")
