"""torch dtype <-> JAX dtype."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from ..errors import LoweringError

TORCH_TO_JAX: dict[torch.dtype, np.dtype] = {
    torch.bool: jnp.dtype(jnp.bool_),
    torch.uint8: jnp.dtype(jnp.uint8),
    torch.int8: jnp.dtype(jnp.int8),
    torch.int16: jnp.dtype(jnp.int16),
    torch.int32: jnp.dtype(jnp.int32),
    torch.int64: jnp.dtype(jnp.int64),
    torch.uint16: jnp.dtype(jnp.uint16),
    torch.uint32: jnp.dtype(jnp.uint32),
    torch.uint64: jnp.dtype(jnp.uint64),
    torch.float16: jnp.dtype(jnp.float16),
    torch.bfloat16: jnp.dtype(jnp.bfloat16),
    torch.float32: jnp.dtype(jnp.float32),
    torch.float64: jnp.dtype(jnp.float64),
    torch.complex64: jnp.dtype(jnp.complex64),
    torch.complex128: jnp.dtype(jnp.complex128),
}
JAX_TO_TORCH: dict[np.dtype, torch.dtype] = {v: k for k, v in TORCH_TO_JAX.items()}


class UnsupportedDtypeError(LoweringError):
    """A dtype with no JAX equivalent (complex32, the float8 and quantized types) reached XLA.

    Checkers decline such calls; this is the clear error for one that did not.  It is a
    ``LoweringError``, so outside ``always_compile`` the graph replays eagerly in torch, which
    computes the result or raises torch's own error for the dtype."""


def to_jax(dtype: torch.dtype) -> np.dtype:
    try:
        return TORCH_TO_JAX[dtype]
    except KeyError:
        raise UnsupportedDtypeError(f"dtype {dtype} has no JAX equivalent") from None


def to_torch(dtype) -> torch.dtype:
    try:
        return JAX_TO_TORCH[jnp.dtype(dtype)]
    except KeyError:
        raise UnsupportedDtypeError(f"JAX dtype {jnp.dtype(dtype)} has no torch equivalent") from None


def is_supported(dtype: torch.dtype) -> bool:
    return dtype in TORCH_TO_JAX


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
