"""Linear algebra lowerings: mm, bmm, mv, dot, vdot and their add*/scaled forms, _trilinear.

torch.matmul, F.linear, einsum and tensordot are CompositeImplicit: by the time they reach the
dispatch mode they are mm/bmm/mv/dot/addmm plus views, which the core handles.

Conventions:
- float32 and float64 products use ``Precision.HIGHEST`` (no reduced-precision passes on
  accelerators); float16/bfloat16 accumulate in float32 as torch's CPU kernels do, and round once.
- Integer products accumulate in int64 and wrap when cast back, which is exact: torch's integer
  gemm wraps in the output type and both are arithmetic modulo 2**bits.
- ``beta == 0`` drops ``input`` entirely (NaN and Inf in it do not propagate), as torch documents.
  ``alpha == 0`` is murkier; we follow what we measured on torch 2.13: its float32/float64 gemm
  paths skip the product (addmm, addmv, addbmm, and baddbmm above ``_BADDBMM_SMALL``), while its
  other kernels (addr, small baddbmm, the float16/bfloat16 paths) compute ``0 * product``, so a
  NaN or Inf in the product propagates.  (A large bfloat16 baddbmm skips it in torch; not modelled.)
- The meta kernels accept dtype combinations the CPU kernels reject (bool, mixed dtypes); the
  checkers replay such calls on CPU stand-ins so the user sees torch's own exception.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .registry import LoweringContext, lowering, replay_on_cpu

aten = torch.ops.aten

_HIGHEST = lax.Precision.HIGHEST
_HALF_TYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_I64 = jnp.dtype(jnp.int64)

# dtypes torch's CPU matmul kernels accept (bool and complex excluded: complex is not lowered)
_MATMUL_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                            torch.float16, torch.bfloat16, torch.float32, torch.float64})


# -- checks --------------------------------------------------------------------------------------

def raise_like_cpu(ctx: LoweringContext) -> str:
    """Let torch's CPU kernel raise its own exception for this call (see registry.replay_on_cpu)."""
    return replay_on_cpu(ctx)


def _check_matmul(ctx: LoweringContext) -> Optional[str]:
    dtypes = {t.dtype for t in ctx.tensor_args()}
    if any(dt.is_complex for dt in dtypes):
        return "complex matmul is not lowered"
    if len(dtypes) != 1 or not dtypes <= _MATMUL_DTYPES:
        return raise_like_cpu(ctx)   # e.g. "expected m1 and m2 to have the same dtype"
    return None


# -- products ------------------------------------------------------------------------------------

def _acc_dtype(dtype) -> jnp.dtype:
    dtype = jnp.dtype(dtype)
    if dtype in _HALF_TYPES:
        return jnp.dtype(jnp.float32)
    if jnp.issubdtype(dtype, jnp.integer):
        return _I64
    return dtype


def matmul(a, b):
    """jnp.matmul in torch's accumulate type (see the module docstring)."""
    acc = _acc_dtype(a.dtype)
    if jnp.issubdtype(acc, jnp.integer):
        a, b = a.astype(acc), b.astype(acc)
    return jnp.matmul(a, b, precision=_HIGHEST, preferred_element_type=acc)


def _scalar(value, dtype):
    """``Scalar::to<acc_t>()``: Python or traced scalars, floats truncated for integer types."""
    return jnp.asarray(value).astype(dtype)


def _is_static(value, number) -> bool:
    return isinstance(value, (bool, int, float)) and value == number


def _scaled(term, factor, drop_when_zero: bool):
    """``factor * term``; with ``drop_when_zero``, a zero factor gives zeros even where ``term``
    is NaN or Inf."""
    if _is_static(factor, 1):
        return term
    if isinstance(factor, (bool, int, float)):
        # static: decide in Python (after the conversion: 0.5 is 0 for integer tensors)
        f = np.asarray(factor).astype(term.dtype)
        if drop_when_zero and f == 0:
            return jnp.zeros_like(term)
        return term * f
    f = _scalar(factor, term.dtype)
    if drop_when_zero:
        return jnp.where(f == 0, jnp.zeros_like(term), term * f)
    return term * f


def _add_scaled(ctx, x, product, beta, alpha, alpha_zero_skips: bool):
    """``beta * x + alpha * product`` with torch's treatment of zero factors."""
    # (float16/bfloat16 kernels always compute 0 * product)
    product = _scaled(product, alpha, alpha_zero_skips and ctx.out_dtype not in _HALF_TYPES)
    x = _scaled(x.astype(product.dtype), beta, True)
    return jnp.broadcast_to(x + product, ctx.out_shape)


@lowering(aten.mm.default, aten.bmm.default, aten.mv.default, aten.dot.default, aten.vdot.default,
          check=_check_matmul)
def mm(ctx, a, b):
    # vdot conjugates its first operand, a no-op for the real dtypes lowered here.
    return matmul(a, b)


@lowering(aten.addmm.default, aten.addmv.default, check=_check_matmul)
def addmm(ctx, x, a, b, *, beta=1, alpha=1):
    return _add_scaled(ctx, x, matmul(a, b), beta, alpha, alpha_zero_skips=True)


@lowering(aten.addbmm.default, check=_check_matmul)
def addbmm(ctx, x, a, b, *, beta=1, alpha=1):
    # one contraction over both the batch and the inner dim, not a bmm and then a sum
    acc = _acc_dtype(a.dtype)
    product = lax.dot_general(a.astype(acc), b.astype(acc), (((0, 2), (0, 1)), ((), ())),
                              precision=_HIGHEST, preferred_element_type=acc)
    return _add_scaled(ctx, x, product, beta, alpha, alpha_zero_skips=True)


# torch's baddbmm uses a naive loop computing ``alpha * sum`` below this many multiply-adds per
# matrix, and gemm (which skips the product when alpha == 0) above it.
_BADDBMM_SMALL = 400


@lowering(aten.baddbmm.default, check=_check_matmul)
def baddbmm(ctx, x, a, b, *, beta=1, alpha=1):
    _, m, k = a.shape
    return _add_scaled(ctx, x, matmul(a, b), beta, alpha,
                       alpha_zero_skips=k * m * b.shape[2] >= _BADDBMM_SMALL)


def _check_addr(ctx: LoweringContext) -> Optional[str]:
    dtypes = {t.dtype for t in ctx.tensor_args()}
    if torch.bool in dtypes:
        return "bool addr (logical and/or) goes to its decomposition"
    return _check_matmul(ctx)


@lowering(aten.addr.default, check=_check_addr)
def addr(ctx, x, u, v, *, beta=1, alpha=1):
    acc = _acc_dtype(u.dtype)
    outer = u.astype(acc)[:, None] * v.astype(acc)[None, :]
    return _add_scaled(ctx, x, outer, beta, alpha, alpha_zero_skips=False)


# -- _trilinear (F.bilinear) ---------------------------------------------------------------------

def _check_trilinear(ctx: LoweringContext) -> Optional[str]:
    dtypes = {t.dtype for t in ctx.tensor_args()}
    if any(dt.is_complex for dt in dtypes) or dtypes & {torch.bool}:
        return "complex and bool _trilinear are not lowered"
    if len(dtypes) != 1:
        return raise_like_cpu(ctx)
    return None


@lowering(aten._trilinear.default, check=_check_trilinear)
def trilinear(ctx, i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """Unsqueeze each operand at its expand dims, multiply the three, sum over ``sumdim``."""
    acc = _acc_dtype(i1.dtype)

    def unsqueezed(x, dims):
        for d in sorted(dims):
            x = jnp.expand_dims(x, d)
        return x.astype(acc)
    product = unsqueezed(i1, expand1) * unsqueezed(i2, expand2) * unsqueezed(i3, expand3)
    if not sumdim:
        return product
    return product.sum(axis=tuple(sorted(set(sumdim))))
