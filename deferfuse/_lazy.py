"""Modules imported at their first use instead of at import time.

JAX takes about a second to import, and a one-off script under defer never needs it: a graph
seen once replays eagerly in torch.  The lowering rules and the executor name ``jnp``, ``lax``
and ``jax`` everywhere, but only touch them while tracing or running XLA computations, so each
of those names is bound to a ``LazyModule`` that imports the real module at its first attribute
access and then rebinds the name in the modules that asked for it: later accesses cost nothing.

Module-level code of a module using these names must not touch them (dtype constants come
from numpy, bfloat16 is looked up at first use); ``tests/test_cache.py`` checks that recording and an eager
replay leave JAX unimported.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from .stats import one_off


class LazyModule(types.ModuleType):
    """Stands for module ``target`` until an attribute is read."""

    def __init__(self, target: str) -> None:
        super().__init__(target)
        self._lazy_target = target
        self._lazy_namespaces: list[tuple[dict, str]] = []

    def _lazy_load(self) -> types.ModuleType:
        if self._lazy_target in sys.modules:
            module = sys.modules[self._lazy_target]
        else:
            with one_off():
                module = importlib.import_module(self._lazy_target)
        for namespace, name in self._lazy_namespaces:
            if namespace.get(name) is self:
                namespace[name] = module
        return module

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_lazy_"):
            raise AttributeError(attr)
        return getattr(self._lazy_load(), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._lazy_target!r}>"


def lazy_import(target: str, namespace: dict, name: str) -> Any:
    """``import target as name`` into ``namespace`` (a module's globals()), done at first use.
    Returns the real module when it is imported already."""
    module = sys.modules.get(target)
    if module is not None:
        return module
    proxy = LazyModule(target)
    proxy._lazy_namespaces.append((namespace, name))
    return proxy


def is_imported(target: str) -> bool:
    return target in sys.modules


class _Late:
    """``late(jnp).exp`` is a function that calls ``jnp.exp`` when called: for tables of rules
    built at import time, before the module is imported."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        module = self._module

        def call(*args: Any, **kwargs: Any) -> Any:
            return getattr(module, name)(*args, **kwargs)
        call.__name__ = call.__qualname__ = name
        return call


def late(module: Any) -> _Late:
    return _Late(module)
