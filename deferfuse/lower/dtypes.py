"""torch dtype <-> JAX dtype."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

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


def to_jax(dtype: torch.dtype) -> np.dtype:
    return TORCH_TO_JAX[dtype]


def to_torch(dtype) -> torch.dtype:
    return JAX_TO_TORCH[jnp.dtype(dtype)]


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
