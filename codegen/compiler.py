"""The compiler pipeline as functions: spec path -> (loaded spec, IR, rendered files)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict

from .errors import SpecError
from .ir import ModelIR
from .loader import LoadedSpec, load_spec
from .render import render
from .resolver import resolve


@dataclass
class Compiled:
    loaded: LoadedSpec
    ir: ModelIR
    files: Dict[str, str]


def compile_spec(path) -> Compiled:
    """Loads, validates, resolves and renders one spec, then checks its declared TP sizes on the rendered
    model; raises SpecError/SpecErrors on a bad spec."""
    loaded = load_spec(Path(path))
    ir = resolve(loaded)
    files = render(ir, loaded.tree)
    check_tp_sizes(loaded, ir, files)
    return Compiled(loaded, ir, files)


def check_tp_sizes(loaded: LoadedSpec, ir: ModelIR, files: Dict[str, str]) -> None:
    """The static TP check of `tensor_parallel.sizes`, on the runtime's own plan: the rendered Model of every
    variant built on the meta device under each size, every layer's weight_loader deciding its shard: the code
    that the loader and `--explain --tp N` run, so the check cannot drift from what serving does."""
    sizes = [t for t in ir.tp_sizes if t > 1]
    if not sizes:
        return
    from xllm_gen.runtime.executor.sharding import ShardingError

    from .explain import model_module_of, tp_rank_table

    module = model_module_of(ir, files)
    for v in ir.variants:
        for tp in sizes:
            try:
                tp_rank_table(ir, files, v, tp, module)
            except ShardingError as e:
                problem = e.problems[0].replace(".*.", ".{i}.")
                where = loaded.tree.smap.value(("tensor_parallel", "sizes", ir.tp_sizes.index(tp)))
                raise SpecError(f"tensor parallel size {tp}, variant {v.name}: {problem}", where) from None
