"""The forms of a decoder layer's dataflow for `xllm-gen draft` (codegen/draft_flow.py) told apart and merged: a form's
residual shape, the translated test of the forward that tells two sets of forms apart on every flag combination that
builds, and two forms of one shape whose norms differ only in name (Falcon's ln_attn / ln_mlp in one checkpoint, one
input_layernorm read into both in another) drafted as one, its norms' weights loading from the other's tensors where
a test says so (`weights: {model.layers.{i}.ln_attn.weight: {from: "...{'ln_attn' if C else 'input_layernorm'}..."}}`)."""
from __future__ import annotations


def _norm_seq(form) -> list:
    return [n for stp in form for pre, _, post in stp for n in (pre, post)]


def merge_groups(kinds: list) -> dict | None:
    """form -> the form it is drafted as: two forms of one residual shape whose norms differ only in name (Falcon's
    ln_attn / ln_mlp, or one input_layernorm read into both) drafted as the one with the most distinct norms, where
    each of its norms stands for one norm of the other (its weights then load from that norm's tensors)."""
    by: dict = {}
    for f in kinds:
        by.setdefault(shape(f), []).append(f)
    out = {}
    for fs in by.values():
        if len(fs) > 2:
            return None
        rep = max(fs, key=lambda f: len({n for n in _norm_seq(f) if n}))
        for f in fs:
            if _norm_map(rep, f) is None:
                return None
            out[f] = rep
    return out


def _norm_map(rep, form) -> dict | None:
    """{a norm of `rep`: the norm of `form` in its place}, None where one norm of `rep` has two."""
    out: dict = {}
    for a, b in zip(_norm_seq(rep), _norm_seq(form)):
        if a is not None and out.setdefault(a, b) != b:
            return None
    return out


def renames(group: dict, rest: list, conds: list) -> tuple:
    """([(norm, `{...}` expression of the name its tensors load from)], the flags it reads) of the merged forms, each
    told apart from its stand-in by a test of the forward; (None, None) where no test does."""
    out, used_all = [], set()
    for f, rep in group.items():
        if f == rep:
            continue
        sub = [s for s in rest if group[s[2]] == rep]
        for c, used in conds:
            then = separates(c, sub)
            if then is not None:
                break
        else:
            return None, None
        used_all |= used
        for a, b in _norm_map(rep, f).items():
            if a != b:
                yes, no = (a, b) if then == rep else (b, a)
                out.append((a, f"{{'{yes}' if {c} else '{no}'}}"))
    return out, used_all


def shape(form) -> tuple:
    return tuple(tuple((pre is not None, b, post is not None) for pre, b, post in stp) for stp in form)


def separates(cond: str, rest: list):
    """The form `cond` holds for, where it tells the two forms apart on every combination in `rest`, else None."""
    by: dict = {True: set(), False: set()}
    for _, post, form in rest:
        try:
            by[bool(eval(cond, {"__builtins__": {}}, dict(post)))].add(form)  # noqa: S307 - a translated config test
        except Exception:  # noqa: BLE001
            return None
    if len(by[True]) != 1 or len(by[False]) != 1 or by[True] == by[False]:
        return None
    return next(iter(by[True]))


def flow_weights(flow, prefix: str) -> list:
    """The `weights:` lines of a merged form's norms: each parameter loads from the tensors of the norm the checkpoint
    holds (`prefix`: the checkpoint's layer prefix, "model.layers.{i}.")."""
    out = []
    for norm, name, params in (getattr(flow, "renames", None) or []):
        for p in params:
            out += [f"  model.layers.{{i}}.{norm}.{p}:", f"    from: \"{prefix}{name}.{p}\""]
    return out
