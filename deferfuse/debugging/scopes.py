"""Which module's forward is running: ``model.layers.2.mlp``, for errors and the divergence finder.

While a user of this module holds it (``hold()``/``release()``, counted), torch's global module
hooks keep a stack of the modules whose ``forward`` is running on this thread: a pre-hook pushes
a ``Scope``, a post-hook (``always_call``: it runs when the forward raises too) pops it.  A scope
costs one small object per module call; its name is worked out only when printed, from the
outermost module's ``named_modules()`` (the root, whose path is its class name).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

import torch


class Scope:
    """One running module call: the module and the root module it was called under."""

    __slots__ = ("module", "root", "__weakref__")

    def __init__(self, module: torch.nn.Module, root: torch.nn.Module) -> None:
        self.module = module
        self.root = root

    @property
    def path(self) -> str:
        """The module's name under the root (``model.layers.2.mlp``); the root's own class name
        for the root, and the module's class name where the root does not reach it."""
        if self.module is self.root:
            return type(self.root).__name__
        name = _names_under(self.root).get(id(self.module))
        return name if name is not None else f"<{type(self.module).__name__} called inside " \
                                             f"{type(self.root).__name__}>"

    def __str__(self) -> str:
        if self.module is self.root:
            return f"{self.path} (the outermost module)"
        return f"{self.path} ({type(self.module).__name__})"

    __repr__ = __str__


# root module -> {id(submodule): dotted name}: made once per root, made again when a module
# is not found (a submodule added since)
_NAMES: "weakref.WeakKeyDictionary[torch.nn.Module, dict[int, str]]" = weakref.WeakKeyDictionary()


def _names_under(root: torch.nn.Module) -> dict[int, str]:
    names = _NAMES.get(root)
    if names is None:
        names = _NAMES[root] = {id(m): name for name, m in root.named_modules(remove_duplicate=False) if name}
    return names


class _Stack(threading.local):
    def __init__(self) -> None:
        self.scopes: list[Scope] = []


_stack = _Stack()
_holders = 0
_handles: list = []
_lock = threading.Lock()


def _before_forward(module: torch.nn.Module, args: Any) -> None:
    scopes = _stack.scopes
    root = scopes[0].root if scopes else module
    if scopes and id(module) not in _names_under(root):
        _NAMES.pop(root, None)   # (a submodule added since the names were made)
    scopes.append(Scope(module, root))


def _after_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
    scopes = _stack.scopes
    # (a forward that raised leaves its inner modules' scopes: their post-hooks ran too, with
    # always_call; pop down to this module's own)
    while scopes:
        if scopes.pop().module is module:
            break


def hold() -> None:
    """Start (or keep) tracking module calls."""
    global _holders
    with _lock:
        _holders += 1
        if _holders == 1:
            hooks = torch.nn.modules.module
            _handles.append(hooks.register_module_forward_pre_hook(_before_forward))
            _handles.append(hooks.register_module_forward_hook(_after_forward, always_call=True))


def release() -> None:
    """Stop tracking module calls once no user holds it any more."""
    global _holders
    with _lock:
        _holders -= 1
        if _holders == 0:
            for handle in _handles:
                handle.remove()
            _handles.clear()
            _stack.scopes.clear()


def current() -> Optional[Scope]:
    """The innermost running module call on this thread (None outside any, or when not held)."""
    scopes = _stack.scopes
    return scopes[-1] if scopes else None
