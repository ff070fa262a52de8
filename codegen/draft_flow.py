"""A decoder layer's dataflow for `xllm-gen draft` (codegen/draft.py), read from its forward as data flow, under the
config flags its `if`s test:

  - the forward is executed symbolically, statement by statement: a value is the layer's input, a call of one of the
    layer's norms or blocks on a value, or a sum of values (`a + b`, `a += b`, `dropout_add(a, b, ...)`); dropouts and
    dtype casts pass their input through; anything else is unknown and the reading gives up (draft_layer.py's reading
    of the residual adds then answers);
  - each `if` whose test reads only `self` is decided on the layer built on the meta device with the flags set (so a
    flag the layer's `__init__` rewrites, Falcon's `num_ln_in_parallel_attn` null meaning 2, is read as the layer
    reads it); other tests (runtime arguments) take their `else`;
  - the layer's output, a sum of the input and its branches, is put in order: the branches that read the input (or
    its norm) form the first step (two of them: a parallel step, `x + attn(n1(x)) + mlp(n2(x))`), those that read the
    input plus the first step's branches the next, and so on; a norm around a block's output is its `post_norm`;
  - the flags the `if` tests read (their values: both of a bool, the constants an int is compared with) are tried
    together: where the forms differ, a test of the forward, translated into a spec expression, that tells them
    apart on every combination that builds becomes the `dataflow: {if: ...}` choice. Where more than two forms
    remain, two of one residual shape whose norms differ only in name are drafted as one, the norms loading from the
    other's tensors where another test says so (draft_forms.py); failing that, the fewest flags are held at their
    defaults (config_assume) and named on the checklist.
"""
from __future__ import annotations

import ast
import itertools
from dataclasses import dataclass

from .draft_forms import merge_groups, renames, separates, shape
from .draft_source import class_source, meta_model, self_assignments, translate

PASS_METHODS = ("to", "float", "type_as", "contiguous", "clone", "view_as", "half", "bfloat16")


class _Unknown(Exception):
    pass


@dataclass(frozen=True)
class V:
    """A symbolic value: the layer input (`x`), a module call (`call`, name, (input,)), a sum (`sum`, args: the terms,
    sorted) or a tuple (`tuple`)."""
    kind: str
    name: str = ""
    args: tuple = ()


X = V("x")


def _sum(*vals: V) -> V:
    terms = []
    for v in vals:
        if v.kind == "tuple":
            raise _Unknown
        terms += list(v.args) if v.kind == "sum" else [v]
    return V("sum", args=tuple(sorted(terms, key=repr)))


@dataclass
class Flow:
    """The layer's dataflow: one form, or two chosen by `cond` (the `then` form first). A form is a tuple of steps, a
    step a tuple of branches (pre-norm or None, block, post-norm or None), all the layer's child module names."""
    forms: list
    cond: str | None = None
    name: str | None = None
    symbols: dict | None = None      # symbol -> its flow mapping text (the flags `cond` reads)
    held: dict | None = None         # flag -> the default it is held at (another form there)
    members: list | None = None      # every form read (a merged form's others among them)
    renames: list | None = None      # (norm, the name it loads from as a `{...}` expression, its parameters)

    @property
    def norms(self) -> list:
        out = []
        for form in self.forms:
            for stp in form:
                for pre, _, post in stp:
                    out += [n for n in (pre, post) if n and n not in out]
        return out

    @property
    def rich(self) -> bool:
        """Beyond what the residual adds' reading draws: a choice, or a parallel step over two norms."""
        return len(self.forms) > 1 or any(len(s) > 1 and len({b[0] for b in s}) > 1 for s in self.forms[0])


class _Exec:
    def __init__(self, inst, tracked: set, children: dict):
        self.inst, self.tracked, self.children, self.env = inst, tracked, children, {}

    def truth(self, test: ast.expr) -> bool:
        names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
        if names - {"self"}:
            return False        # a runtime argument (use_cache, output_attentions): its `else`
        try:
            return bool(eval(compile(ast.Expression(test), "<test>", "eval"), {"__builtins__": {}},  # noqa: S307
                             {"self": self.inst}))
        except Exception:  # noqa: BLE001 - a test the built layer cannot answer
            raise _Unknown from None

    def run(self, body) -> V | None:
        for s in body:
            if isinstance(s, (ast.Expr, ast.Pass)):
                continue
            if isinstance(s, ast.If):
                out = self.run(s.body if self.truth(s.test) else s.orelse)
                if out is not None:
                    return out
            elif isinstance(s, ast.Assign) and len(s.targets) == 1:
                self.assign(s.targets[0], self.val(s.value))
            elif isinstance(s, ast.AnnAssign) and s.value is not None:
                self.assign(s.target, self.val(s.value))
            elif isinstance(s, ast.AugAssign) and isinstance(s.op, ast.Add) and isinstance(s.target, ast.Name):
                self.env[s.target.id] = _sum(self.env.get(s.target.id, V("?")), self.val(s.value))
            elif isinstance(s, ast.Return):
                out = self.val(s.value) if s.value is not None else V("?")
                return out.args[0] if out.kind == "tuple" and out.args else out
            else:
                raise _Unknown
        return None

    def assign(self, target, value: V) -> None:
        if isinstance(target, ast.Name):
            self.env[target.id] = value
        elif isinstance(target, ast.Tuple):
            parts = list(value.args) if value.kind == "tuple" else [value] + [V("?")] * (len(target.elts) - 1)
            for t, v in zip(target.elts, parts):
                self.assign(t, v)
        # an attribute / subscript target: not the layer's data flow

    def val(self, n) -> V:
        if isinstance(n, ast.Name):
            return self.env.get(n.id, V("?"))
        if isinstance(n, ast.BinOp):
            a, b = self.val(n.left), self.val(n.right)
            if isinstance(n.op, ast.Add):
                return _sum(a, b)
            if isinstance(n.op, (ast.Mult, ast.Div)):     # a scaled branch: the scalings are read elsewhere
                return a if a.kind != "?" else b
            return V("?")
        if isinstance(n, ast.Tuple):
            return V("tuple", args=tuple(self.val(e) for e in n.elts))
        if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and n.slice.value == 0:
            v = self.val(n.value)
            return v.args[0] if v.kind == "tuple" and v.args else v
        if isinstance(n, ast.Call):
            return self.call(n)
        return V("?")

    def call(self, n: ast.Call) -> V:
        f = n.func
        first = n.args[0] if n.args else next((k.value for k in n.keywords if k.arg == "hidden_states"), None)
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
            if f.attr in self.tracked:
                return V("call", f.attr, (self.val(first) if first is not None else V("?"),))
            kind = type(self.children.get(f.attr)).__name__
            if first is not None and ("Dropout" in kind or "Identity" in kind):
                return self.val(first)
            return V("?")
        fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if isinstance(f, ast.Attribute) and fname in PASS_METHODS and not (
                isinstance(f.value, ast.Name) and f.value.id in ("torch", "nn", "F")):
            return self.val(f.value)
        if fname.endswith("dropout_add") and len(n.args) >= 2:
            return _sum(self.val(n.args[0]), self.val(n.args[1]))
        if "dropout" in fname and first is not None:
            return self.val(first)
        return V("?")


def _steps(out: V, norms: set, blocks: tuple) -> tuple | None:
    """The output (a sum of the input and the branches) in residual steps, or None where it is not one."""
    terms = list(out.args) if out.kind == "sum" else [out]
    if terms.count(X) != 1:
        return None
    branches = []
    for t in terms:
        if t == X:
            continue
        post = None
        if t.kind == "call" and t.name in norms:
            post, t = t.name, t.args[0]
        if t.kind != "call" or t.name not in blocks:
            return None
        inp, pre = t.args[0], None
        if inp.kind == "call" and inp.name in norms:
            pre, inp = inp.name, inp.args[0]
        stream = set(inp.args) if inp.kind == "sum" else {inp}
        branches.append((stream, (pre, t.name, post), t if post is None else V("call", post, (t,))))
    current, steps = {X}, []
    while branches:
        ready = [b for b in branches if b[0] == current]
        if not ready:
            return None
        steps.append(tuple(sorted((b[1] for b in ready), key=lambda br: blocks.index(br[1]))))
        current |= {b[2] for b in ready}
        branches = [b for b in branches if b not in ready]
    return tuple(steps)


def _tests(fwd: ast.FunctionDef) -> list:
    return [n.test for n in ast.walk(fwd) if isinstance(n, ast.If)]


def _flag_values(tests: list, attrs: dict, fields: set, defaults: dict) -> dict:
    """{config field: the values to try} of the fields the forward's config tests read."""
    values: dict = {}
    for t in tests:
        tr = translate(t, attrs, fields)
        if tr is None:
            continue
        consts = {c.value for c in ast.walk(t) if isinstance(c, ast.Constant) and isinstance(c.value, int)
                  and not isinstance(c.value, bool)}
        for f in sorted(tr[1]):
            dv = defaults.get(f)
            vals = values.setdefault(f, [dv])
            more = [not dv] if isinstance(dv, bool) else sorted(consts) if dv is None or isinstance(dv, int) else []
            vals += [v for v in more if v not in vals]
    return values


def read_flow(cls, config, prefix: str, attn: str, mlp: str, defaults: dict, fields: set) -> Flow | None:
    """The dataflow of the decoder layer at `prefix` whose attention is the child `attn` and feed-forward `mlp`."""
    base = meta_model(cls, config)
    if base is None:
        return None
    try:
        layer = base.get_submodule(prefix.replace("{i}", "0").rstrip("."))
        tree = ast.parse(class_source(type(layer)))
    except (AttributeError, SyntaxError):
        return None
    fwd = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "forward"), None)
    init = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if fwd is None or len(fwd.args.args) < 2:
        return None
    attrs = self_assignments(ast.unparse(init)) if init is not None else {}
    tests = _tests(fwd)
    flags = _flag_values(tests, attrs, fields, defaults)
    combos = [dict(zip(flags, vs)) for vs in itertools.product(*flags.values())][:64] if flags else [{}]
    seen, params = [], {}      # (combo, the config as the layer reads it, form); norm -> its parameters' names
    for combo in combos:
        model = base if not combo else meta_model(cls, config, **combo)
        if model is None:
            continue
        try:
            inst = model.get_submodule(prefix.replace("{i}", "0").rstrip("."))
        except AttributeError:
            continue
        inst.eval()
        children = dict(inst.named_children())
        norms = {c for c, m in children.items() if "norm" in type(m).__name__.lower()}
        if attn not in children or mlp not in children:
            continue
        ex = _Exec(inst, norms | {attn, mlp}, children)
        ex.env[fwd.args.args[1].arg] = X
        try:
            form = _steps(ex.run(fwd.body) or V("?"), norms, (attn, mlp))
        except _Unknown:
            form = None
        if form is None:
            if not combo or combo == {f: v[0] for f, v in flags.items()}:
                return None         # the defaults' form is unread: nothing to say
            continue
        seen.append((combo, {f: getattr(model.config, f, combo[f]) for f in combo}, form))
        params.update({n: [p for p, _ in inst.get_submodule(n).named_parameters()] for n in norms})
    if not seen or seen[0][0] != {f: v[0] for f, v in flags.items()}:
        return None
    flow = _choose(seen, tests, attrs, fields, flags, defaults)
    flow.members = list(dict.fromkeys(s[2] for s in seen))
    flow.renames = [(n, e, params.get(n, ["weight"])) for n, e in flow.renames or ()]
    return flow


def _choose(seen: list, tests: list, attrs: dict, fields: set, flags: dict, defaults: dict) -> Flow | None:
    forms = list(dict.fromkeys(s[2] for s in seen))
    if len(forms) == 1:
        return Flow([forms[0]])
    conds = []
    for t in tests:
        tr = translate(t, attrs, fields)
        if tr is not None and tr[1]:
            conds += [(tr[0], tr[1]), (f"not ({tr[0]})", tr[1])]
    conds.sort(key=lambda c: len(c[1]))     # the tests of the fewest flags first
    default = {f: v[0] for f, v in flags.items()}
    for k in range(len(flags)):        # the fewest flags held at their defaults
        found = []
        for held in itertools.combinations(sorted(flags), k):
            rest = [s for s in seen if all(s[0][f] == default[f] for f in held)]
            kinds = list(dict.fromkeys(s[2] for s in rest))
            group = {f: f for f in kinds} if len(kinds) == 2 else merge_groups(kinds)
            if group is None or len(set(group.values())) != 2:
                continue
            moved, rused = renames(group, rest, conds)
            if moved is None:
                continue
            for c, used in conds:
                then = separates(c, [(a, b, group[f]) for a, b, f in rest])
                if then is not None:
                    other = next(f for f in group.values() if f != then)
                    # the most combinations kept; then the pair of one residual shape (norms differ only)
                    found.append(((-len(rest), shape(then) != shape(other)), held, c, used, then, other,
                                  rest, (moved, rused)))
                    break
        if found:
            _, held, c, used, then, other, rest, (moved, rused) = min(found, key=lambda x: x[0])
            return Flow([then, other], c, "".join(w.capitalize() for w in sorted(used)[0].split("_")),
                        {f: _symbol(f, rest, defaults) for f in sorted(set(used) | rused)},
                        {f: default[f] for f in held}, renames=moved)
    return Flow([forms[0]], held={f: default[f] for f in flags})


def _symbol(f: str, rest: list, defaults: dict) -> str:
    """A flag's symbol text: a null the layer's `__init__` replaces by one value read as that value (`if_null`)."""
    from .draft_render import _yaml_scalar
    dv = defaults.get(f)
    filled = {p[f] for c, p, _ in rest if c[f] is None and p[f] is not None}
    if dv is None and len(filled) == 1:
        v = filled.pop()
        typ = "bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "float"
        return (f"{{type: {typ}, from: {f}, default: {_yaml_scalar(v)}, if_null: {_yaml_scalar(v)}, "
                f"same_meaning: \"None is {v} where the decoder layer reads it (its __init__ sets it)\"}}")
    typ = "bool" if isinstance(dv, bool) else "int" if isinstance(dv, int) else "str" if isinstance(dv, str) else "float"
    return f"{{type: {typ}, from: {f}, default: {_yaml_scalar(dv)}}}"


def flow_lines(flow: Flow, block_of, extra: str = "") -> list:
    """The `dataflow:` lines (after `    dataflow:`); `block_of(child)` -> the step's block text; `extra`: more keys of
    each branch (`, scale: S`)."""
    def form_lines(form, ind: str) -> list:
        out = []
        for stp in form:
            parts = ["{" + ", ".join(([f"norm: {pre}"] if pre else []) + [f"block: {block_of(b)}"]
                                     + ([f"post_norm: {post}"] if post else [])) + extra + "}" for pre, b, post in stp]
            out.append(f"{ind}- {parts[0]}" if len(parts) == 1 else f"{ind}- parallel: [{', '.join(parts)}]")
        return out
    if len(flow.forms) == 1:
        return form_lines(flow.forms[0], "      ")
    return [f"      if: \"{flow.cond}\"", f"      name: {flow.name}", "      then:",
            *form_lines(flow.forms[0], "        "), "      else:", *form_lines(flow.forms[1], "        ")]


def flow_symbols(d, layer) -> None:
    """The symbols of the flags a drafted choice reads, and the flags held at their defaults, on the checklist."""
    flow = getattr(getattr(layer, "roles", None), "flow", None)
    if flow is None:
        return
    d.symbols.update(flow.symbols or {})
    for f, v in (flow.held or {}).items():
        d.checklist.append(f"the decoder layer's forward has another dataflow where `{f}` is not {v!r}: not drafted "
                           f"(the draft's forms are chosen by the other flags); `{f}` = {v!r} is assumed")


def drop_flow_hints(d, layer) -> None:
    """The source hint of a parallel residual, where the drafted dataflow has a parallel step."""
    flow = getattr(getattr(layer, "roles", None), "flow", None)
    if flow is not None and any(len(stp) > 1 for form in flow.forms for stp in form):
        d.checklist[:] = [c for c in d.checklist if not c.startswith("a parallel-residual dataflow appears")]
