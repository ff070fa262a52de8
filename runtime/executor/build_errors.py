"""What a config the generated model cannot be built from gives (ModelRunner.__init__ raises it, with the config.json
path): the spec, the error, and where in the generated code it failed (file:line, its source, the layer being built),
with the per-layer config field to blame when a per-layer list is shorter than the layer count.
"""
from __future__ import annotations

import linecache
from pathlib import Path


def _model_build_error(model_module, e: BaseException) -> str:
    """What a config that the model cannot be built from gives: the spec, the error, and where in the generated
    code (file:line, its source, the layer being built), e.g. a per-layer tuple shorter than the layer count."""
    where = None
    gen_dir = Path(model_module.__file__).resolve().parent
    tb = e.__traceback__
    while tb is not None:                        # the innermost frame of the generated module
        if Path(tb.tb_frame.f_code.co_filename).resolve().parent == gen_dir:
            where = tb
        tb = tb.tb_next
    at, hint = "", ""
    if where is not None:
        file = where.tb_frame.f_code.co_filename
        layer = where.tb_frame.f_locals.get("layer_idx")
        hint = _per_layer_hint(e, where.tb_frame.f_locals, linecache.getline(file, where.tb_lineno), layer)
        at = (f" (building {'layer ' + str(layer) + ', ' if isinstance(layer, int) else ''}"
              f"{gen_dir.name}/{Path(file).name}:{where.tb_lineno}: {linecache.getline(file, where.tb_lineno).strip()}"
              f"{_fields_read(where.tb_frame.f_locals.get('config'), _statement(file, where.tb_lineno))})")
    spec = getattr(model_module, "SPEC", model_module.__name__)
    return f"{spec}: the model cannot be built from this config: {hint}{type(e).__name__}: {e}{at}"


def _statement(file: str, lineno: int, most: int = 16) -> str:
    """The generated statement that starts at `lineno`, over its continuation lines (until its brackets close)."""
    lines, depth = [], 0
    for n in range(lineno, lineno + most):
        line = linecache.getline(file, n)
        if not line:
            break
        lines.append(line)
        depth += sum(line.count(c) for c in "([{") - sum(line.count(c) for c in ")]}")
        if depth <= 0:
            break
    return "".join(lines)


def _fields_read(config, statement: str) -> str:
    """'; config fields it reads: a = 1, b = 0.3': the checkpoint's values the failing statement computes with (a
    rotary of odd dims names partial_rotary_factor, not only the generated line)."""
    import re

    if config is None:
        return ""
    names = list(dict.fromkeys(re.findall(r"config\.(\w+)", statement)))
    shown = [f"{n} = {getattr(config, n)!r}" for n in names if hasattr(config, n)
             and not isinstance(getattr(config, n), (tuple, list, dict))]
    return f"; config fields it reads: {', '.join(shown)}" if shown else ""


def _per_layer_hint(e: BaseException, local: dict, source: str, layer) -> str:
    """A per-layer list of the config (`config.NAME[...]` in the failing line) shorter than the layer count:
    the field to blame, before the IndexError."""
    import re

    config = local.get("config")
    if not isinstance(e, IndexError) or config is None or not isinstance(layer, int):
        return ""
    for name in re.findall(r"config\.(\w+)\[", source):
        v = getattr(config, name, None)
        if isinstance(v, (tuple, list)) and len(v) <= layer:
            n = getattr(config, "num_hidden_layers", None)
            return (f"config.json field '{name}' lists {len(v)} entr{'y' if len(v) == 1 else 'ies'}, one per layer, "
                    f"but layer {layer} is built{f' (num_hidden_layers = {n})' if isinstance(n, int) else ''}; ")
    return ""
