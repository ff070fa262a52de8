"""Finds the generated package that serves a checkpoint, from config.json `architectures`.

Generated packages are found, not listed, in three places:
- the packages under `xllm_gen.generated` (the specs shipped with xllm-gen);
- every directory on the `XLLM_GEN_PATH` environment variable (os.pathsep-separated): a user's own
  `generated/` directory, written by `xllm-gen path/to/specs/my_model.yaml` (-> path/to/generated/);
- installed distributions that declare the entry point group `xllm_gen.models` (name = anything,
  value = an importable generated package, e.g. `my_models.generated.my_model`).

Two packages that claim one architecture are an error naming both: the first match never silently wins.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import pkgutil
import sys
import types
from pathlib import Path
from types import ModuleType

import xllm_gen.generated as generated_pkg

SEARCH_PATH_ENV = "XLLM_GEN_PATH"
ENTRY_POINT_GROUP = "xllm_gen.models"
_USER_PKG = "xllm_gen_user"        # synthetic namespace whose __path__ is XLLM_GEN_PATH


class RegistryError(ValueError):
    pass


def _architectures(package: str) -> tuple:
    """ARCHITECTURES of a generated package, read from its cheap __init__ (no torch import)."""
    try:
        mod = importlib.import_module(package)
    except Exception as exc:  # noqa: BLE001 - a broken package is reported, not fatal for the others
        raise RegistryError(f"generated package {package} cannot be imported: {type(exc).__name__}: {exc}") \
            from None
    return tuple(getattr(mod, "ARCHITECTURES", ()))


def _user_namespace() -> list[str]:
    dirs = [d for d in os.environ.get(SEARCH_PATH_ENV, "").split(os.pathsep) if d]
    if not dirs:
        return []
    ns = sys.modules.get(_USER_PKG)
    if ns is None:
        ns = types.ModuleType(_USER_PKG)
        ns.__path__ = []
        sys.modules[_USER_PKG] = ns
    ns.__path__[:] = [str(Path(d).resolve()) for d in dirs]
    return list(ns.__path__)


def generated_packages() -> dict[str, str]:
    """architecture name -> generated package name (e.g. "xllm_gen.generated.<spec name>")."""
    candidates: list[str] = []
    for info in pkgutil.iter_modules(generated_pkg.__path__):
        if info.ispkg:
            candidates.append(f"{generated_pkg.__name__}.{info.name}")
    for d in _user_namespace():
        for info in pkgutil.iter_modules([d]):
            if info.ispkg and (Path(d) / info.name / "model.py").is_file():
                candidates.append(f"{_USER_PKG}.{info.name}")
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        candidates.append(ep.value)
    found: dict[str, str] = {}
    for package in candidates:
        for arch in _architectures(package):
            if arch in found and found[arch] != package:
                raise RegistryError(f"architecture {arch} is claimed by two generated packages: {found[arch]} and "
                                    f"{package}; remove one (or give the specs different architectures)")
            found[arch] = package
    return found


def resolve(hf_config: dict) -> tuple[ModuleType, ModuleType]:
    """(model module, runner module) for a checkpoint's config.json."""
    archs = hf_config.get("architectures") if isinstance(hf_config, dict) else None
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"config.json: `architectures` must be a list of names, got {archs!r}")
    table = generated_packages()
    for arch in archs:
        if arch in table:
            pkg = table[arch]
            return importlib.import_module(f"{pkg}.model"), importlib.import_module(f"{pkg}.runner")
    raise ValueError(f"config.json architectures {archs} are not served by any generated model "
                     f"(known: {', '.join(sorted(table)) or 'none'}; compile a spec with xllm-gen and put its "
                     f"generated/ directory on {SEARCH_PATH_ENV})")
