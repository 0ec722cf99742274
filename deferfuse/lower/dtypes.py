"""torch dtype <-> JAX dtype."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import LoweringError
from .._lazy import lazy_import

jnp = lazy_import("jax.numpy", globals(), "jnp")

# numpy's dtypes are JAX's.  bfloat16 is ml_dtypes' (as in JAX), whose import takes most of a
# second: it is looked up at first use, so recording and eager replays never import it.
_NUMPY_NAMES: dict[torch.dtype, str] = {
    torch.bool: "bool", torch.uint8: "uint8", torch.int8: "int8", torch.int16: "int16",
    torch.int32: "int32", torch.int64: "int64", torch.uint16: "uint16", torch.uint32: "uint32",
    torch.uint64: "uint64", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.float32: "float32", torch.float64: "float64", torch.complex64: "complex64",
    torch.complex128: "complex128",
}
_TO_JAX: dict[torch.dtype, np.dtype] = {}
_TO_TORCH: dict[str, torch.dtype] = {name: dtype for dtype, name in _NUMPY_NAMES.items()}


class DtypeNames:
    """A set of dtypes given by name: ``dtype in HALF_TYPES`` without importing ml_dtypes."""

    def __init__(self, *names: str) -> None:
        self.names = frozenset(names)

    def __contains__(self, dtype: Any) -> bool:
        return np.dtype(dtype).name in self.names


HALF_TYPES = DtypeNames("float16", "bfloat16")


class UnsupportedDtypeError(LoweringError):
    """A dtype with no JAX equivalent (complex32, the float8 and quantized types) reached XLA.

    Checkers decline such calls; this is the clear error for one that did not.  It is a
    ``LoweringError``, so outside ``always_compile`` the graph replays eagerly in torch, which
    computes the result or raises torch's own error for the dtype."""


def to_jax(dtype: torch.dtype) -> np.dtype:
    found = _TO_JAX.get(dtype)
    if found is not None:
        return found
    name = _NUMPY_NAMES.get(dtype)
    if name is None:
        raise UnsupportedDtypeError(f"dtype {dtype} has no JAX equivalent")
    if name == "bfloat16":
        import ml_dtypes
        found = np.dtype(ml_dtypes.bfloat16)
    else:
        found = np.dtype(name)
    _TO_JAX[dtype] = found
    return found


def to_torch(dtype) -> torch.dtype:
    try:
        return _TO_TORCH[np.dtype(dtype).name]
    except KeyError:
        raise UnsupportedDtypeError(f"JAX dtype {np.dtype(dtype)} has no torch equivalent") from None


def is_supported(dtype: torch.dtype) -> bool:
    return dtype in _NUMPY_NAMES


def cast(x, dtype):
    """``x.astype(dtype)``, keeping IEEE semantics through XLA's simplifier.

    XLA rewrites ``convert(pred) * y`` as ``select(pred, y, 0)``, which turns ``False * NaN`` into
    0 where torch gives NaN.  Converting a bool through uint8 keeps the multiply a multiply.
    """
    x = jnp.asarray(x)
    dtype = jnp.dtype(dtype)
    if x.dtype == jnp.bool_ and dtype != jnp.bool_:
        x = x.astype(jnp.uint8)
    return x.astype(dtype)
