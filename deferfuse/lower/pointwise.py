"""Pointwise lowerings: arithmetic, math, comparison, logical, bitwise, casts."""

from __future__ import annotations

import jax.numpy as jnp

import torch

from .registry import lowering

aten = torch.ops.aten


def _operands(ctx, *xs):
    dt = ctx.compute_dtype
    return [jnp.asarray(x).astype(dt) if not hasattr(x, "dtype") or x.dtype != dt else x for x in xs]


@lowering(aten.add.Tensor, aten.add.Scalar)
def add(ctx, x, y, alpha=1):
    x, y = _operands(ctx, x, y)
    if not (isinstance(alpha, (int, float)) and alpha == 1):
        y = y * jnp.asarray(alpha).astype(y.dtype)
    return x + y


@lowering(aten.mul.Tensor, aten.mul.Scalar)
def mul(ctx, x, y):
    x, y = _operands(ctx, x, y)
    return x * y
