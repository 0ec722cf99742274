"""RMSNorm as a Pallas kernel over a grid of row blocks, with its backward given (``bwd=``):
JAX cannot differentiate ``pallas_call``.

On the CPU Pallas runs only in interpret mode (``pallas_interpret()`` says so); on an
accelerator the same kernel is compiled.  ``eps`` is static: a Pallas kernel cannot close over a
traced value, so a new ``eps`` compiles a new kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import torch
from jax import lax
from jax.experimental import pallas as pl

from ..jax_op import jax_op, pallas_interpret

_BLOCKS = (256, 128, 64, 32, 16, 8, 4, 2, 1)


def _block_rows(n: int) -> int:
    """The largest block of rows (at most 256) that divides ``n``: the grid covers every row."""
    return next(b for b in _BLOCKS if n % b == 0)


def _compute_dtype(dtype):
    """float32, or float64 for float64 inputs (as torch's CPU kernels compute)."""
    return jnp.promote_types(dtype, jnp.float32)


def _kernel(x_ref, w_ref, o_ref, *, eps: float):
    dt = _compute_dtype(x_ref.dtype)
    x = x_ref[...].astype(dt)
    rstd = lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    o_ref[...] = (x * rstd * w_ref[...].astype(dt)).astype(o_ref.dtype)


def _rmsnorm_bwd(g, x, weight, eps: float):
    """(dx, dweight) of y = x * rstd * w, computed in float32 (float64 for float64)."""
    d = x.shape[-1]
    dt = _compute_dtype(x.dtype)
    xf, gf, wf = x.astype(dt), g.astype(dt), weight.astype(dt)
    rstd = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    xhat = xf * rstd
    gw = gf * wf
    dx = rstd * (gw - xhat * jnp.sum(gw * xhat, axis=-1, keepdims=True) / d)
    dw = jnp.sum((gf * xhat).reshape(-1, d), axis=0)
    return dx.astype(x.dtype), dw.astype(weight.dtype)


@jax_op("deferfuse_examples::rmsnorm", bwd=_rmsnorm_bwd, static_argnames=("eps",))
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * weight`` over the last dim, in float32 (float64
    for float64 inputs)."""
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}; expected ({d},)")
    rows = x.reshape(-1, d)
    block = _block_rows(rows.shape[0])
    out = pl.pallas_call(
        functools.partial(_kernel, eps=eps),
        out_shape=jax.ShapeDtypeStruct(rows.shape, x.dtype),
        grid=(rows.shape[0] // block,),
        in_specs=[pl.BlockSpec((block, d), lambda i: (i, 0)), pl.BlockSpec((d,), lambda i: (0,))],
        out_specs=pl.BlockSpec((block, d), lambda i: (i, 0)),
        interpret=pallas_interpret(),
    )(rows, weight)
    return out.reshape(x.shape)


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The same computation in torch ops."""
    dt = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dt)
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.to(dt)).to(x.dtype)
