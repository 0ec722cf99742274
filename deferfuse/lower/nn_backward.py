"""Backward ops of nn forward ops (upsampling, replication padding, grid sampling, max pooling,
distances), antialiased bilinear upsampling and its backward, and a few reductions that reach
aten as single ops (adaptive max pooling, pdist, cdist, histc, hash_tensor).

Conventions (those of nn.py, whose helpers this module reuses):
- float16/bfloat16 compute in float32 and round once at the end.
- Backward ops of linear forward ops (upsampling, padding, grid sampling with respect to its
  input) are the VJP of a JAX forward that computes exactly torch's CPU kernel's source indices
  and weights; the indices and weights depend only on shapes and are NumPy constants.
- The backward of a max pooling op scatters the gradient to the indices its forward returned.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
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
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


def _check_floating(ctx: LoweringContext) -> Optional[str]:
    """Every tensor argument floating point of one dtype (complex declined); otherwise torch's
    CPU kernel raises its own error at record time."""
    return common.check_dtypes(ctx, ctx.tensor_args(), floating=True)


def _np_float(dtype) -> type:
    """The NumPy type torch's CPU kernels compute index arithmetic in (opmath: float for float32
    and half types, double for float64)."""
    return np.float64 if jnp.dtype(dtype) == _F64 else np.float32


# -- upsampling ----------------------------------------------------------------------------------
#
# Each upsampling op is separable: along every spatial dim, an output position reads a few input
# positions (taps) with weights.  ``_taps_*`` give, per dim, a list of (indices, weights) pairs
# over the output positions (weights None: 1); the forward applies them one dim at a time and the
# backward is its VJP (a scatter-add of the weighted gradient, as torch's backward kernels do).

def _scale_value(scale, in_size: int, out_size: int, ft):
    """torch's compute_scales_value: 1 / scale_factor when one was given, else in / out."""
    if scale is not None and scale > 0:
        return ft(1.0 / scale)
    return ft(in_size) / ft(out_size)


def _area_scale(in_size: int, out_size: int, align_corners: bool, scale, ft):
    if align_corners:
        return ft(in_size - 1) / ft(out_size - 1) if out_size > 1 else ft(0)
    return _scale_value(scale, in_size, out_size, ft)


def _source_index(scale, out_size: int, align_corners: bool, cubic: bool, ft) -> np.ndarray:
    """torch's area_pixel_compute_source_index over the output positions, in ``ft``."""
    o = np.arange(out_size).astype(ft)
    if align_corners:
        return (scale * o).astype(ft)
    src = (scale * (o + ft(0.5)) - ft(0.5)).astype(ft)
    return src if cubic else np.where(src < 0, ft(0), src).astype(ft)


def _guard(real: np.ndarray, in_size: int, ft):
    """torch's guard_index_and_lambda: (floor index capped at in - 1, fraction clamped to [0, 1])."""
    index = np.minimum(np.floor(real).astype(np.int64), in_size - 1)
    lam = np.clip((real - index.astype(ft)).astype(ft), ft(0), ft(1)).astype(ft)
    return index, lam


def _taps_nearest(in_size, out_size, scale, exact, ft):
    if exact:
        s = np.float32(_scale_value(scale, in_size, out_size, np.float32))
        pos = ((np.arange(out_size) + 0.5) * np.float64(s)).astype(np.float32)
        idx = np.minimum(np.floor(pos).astype(np.int64), in_size - 1)
    else:
        idx = common.nearest_source(out_size, in_size, scale)
    return [(np.asarray(idx, np.int64), None)]


def _taps_linear(in_size, out_size, scale, align_corners, ft):
    if out_size == in_size:
        return [(np.arange(out_size), None)]
    ratio = _area_scale(in_size, out_size, align_corners, scale, ft)
    i0, l1 = _guard(_source_index(ratio, out_size, align_corners, False, ft), in_size, ft)
    i1 = i0 + (i0 < in_size - 1)
    return [(i0, (ft(1) - l1).astype(ft)), (i1, l1)]


def _cubic_coefficients(t: np.ndarray, ft) -> list[np.ndarray]:
    a = ft(-0.75)

    def conv1(x):   # |x| <= 1
        return (((a + 2) * x - (a + 3)) * x * x + 1).astype(ft)

    def conv2(x):   # 1 < |x| < 2
        return (((a * x - 5 * a) * x + 8 * a) * x - 4 * a).astype(ft)
    one = ft(1)
    return [conv2((t + one).astype(ft)), conv1(t), conv1((one - t).astype(ft)),
            conv2((one - t + one).astype(ft))]


def _taps_cubic(in_size, out_size, scale, align_corners, ft):
    ratio = _area_scale(in_size, out_size, align_corners, scale, ft)
    i, t = _guard(_source_index(ratio, out_size, align_corners, True, ft), in_size, ft)
    coeffs = _cubic_coefficients(t, ft)
    # taps outside the input read (and receive the gradient of) the nearest edge
    return [(np.clip(i - 1 + k, 0, in_size - 1), coeffs[k]) for k in range(4)]


def _apply_taps(x, taps_per_dim):
    nd = len(taps_per_dim)
    for axis, taps in zip(range(x.ndim - nd, x.ndim), taps_per_dim):
        out = None
        for idx, w in taps:
            part = jnp.take(x, jnp.asarray(idx), axis=axis)
            if w is not None:
                part = part * jnp.asarray(w, x.dtype).reshape((-1,) + (1,) * (x.ndim - axis - 1))
            out = part if out is None else out + part
        x = out
    return x


def _upsample_backward(grad_output, input_size, taps_per_dim):
    g = common.acc(grad_output)
    zeros = jnp.zeros(tuple(input_size), g.dtype)
    return jax.vjp(lambda x: _apply_taps(x, taps_per_dim), zeros)[1](g)[0]


def _check_upsample_backward(ctx: LoweringContext) -> Optional[str]:
    return common.check_dtypes(ctx, ctx.args[:1], floating=True)


_NEAREST_BACKWARD = {
    aten.upsample_nearest1d_backward.default: (1, False),
    aten.upsample_nearest3d_backward.default: (3, False),
    aten._upsample_nearest_exact1d_backward.default: (1, True),
    aten._upsample_nearest_exact2d_backward.default: (2, True),
    aten._upsample_nearest_exact3d_backward.default: (3, True),
}


@lowering(*_NEAREST_BACKWARD, check=_check_upsample_backward)
def upsample_nearest_backward(ctx, grad_output, output_size, input_size, *scales):
    nd, exact = _NEAREST_BACKWARD[ctx.op]
    return _separable_backward(grad_output, output_size, input_size, scales, nd,
                               lambda i, o, s, ft: _taps_nearest(i, o, s, exact, ft))


_INTERP_BACKWARD = {
    aten.upsample_linear1d_backward.default: (1, _taps_linear),
    aten.upsample_bilinear2d_backward.default: (2, _taps_linear),
    aten.upsample_trilinear3d_backward.default: (3, _taps_linear),
    aten.upsample_bicubic2d_backward.default: (2, _taps_cubic),
}


@lowering(*_INTERP_BACKWARD, check=_check_upsample_backward)
def upsample_interp_backward(ctx, grad_output, output_size, input_size, align_corners, *scales):
    nd, taps_of = _INTERP_BACKWARD[ctx.op]
    return _separable_backward(grad_output, output_size, input_size, scales, nd,
                               lambda i, o, s, ft: taps_of(i, o, s, align_corners, ft))


def _separable_backward(grad_output, output_size, input_size, scales, nd: int, taps_of):
    """The backward of an upsampling op given how it reads each spatial dim (``taps_of``)."""
    scales = (tuple(scales) + (None,) * nd)[:nd]
    ft = _np_float(common.acc(grad_output).dtype)
    taps = [taps_of(i, o, s, ft) for i, o, s in zip(input_size[-nd:], output_size, scales)]
    return _upsample_backward(grad_output, input_size, taps)


# -- antialiased bilinear upsampling (interpolate(mode="bilinear", antialias=True)) --------------
#
# torch's CPU kernel (UpSampleKernel.cpp, HelperInterpBase::_compute_indices_min_size_weights_aa)
# is separable: along each spatial dim, output position i reads the input window
# [xmin, xmin + xsize) with the triangle filter 1 - |t| stretched by the downscale factor (its
# support is max(scale, 1) input pixels either side of the window's centre scale * (i + 0.5)), the
# weights normalised to sum 1.  Everything is computed in the input's dtype (float for float32),
# with the C++ promotions to double that the kernel's literals cause.  The forward resamples the
# width first, then the height, each as t0 * w0 + t1 * w1 + ... in order, and skips a dim whose
# size does not change (all of it when no size changes); the backward kernel computes the weights
# of both dims whatever the sizes, and adds (wx * wy) * grad to every input pixel of the window.

def _aa_weights(in_size: int, out_size: int, scale, align_corners: bool, ft):
    """(window starts [out], window sizes [out], weights [out, taps]) of one dim, as torch's
    kernel computes them for a tensor whose dtype computes in ``ft``."""
    f64 = np.float64
    s = _area_scale(in_size, out_size, align_corners, scale, ft)
    wide = s >= 1.0
    support = ft(f64(s)) if wide else ft(1.0)       # (interp_size * 0.5) * scale, interp_size 2
    taps = int(math.ceil(support)) * 2 + 1
    invscale = ft(1.0 / f64(s)) if wide else ft(1.0)
    i = np.arange(out_size)
    center = (f64(s) * (i + 0.5)).astype(ft)         # scale * (i + 0.5) in double, stored
    lo = ((center - support).astype(ft).astype(f64) + 0.5).astype(np.int64)   # C++ truncation
    hi = ((center + support).astype(ft).astype(f64) + 0.5).astype(np.int64)
    xmin = np.maximum(lo, 0)
    xsize = np.clip(np.minimum(hi, in_size) - xmin, 0, taps)
    j = np.arange(taps)
    # filter((j + xmin - center + 0.5) * invscale): (int - float) in ft, the rest in double, the
    # argument and the result stored in ft
    rel = ((j[None, :] + xmin[:, None]).astype(ft) - center[:, None]).astype(ft)
    t = np.abs(((rel.astype(f64) + 0.5) * f64(invscale)).astype(ft))
    w = np.where(t < 1.0, (1.0 - t.astype(f64)).astype(ft), ft(0)).astype(ft)
    w = np.where(j[None, :] < xsize[:, None], w, ft(0)).astype(ft)
    total = np.zeros(out_size, ft)
    for k in range(taps):                           # summed in ft, in order
        total = (total + w[:, k]).astype(ft)
    # (the kernel leaves the weights as they are when they sum to 0)
    divisor = np.where(total == 0, ft(1), total)[:, None]
    return xmin, xsize, (w / divisor).astype(ft)


# Above this many taps a dim is applied as one gather and a sum instead of a chain of gathers.
_AA_UNROLL = 16


def _apply_aa_dim(x, axis: int, xmin, xsize, weights, *, backward: bool):
    """Resample ``x`` along ``axis`` with the windows and weights of ``_aa_weights``.  Taps past a
    window's size read nothing (a 0 weight would still turn an infinite input into NaN); the
    forward kernel always reads the first tap (with weight 0 if the window is empty), its
    backward only the window."""
    in_size = x.shape[axis]
    out_size, taps = weights.shape
    j = np.arange(taps)
    idx = np.minimum(xmin[:, None] + j[None, :], max(in_size - 1, 0))
    used = j[None, :] < xsize[:, None]
    if not backward:
        used = used | (j[None, :] == 0)
    trailing = (1,) * (x.ndim - axis - 1)
    if in_size == 0 or out_size == 0:
        shape = list(x.shape)
        shape[axis] = out_size
        return jnp.zeros(shape, x.dtype)
    if taps <= _AA_UNROLL:
        out = None
        for k in range(taps):
            if not used[:, k].any():
                continue
            part = jnp.take(x, jnp.asarray(idx[:, k]), axis=axis)
            part = part * jnp.asarray(weights[:, k], x.dtype).reshape((-1,) + trailing)
            if not used[:, k].all():
                part = jnp.where(jnp.asarray(used[:, k]).reshape((-1,) + trailing), part,
                                 jnp.zeros((), x.dtype))
            out = part if out is None else out + part
        return out
    parts = jnp.take(x, jnp.asarray(idx.reshape(-1)), axis=axis)
    parts = parts.reshape(x.shape[:axis] + (out_size, taps) + x.shape[axis + 1:])
    w = jnp.asarray(weights, x.dtype).reshape((out_size, taps) + trailing)
    parts = jnp.where(jnp.asarray(used).reshape((out_size, taps) + trailing), parts * w,
                      jnp.zeros((), x.dtype))
    return parts.sum(axis=axis + 1)


def _upsample_aa(x, out_hw, align_corners: bool, scales, *, backward: bool = False,
                 first_row_only: bool = False):
    """The antialiased bilinear resampling of ``x``'s last two dims to ``out_hw``: the forward
    kernel's arithmetic, or (``backward``) the map whose transpose the backward kernel adds.
    ``first_row_only``: every output row reads the window and weights of row 0 (see
    ``_aa_rows_quirk``)."""
    ft = _np_float(x.dtype)
    in_hw = x.shape[-2:]
    if not backward and tuple(in_hw) == tuple(out_hw):
        return x
    for axis in (x.ndim - 1, x.ndim - 2):           # width first, then height
        k = axis - (x.ndim - 2)
        if not backward and in_hw[k] == out_hw[k]:
            continue
        xmin, xsize, weights = _aa_weights(in_hw[k], out_hw[k], scales[k], align_corners, ft)
        if k == 0 and first_row_only and out_hw[0] > 0:
            xmin, xsize, weights = (np.broadcast_to(a[:1], a.shape) for a in (xmin, xsize, weights))
        x = _apply_aa_dim(x, axis, xmin, xsize, weights, backward=backward)
    return x


def _aa_rows_quirk(ctx: LoweringContext, in_hw, out_hw) -> bool:
    """Whether torch's forward kernel gives every output row the window and weights of row 0.
    Its height pass reads the row's window from the first element of each inner loop, assuming
    the loop runs along the width (or the channels, for channels-last tensors); when the output
    is one pixel wide and laid out with the height innermost, the loop runs down the column.
    (Large outputs split across threads restart the column mid-way; that is not modelled.)"""
    if out_hw[1] != 1 or in_hw[0] == out_hw[0]:
        return False
    out = ctx.out[0]
    dims = [d for d in range(len(out.shape)) if out.shape[d] > 1]
    return bool(dims) and min(dims, key=lambda d: out.stride[d]) == len(out.shape) - 2


def _check_aa(ctx: LoweringContext) -> Optional[str]:
    dtype = ctx.args[0].dtype
    if dtype in (torch.float32, torch.float64):
        return None
    if dtype == torch.uint8 or dtype.is_complex:
        return f"{dtype} antialiased upsampling is not lowered"
    return common.raise_like_cpu(ctx)      # half types and integers: "not implemented for 'Half'"


@lowering(aten._upsample_bilinear2d_aa.default, check=_check_aa)
def upsample_bilinear2d_aa(ctx, x, output_size, align_corners, scales_h=None, scales_w=None):
    out_hw = ctx.out_shape[-2:]
    return _upsample_aa(x, out_hw, align_corners, (scales_h, scales_w),
                        first_row_only=_aa_rows_quirk(ctx, x.shape[-2:], out_hw))


@lowering(aten._upsample_bilinear2d_aa_backward.default, check=_check_aa)
def upsample_bilinear2d_aa_backward(ctx, grad_output, output_size, input_size, align_corners,
                                    scales_h=None, scales_w=None):
    def resample(x):
        return _upsample_aa(x, tuple(output_size), align_corners, (scales_h, scales_w), backward=True)
    zeros = jnp.zeros(tuple(input_size), grad_output.dtype)
    return jax.vjp(resample, zeros)[1](grad_output)[0]


# -- replication padding -------------------------------------------------------------------------

@lowering(aten.replication_pad1d_backward.default, aten.replication_pad2d_backward.default,
          aten.replication_pad3d_backward.default, check=_check_upsample_backward)
def replication_pad_backward(ctx, grad_output, x, padding):
    g = common.acc(grad_output)
    zeros = jnp.zeros(x.shape, g.dtype)
    return jax.vjp(lambda x: common.pad_then_crop(x, padding, "edge"), zeros)[1](g)[0]


# -- max pooling backward ------------------------------------------------------------------------

def _scatter_to_indices(grad_output, x, indices, nd: int):
    """Add each gradient element to the input position its (per-plane flat) index names."""
    spatial = math.prod(x.shape[x.ndim - nd:])
    lead = x.shape[:x.ndim - nd]
    planes = math.prod(lead)
    g = common.acc(grad_output).reshape(planes, -1)
    idx = indices.reshape(planes, -1)
    rows = jnp.arange(planes)[:, None]
    grad = jnp.zeros((planes, spatial), g.dtype).at[rows, idx].add(g, mode="drop")
    return grad.reshape(x.shape)


def _check_pool_backward(ctx: LoweringContext) -> Optional[str]:
    return common.check_dtypes(ctx, ctx.args[:2], floating=True)


@lowering(aten.max_pool3d_with_indices_backward.default, check=_check_pool_backward)
def max_pool3d_with_indices_backward(ctx, grad_output, x, kernel_size, stride, padding, dilation,
                                     ceil_mode, indices):
    return _scatter_to_indices(grad_output, x, indices, 3)


@lowering(aten.adaptive_max_pool2d_backward.default, aten.adaptive_max_pool3d_backward.default,
          check=_check_pool_backward)
def adaptive_max_pool_backward(ctx, grad_output, x, indices):
    nd = 3 if ctx.op is aten.adaptive_max_pool3d_backward.default else 2
    return _scatter_to_indices(grad_output, x, indices, nd)


def _check_adaptive_max(ctx: LoweringContext) -> Optional[str]:
    return common.check_dtypes(ctx, ctx.args[:1], floating=True)


@lowering(aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default,
          check=_check_adaptive_max)
def adaptive_max_pool(ctx, x, output_size):
    nd = 3 if ctx.op is aten.adaptive_max_pool3d.default else 2
    out_sizes = ctx.out_shape[-nd:]
    in_sizes = x.shape[-nd:]
    lead = x.shape[:-nd]
    if x.size == 0 or math.prod(out_sizes) == 0:
        empty = jnp.zeros(ctx.out_shape, x.dtype)
        return empty, jnp.zeros(ctx.out_shape, jnp.int64)
    # Gather every window as (out positions..., taps) with the taps in row-major order.  torch
    # scans a window from its first position with -inf as the running max, taking a value that
    # is greater or NaN: the result is the last NaN if any, else the first maximum.
    per_dim = [common.adaptive_windows(i, o) for i, o in zip(in_sizes, out_sizes)]
    flat, inside = per_dim[0][0], per_dim[0][1]
    for (taps, ok, _), size in zip(per_dim[1:], in_sizes[1:]):
        flat, inside = _outer(flat, taps, size), _outer_mask(inside, ok)
    k = flat.shape[-1]
    planes = x.reshape(lead + (-1,))
    vals = jnp.take(planes, jnp.asarray(flat.reshape(-1)), axis=-1).reshape(lead + flat.shape)
    vals = jnp.where(jnp.asarray(inside), vals, -jnp.inf)
    isnan = jnp.isnan(vals)
    last_nan = (k - 1) - jnp.argmax(jnp.flip(isnan, -1), axis=-1)
    first_max = jnp.argmax(jnp.where(isnan, -jnp.inf, vals), axis=-1)
    pick = jnp.where(isnan.any(-1), last_nan, first_max)
    best = jnp.take_along_axis(vals, pick[..., None], axis=-1)[..., 0]
    index = jnp.take_along_axis(jnp.broadcast_to(jnp.asarray(flat), vals.shape), pick[..., None],
                                axis=-1)[..., 0]
    return best, index


def _outer(flat: np.ndarray, taps: np.ndarray, size: int) -> np.ndarray:
    """Combine flat indices (o..., t) with one more dim's (o', t'): (o..., o', t * T' + t')."""
    o_shape, t_prev = flat.shape[:-1], flat.shape[-1]
    o_new, t_new = taps.shape
    combined = flat.reshape(o_shape + (1, t_prev, 1)) * size + taps.reshape((1,) * len(o_shape) + (o_new, 1, t_new))
    return combined.reshape(o_shape + (o_new, t_prev * t_new))


def _outer_mask(mask: np.ndarray, ok: np.ndarray) -> np.ndarray:
    o_shape, t_prev = mask.shape[:-1], mask.shape[-1]
    o_new, t_new = ok.shape
    combined = mask.reshape(o_shape + (1, t_prev, 1)) & ok.reshape((1,) * len(o_shape) + (o_new, 1, t_new))
    return combined.reshape(o_shape + (o_new, t_prev * t_new))


# -- pdist and cdist -----------------------------------------------------------------------------
#
# torch's CPU kernels compute each distance from |a - b| elementwise (0-norm: count of nonzero
# differences; inf-norm: the largest; else (sum |d|^p)^(1/p)), and their backward kernels use
# per-norm formulas that give 0 where the distance is 0 (except for p = 1 and inf).  cdist with
# p = 2 on more than 25 rows (or compute_mode 1) uses a matrix product instead.

def _contiguous(m) -> bool:
    if 0 in m.shape:
        return True
    expected = 1
    for size, stride in reversed(list(zip(m.shape, m.stride))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _norm_of_diffs(diff, p: float):
    """The p-norm of each row of the last axis of ``diff`` (which is |a - b|)."""
    if p == 0:
        return jnp.minimum(jnp.ceil(diff), 1).sum(-1)
    if p == 1:
        return diff.sum(-1)
    if p == 2:
        return jnp.sqrt((diff * diff).sum(-1))
    if math.isinf(p):
        return diff.max(-1, initial=0) if diff.shape[-1] else jnp.zeros(diff.shape[:-1], diff.dtype)
    return jnp.power(jnp.power(diff, p).sum(-1), 1.0 / p)


def _norm_backward(diff, grad, dist, p: float):
    """torch's per-pair gradient of the p-norm with respect to ``diff`` (= a - b), with ``grad``
    and ``dist`` broadcast against ``diff``."""
    zero = jnp.zeros((), diff.dtype)
    if p == 0:
        return jnp.zeros_like(diff)
    if p == 1:
        return grad * jnp.sign(diff)
    if p < 2:
        value = jnp.sign(diff) * jnp.power(jnp.abs(diff), p - 1) * grad / jnp.power(dist, p - 1)
        return jnp.where(dist == 0, zero, value)
    if p == 2:
        return jnp.where(dist == 0, zero, grad * diff / dist)
    if math.isinf(p):
        hit = 1 - jnp.minimum(1, jnp.ceil(jnp.abs(jnp.abs(diff) - dist)))
        return grad * jnp.sign(diff) * hit
    value = diff * jnp.power(jnp.abs(diff), p - 2) * grad / jnp.power(dist, p - 1)
    return jnp.where(dist == 0, zero, value)


def _check_pdist(ctx: LoweringContext) -> Optional[str]:
    tensors = ctx.tensor_args()
    if any(not t.dtype.is_floating_point for t in tensors) or len({t.dtype for t in tensors}) > 1:
        return "pdist and cdist of non-floating or mixed dtypes run torch's kernel (which raises)"
    if ctx.op in (aten._pdist_forward.default, aten._pdist_backward.default) and \
            not all(_contiguous(t) for t in tensors):
        return "torch's pdist kernels reject non-contiguous inputs"
    return None


def _pairs(n: int):
    return np.triu_indices(n, 1)


@lowering(aten._pdist_forward.default, check=_check_pdist)
def pdist_forward(ctx, x, p=2.0):
    n = x.shape[0]
    if n <= 1:
        return jnp.zeros((0,), x.dtype)
    i, j = _pairs(n)
    a = common.acc(x)
    return _norm_of_diffs(jnp.abs(a[i] - a[j]), float(p))


@lowering(aten._pdist_backward.default, check=_check_pdist)
def pdist_backward(ctx, grad, x, p, pdist):
    n = x.shape[0]
    a = common.acc(x)
    if n <= 1 or x.shape[1] == 0:
        return jnp.zeros(x.shape, a.dtype)
    i, j = _pairs(n)
    per_pair = _norm_backward(a[i] - a[j], common.acc(grad)[:, None], common.acc(pdist)[:, None], float(p))
    return jnp.zeros(x.shape, a.dtype).at[i].add(per_pair).at[j].add(-per_pair)


def _cdist_mm(p: float, r1: int, r2: int, mode) -> bool:
    mode = 0 if mode is None else mode
    return p == 2 and (mode == 1 or (mode == 0 and (r1 > 25 or r2 > 25)))


@lowering(aten._cdist_forward.default, check=_check_pdist)
def cdist_forward(ctx, x1, x2, p, compute_mode=None):
    out_shape = ctx.out_shape
    batch = out_shape[:-2]
    (r1, c), r2 = x1.shape[-2:], x2.shape[-2]
    a = jnp.broadcast_to(common.acc(x1), batch + (r1, c))
    b = jnp.broadcast_to(common.acc(x2), batch + (r2, c))
    if r1 == 0 or r2 == 0 or math.prod(batch) == 0 or c == 0:
        return jnp.zeros(out_shape, a.dtype)
    if _cdist_mm(float(p), r1, r2, compute_mode):
        # torch's _euclidean_dist: [-2 a, |a|^2, 1] @ [b, 1, |b|^2]^T, clamped at 0, square root
        na = (a * a).sum(-1, keepdims=True)
        nb = (b * b).sum(-1, keepdims=True)
        left = jnp.concatenate([-2 * a, na, jnp.ones_like(na)], -1)
        right = jnp.concatenate([b, jnp.ones_like(nb), nb], -1)
        prod = jnp.matmul(left, jnp.swapaxes(right, -1, -2), precision=lax.Precision.HIGHEST)
        return jnp.sqrt(jnp.maximum(prod, 0))
    return _norm_of_diffs(jnp.abs(a[..., :, None, :] - b[..., None, :, :]), float(p))


@lowering(aten._cdist_backward.default, check=_check_pdist)
def cdist_backward(ctx, grad, x1, x2, p, cdist):
    batch = tuple(np.broadcast_shapes(x1.shape[:-2], x2.shape[:-2]))
    (r1, c), r2 = x1.shape[-2:], x2.shape[-2]
    if r1 == 0 or r2 == 0 or c == 0 or math.prod(batch) == 0:
        return jnp.zeros(ctx.out_shape, common.acc(x1).dtype)   # (x1's own shape, not the broadcast one)
    a = jnp.broadcast_to(common.acc(x1), batch + (r1, c))
    b = jnp.broadcast_to(common.acc(x2), batch + (r2, c))
    g = common.acc(grad).reshape(batch + (r1, r2))[..., None]
    d = common.acc(cdist).reshape(batch + (r1, r2))[..., None]
    per_pair = _norm_backward(a[..., :, None, :] - b[..., None, :, :], g, d, float(p))
    return per_pair.sum(-2)


# -- histc ---------------------------------------------------------------------------------------

def _check_histc(ctx: LoweringContext) -> Optional[str]:
    x = ctx.args[0]
    if not x.dtype.is_floating_point:
        return common.raise_like_cpu(ctx)   # "histogram_cpu" not implemented for 'Long'
    if x.dtype in (torch.float16, torch.bfloat16) and math.prod(x.shape) > 256:
        return "torch counts half-precision histograms in their own dtype, which saturates"
    return None


@lowering(aten.histc.default, check=_check_histc)
def histc(ctx, x, bins=100, min=0, max=0):
    dtype = x.dtype
    flat = x.reshape(-1)
    lo = jnp.asarray(min, _F64)
    hi = jnp.asarray(max, _F64)
    if flat.size:
        # torch takes the data's range when min == max (then widens an empty range by 1 each way)
        data_lo, data_hi = flat.min().astype(_F64), flat.max().astype(_F64)
        same = lo == hi
        lo, hi = jnp.where(same, data_lo, lo), jnp.where(same, data_hi, hi)
    same = lo == hi
    lo, hi = jnp.where(same, lo - 1, lo), jnp.where(same, hi + 1, hi)
    runtime_check(~(jnp.isfinite(lo) & jnp.isfinite(hi)), RuntimeError,
                  "torch.histc: range of [min, max] is not finite")
    runtime_check(lo > hi, RuntimeError, "torch.histc: max must be larger than min")
    # the kernel works in the input's dtype with the edges rounded to it, one rounding per step
    def r(v):
        return v.astype(dtype)
    left, right = r(lo), r(hi)
    work = _F32 if dtype in _HALF_TYPES else dtype
    inside = (flat >= left) & (flat <= right)
    t = r(r(flat.astype(work) - left.astype(work)).astype(work) * bins)
    t = r(t.astype(work) / r(right.astype(work) - left.astype(work)).astype(work))
    pos = jnp.where(inside, t, 0).astype(jnp.int64)
    pos = jnp.where(pos == bins, bins - 1, pos)
    pos = jnp.where(inside, pos, bins)   # dropped
    counts = jnp.zeros((bins,), jnp.int64).at[pos].add(1, mode="drop")
    return counts.astype(dtype)


# -- hash_tensor ---------------------------------------------------------------------------------

def _check_hash(ctx: LoweringContext) -> Optional[str]:
    x = ctx.args[0]
    dims = ctx.args[1] if len(ctx.args) > 1 else ctx.kwargs.get("dim", [])
    mode = ctx.kwargs.get("mode", 0)
    if mode != 0:
        return "only hash_tensor mode 0 (xor) is lowered"
    if x.dtype.is_complex:
        return "complex hash_tensor is not lowered"
    dims = [dims] if isinstance(dims, int) else list(dims or ())
    if (not dims and math.prod(x.shape) == 0) or any(x.shape[d] == 0 for d in dims if x.shape):
        # torch wants a reduction dim for an empty input, and no empty reduction dim
        return common.raise_like_cpu(ctx)
    return None


@lowering(aten.hash_tensor.default, check=_check_hash)
def hash_tensor(ctx, x, dim=(), keepdim=False, mode=0):
    # each element widened to its 64-bit float or integer type, bit-cast to uint64, then xor-ed
    if jnp.issubdtype(x.dtype, jnp.floating):
        bits = lax.bitcast_convert_type(x.astype(_F64), jnp.uint64)
    elif jnp.issubdtype(x.dtype, jnp.unsignedinteger):
        bits = x.astype(jnp.uint64)
    else:
        bits = lax.bitcast_convert_type(x.astype(jnp.int64), jnp.uint64)
    dims = [dim] if isinstance(dim, int) else list(dim or ())
    axes = tuple(sorted({d % x.ndim for d in dims})) if dims and x.ndim else tuple(range(x.ndim))
    out = lax.reduce(bits, np.uint64(0), lax.bitwise_xor, axes)
    return out.reshape(ctx.out_shape)


# -- grid sampling -------------------------------------------------------------------------------
#
# A JAX grid sampler following torch's CPU kernels (interpolation 0 bilinear, 1 nearest,
# 2 bicubic; padding 0 zeros, 1 border, 2 reflection); its backward is the VJP with respect to
# the input and the grid.  The coordinate functions are written with ``where`` so that their
# derivatives at the edges are torch's: a clipped coordinate (borders included) has gradient 0.

_BILINEAR, _NEAREST, _BICUBIC = 0, 1, 2
_ZEROS, _BORDER, _REFLECTION = 0, 1, 2


def _unnormalize(coord, size: int, align_corners: bool):
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _clip(coord, size: int):
    top = size - 1
    return jnp.where(coord <= 0, jnp.zeros((), coord.dtype),
                     jnp.where(coord >= top, jnp.asarray(top, coord.dtype), coord))


def _reflect(coord, twice_low: int, twice_high: int):
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    low = twice_low / 2
    span = (twice_high - twice_low) / 2
    d = coord - low
    d = jnp.where(d < 0, -d, d)
    extra = jnp.fmod(d, span)
    flips = jnp.floor(d / span)
    even = jnp.fmod(flips, 2) == 0
    return jnp.where(even, extra + low, span - extra + low)


def _apply_padding(coord, size: int, padding_mode: int, align_corners: bool):
    if padding_mode == _BORDER:
        return _clip(coord, size)
    if padding_mode == _REFLECTION:
        if align_corners:
            coord = _reflect(coord, 0, 2 * (size - 1))
        else:
            coord = _reflect(coord, -1, 2 * size - 1)
        return _clip(coord, size)
    return coord


def _grid_sample(x, grid, mode: int, padding_mode: int, align_corners: bool):
    """grid_sampler_2d/3d: x (N, C, *in), grid (N, *out, nd) with x, y(, z) last -> (N, C, *out)."""
    nd = grid.shape[-1]
    n, c = x.shape[:2]
    in_sizes = x.shape[2:]
    out_sizes = grid.shape[1:-1]
    flat_x = x.reshape(n, c, -1)
    # coordinates per spatial dim of x, outermost first (grid's last axis lists them innermost first)
    coords = [grid[..., nd - 1 - d].reshape(n, -1) for d in range(nd)]
    coords = [_unnormalize(co, size, align_corners) for co, size in zip(coords, in_sizes)]

    def gather(int_coords):
        """Values at integer coordinates (a list over dims), 0 outside the input: (N, C, P)."""
        ok = None
        flat = None
        for ic, size in zip(int_coords, in_sizes):
            inside = (ic >= 0) & (ic < size)
            ok = inside if ok is None else ok & inside
            safe = jnp.clip(ic, 0, size - 1).astype(jnp.int64)
            flat = safe if flat is None else flat * size + safe
        vals = jnp.take_along_axis(flat_x, flat[:, None, :], axis=2)
        return jnp.where(ok[:, None, :], vals, jnp.zeros((), vals.dtype))

    if mode == _BICUBIC:
        floors = [jnp.floor(co) for co in coords]
        coeffs = [_cubic_weights(co - f) for co, f in zip(coords, floors)]
        out = None
        for taps in np.ndindex(*(4,) * nd):
            positions = []
            weight = None
            for d, k in enumerate(taps):
                p = _apply_padding(floors[d] - 1 + k, in_sizes[d], padding_mode, align_corners)
                positions.append(jnp.trunc(lax.stop_gradient(p)))
                weight = coeffs[d][k] if weight is None else weight * coeffs[d][k]
            part = gather(positions) * weight[:, None, :]
            out = part if out is None else out + part
    else:
        coords = [_apply_padding(co, size, padding_mode, align_corners)
                  for co, size in zip(coords, in_sizes)]
        if mode == _NEAREST:
            out = gather([jnp.round(lax.stop_gradient(co)) for co in coords])
        else:
            floors = [jnp.floor(lax.stop_gradient(co)) for co in coords]
            out = None
            for corner in np.ndindex(*(2,) * nd):
                weight = None
                for d, k in enumerate(corner):
                    # the weight of the lower corner is (floor + 1 - x), of the upper (x - floor)
                    w = (floors[d] + 1 - coords[d]) if k == 0 else (coords[d] - floors[d])
                    weight = w if weight is None else weight * w
                part = gather([f + k for f, k in zip(floors, corner)]) * weight[:, None, :]
                out = part if out is None else out + part
    return out.reshape((n, c) + tuple(out_sizes))


def _cubic_weights(t):
    a = -0.75

    def conv1(v):
        return ((a + 2) * v - (a + 3)) * v * v + 1

    def conv2(v):
        return ((a * v - 5 * a) * v + 8 * a) * v - 4 * a
    return [conv2(t + 1), conv1(t), conv1(1 - t), conv2(2 - t)]


def _check_grid_sampler(ctx: LoweringContext) -> Optional[str]:
    backward = ctx.op._schema.name.endswith("_backward")
    x, grid = ctx.args[1:3] if backward else ctx.args[0:2]
    mode = ctx.args[3] if backward else ctx.args[2]
    nd = len(grid.shape) - 2
    if nd == 3 and mode == _BICUBIC:
        return "torch's grid_sampler_3d has no bicubic mode (it raises)"
    if mode not in (_BILINEAR, _NEAREST, _BICUBIC):
        return "unknown interpolation mode"
    dtypes = {t.dtype for t in ctx.tensor_args()}
    if len(dtypes) != 1 or not all(dt.is_floating_point for dt in dtypes):
        return "grid sampling of mixed or non-floating dtypes runs torch's kernel (which raises)"
    if dtypes & {torch.float16, torch.bfloat16}:
        return "half-precision grid sampling is not lowered"
    return None


@lowering(aten.grid_sampler_3d.default, check=_check_grid_sampler)
def grid_sampler_3d(ctx, x, grid, interpolation_mode, padding_mode, align_corners):
    return _grid_sample(x, grid, interpolation_mode, padding_mode, align_corners)


@lowering(aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d_backward.default,
          check=_check_grid_sampler)
def grid_sampler_backward(ctx, grad_output, x, grid, interpolation_mode, padding_mode,
                          align_corners, output_mask):
    def forward(x, grid):
        return _grid_sample(x, grid, interpolation_mode, padding_mode, align_corners)
    _, vjp = jax.vjp(forward, x, grid)
    grad_input, grad_grid = vjp(grad_output)
    # an input gradient torch leaves undefined (output_mask[0] False) is absent from ctx.out
    return (grad_input, grad_grid) if output_mask[0] else (grad_grid,)
