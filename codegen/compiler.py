"""The compiler pipeline as functions: spec path -> (loaded spec, IR, rendered files)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

from .errors import SpecError
from .ir import ModelIR
from .loader import LoadedSpec, load_spec
from .render import render
from .resolver import resolve
from .usage import check_symbols_used


@dataclass
class Compiled:
    loaded: LoadedSpec
    ir: ModelIR
    files: Dict[str, str]
    model_module: Optional[Any] = None      # the rendered model.py, imported (built once, by the TP check)

    def module(self):
        """The rendered model module (imported once; --explain builds its tables on it)."""
        if self.model_module is None:
            from .explain import model_module_of
            self.model_module = model_module_of(self.ir, self.files)
        return self.model_module


def compile_spec(path) -> Compiled:
    """Loads, validates, resolves and renders one spec, then checks its declared TP sizes on the rendered
    model; raises SpecError/SpecErrors on a bad spec."""
    loaded = load_spec(Path(path))
    ir = resolve(loaded)
    compiled = Compiled(loaded, ir, render(ir, loaded.tree))
    check_symbols_used(loaded, ir, compiled.files)
    check_tp_sizes(compiled)
    return compiled


def check_tp_sizes(compiled: Compiled) -> None:
    """The static TP check of `tensor_parallel.sizes`, on the runtime's own plan: the rendered Model of every
    variant built on the meta device under each size, every layer's weight_loader deciding its shard: the code
    that the loader and `--explain --tp N` run, so the check cannot drift from what serving does."""
    loaded, ir, files = compiled.loaded, compiled.ir, compiled.files
    sizes = [t for t in ir.tp_sizes if t > 1]
    if not sizes:
        return
    from xllm_gen.runtime.executor.sharding import ShardingError
    from xllm_gen.runtime.loading.hf_config import ConfigError

    from .explain import tp_rank_table

    module = compiled.module()
    for v in ir.variants:
        for tp in sizes:
            try:
                tp_rank_table(ir, files, v, tp, module)
            except ConfigError as e:        # a variant value the generated Config refuses (a rope key's type, ...)
                where = loaded.tree.smap.value(("variants", v.name))
                msg = str(e).split(": ", 1)[-1]
                raise SpecError(f"variants.{v.name}: its values are refused by the generated Config: {msg}",
                                where) from None
            except ShardingError as e:
                problem = e.problems[0].replace(".*.", ".{i}.")
                where = loaded.tree.smap.value(("tensor_parallel", "sizes", ir.tp_sizes.index(tp)))
                raise SpecError(f"tensor parallel size {tp}, variant {v.name}: {problem}", where) from None
