"""Finds the generated package that serves a checkpoint, from config.json `architectures`."""
from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

import xllm_gen.generated as generated_pkg


def generated_packages() -> dict[str, str]:
    """architecture name -> generated package name (e.g. "xllm_gen.generated.qwen3")."""
    found: dict[str, str] = {}
    for info in pkgutil.iter_modules(generated_pkg.__path__):
        if not info.ispkg:
            continue
        name = f"{generated_pkg.__name__}.{info.name}"
        try:
            model = importlib.import_module(f"{name}.model")
        except ModuleNotFoundError:
            continue
        for arch in getattr(model, "ARCHITECTURES", ()):
            found[arch] = name
    return found


def resolve(hf_config: dict) -> tuple[ModuleType, ModuleType]:
    """(model module, runner module) for a checkpoint's config.json."""
    archs = hf_config.get("architectures") or []
    table = generated_packages()
    for arch in archs:
        if arch in table:
            pkg = table[arch]
            return importlib.import_module(f"{pkg}.model"), importlib.import_module(f"{pkg}.runner")
    raise ValueError(f"config.json architectures {archs} are not served by any generated model "
                     f"(known: {', '.join(sorted(table)) or 'none; run xllm-gen specs/*.yaml'})")
