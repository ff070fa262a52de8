"""Per-layer list fields a config class computes when config.json lacks them, for `xllm-gen draft` (codegen/draft.py):
the class's own `__post_init__` (or `__init__`) read and translated into a spec `default_expr`, never a family's name.

The forms read (each `self.<f>` of the class is a config field; locals assigned before are substituted):
  - `if self.f is None: self.f = [E for v in range(N)]` (or `if not self.f:`), SmolLM3's `no_rope_layers`;
  - `self.f = self.f if self.f else <local list>` / `self.f or ...`, Llama 4's `no_rope_layers`;
  - `self.f = []` then `for v in range(N):` with locals and `self.f.append(A)` under an `if` / `else`, SmolLM3's
    `layer_types` (sliding where `use_sliding_window` and the layer has no rope);
  - a comprehension over another list field (`for x in self.other`) becomes `for i in range(len(other))` with
    `other[i]`.
The expression is then checked against the class built at several layer counts and values of every field it reads
(bools flipped, ints and null windows varied, int lists given explicitly): one disagreement and it is not used.
"""
from __future__ import annotations

import ast
import copy
import itertools

from .draft_source import add_symbol, class_source

CALLS = ("bool", "int", "len", "min", "max", "float")


class _No(Exception):
    pass


def _function(config_cls) -> ast.FunctionDef | None:
    try:
        tree = ast.parse(class_source(config_cls))
    except SyntaxError:
        return None
    fns = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    return fns.get("__post_init__") or fns.get("__init__")


def _is_self(n, f: str | None = None) -> bool:
    return isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" and (
        f is None or n.attr == f)


class _Conv:
    """Python of the config class -> spec expression AST; `used` collects the config fields read."""

    def __init__(self, fields: set):
        self.fields, self.used, self.depth = fields, set(), 0
        self.keywords: dict = {}        # a keyword the class pops from kwargs -> its default (read as a field)

    def __call__(self, n, env: dict):
        c = self
        if _is_self(n):
            if n.attr not in c.fields or n.attr.startswith("_"):
                raise _No
            c.used.add(n.attr)
            return ast.Name(n.attr, ast.Load())
        if isinstance(n, ast.Name):
            if n.id in env:
                return copy.deepcopy(env[n.id])
            if n.id in ("True", "False", "None"):
                return n
            raise _No
        if isinstance(n, ast.Constant):
            return n
        if isinstance(n, ast.ListComp):
            return c.comp(n, env)
        if isinstance(n, ast.Call):
            k = _keyword(n)
            if k is not None:       # kwargs.pop("first_k_dense_replace", 0): a field config.json may hold
                self.keywords[k[0]], _ = k[1], self.used.add(k[0])
                return ast.Name(k[0], ast.Load())
            if isinstance(n.func, ast.Name) and n.func.id in CALLS and not n.keywords:
                return ast.Call(n.func, [c(a, env) for a in n.args], [])
            raise _No
        if isinstance(n, ast.BinOp):
            return ast.BinOp(c(n.left, env), n.op, c(n.right, env))
        if isinstance(n, ast.UnaryOp):
            return ast.UnaryOp(n.op, c(n.operand, env))
        if isinstance(n, ast.BoolOp):
            return ast.BoolOp(n.op, [c(v, env) for v in n.values])
        if isinstance(n, ast.Compare):
            return ast.Compare(c(n.left, env), n.ops, [c(x, env) for x in n.comparators])
        if isinstance(n, ast.IfExp):
            return ast.IfExp(c(n.test, env), c(n.body, env), c(n.orelse, env))
        if isinstance(n, ast.Subscript):
            return ast.Subscript(c(n.value, env), c(n.slice, env), ast.Load())
        if isinstance(n, (ast.Tuple, ast.List)):
            return type(n)([c(e, env) for e in n.elts], ast.Load())
        raise _No

    def comp(self, n: ast.ListComp, env: dict):
        if len(n.generators) != 1 or not isinstance(n.generators[0].target, ast.Name):
            raise _No
        g = n.generators[0]
        var = "ijkm"[self.depth] if self.depth < 4 else None
        if var is None:
            raise _No
        self.depth += 1
        idx = ast.Name(var, ast.Load())
        it = g.iter
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range" and not it.keywords:
            rng = ast.Call(ast.Name("range", ast.Load()), [self(a, env) for a in it.args], [])
            inner = {**env, g.target.id: idx}
        else:       # for x in <a list>: range(len(list)), x -> list[i]
            seq = self(it, env)
            rng = ast.Call(ast.Name("range", ast.Load()), [ast.Call(ast.Name("len", ast.Load()), [seq], [])], [])
            inner = {**env, g.target.id: ast.Subscript(copy.deepcopy(seq), idx, ast.Load())}
        out = ast.ListComp(self(n.elt, inner), [ast.comprehension(
            ast.Name(var, ast.Store()), rng, [self(x, inner) for x in g.ifs], 0)])
        self.depth -= 1
        return out


class _Truth(ast.NodeTransformer):
    """`bool(x)` where only its truth is read (a condition) -> x (Gemma 2's `if bool((i + 1) % 2)`)."""

    def _strip(self, n):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "bool" and len(n.args) == 1:
            return n.args[0]
        return n

    def visit_IfExp(self, n):
        self.generic_visit(n)
        n.test = self._strip(n.test)
        return n


def _keyword(n: ast.Call):
    """(name, default) of `kwargs.pop("name", default)` / `kwargs.get(...)` with a constant default, else None."""
    f = n.func
    if isinstance(f, ast.Attribute) and f.attr in ("pop", "get") and isinstance(f.value, ast.Name) and \
            f.value.id == "kwargs" and len(n.args) == 2 and all(isinstance(a, ast.Constant) for a in n.args) and \
            isinstance(n.args[0].value, str):
        return n.args[0].value, n.args[1].value
    return None


def _locals(stmts, conv: _Conv, env: dict) -> dict:
    """env with the plain `name = expr` assignments of stmts (those that translate)."""
    env = dict(env)
    for s in stmts:
        if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
            try:
                env[s.targets[0].id] = conv(s.value, env)
            except _No:
                env.pop(s.targets[0].id, None)
    return env


def _appends(stmt, f: str):
    """The element appended to self.f by `stmt` (an append, or an if / else of appends as an IfExp), else None."""
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Attribute) \
            and stmt.value.func.attr == "append" and _is_self(stmt.value.func.value, f) and len(stmt.value.args) == 1:
        return stmt.value.args[0]
    if isinstance(stmt, ast.If) and len(stmt.body) == 1 and len(stmt.orelse) == 1:
        a, b = _appends(stmt.body[0], f), _appends(stmt.orelse[0], f)
        if a is not None and b is not None:
            return ast.IfExp(stmt.test, a, b)
    return None


def _loop(stmts, i: int, f: str, conv: _Conv, env: dict):
    """`self.f = []` at stmts[i], then `for v in ...:` of locals and appends: the comprehension it builds."""
    if i + 1 >= len(stmts) or not isinstance(stmts[i + 1], ast.For):
        return None
    loop = stmts[i + 1]
    if not loop.body or loop.orelse:
        return None
    elt = _appends(loop.body[-1], f)
    if elt is None:
        return None
    # the loop's locals substituted into the element (Python text, translated as one comprehension)
    subst = {s.targets[0].id: s.value for s in loop.body[:-1]
             if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)}
    if len(subst) != len(loop.body) - 1:
        return None

    class Sub(ast.NodeTransformer):
        def visit_Name(self, n):
            return copy.deepcopy(subst[n.id]) if n.id in subst else n
    elt = Sub().visit(copy.deepcopy(elt))
    return conv(ast.ListComp(elt, [ast.comprehension(loop.target, loop.iter, [], 0)]), env)


def _null_test(test, f: str) -> bool:
    return (isinstance(test, ast.Compare) and _is_self(test.left, f) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Is) and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None) or (
        isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and _is_self(test.operand, f))


def _find(stmts, f: str, conv: _Conv, env: dict):
    """The translated expression self.f gets where config.json lacks it (None where not one of the forms read)."""
    env = dict(env)
    for i, s in enumerate(stmts):
        if isinstance(s, ast.If) and _null_test(s.test, f):
            for j, b in enumerate(s.body):
                if isinstance(b, ast.Assign) and len(b.targets) == 1 and _is_self(b.targets[0], f):
                    if isinstance(b.value, ast.List) and not b.value.elts:
                        return _loop(s.body, j, f, conv, _locals(s.body[:j], conv, env))
                    return conv(b.value, _locals(s.body[:j], conv, env))
        if isinstance(s, ast.Assign) and len(s.targets) == 1 and _is_self(s.targets[0], f):
            v = s.value
            if isinstance(v, ast.IfExp) and _is_self(v.body, f) and (_is_self(v.test, f) or (
                    isinstance(v.test, ast.Compare) and _is_self(v.test.left, f)
                    and isinstance(v.test.ops[0], ast.IsNot))):
                return conv(v.orelse, env)
            if isinstance(v, ast.BoolOp) and isinstance(v.op, ast.Or) and len(v.values) == 2 and _is_self(v.values[0], f):
                return conv(v.values[1], env)
        if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
            env = _locals([s], conv, env)
    return None


_ABSENT = object()


def _alternatives(dv, nullable: bool, n: int) -> list:
    """Values to probe a field with besides leaving it out (its default)."""
    if isinstance(dv, bool):
        return [not dv]
    if isinstance(dv, int):
        return [v for v in (1, 2, 3) if v != dv][:2] + ([None] if nullable else [])
    if dv is None:
        return [16]
    if isinstance(dv, list) and dv and all(isinstance(x, int) and not isinstance(x, bool) for x in dv):
        return [[int(k % 3 != 1) for k in range(n)]]
    return []


def _agrees(config_cls, f: str, expr: str, used: set, defaults: dict, keywords: dict | None = None) -> bool:
    """expr gives the class's own value of f at every probe (the layer counts 4 and 7 times each read field at its
    default or varied; the fields passed read as passed, the others as the class holds them)."""
    import builtins
    env0 = {"range": range, **{c: getattr(builtins, c) for c in CALLS}}
    ann = {}
    for k in reversed(getattr(config_cls, "__mro__", ())):
        ann.update(getattr(k, "__annotations__", {}))
    others = sorted(used - {"num_hidden_layers"})
    checked = 0
    for n in (4, 7):
        choices = [[_ABSENT] + _alternatives(defaults.get(u), "None" in str(ann.get(u, "")), n) for u in others]
        combos = list(itertools.product(*choices))
        if len(combos) > 48:        # each field varied alone
            combos = [tuple(_ABSENT for _ in choices)] + [
                tuple(v if k == m else _ABSENT for k in range(len(choices))) for m, ch in enumerate(choices)
                for v in ch[1:]]
        for combo in combos:
            kw = {"num_hidden_layers": n, **{u: v for u, v in zip(others, combo) if v is not _ABSENT}}
            try:
                cfg = config_cls(**kw)
            except Exception:  # noqa: BLE001 - the class refuses these values: no evidence
                continue
            env = {u: kw[u] if u in kw else (keywords or {}).get(u, getattr(cfg, u, None)) for u in used}
            try:
                want = eval(expr, {**env0, **env})  # noqa: S307 - the draft's own translated expression (a comprehension
                # sees globals only)
            except Exception:  # noqa: BLE001
                return False
            if list(want) != list(getattr(cfg, f, None) or []):
                return False
            checked += 1
    return checked >= 2


def computed_default(config_cls, f: str, defaults: dict, fields: set) -> tuple[str, set, dict] | None:
    """(default_expr, the fields it reads, {keyword the class pops: its default}) of list field f as the config class computes it when absent, checked."""
    fn = _function(config_cls)
    if fn is None:
        return None
    conv = _Conv(set(fields) | set(defaults))
    try:
        node = _find(fn.body, f, conv, {})
    except _No:
        return None
    if node is None:
        return None
    node = _Truth().visit(node)
    used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & conv.used
    expr = ast.unparse(ast.fix_missing_locations(node)).replace('"', "'")
    kw = {k: v for k, v in conv.keywords.items() if k in used}
    return (expr, used, kw) if _agrees(config_cls, f, expr, used, {**defaults, **kw}, kw) else None


def read_list_default(d, f: str, defaults: dict, config_cls, typ: str | None = None) -> bool:
    """A symbol reading list field f with the default_expr the class computes, and symbols for the fields that reads;
    False (nothing added) where the class's computation was not read."""
    if f in d.symbols:
        return True
    dv = defaults.get(f, d.config.get(f))
    typ = typ or ("str_tuple" if isinstance(dv, list) and dv and all(isinstance(x, str) for x in dv) else "int_tuple")
    found = computed_default(config_cls, f, defaults, set(d.config) | set(defaults))
    if found is None:
        return False
    d.symbols[f] = f'{{type: {typ}, from: {f}, default_expr: "{found[0]}"}}'
    defaults = {**defaults, **found[2]}
    for u in sorted(found[1] - {f}):
        v = defaults.get(u, d.config.get(u))
        if isinstance(v, list):
            add_list_symbol(d, u, defaults, config_cls)
        elif u == "sliding_window" or v is None:
            d.symbols.setdefault(u, f"{{type: int, from: {u}, optional: true, min: 1}}")
        else:
            add_symbol(d, u, defaults, config_cls)
    return True


def add_list_symbol(d, f: str, defaults: dict, config_cls, typ: str | None = None) -> bool:
    """read_list_default, else a required symbol and a checklist item. True where the default was read."""
    if read_list_default(d, f, defaults, config_cls, typ):
        return True
    dv = defaults.get(f, d.config.get(f))
    typ = typ or ("str_tuple" if isinstance(dv, list) and dv and all(isinstance(x, str) for x in dv) else "int_tuple")
    d.symbols[f] = f"{{type: {typ}, from: {f}}}"
    d.checklist.append(f"`{f}` is read from config.json (required): the list the config class computes when it is "
                       f"absent was not read from its source; write its `default_expr`")
    return False
