"""Python numbers in recorded calls: runtime scalars (fed in, not compiled in) and static keys."""

from __future__ import annotations

from typing import Any

from ..ir.graph import RuntimeScalar


SCALARS: dict[float, RuntimeScalar] = {}
_SCALARS_LIMIT = 256


def runtime_scalar(a: float) -> RuntimeScalar:
    """A RuntimeScalar for ``a``, shared by the calls that pass the same value (they are
    immutable): a loop's constants then allocate nothing.  Zeros are not shared (0.0 and -0.0
    are equal keys), nor are nans (no nan equals a key)."""
    r = SCALARS.get(a) if a else None
    if r is None:
        r = RuntimeScalar(a)
        if a:
            if len(SCALARS) >= _SCALARS_LIMIT:
                SCALARS.clear()
            SCALARS[a] = r
    return r


def ints_only(items) -> bool:
    for x in items:
        if type(x) is not int:
            return False
    return True


def static_key(a: Any, is_scalar_arg: bool) -> Any:
    """The key part of a non-tensor argument: ``float`` (the type) for a runtime scalar."""
    if type(a) is float and is_scalar_arg:
        return float
    if isinstance(a, float):
        # key floats by their bits: -0.0 and nan must not collide
        return (float, a.hex())
    if type(a) is bool:
        # True == 1 and hash alike, but promote differently
        return (bool, a)
    return a
