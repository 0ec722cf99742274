"""Meta inference without importing Dynamo.

Most pointwise ops get their meta kernel from torch's Python references (``torch._refs``), and
each of those is wrapped in ``torch._disable_dynamo``: a wrapper that, at its first call, imports
``torch._dynamo`` (about 0.8 s on a 2-core VM) to build Dynamo's ``disable`` of the function and
caches it on the function as ``__dynamo_disable``.  A strict one-off script never imports Dynamo;
our first meta inference would.

While Dynamo is not imported nothing can be tracing, so Dynamo's ``disable`` of a function is
the function itself.  ``no_dynamo_import()`` puts a stand-in into that cache slot of each such
wrapper for the duration of one meta inference: it calls the function directly while Dynamo is
not imported, and once it is (another thread imported it meanwhile) it builds and caches
Dynamo's own ``disable``, as torch would have.  On the way out, stand-ins still in place are
removed, so outside our meta inference torch behaves exactly as it does without deferfuse.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any, Callable, Iterator, Optional

import torch

_DYNAMO = "torch._dynamo"
_SLOT = "__dynamo_disable"  # where torch._compile._disable_dynamo caches the disabled function
_REFERENCE_MODULES = ("torch._refs", "torch._decomp", "torch._meta_registrations", "torch._prims")


class _UntilDynamoLoads:
    """Dynamo's ``disable(fn)`` while Dynamo is not imported (``fn`` itself)."""

    __slots__ = ("fn", "recursive")

    def __init__(self, fn: Callable, recursive: bool) -> None:
        self.fn = fn
        self.recursive = recursive

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _DYNAMO not in sys.modules:
            return self.fn(*args, **kwargs)
        import torch._dynamo  # loaded already: what torch's own wrapper does at this point

        disabled = torch._dynamo.disable(self.fn, self.recursive, wrapping=False)
        setattr(self.fn, _SLOT, disabled)
        return disabled(*args, **kwargs)


def _wrapper_code() -> Optional[types.CodeType]:
    disable = getattr(getattr(torch, "_compile", None), "_disable_dynamo", None)
    if disable is None:
        return None
    code = disable(lambda: None).__code__
    if not {"fn", "recursive"} <= set(code.co_freevars):
        return None   # another torch: leave it alone
    return code


def _find_wrapped() -> list[tuple[Callable, bool]]:
    """(function, recursive) of every ``_disable_dynamo`` wrapper reachable from the reference
    modules' globals, through ``__wrapped__`` chains and closures."""
    code = _wrapper_code()
    if code is None:
        return []
    found: list[tuple[Callable, bool]] = []
    seen: set[int] = set()

    def walk(f: Any) -> None:
        while type(f) is types.FunctionType and id(f) not in seen:
            seen.add(id(f))
            cells = f.__closure__ or ()
            if f.__code__ is code:
                named = dict(zip(f.__code__.co_freevars, cells))
                found.append((named["fn"].cell_contents, bool(named["recursive"].cell_contents)))
            for cell in cells:
                try:
                    inner = cell.cell_contents
                except ValueError:   # an empty cell
                    continue
                walk(inner)
            f = getattr(f, "__wrapped__", None)

    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith(_REFERENCE_MODULES):
            for value in list(vars(module).values()):
                walk(value)
    return found


_WRAPPED: Optional[list[tuple[Callable, bool]]] = None


@contextlib.contextmanager
def no_dynamo_import() -> Iterator[None]:
    """Run torch's meta kernels inside without their first call importing Dynamo."""
    global _WRAPPED
    if _DYNAMO in sys.modules:
        yield
        return
    if _WRAPPED is None:
        _WRAPPED = _find_wrapped()
    placed = []
    for fn, recursive in _WRAPPED:
        if getattr(fn, _SLOT, None) is None:
            stand_in = _UntilDynamoLoads(fn, recursive)
            setattr(fn, _SLOT, stand_in)
            placed.append((fn, stand_in))
    try:
        yield
    finally:
        for fn, stand_in in placed:
            if getattr(fn, _SLOT, None) is stand_in:
                delattr(fn, _SLOT)
