"""Lowerings of the storage model: strided reads and writes of a flat storage value.

A strided view whose strides nest (each stride a multiple of the next, without overlap) is a
reshape of a contiguous region followed by slices and a transpose, which XLA fuses at no cost;
only views that do not nest (as_strided with odd strides) fall back to a gather or scatter
with precomputed indices.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..ir import graph
from ..ir.meta import TensorMeta
from .registry import LoweringContext, runtime_check
from .._lazy import lazy_import

jnp = lazy_import("jax.numpy", globals(), "jnp")
lax = lazy_import("jax.lax", globals(), "lax")


class _Nesting:
    """How a strided layout maps onto a reshaped region of the flat storage."""

    def __init__(self, meta: TensorMeta) -> None:
        self.meta = meta
        # Dims that move through memory; size-1 dims and broadcast (stride 0) dims are added back
        # by reshape/broadcast.
        moving = [(d, size, stride) for d, (size, stride) in enumerate(zip(meta.shape, meta.stride))
                  if size != 1 and stride != 0]
        moving.sort(key=lambda m: -m[2])
        self.moving = moving
        self.ok = True
        for (_, size_a, stride_a), (_, size_b, stride_b) in zip(moving, moving[1:]):
            if stride_a % stride_b != 0 or size_b * stride_b > stride_a:
                self.ok = False
        if moving:
            first = moving[0]
            self.region_shape = [first[1]] + [a[2] // b[2] for a, b in zip(moving, moving[1:])] + [moving[-1][2]]
            self.total = first[1] * first[2]
        else:
            self.region_shape = [1]
            self.total = 1
        # index into the region: [:size] along each moving dim, then 0 on the trailing axis
        self.index = tuple(slice(0, m[1]) for m in moving) + (0,)

    def region(self, flat: jnp.ndarray) -> jnp.ndarray:
        start, stop = self.meta.offset, self.meta.offset + self.total
        if stop > flat.shape[0]:
            flat = jnp.pad(flat, (0, stop - flat.shape[0]))
        return lax.slice(flat, (start,), (stop,)).reshape(self.region_shape)

    def to_logical(self, arr: jnp.ndarray) -> jnp.ndarray:
        """(moving dims in memory order) -> the tensor's logical shape."""
        order = [m[0] for m in self.moving]
        perm = sorted(range(len(order)), key=lambda i: order[i])
        arr = jnp.transpose(arr, perm) if perm != list(range(len(perm))) else arr
        kept = [size if (size != 1 and stride != 0) else 1
                for size, stride in zip(self.meta.shape, self.meta.stride)]
        arr = arr.reshape(kept)
        return jnp.broadcast_to(arr, self.meta.shape)

    def from_logical(self, value: jnp.ndarray) -> jnp.ndarray:
        """The tensor's logical value -> moving dims in memory order (broadcast dims taken at 0)."""
        index = tuple(0 if (size != 1 and stride == 0) else slice(None)
                      for size, stride in zip(self.meta.shape, self.meta.stride))
        value = value[index] if any(i == 0 for i in index) else value
        remaining = [(d, size) for d, (size, stride) in enumerate(zip(self.meta.shape, self.meta.stride))
                     if stride != 0 or size == 1]
        # drop size-1 dims, then order the moving dims by decreasing stride
        value = value.reshape([size for _, size in remaining if size != 1])
        positions = [d for d, size in remaining if size != 1]
        order = [positions.index(m[0]) for m in self.moving]
        return jnp.transpose(value, order) if order != list(range(len(order))) else value


def _linear_indices(meta: TensorMeta) -> np.ndarray:
    idx = np.full(meta.shape, meta.offset, dtype=np.int64)
    for d, (size, stride) in enumerate(zip(meta.shape, meta.stride)):
        shape = [1] * len(meta.shape)
        shape[d] = size
        idx = idx + (np.arange(size, dtype=np.int64) * stride).reshape(shape)
    return idx


def read_view(flat: jnp.ndarray, meta: TensorMeta) -> jnp.ndarray:
    if meta.numel == 0:
        return jnp.zeros(meta.shape, flat.dtype)
    if meta.is_contiguous and meta.offset == 0 and meta.numel == flat.shape[0]:
        return flat.reshape(meta.shape)
    nest = _Nesting(meta)
    if nest.ok:
        return nest.to_logical(nest.region(flat)[nest.index])
    return flat[_linear_indices(meta)]


def write_view(flat: jnp.ndarray, value: jnp.ndarray, meta: TensorMeta) -> jnp.ndarray:
    value = jnp.broadcast_to(value.astype(flat.dtype), meta.shape)
    if meta.numel == 0:
        return flat
    if meta.is_contiguous and meta.offset == 0 and meta.numel == flat.shape[0]:
        return value.reshape(-1)
    nest = _Nesting(meta)
    if nest.ok:
        stop = meta.offset + nest.total
        if stop <= flat.shape[0]:
            region = nest.region(flat).at[nest.index].set(nest.from_logical(value))
            return lax.dynamic_update_slice(flat, region.reshape(-1), (meta.offset,))
    return flat.at[_linear_indices(meta).reshape(-1)].set(value.reshape(-1))


def flatten(value: jnp.ndarray, meta: TensorMeta) -> jnp.ndarray:
    """A tensor covering its storage, as the storage's flat contents in memory order."""
    if meta.is_contiguous and meta.offset == 0 and meta.numel == meta.storage_numel:
        return value.reshape(-1)
    if meta.is_dense and meta.offset == 0 and meta.numel == meta.storage_numel:
        order = sorted(range(len(meta.shape)), key=lambda d: (-meta.stride[d], d))
        return jnp.transpose(value, order).reshape(-1)
    return write_view(jnp.zeros((meta.storage_numel,), value.dtype), value, meta)


def _meta_arg(ctx: LoweringContext, i: int) -> TensorMeta:
    meta = ctx.args[i]
    assert isinstance(meta, TensorMeta)
    return meta


def _bits(value, conj: bool, neg: bool):
    value = jnp.conj(value) if conj else value
    return -value if neg else value


INTERNAL_RULES = {
    graph.READ_VIEW: lambda ctx, flat, meta: read_view(flat, meta),
    graph.WRITE_VIEW: lambda ctx, flat, value, meta: write_view(flat, value, meta),
    graph.FLATTEN: lambda ctx, value, meta: flatten(value, meta),
    graph.CAST: lambda ctx, value, dtype: value,  # the caller casts to the output dtype
    graph.BITS: lambda ctx, value, conj, neg: _bits(value, conj, neg),
    graph.AS_REAL: lambda ctx, value: jnp.stack([jnp.real(value), jnp.imag(value)], axis=-1).reshape(-1),
}


def _value_check(condition, error: type, message: str):
    runtime_check(~condition, error, message)
    return condition


INTERNAL_RULES[graph.VALUE_CHECK] = lambda ctx, condition, error, message: _value_check(condition, error, message)


def internal_rule(op: graph.InternalOp) -> Optional[object]:
    return INTERNAL_RULES.get(op)
