"""segment_reduce and its backward: folds of contiguous segments of a dim (given by lengths or
offsets) into sums, means, products, maxima or minima, as torch's CPU kernel folds them.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from . import common
from . import dtypes as _dtypes
from .registry import LoweringContext, lowering, runtime_check
from .._lazy import lazy_import

jax = lazy_import("jax", globals(), "jax")
jnp = lazy_import("jax.numpy", globals(), "jnp")
lax = lazy_import("jax.lax", globals(), "lax")

aten = torch.ops.aten

_HALF_TYPES = _dtypes.HALF_TYPES


# -- segment_reduce ------------------------------------------------------------------------------
# torch's CPU kernel walks each row of ``lengths`` (or ``offsets``), whose last dim lies along
# ``axis`` of the data and whose leading dims match the data's dims before ``axis``, and folds
# each segment into a ``scalar_t`` accumulator that starts at ``initial`` (else 0, 1, -inf or
# +inf; an empty mean is NaN), one rounding per element.  Max and min take a NaN element as the
# result from then on.  The rule maps each element to its segment id (segments are contiguous:
# the id is the number of segment ends at or before it) and reduces with jax.ops.segment_*;
# float16/bfloat16 sums and products are folded in order with a scan, as the kernel rounds them.
# Values torch validates (negative lengths, rows of lengths not summing to the size, offsets that
# decrease) raise torch's RuntimeError through runtime_check; a segment outside the data, which
# torch would read out of bounds (unsafe=True or offsets), raises a RuntimeError too.

_SEGMENT_REDUCTIONS = {"sum": "sum", "mean": "mean", "prod": "prod",
                       "max": "max", "amax": "max", "min": "min", "amin": "min"}
# the half-precision product gradient's exclusive products are folded element by element
_SEGMENT_HALF_PROD_GRAD_MAX = 512


def _segment_bounds_arg(ctx: LoweringContext):
    lengths, offsets = common.arg(ctx, "lengths"), common.arg(ctx, "offsets")
    return lengths, offsets


def _check_segment_common(ctx: LoweringContext, data: Any, reduce: str, forward: bool) -> Optional[str]:
    lengths, offsets = _segment_bounds_arg(ctx)
    if reduce not in _SEGMENT_REDUCTIONS:
        raise RuntimeError(f"reduce argument must be either sum, prod, mean, amax or amin, got {reduce}")
    if lengths is None and offsets is None:
        return "segment_reduce without lengths or offsets"
    if lengths is not None and offsets is not None:
        return "segment_reduce with both lengths and offsets (meta and CPU kernels disagree)"
    bounds = offsets if offsets is not None else lengths
    ndim = len(data.shape)
    axis = common.arg(ctx, "axis", 0)
    if ndim == 0:
        return "segment_reduce of a 0-dim tensor"
    axis %= ndim
    if forward:
        if ndim < len(bounds.shape):
            raise RuntimeError("Expected data.dim() >= lengths_value.dim() to be true, but got false.")
        if axis != len(bounds.shape) - 1:
            which = "offsets" if offsets is not None else "lengths"
            raise RuntimeError(f"segment_reduce(): Expected axis to be the last dimension of {which} but got {axis}.")
    if len(bounds.shape) != axis + 1 or tuple(bounds.shape[:-1]) != tuple(data.shape[:axis]):
        return "segment_reduce with lengths/offsets whose leading dims differ from the data's"
    if bounds.dtype not in (torch.int32, torch.int64):
        return "segment_reduce with lengths/offsets that are not int32/int64"
    if data.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return "segment_reduce of a non-floating dtype (torch raises NotImplementedError)"
    if offsets is not None and offsets.shape[-1] < 1:
        return "segment_reduce with empty offsets"
    initial = common.arg(ctx, "initial")
    if isinstance(initial, complex):
        return "segment_reduce with a complex initial value"
    if (isinstance(initial, int) and not isinstance(initial, bool) and data.dtype != torch.float64
            and abs(initial) > torch.finfo(data.dtype).max):
        names = {torch.float32: "float", torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16"}
        raise RuntimeError(f"value cannot be converted to type {names[data.dtype]} without overflow")
    return None


def _check_segment_reduce(ctx: LoweringContext) -> Optional[str]:
    data, reduce = ctx.args[0], ctx.args[1]
    if common.arg(ctx, "indices") is not None:
        return "indices based segment_reduce is not supported by torch"
    reason = _check_segment_common(ctx, data, reduce, forward=True)
    if reason is not None:
        return reason
    lengths = common.arg(ctx, "lengths")
    if lengths is not None and not common.arg(ctx, "unsafe", False) and math.prod(lengths.shape) == 0:
        return common.raise_like_cpu(ctx)       # lengths.min() of an empty tensor
    if ctx.out[0].dtype != data.dtype:
        return "segment_reduce with an unexpected output dtype"
    axis = common.arg(ctx, "axis", 0) % len(data.shape)
    bounds = lengths if lengths is not None else common.arg(ctx, "offsets")
    segments = bounds.shape[-1] - (lengths is None)
    if tuple(ctx.out_shape) != tuple(data.shape[:axis]) + (segments,) + tuple(data.shape[axis + 1:]):
        return "segment_reduce with a negative axis (the meta kernel does not wrap it)"
    return None


def _check_segment_reduce_backward(ctx: LoweringContext) -> Optional[str]:
    grad, output, data, reduce = ctx.args[:4]
    reason = _check_segment_common(ctx, data, reduce, forward=False)
    if reason is not None:
        return reason
    if grad.dtype != data.dtype or output.dtype != data.dtype:
        return "segment_reduce backward with grad/output dtypes that differ from the data's"
    if tuple(grad.shape) != tuple(output.shape) or len(grad.shape) != len(data.shape):
        return "segment_reduce backward with mismatched grad/output shapes"
    axis = common.arg(ctx, "axis", 0) % len(data.shape)
    lengths, offsets = _segment_bounds_arg(ctx)
    bounds = offsets if offsets is not None else lengths
    segments = bounds.shape[-1] - (offsets is not None)
    expect = tuple(data.shape[:axis]) + (segments,) + tuple(data.shape[axis + 1:])
    if tuple(grad.shape) != expect:
        return "segment_reduce backward with a grad of unexpected shape"
    if (_SEGMENT_REDUCTIONS[reduce] == "prod" and data.dtype in (torch.float16, torch.bfloat16)
            and data.shape[axis] > _SEGMENT_HALF_PROD_GRAD_MAX):
        return "half-precision segment prod gradient over a long axis (exact folding is quadratic)"
    return None


def _segment_initial(initial: Any, dtype) -> Any:
    """``initial.to<scalar_t>()``: a checked conversion (torch raises on overflow)."""
    value = jnp.asarray(initial)
    if jnp.issubdtype(value.dtype, jnp.floating) and dtype != jnp.float64:
        value64 = value.astype(jnp.float64)
        overflow = jnp.isfinite(value64) & (jnp.abs(value64) > float(jnp.finfo(dtype).max))
        name = {"float32": "float", "float16": "c10::Half", "bfloat16": "c10::BFloat16"}[jnp.dtype(dtype).name]
        runtime_check(overflow, RuntimeError, f"value cannot be converted to type {name} without overflow")
    return value.astype(dtype)


def _segment_layout(data, lengths, offsets, axis: int):
    """data as (outer, size, inner); per-row segment starts and ends (outer, segments); each
    element's segment id (outer, size), ``segments`` where the element is in no segment."""
    axis %= data.ndim
    outer = math.prod(data.shape[:axis])
    size = data.shape[axis]
    x = data.reshape(outer, size, -1) if data.size else jnp.zeros((outer, size, math.prod(data.shape[axis + 1:])), data.dtype)
    if offsets is not None:
        bounds = offsets.reshape(outer, -1).astype(jnp.int64)
        starts, ends = bounds[:, :-1], bounds[:, 1:]
    else:
        lens = lengths.reshape(outer, -1).astype(jnp.int64)
        ends = jnp.cumsum(lens, axis=1)
        starts = ends - lens
    segments = starts.shape[1]
    pos = jnp.arange(size, dtype=jnp.int64)
    if segments:
        ids = jnp.sum(ends[:, None, :] <= pos[None, :, None], axis=2)
        inside = (pos[None, :] >= starts[:, :1]) & (pos[None, :] < ends[:, -1:])
        ids = jnp.where(inside, ids, segments)
    else:
        ids = jnp.full((outer, size), segments, jnp.int64)
    return x, starts, ends, ids


def _segment_runtime_checks(x, starts, ends, lengths, offsets, unsafe: bool, forward: bool) -> None:
    size, inner = x.shape[1], x.shape[2]
    seglen = ends - starts
    if forward and lengths is not None and not unsafe:
        runtime_check(lengths < 0, RuntimeError, "lengths contains negative value!")
        runtime_check(jnp.sum(lengths.astype(jnp.int64), axis=-1) != size, RuntimeError,
                      "segment_reduce(): Expected all rows of lengths along axis to sum to "
                      "data.size(lengths.dim()-1) when !unsafe.")
    if inner == 0 or seglen.size == 0:
        return
    runtime_check(seglen < 0, RuntimeError, "Expected segment_length >= 0 to be true, but got false.")
    outside = (seglen > 0) & ((starts < 0) | (ends > size))
    runtime_check(outside, RuntimeError,
                  "segment_reduce(): a segment lies outside the data (torch would read out of bounds)")


def _segment_gather(per_segment, ids):
    """per_segment (outer, segments + 1, inner) -> per element (outer, size, inner)."""
    return jnp.take_along_axis(per_segment, ids[:, :, None], axis=1)


def _segment_apply(x, ids, segments: int, how: str):
    outer, size, inner = x.shape
    gid = (ids + jnp.arange(outer, dtype=jnp.int64)[:, None] * (segments + 1)).reshape(-1)
    flat = x.reshape(outer * size, inner)
    fn = {"sum": jax.ops.segment_sum, "prod": jax.ops.segment_prod,
          "max": jax.ops.segment_max, "min": jax.ops.segment_min}[how]
    out = fn(flat, gid, num_segments=outer * (segments + 1))
    return out.reshape(outer, segments + 1, inner)[:, :segments]


def _segment_fold(x, ids, init, how: str):
    """The running fold along each segment, rounding each step to x's dtype as the kernel does:
    (outer, size, inner), the value after each element."""
    work = jnp.float32
    reset = jnp.concatenate([jnp.ones_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], axis=1)

    def step(acc, item):
        v, r = item
        acc = jnp.where(r[:, None], init, acc)
        acc = (acc.astype(work) + v.astype(work)) if how == "sum" else (acc.astype(work) * v.astype(work))
        acc = acc.astype(x.dtype)
        return acc, acc

    start = jnp.broadcast_to(init, (x.shape[0], x.shape[2])).astype(x.dtype)
    _, ys = lax.scan(step, start, (jnp.moveaxis(x, 1, 0), jnp.moveaxis(reset, 1, 0)))
    return jnp.moveaxis(ys, 0, 1)


def _segment_divide(value, count, dtype):
    """``scalar_t / int64_t`` as torch's CPU code computes it."""
    dtype = jnp.dtype(dtype)
    if dtype in _HALF_TYPES:
        return (value.astype(jnp.float32) / count.astype(dtype).astype(jnp.float32)).astype(dtype)
    return value / count.astype(dtype)


def _segment_default_initial(how: str, dtype):
    return jnp.asarray({"sum": 0.0, "mean": 0.0, "prod": 1.0, "max": -math.inf, "min": math.inf}[how], dtype)


@lowering(aten.segment_reduce.default, check=_check_segment_reduce)
def segment_reduce(ctx, data, reduce, *, lengths=None, indices=None, offsets=None, axis=0,
                   unsafe=False, initial=None):
    how = _SEGMENT_REDUCTIONS[reduce]
    dtype = data.dtype
    x, starts, ends, ids = _segment_layout(data, lengths, offsets, axis)
    _segment_runtime_checks(x, starts, ends, lengths, offsets, unsafe, forward=True)
    segments = starts.shape[1]
    init = _segment_default_initial(how, dtype) if initial is None else _segment_initial(initial, dtype)
    seglen = jnp.maximum(ends - starts, 0)[:, :, None]
    if how in ("max", "min"):
        nan_any = _segment_apply(jnp.isnan(x).astype(jnp.int32), ids, segments, "sum") > 0
        best = _segment_apply(x, ids, segments, how)
        pick = jnp.maximum if how == "max" else jnp.minimum
        out = jnp.where(nan_any | jnp.isnan(init), jnp.nan, pick(init, best))
        out = jnp.where(seglen > 0, out, init)
    elif jnp.dtype(dtype) in _HALF_TYPES:
        ys = _segment_fold(x, ids, init, "prod" if how == "prod" else "sum")
        last = jnp.clip(ends - 1, 0, max(x.shape[1] - 1, 0))
        if x.shape[1]:
            folded = jnp.take_along_axis(ys, last[:, :, None], axis=1)
        else:
            folded = jnp.broadcast_to(init, seglen.shape[:2] + (x.shape[2],))
        out = jnp.where(seglen > 0, folded, init)
    else:
        part = _segment_apply(x, ids, segments, "prod" if how == "prod" else "sum")
        out = init * part if how == "prod" else init + part
    if how == "mean":
        divided = jnp.where(jnp.isnan(out), out, _segment_divide(out, jnp.maximum(seglen, 1), dtype))
        empty = jnp.asarray(jnp.nan, dtype) if initial is None else init
        out = jnp.where(seglen > 0, divided, empty)
    out = out.astype(dtype)
    return out.reshape(ctx.out_shape)


def _segment_exclusive_prod_exact(x, ids, init):
    """For each element, init times the product of the other elements of its segment, folded in
    the kernel's order and rounded to x's dtype each step (quadratic: for short rows)."""
    dtype = x.dtype
    ys = _segment_fold(x, ids, init, "prod")
    # the fold up to the element before: init at a segment's first element
    first = jnp.concatenate([jnp.ones_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    before = jnp.concatenate([jnp.zeros_like(ys[:, :1]), ys[:, :-1]], axis=1)
    acc = jnp.where(first[:, :, None], init, before).astype(dtype)
    size = x.shape[1]
    pos = jnp.arange(size)

    def body(k, acc):
        xk = lax.dynamic_slice_in_dim(x, k, 1, axis=1)            # (outer, 1, inner)
        idk = lax.dynamic_slice_in_dim(ids, k, 1, axis=1)         # (outer, 1)
        use = (ids == idk) & (pos[None, :] < k)
        stepped = (acc.astype(jnp.float32) * xk.astype(jnp.float32)).astype(dtype)
        return jnp.where(use[:, :, None], stepped, acc)

    return lax.fori_loop(0, size, body, acc)


@lowering(aten._segment_reduce_backward.default, check=_check_segment_reduce_backward)
def segment_reduce_backward(ctx, grad, output, data, reduce, *, lengths=None, offsets=None, axis=0,
                            initial=None):
    how = _SEGMENT_REDUCTIONS[reduce]
    dtype = data.dtype
    half = jnp.dtype(dtype) in _HALF_TYPES
    x, starts, ends, ids = _segment_layout(data, lengths, offsets, axis)
    _segment_runtime_checks(x, starts, ends, lengths, offsets, True, forward=False)
    outer, size, inner = x.shape
    segments = starts.shape[1]
    if x.size == 0 or segments == 0:
        return jnp.zeros(ctx.out_shape, dtype)
    pad = jnp.zeros((outer, 1, inner), dtype)
    g = _segment_gather(jnp.concatenate([grad.reshape(outer, segments, inner), pad], axis=1), ids)
    o = _segment_gather(jnp.concatenate([output.reshape(outer, segments, inner), pad], axis=1), ids)
    seglen = jnp.maximum(ends - starts, 0)
    n = jnp.take_along_axis(jnp.concatenate([seglen, jnp.ones_like(seglen[:, :1])], axis=1), ids, axis=1)[:, :, None]
    inside = (ids < segments)[:, :, None]

    def mul(a, b):
        return (a.astype(jnp.float32) * b.astype(jnp.float32)).astype(dtype) if half else a * b

    if how == "sum":
        gi = g
    elif how == "mean":
        gi = _segment_divide(g, n, dtype)
    elif how in ("max", "min"):
        sel = jnp.isnan(x) | (x == o)
        counter = _segment_gather(
            jnp.concatenate([_segment_apply(sel.astype(jnp.int64), ids, segments, "sum"),
                             jnp.ones((outer, 1, inner), jnp.int64)], axis=1), ids)
        gi = jnp.where(sel, g, jnp.zeros_like(g))
        gi = jnp.where((counter >= 2) & (gi > 0), _segment_divide(gi, counter, dtype), gi)
    else:   # prod
        init = jnp.asarray(1.0, dtype) if initial is None else _segment_initial(initial, dtype)
        special = jnp.isnan(x) | (x == 0)
        gv = mul(g, o)
        plain = (gv.astype(jnp.float32) / x.astype(jnp.float32)).astype(dtype) if half else gv / x
        if half:
            exclusive = _segment_exclusive_prod_exact(x, ids, init)
        else:
            def count(mask):
                per = _segment_apply(mask.astype(jnp.int64), ids, segments, "sum")
                return _segment_gather(jnp.concatenate([per, jnp.zeros((outer, 1, inner), jnp.int64)], axis=1), ids)
            nans = count(jnp.isnan(x)) - jnp.isnan(x)
            zeros = count(x == 0) - (x == 0)
            infs = count(jnp.isinf(x))
            rest = jnp.where(special, jnp.ones_like(x), x)
            p = _segment_gather(jnp.concatenate([_segment_apply(rest, ids, segments, "prod"),
                                                 jnp.ones((outer, 1, inner), dtype)], axis=1), ids)
            others = jnp.where(nans > 0, jnp.nan, jnp.where(zeros > 0, jnp.where(infs > 0, jnp.nan, 0.0), p))
            exclusive = (init * others).astype(dtype)
        gi = jnp.where(special, mul(g, exclusive), plain)
    gi = jnp.where(inside, gi, jnp.zeros_like(gi))
    return gi.astype(dtype).reshape(ctx.out_shape)
