"""Finds the generated package that serves a checkpoint, from config.json `architectures`.

Generated packages are found, not listed, in three places:
- the packages under `xllm_gen.generated` (the specs shipped with xllm-gen);
- every directory on the `XLLM_GEN_PATH` environment variable (os.pathsep-separated): a user's own
  `generated/` directory, written by `xllm-gen path/to/specs/my_model.yaml` (-> path/to/generated/);
- installed distributions that declare the entry point group `xllm_gen.models` (name = anything,
  value = an importable generated package, e.g. `my_models.generated.my_model`).

Two packages that claim one architecture are an error naming both when a checkpoint of that architecture is
loaded (the first match never silently wins; every other architecture still loads), unless XLLM_GEN_PREFER
names the one to use.
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
PREFER_ENV = "XLLM_GEN_PREFER"     # os.pathsep-separated packages that win an architecture two packages claim
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


def _scan() -> tuple[dict[str, str], dict[str, list[str]]]:
    """(architecture -> package, architecture -> the packages that claim it where more than one does)."""
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
    claims: dict[str, list[str]] = {}
    for package in candidates:
        for arch in _architectures(package):
            if package not in claims.setdefault(arch, []):
                claims[arch].append(package)
            found.setdefault(arch, package)
    conflicts = {a: ps for a, ps in claims.items() if len(ps) > 1}
    prefer = [p for p in os.environ.get(PREFER_ENV, "").split(os.pathsep) if p]
    for arch, packages in list(conflicts.items()):
        chosen = [p for p in packages if p in prefer]
        if len(chosen) == 1:                 # the user's choice settles it
            found[arch] = chosen[0]
            del conflicts[arch]
        else:
            found.pop(arch, None)
    return found, conflicts


def generated_packages() -> dict[str, str]:
    """architecture name -> generated package name (e.g. "xllm_gen.generated.<spec name>"). An architecture that
    two packages claim is left out (resolve() names both when a checkpoint asks for it); the others still load."""
    return _scan()[0]


def relabel_hint(hf_config: dict, failed_package: str) -> str:
    """When a config.json is refused by the spec of its `architectures`, but another generated model reads it
    without error: the likely cause, a checkpoint whose architecture was relabelled ('' when none fits)."""
    try:
        table = generated_packages()
    except Exception:  # noqa: BLE001 - a hint never fails the error it decorates
        return ""
    fits = []
    for arch, package in sorted(table.items()):
        if package == failed_package:
            continue
        try:
            importlib.import_module(f"{package}.model").Config.from_hf(hf_config)
        except Exception:  # noqa: BLE001 - this one does not read the config either
            continue
        fits.append(f"{arch} ({getattr(importlib.import_module(package), 'SPEC', package)})")
    if not fits:
        return ""
    mt = hf_config.get("model_type")
    return (f"; but this config reads without error as {' or '.join(fits[:3])}: was `architectures` relabelled"
            f"{f' (model_type is {mt!r})' if isinstance(mt, str) else ''}?")


def resolve(hf_config: dict) -> tuple[ModuleType, ModuleType]:
    """(model module, runner module) for a checkpoint's config.json."""
    archs = hf_config.get("architectures") if isinstance(hf_config, dict) else None
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"config.json: `architectures` must be a list of names, got {archs!r}")
    table, conflicts = _scan()
    for arch in archs:
        if arch in conflicts:
            raise RegistryError(f"architecture {arch} is claimed by {len(conflicts[arch])} generated packages: "
                                f"{', '.join(conflicts[arch])}; remove one, give the specs different architectures, "
                                f"or choose one with {PREFER_ENV}=<package> (other architectures are not affected)")
        if arch in table:
            pkg = table[arch]
            return importlib.import_module(f"{pkg}.model"), importlib.import_module(f"{pkg}.runner")
    raise ValueError(f"config.json architectures {archs} are not served by any generated model "
                     f"(known: {', '.join(sorted(table)) or 'none'}; compile a spec with xllm-gen and put its "
                     f"generated/ directory on {SEARCH_PATH_ENV})")
