"""A module reference that imports on first use.

Why: the controller imports the worker module only to name the actor class for ``ray.remote``;
it never runs a step. Importing torch there cost 2-3 s of CPU on every run's critical path (the
controller starts before any worker) and ~300 MB of controller memory, for nothing.

Why not ``importlib.util.LazyLoader``: it installs a half-loaded module in ``sys.modules`` for the
whole process, so every other importer of torch (including torch's own submodules) would share
the lazy object. This proxy defers only the references made through it.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class LazyModule:
    def __init__(self, name: str):
        self.__dict__["_name"] = name
        self.__dict__["_module"] = None

    def _load(self) -> ModuleType:
        module = self.__dict__["_module"]
        if module is None:
            module = importlib.import_module(self.__dict__["_name"])
            self.__dict__["_module"] = module
        return module

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._load(), attr)

    def __repr__(self) -> str:
        state = "loaded" if self.__dict__["_module"] is not None else "not loaded"
        return f"<lazy module {self.__dict__['_name']!r} ({state})>"
