"""Order-statistic lowerings: median and nanmedian (full and along a dim), mode and kthvalue,
each following the exact algorithm of torch's CPU kernel where ties make the index depend on it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import common
from .registry import LoweringContext, lowering
from .._lazy import lazy_import

jax = lazy_import("jax", globals(), "jax")
jnp = lazy_import("jax.numpy", globals(), "jnp")
lax = lazy_import("jax.lax", globals(), "lax")

aten = torch.ops.aten


# -- median, nanmedian ---------------------------------------------------------------------------
# torch's CPU kernels: median returns the first NaN of a row if it has one; otherwise both pick
# the element of rank (n - 1) // 2 (n counting non-NaN elements for nanmedian) under the order
# (value, index), which is a stable sort's order (jnp's sort treats -0.0 and 0.0 as equal, like
# torch's comparator).  An all-NaN row of nanmedian is the one case with ties left to
# std::nth_element; its comparisons are then all false, so the index depends only on the row
# length, and torch's own kernel on a NaN row of that length gives it at trace time.

def _check_median(ctx: LoweringContext) -> Optional[str]:
    x = ctx.args[0]
    if x.dtype == torch.bool:
        return common.raise_like_cpu(ctx)          # CPU: "median_cpu" not implemented for 'Bool'
    if len(ctx.args) > 1 and x.shape and x.shape[ctx.args[1] % len(x.shape)] == 0:
        return common.raise_like_cpu(ctx)          # IndexError: reduction dim of size 0
    if len(ctx.args) == 1 and x.numel == 0 and not (x.dtype.is_floating_point
                                                    or x.dtype == torch.int64):
        # torch gives NaN cast to the dtype: int64's minimum; other widths are the compiler's
        return "median of an empty integer tensor narrower than int64"
    return common.real_only(ctx)


def _nan_count(x, axis, keepdims=False):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.zeros(x.shape[:axis] + ((1,) if keepdims else ()) + x.shape[axis + 1:], jnp.int64)
    return jnp.sum(jnp.isnan(x), axis=axis, keepdims=keepdims, dtype=jnp.int64)


def _median_full(x, ignore_nan: bool):
    x = x.reshape(-1)
    if x.size == 0:   # torch returns NaN, cast to the dtype (int64's minimum for int64)
        if jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.asarray(jnp.nan, x.dtype)
        return jnp.asarray(jnp.iinfo(x.dtype).min, x.dtype)
    s = jnp.sort(x)                          # NaN last
    nans = _nan_count(x, 0)
    n = x.size - nans if ignore_nan else x.size
    pick = s[jnp.maximum(n - 1, 0) // 2]
    if not ignore_nan and jnp.issubdtype(x.dtype, jnp.floating):
        pick = jnp.where(nans > 0, jnp.asarray(jnp.nan, x.dtype), pick)
    return pick


@lowering(aten.median.default, check=_check_median)
def median(ctx, x):
    return _median_full(x, ignore_nan=False)


@lowering(aten.nanmedian.default, check=_check_median)
def nanmedian(ctx, x):
    return _median_full(x, ignore_nan=True)


def _all_nan_nanmedian_index(size: int) -> int:
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():
        return int(torch.nanmedian(torch.full((size,), math.nan), 0).indices)


def _median_dim(x, dim, keepdim, ignore_nan: bool):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    axis = dim % x.ndim
    size = x.shape[axis]
    order = jnp.argsort(x, axis=axis, stable=True)          # NaN last
    nans = _nan_count(x, axis, keepdims=True)
    count = size - nans if ignore_nan else jnp.full(nans.shape, size, jnp.int64)
    rank = jnp.maximum(count - 1, 0) // 2
    index = jnp.take_along_axis(order, rank, axis=axis)
    if jnp.issubdtype(x.dtype, jnp.floating):
        if ignore_nan:
            if x.size:
                every = jnp.asarray(_all_nan_nanmedian_index(size), index.dtype)
                index = jnp.where(nans == size, every, index)
        else:
            first_nan = jnp.argmax(jnp.isnan(x), axis=axis, keepdims=True)
            index = jnp.where(nans > 0, first_nan, index)
    index = index.astype(jnp.int64)
    values = jnp.take_along_axis(x, index, axis=axis)
    if not keepdim:
        values, index = jnp.squeeze(values, axis), jnp.squeeze(index, axis)
    return values, index


@lowering(aten.median.dim, check=_check_median)
def median_dim(ctx, x, dim, keepdim=False):
    return _median_dim(x, dim, keepdim, ignore_nan=False)


@lowering(aten.nanmedian.dim, check=_check_median)
def nanmedian_dim(ctx, x, dim, keepdim=False):
    return _median_dim(x, dim, keepdim, ignore_nan=True)


# -- mode ----------------------------------------------------------------------------------------
# torch's CPU kernel sorts each row's (value, index) pairs with std::sort on the value alone, then
# takes the first run of equal values (in sorted order) with the strictly highest count, and
# returns the value and index of that run's last pair.  libstdc++'s std::sort is a plain
# insertion sort for up to 16 elements, emulated here step by step (NaNs, which compare false
# both ways, land where it puts them and form runs of one).  Longer rows go through introsort,
# which is not stable: the index among tied values is then left to torch's kernel.

_INSERTION_SORT_MAX = 16


def _check_mode(ctx: LoweringContext) -> Optional[str]:
    x, dim = ctx.args[0], common.arg(ctx, "dim", -1)
    if x.shape:
        size = x.shape[dim % len(x.shape)]
        if size == 0:
            return common.raise_like_cpu(ctx)      # IndexError: reduction dim of size 0
        if size > _INSERTION_SORT_MAX:
            return "mode over more than 16 elements: std::sort's unstable order picks the index"
    return common.real_only(ctx)


def _insertion_sort(values, index):
    """libstdc++'s __insertion_sort with ``<`` on the last axis, carrying ``index`` along."""
    n = values.shape[-1]
    for i in range(1, n):
        v, k = values[..., i:i + 1], index[..., i:i + 1]
        less = v < values[..., :i]                                   # (..., i)
        front = less[..., :1]
        # unguarded linear insert: move back past the trailing run of greater elements
        trailing = jnp.sum(jnp.cumprod(less[..., ::-1], axis=-1), axis=-1, keepdims=True)
        pos = jnp.where(front, 0, i - trailing)
        j = lax.broadcasted_iota(jnp.int64, values.shape[:-1] + (i + 1,), values.ndim - 1)
        head_v = values[..., :i + 1]
        head_k = index[..., :i + 1]
        prev_v = jnp.concatenate([values[..., :1], values[..., :i]], axis=-1)
        prev_k = jnp.concatenate([index[..., :1], index[..., :i]], axis=-1)
        new_v = jnp.where(j < pos, head_v, jnp.where(j == pos, v, prev_v))
        new_k = jnp.where(j < pos, head_k, jnp.where(j == pos, k, prev_k))
        values = jnp.concatenate([new_v, values[..., i + 1:]], axis=-1)
        index = jnp.concatenate([new_k, index[..., i + 1:]], axis=-1)
    return values, index


@lowering(aten.mode.default, check=_check_mode)
def mode(ctx, x, dim=-1, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    axis = dim % x.ndim
    values = jnp.moveaxis(x, axis, -1)
    index = lax.broadcasted_iota(jnp.int64, values.shape, values.ndim - 1)
    if values.size:
        values, index = _insertion_sort(values, index)
    # runs of equal values: a run ends where the next value differs (NaN != NaN)
    pos = lax.broadcasted_iota(jnp.int64, values.shape, values.ndim - 1)
    differs = values[..., 1:] != values[..., :-1]
    edge = jnp.ones(values.shape[:-1] + (1,), bool)
    starts = jnp.concatenate([edge, differs], axis=-1)
    ends = jnp.concatenate([differs, edge], axis=-1)
    run_start = lax.cummax(jnp.where(starts, pos, 0), axis=values.ndim - 1)
    length = jnp.where(ends, pos - run_start + 1, -1)
    best = jnp.argmax(length, axis=-1, keepdims=True)                # the first longest run
    out_v = jnp.take_along_axis(values, best, axis=-1)
    out_i = jnp.take_along_axis(index, best, axis=-1)
    out_v, out_i = jnp.moveaxis(out_v, -1, axis), jnp.moveaxis(out_i, -1, axis)
    if not keepdim:
        out_v, out_i = jnp.squeeze(out_v, axis), jnp.squeeze(out_i, axis)
    return out_v, out_i


# -- kthvalue ------------------------------------------------------------------------------------
# torch's CPU kernel runs a Hoare-partition quickselect (Sedgewick's, median-of-three pivot) on
# each row with NaN as the largest value; the value is the k-th smallest, and among tied values
# the index is wherever that algorithm's swaps leave it.  The rule runs the same algorithm, row by
# row under vmap: each step finds the next i and j of the partition loop with a vector search.
# It costs O(n) per swap, so long rows are left to torch's kernel.

_KTHVALUE_MAX = 1024


def _check_kthvalue(ctx: LoweringContext) -> Optional[str]:
    x, k, dim = ctx.args[0], ctx.args[1], common.arg(ctx, "dim", -1)
    size = x.shape[dim % len(x.shape)] if x.shape else 1
    if x.dtype == torch.bool or not 1 <= k <= size:
        return common.raise_like_cpu(ctx)          # "not implemented for 'Bool'", "k out of range"
    if size > _KTHVALUE_MAX:
        return "kthvalue over more than 1024 elements (the exact quickselect is quadratic)"
    return common.real_only(ctx)


def _quickselect(row, k: int):
    n = row.shape[0]
    pos = jnp.arange(n)
    floating = jnp.issubdtype(row.dtype, jnp.floating)

    def gt(a, b):   # "greater or NaN", torch's comparison
        return ((jnp.isnan(a) & ~jnp.isnan(b)) | (a > b)) if floating else a > b

    def swap(arr, idx, a, b, when):
        va, vb, ia, ib = arr[a], arr[b], idx[a], idx[b]
        arr = arr.at[a].set(jnp.where(when, vb, va)).at[b].set(jnp.where(when, va, vb))
        idx = idx.at[a].set(jnp.where(when, ib, ia)).at[b].set(jnp.where(when, ia, ib))
        return arr, idx

    def outer(state):
        arr, idx, lo, hi, done = state
        active = ~done
        two, part = active & (hi == lo + 1), active & (hi > lo + 1)
        arr, idx = swap(arr, idx, lo, hi, two & gt(arr[lo], arr[hi]))
        # median of three: arr[lo + 1] <= arr[lo] <= arr[hi], arr[lo] is the pivot
        lo1 = jnp.minimum(lo + 1, n - 1)
        arr, idx = swap(arr, idx, (lo + hi) >> 1, lo1, part)
        arr, idx = swap(arr, idx, lo1, hi, part & gt(arr[lo1], arr[hi]))
        arr, idx = swap(arr, idx, lo, hi, part & gt(arr[lo], arr[hi]))
        arr, idx = swap(arr, idx, lo1, lo, part & gt(arr[lo1], arr[lo]))
        pivot = arr[lo]

        def scan(inner):
            arr, idx, i, j, going = inner
            # do i++ while (pivot > arr[i]); do j-- while (arr[j] > pivot)
            i = jnp.argmax((pos > i) & ~gt(pivot, arr)).astype(i.dtype)
            j = (n - 1 - jnp.argmax(((pos < j) & ~gt(arr, pivot))[::-1])).astype(j.dtype)
            going = going & (j >= i)
            arr, idx = swap(arr, idx, i, j, going)
            return arr, idx, i, j, going

        arr, idx, i, j, _ = lax.while_loop(lambda s: s[4], scan, (arr, idx, lo1, hi, part))
        arr, idx = swap(arr, idx, lo, j, part)
        lo = jnp.where(part & (j <= k), i, lo)
        hi = jnp.where(part & (j >= k), j - 1, hi)
        return arr, idx, lo, hi, done | ~part

    start = (row, jnp.arange(n, dtype=jnp.int64), jnp.int64(0), jnp.int64(n - 1), jnp.bool_(False))
    arr, idx, *_ = lax.while_loop(lambda s: ~s[4], outer, start)
    return arr[k], idx[k]


@lowering(aten.kthvalue.default, check=_check_kthvalue)
def kthvalue(ctx, x, k, dim=-1, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    axis = dim % x.ndim
    if x.size == 0:
        return (jnp.zeros(ctx.out[0].shape, x.dtype), jnp.zeros(ctx.out[1].shape, jnp.int64))
    rows = jnp.moveaxis(x, axis, -1)
    lead = rows.shape[:-1]
    values, index = jax.vmap(lambda r: _quickselect(r, k - 1))(rows.reshape(-1, rows.shape[-1]))
    values, index = values.reshape(lead), index.reshape(lead)
    if keepdim:
        values, index = jnp.expand_dims(values, axis), jnp.expand_dims(index, axis)
    return values, index
