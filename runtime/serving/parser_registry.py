"""A registry of output parsers by format name (tool-call and reasoning parsers share it): built-in formats are
imported on first use, and family names are aliases kept outside the runtime (xllm_gen/parser_aliases.py)."""
from __future__ import annotations

import importlib

_ALIASES_MODULE = "xllm_gen.parser_aliases"


class ParserRegistry:
    def __init__(self, what: str, builtin: dict, aliases_attr: str):
        self.what, self.builtin, self.aliases_attr = what, builtin, aliases_attr
        self.parsers: dict = {}

    def aliases(self) -> dict:
        try:
            return dict(getattr(importlib.import_module(_ALIASES_MODULE), self.aliases_attr))
        except (ImportError, AttributeError):
            return {}

    def register(self, name: str):
        def deco(cls):
            cls.name = name
            self.parsers[name] = cls
            return cls
        return deco

    def names(self) -> list[str]:
        return sorted(set(self.parsers) | set(self.builtin) | set(self.aliases()))

    def get(self, name: str) -> type:
        """The parser class registered as `name` (or aliased to it); ValueError listing the known ones."""
        name = self.aliases().get(name, name)
        if name not in self.parsers and name in self.builtin:
            importlib.import_module(self.builtin[name])
        if name not in self.parsers:
            raise ValueError(f"unknown {self.what} {name!r}; known: {', '.join(self.names())}")
        return self.parsers[name]
