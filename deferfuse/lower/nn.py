"""Neural-network lowerings: convolution (and its backward), embedding, nll_loss, pooling,
nearest upsampling, the pointwise losses that reach aten as single ops, and the chunked
linear_cross_entropy custom ops (torch_nn namespace).

Conventions:
- float16/bfloat16 compute in float32 and round once at the end, as torch's CPU kernels
  accumulate in float; integer convolutions accumulate in int64 and wrap when cast back (exact).
- Every window, index and divisor of a pooling or upsampling op depends only on shapes, so it is
  computed here in NumPy at trace time and enters the program as a constant.
- Backward ops of linear forward ops (convolution, average pooling, upsampling) are the VJP of the
  forward rule: the transpose of exactly the arithmetic the forward does.
- Out-of-range targets and indices (nll_loss, embedding) make torch raise from inside its
  kernels: the lowerings register runtime checks (lower/registry.py), which raise torch's error
  when the computation runs.  BCE inputs outside [0, 1] are not checked yet: they give NaN.
"""

from __future__ import annotations

import itertools
import math
from typing import Optional

import numpy as np
import torch

from . import common
from . import host_products
from . import xla_fixes
from .registry import bounds_check, LoweringContext, lowering, runtime_check
from .._lazy import lazy_import

jax = lazy_import("jax", globals(), "jax")
jnp = lazy_import("jax.numpy", globals(), "jnp")
lax = lazy_import("jax.lax", globals(), "lax")

aten = torch.ops.aten

_HIGHEST = "highest"
_MEAN, _SUM = 1, 2   # at::Reduction (0 is none)


def _tuple(value, n: int) -> tuple[int, ...]:
    """An int-list argument expanded to ``n`` spatial dims (aten accepts one value for all)."""
    value = [value] if isinstance(value, int) else list(value)
    return tuple(value * n) if len(value) == 1 else tuple(value)


def _reduce(loss, reduction: int):
    if reduction == _MEAN:
        return loss.mean()
    if reduction == _SUM:
        return loss.sum()
    return loss


# -- convolution ---------------------------------------------------------------------------------

def _conv(x, w, stride, padding, dilation, transposed, output_padding, groups):
    nd = x.ndim - 2
    stride, padding, dilation = _tuple(stride, nd), _tuple(padding, nd), _tuple(dilation, nd)
    spatial = "DHW"[3 - nd:]   # the checkers admit 1 to 3 spatial dims
    dims = ("NC" + spatial, "OI" + spatial, "NC" + spatial)
    acc = common.acc(x).dtype
    x, w = x.astype(acc), w.astype(acc)
    if not transposed:
        return lax.conv_general_dilated(
            x, w, window_strides=stride, padding=[(p, p) for p in padding], rhs_dilation=dilation,
            feature_group_count=groups, dimension_numbers=dims, precision=_HIGHEST,
            preferred_element_type=acc)
    # A transposed convolution is the convolution whose input is dilated by the stride, with the
    # kernel flipped and its in/out channels swapped within each group.
    output_padding = _tuple(output_padding, nd)
    c_in, c_out_per_group, *kernel = w.shape
    w = w.reshape(groups, c_in // groups, c_out_per_group, *kernel)
    w = jnp.swapaxes(w, 1, 2).reshape(groups * c_out_per_group, c_in // groups, *kernel)
    w = jnp.flip(w, axis=tuple(range(2, 2 + nd)))
    pads = [(d * (k - 1) - p, d * (k - 1) - p + op)
            for k, p, d, op in zip(kernel, padding, dilation, output_padding)]
    return lax.conv_general_dilated(
        x, w, window_strides=(1,) * nd, padding=pads, lhs_dilation=stride, rhs_dilation=dilation,
        feature_group_count=groups, dimension_numbers=dims, precision=_HIGHEST,
        preferred_element_type=acc)


def _check_conv(ctx: LoweringContext) -> Optional[str]:
    if not 1 <= len(ctx.args[0].shape) - 2 <= 3:
        return "only 1d, 2d and 3d convolutions are lowered"
    return common.check_dtypes(ctx, ctx.args[:3], floating=False)


@lowering(aten.convolution.default, check=_check_conv)
def convolution(ctx, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    if host_products.applies(ctx):
        return host_products.convolution(ctx, x, w, bias, stride, padding, dilation, transposed,
                                         output_padding, groups)
    out = _conv(x, w, stride, padding, dilation, transposed, output_padding, groups)
    if bias is not None:
        out = out + common.acc(bias).reshape((1, -1) + (1,) * (out.ndim - 2))
    return out


def _check_conv_backward(ctx: LoweringContext) -> Optional[str]:
    if not 1 <= len(ctx.args[1].shape) - 2 <= 3:
        return "only 1d, 2d and 3d convolutions are lowered"
    return common.check_dtypes(ctx, ctx.args[:3], floating=True)


@lowering(aten.convolution_backward.default, check=_check_conv_backward)
def convolution_backward(ctx, grad_output, x, w, bias_sizes, stride, padding, dilation, transposed,
                         output_padding, groups, output_mask):
    if host_products.applies(ctx):
        return host_products.convolution_backward(ctx, grad_output, x, w, bias_sizes, stride, padding,
                                                  dilation, transposed, output_padding, groups,
                                                  output_mask)
    g = common.acc(grad_output)

    def forward(x, w):
        return _conv(x, w, stride, padding, dilation, transposed, output_padding, groups)
    _, vjp = jax.vjp(forward, common.acc(x), common.acc(w))
    grad_input, grad_weight = vjp(g)
    grad_bias = g.sum(axis=(0,) + tuple(range(2, g.ndim)))
    # outputs torch leaves undefined (output_mask False) are absent from ctx.out
    return tuple(r for r, wanted in zip((grad_input, grad_weight, grad_bias), output_mask) if wanted)


# -- embedding -----------------------------------------------------------------------------------

def _check_embedding(ctx: LoweringContext) -> Optional[str]:
    if ctx.args[0].dtype.is_complex:
        return "complex embeddings are not lowered"
    return None


@lowering(aten.embedding.default, check=_check_embedding)
def embedding(ctx, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    # padding_idx only changes the backward; out-of-range indices raise torch's IndexError
    bounds_check(indices, weight.shape[0], 0)
    return jnp.take(weight, indices, axis=0, mode="fill")


def _check_embedding_backward(ctx: LoweringContext) -> Optional[str]:
    return common.check_dtypes(ctx, ctx.args[:1], floating=True)


@lowering(aten.embedding_dense_backward.default, check=_check_embedding_backward)
def embedding_dense_backward(ctx, grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    dim = grad_output.shape[-1]
    g = common.acc(grad_output).reshape(-1, dim)
    idx = indices.reshape(-1)
    keep = idx != padding_idx
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), g.dtype).at[idx].add(1, mode="drop")
        g = g / counts[jnp.clip(idx, 0, num_weights - 1)][:, None]
    g = jnp.where(keep[:, None], g, 0)
    return jnp.zeros((num_weights, dim), g.dtype).at[idx].add(g, mode="drop")


# -- nll_loss ------------------------------------------------------------------------------------

def _check_nll(ctx: LoweringContext) -> Optional[str]:
    backward = ctx.op._schema.name.endswith("_backward")
    x, target = ctx.args[1:3] if backward else ctx.args[0:2]
    # the meta kernels accept int32 targets and integer inputs; the CPU kernels do not
    if not x.dtype.is_floating_point or target.dtype not in (torch.int64, torch.uint8):
        return common.raise_like_cpu(ctx)
    return None


def _target_weights(x, target, weight, ignore_index):
    """(per-target weights with ignored targets at 0, ignored mask, targets safe to gather)."""
    ignored = target == ignore_index
    safe = jnp.where(ignored, 0, target)
    acc = common.acc(x).dtype
    w = jnp.ones(target.shape, acc) if weight is None else common.acc(weight)[safe]
    return jnp.where(ignored, jnp.zeros((), acc), w), ignored, safe


def _nll_forward(x, target, weight, reduction, ignore_index):
    class_axis = 0 if x.ndim == 1 else 1
    classes = x.shape[class_axis]
    # (torch's CPU kernel: IndexError for a target outside [0, classes) that is not ignored)
    runtime_check(~(target == ignore_index) & ((target < 0) | (target >= classes)), IndexError,
                  "Target {value} is out of bounds.", target)
    w, ignored, safe = _target_weights(x, target, weight, ignore_index)
    picked = jnp.take_along_axis(common.acc(x), jnp.expand_dims(safe, class_axis), axis=class_axis,
                                 mode="fill")
    picked = jnp.squeeze(picked, class_axis)
    # where, not a multiplication by 0: an ignored target's NaN input must not leak in
    losses = jnp.where(ignored, jnp.zeros((), w.dtype), -picked * w)
    if reduction == 0:
        return losses, jnp.zeros((), w.dtype)
    total_weight = w.sum()
    total = losses.sum()
    return (total / total_weight if reduction == _MEAN else total), total_weight


def _nll_backward(grad_output, x, target, weight, reduction, ignore_index, total_weight):
    class_axis = 0 if x.ndim == 1 else 1
    w, ignored, safe = _target_weights(x, target, weight, ignore_index)
    g = common.acc(grad_output)
    if reduction == _MEAN:
        g = g / common.acc(total_weight)
    per_target = jnp.where(ignored, jnp.zeros((), w.dtype), w * -g)
    classes = lax.broadcasted_iota(jnp.int64, x.shape, class_axis)
    hit = classes == jnp.expand_dims(safe, class_axis)
    return jnp.where(hit, jnp.expand_dims(per_target, class_axis), jnp.zeros((), w.dtype))


@lowering(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default, check=_check_nll)
def nll_loss_forward(ctx, x, target, weight, reduction, ignore_index):
    return _nll_forward(x, target, weight, reduction, ignore_index)


@lowering(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default, check=_check_nll)
def nll_loss_backward(ctx, grad_output, x, target, weight, reduction, ignore_index, total_weight):
    return _nll_backward(grad_output, x, target, weight, reduction, ignore_index, total_weight)


# -- pooling -------------------------------------------------------------------------------------

def _pool_params(kernel_size, stride, padding, dilation=1, nd=2):
    kernel = _tuple(kernel_size, nd)
    stride = _tuple(stride, nd) if stride else kernel   # an empty stride means the kernel size
    return kernel, stride, _tuple(padding, nd), _tuple(dilation, nd)


def _windows(in_size: int, out_size: int, kernel: int, stride: int, pad: int, dilation: int):
    """Per output position and kernel tap: the input index it reads and whether that is inside."""
    taps = np.arange(out_size)[:, None] * stride - pad + np.arange(kernel)[None, :] * dilation
    return taps, (taps >= 0) & (taps < in_size)


def _padded_taps(x, kernel, stride, pad, dilation, out_sizes, fill):
    """The kernel taps as strided slices of ``x`` padded with ``fill``: a list over the kernel
    offsets (row-major, last spatial dim fastest) of arrays shaped like the output."""
    nd = len(out_sizes)
    sizes = x.shape[-nd:]
    need = [(o - 1) * s + (k - 1) * d + 1 for o, s, k, d in zip(out_sizes, stride, kernel, dilation)]
    lead = [(0, 0)] * (x.ndim - nd)
    x = jnp.pad(x, lead + [(p, max(0, n - p - size)) for p, n, size in zip(pad, need, sizes)],
                constant_values=fill)
    return [x[(...,) + tuple(slice(i * d, i * d + (o - 1) * s + 1, s)
                             for i, d, o, s in zip(offset, dilation, out_sizes, stride))]
            for offset in itertools.product(*(range(k) for k in kernel))]


def _check_pool(ctx: LoweringContext) -> Optional[str]:
    backward = ctx.op._schema.name.endswith("_backward")
    x = ctx.args[1] if backward else ctx.args[0]
    if x.dtype.is_complex:
        return "complex pooling is not lowered"
    integer_ok = {aten.max_pool2d_with_indices.default: True,
                  aten.avg_pool2d.default: x.dtype == torch.int64,
                  aten.avg_pool3d.default: x.dtype == torch.int64}.get(ctx.op, False)
    if x.dtype == torch.bool or not (x.dtype.is_floating_point or integer_ok):
        return common.raise_like_cpu(ctx)   # e.g. "avg_pool2d" not implemented for 'Byte'
    return None


@lowering(aten.max_pool2d_with_indices.default, check=_check_pool)
def max_pool2d_with_indices(ctx, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    kernel, stride, pad, dilation = _pool_params(kernel_size, stride, padding, dilation)
    (h, w), (oh, ow) = x.shape[-2:], ctx.out_shape[-2:]
    rows, row_ok = _windows(h, oh, kernel[0], stride[0], pad[0], dilation[0])
    cols, col_ok = _windows(w, ow, kernel[1], stride[1], pad[1], dilation[1])
    if jnp.issubdtype(x.dtype, jnp.floating):
        fill = -np.inf
    else:
        fill = np.iinfo(x.dtype).min
    taps = _padded_taps(x, kernel, stride, pad, dilation, (oh, ow), fill)
    # torch scans the window in row-major order from the first in-bounds tap, taking a value when
    # it is greater than the running max or NaN: ties keep the first index, NaNs the last one.
    best = jnp.full(taps[0].shape, fill, x.dtype)
    first = np.full((oh, ow), -1, np.int64)
    index = jnp.zeros(taps[0].shape, jnp.int64)
    for t, (i, j) in enumerate((i, j) for i in range(kernel[0]) for j in range(kernel[1])):
        inside = row_ok[:, i][:, None] & col_ok[:, j][None, :]
        flat = rows[:, i][:, None] * w + cols[:, j][None, :]
        first = np.where((first < 0) & inside, flat, first)
        take = (taps[t] > best) | jnp.isnan(taps[t]) if jnp.issubdtype(x.dtype, jnp.floating) \
            else taps[t] > best
        take = take & inside
        best = jnp.where(take, taps[t], best)
        index = jnp.where(take, flat, index)
    # a window whose inside values are all -inf (or the integer minimum) keeps its first index
    untouched = best == fill
    index = jnp.where(untouched, jnp.asarray(np.maximum(first, 0)), index)
    return best, index


@lowering(aten.max_pool2d_with_indices_backward.default, check=_check_pool)
def max_pool2d_with_indices_backward(ctx, grad_output, x, kernel_size, stride, padding, dilation,
                                     ceil_mode, indices):
    h, w = x.shape[-2:]
    lead = x.shape[:-2]
    planes = math.prod(lead)
    g = common.acc(grad_output).reshape(planes, -1)
    idx = indices.reshape(planes, -1)
    rows = jnp.arange(planes)[:, None]
    grad = jnp.zeros((planes, h * w), g.dtype).at[rows, idx].add(g, mode="drop")
    return grad.reshape(x.shape)


def _avg_divisors(in_sizes, out_sizes, kernel, stride, pad, count_include_pad, divisor_override):
    """torch's avg_pool divisor for each output position (shape ``out_sizes``)."""
    if divisor_override:
        # any nonzero value, negative ones included (torch divides by -2 as asked)
        return np.full(tuple(out_sizes), divisor_override, np.int64)
    divisor = np.ones((), np.int64)
    for axis, (size, out, k, s, p) in enumerate(zip(in_sizes, out_sizes, kernel, stride, pad)):
        start = np.arange(out) * s - p
        end = np.minimum(start + k, size + p)
        length = end - start if count_include_pad else np.minimum(end, size) - np.maximum(start, 0)
        divisor = divisor[..., None] * length
    # a window entirely in the padding sums nothing; torch writes 0 there
    return np.where(divisor > 0, divisor, 1)


def _avg_pool(x, out_sizes, kernel_size, stride, padding, ceil_mode, count_include_pad,
              divisor_override):
    nd = len(out_sizes)
    kernel, stride, pad, _ = _pool_params(kernel_size, stride, padding, nd=nd)
    taps = _padded_taps(common.acc(x), kernel, stride, pad, (1,) * nd, out_sizes, 0)
    total = taps[0]
    for t in taps[1:]:
        total = total + t
    divisor = jnp.asarray(_avg_divisors(x.shape[-nd:], out_sizes, kernel, stride, pad,
                                        count_include_pad, divisor_override), total.dtype)
    if jnp.issubdtype(total.dtype, jnp.integer):
        return lax.div(total, jnp.broadcast_to(divisor, total.shape))   # C++ division truncates
    return total / divisor


@lowering(aten.avg_pool2d.default, aten.avg_pool3d.default, check=_check_pool)
def avg_pool(ctx, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
             divisor_override=None):
    nd = 3 if ctx.op is aten.avg_pool3d.default else 2
    return _avg_pool(x, ctx.out_shape[-nd:], kernel_size, stride, padding, ceil_mode,
                     count_include_pad, divisor_override)


@lowering(aten.avg_pool2d_backward.default, aten.avg_pool3d_backward.default, check=_check_pool)
def avg_pool_backward(ctx, grad_output, x, kernel_size, stride, padding, ceil_mode,
                      count_include_pad, divisor_override):
    nd = 3 if ctx.op is aten.avg_pool3d_backward.default else 2
    g = common.acc(grad_output)

    def forward(x):
        return _avg_pool(x, g.shape[-nd:], kernel_size, stride, padding, ceil_mode,
                         count_include_pad, divisor_override)
    return jax.vjp(forward, common.acc(x))[1](g)[0]


def _adaptive_avg_pool(x, out_sizes):
    """Sum each window one spatial dim at a time (the windows are a product of per-dim ranges),
    then divide by the window's size."""
    nd = len(out_sizes)
    x = common.acc(x)
    divisor = np.ones((), np.int64)
    for axis, out in zip(range(x.ndim - nd, x.ndim), out_sizes):
        taps, inside, length = common.adaptive_windows(x.shape[axis], out)
        shape = (1,) * axis + taps.shape + (1,) * (x.ndim - axis - 1)
        patches = jnp.take(x, jnp.asarray(taps.reshape(-1)), axis=axis)
        patches = patches.reshape(x.shape[:axis] + taps.shape + x.shape[axis + 1:])
        x = jnp.where(inside.reshape(shape), patches, jnp.zeros((), x.dtype)).sum(axis=axis + 1)
        divisor = divisor[..., None] * length
    return x / jnp.asarray(divisor, x.dtype)


@lowering(aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default, check=_check_pool)
def adaptive_avg_pool(ctx, x, output_size):
    nd = 3 if ctx.op is aten._adaptive_avg_pool3d.default else 2
    return _adaptive_avg_pool(x, ctx.out_shape[-nd:])


@lowering(aten._adaptive_avg_pool2d_backward.default, aten._adaptive_avg_pool3d_backward.default,
          check=_check_pool)
def adaptive_avg_pool_backward(ctx, grad_output, x):
    nd = 3 if ctx.op is aten._adaptive_avg_pool3d_backward.default else 2
    g = common.acc(grad_output)
    return jax.vjp(lambda x: _adaptive_avg_pool(x, g.shape[-nd:]), common.acc(x))[1](g)[0]


# -- nearest upsampling --------------------------------------------------------------------------


def _upsample_nearest(x, out_hw, scales_h, scales_w):
    rows = common.nearest_source(out_hw[0], x.shape[-2], scales_h)
    cols = common.nearest_source(out_hw[1], x.shape[-1], scales_w)
    return x[..., rows[:, None], cols[None, :]]


def _check_upsample(ctx: LoweringContext) -> Optional[str]:
    dtype = ctx.args[0].dtype
    if dtype.is_complex:
        return "complex upsampling is not lowered"
    if not (dtype.is_floating_point or dtype == torch.uint8):
        return common.raise_like_cpu(ctx)
    return None


@lowering(aten.upsample_nearest2d.default, check=_check_upsample)
def upsample_nearest2d(ctx, x, output_size, scales_h=None, scales_w=None):
    return _upsample_nearest(x, ctx.out_shape[-2:], scales_h, scales_w)


@lowering(aten.upsample_nearest2d.vec, check=_check_upsample)
def upsample_nearest2d_vec(ctx, x, output_size, scale_factors):
    # torch passes the scale factors on only when they, not a size, were given
    scales = scale_factors if scale_factors is not None and output_size is None else (None, None)
    return _upsample_nearest(x, ctx.out_shape[-2:], *scales)


@lowering(aten.upsample_nearest2d_backward.default, check=_check_upsample)
def upsample_nearest2d_backward(ctx, grad_output, output_size, input_size, scales_h=None,
                                scales_w=None):
    g = common.acc(grad_output)
    zeros = jnp.zeros(tuple(input_size), g.dtype)
    return jax.vjp(lambda x: _upsample_nearest(x, output_size, scales_h, scales_w), zeros)[1](g)[0]


# -- pointwise losses ----------------------------------------------------------------------------

def _check_loss(ctx: LoweringContext) -> Optional[str]:
    return common.check_dtypes(ctx, ctx.tensor_args(), floating=True)


def _norm(x, reduction):
    """The factor torch's loss backward kernels scale by: 1/numel for mean."""
    return 1.0 / x.size if reduction == _MEAN else 1.0


@lowering(aten.mse_loss.default, check=_check_loss)
def mse_loss(ctx, x, target, reduction=_MEAN):
    d = common.acc(x) - common.acc(target)
    return _reduce(d * d, reduction)


@lowering(aten.mse_loss_backward.default, check=_check_loss)
def mse_loss_backward(ctx, grad_output, x, target, reduction):
    d = common.acc(x) - common.acc(target)
    return d * jnp.asarray(2.0 * _norm(x, reduction), d.dtype) * common.acc(grad_output)


@lowering(aten.smooth_l1_loss.default, check=_check_loss)
def smooth_l1_loss(ctx, x, target, reduction=_MEAN, beta=1.0):
    z = jnp.abs(common.acc(x) - common.acc(target))
    if beta == 0:
        return _reduce(z, reduction)
    loss = jnp.where(z < beta, 0.5 * z * z / beta, z - 0.5 * beta)
    return _reduce(loss, reduction)


@lowering(aten.smooth_l1_loss_backward.default, check=_check_loss)
def smooth_l1_loss_backward(ctx, grad_output, x, target, reduction, beta):
    d = common.acc(x) - common.acc(target)
    g = common.acc(grad_output) * jnp.asarray(_norm(x, reduction), d.dtype)
    inner = d * g / beta if beta else jnp.zeros_like(d)
    return jnp.where(d <= -beta, -g, jnp.where(d >= beta, g, inner))


@lowering(aten.huber_loss.default, check=_check_loss)
def huber_loss(ctx, x, target, reduction=_MEAN, delta=1.0):
    z = jnp.abs(common.acc(x) - common.acc(target))
    loss = jnp.where(z < delta, 0.5 * z * z, delta * (z - 0.5 * delta))
    return _reduce(loss, reduction)


@lowering(aten.huber_loss_backward.default, check=_check_loss)
def huber_loss_backward(ctx, grad_output, x, target, reduction, delta):
    d = common.acc(x) - common.acc(target)
    g = common.acc(grad_output) * jnp.asarray(_norm(x, reduction), d.dtype)
    return jnp.where(d <= -delta, -g * delta, jnp.where(d >= delta, g * delta, d * g))


@lowering(aten.binary_cross_entropy.default, check=_check_loss)
def binary_cross_entropy(ctx, x, target, weight=None, reduction=_MEAN):
    # log terms clamped at -100 as torch does, so that 0 * log(0) stays finite
    x, t = common.acc(x), common.acc(target)
    loss = (t - 1) * jnp.maximum(jnp.log1p(-x), -100.0) - t * jnp.maximum(jnp.log(x), -100.0)
    if weight is not None:
        loss = loss * common.acc(weight)
    return _reduce(loss, reduction)


@lowering(aten.binary_cross_entropy_backward.default, check=_check_loss)
def binary_cross_entropy_backward(ctx, grad_output, x, target, weight=None, reduction=_MEAN):
    x, t = common.acc(x), common.acc(target)
    grad = common.acc(grad_output) * (x - t) / jnp.maximum((1 - x) * x, 1e-12)
    if weight is not None:
        grad = grad * common.acc(weight)
    return grad / x.size if reduction == _MEAN else grad


@lowering(aten.binary_cross_entropy_with_logits.default, check=_check_loss)
def binary_cross_entropy_with_logits(ctx, x, target, weight=None, pos_weight=None, reduction=_MEAN):
    x, t = common.acc(x), common.acc(target)
    log_sigmoid = jnp.minimum(x, 0) - jnp.log1p(xla_fixes.exp(-jnp.abs(x)))
    if pos_weight is not None:
        log_sigmoid = log_sigmoid * ((common.acc(pos_weight) - 1) * t + 1)
    loss = (1 - t) * x - log_sigmoid
    if weight is not None:
        loss = loss * common.acc(weight)
    return _reduce(loss, reduction)


# -- chunked linear_cross_entropy ----------------------------------------------------------------
#
# F.linear_cross_entropy(..., options=LinearCrossEntropyOptions(...)) calls one of two custom ops
# (torch/nn/modules/linear_cross_entropy.py) that walk the batch in chunks of batch_chunk_size
# rows so that only a (chunk, classes) block of logits exists at a time:
# - _linear_cross_entropy_batch_chunked (reduction mean or sum) returns the loss and, for the
#   operands its compute_*_grad flags name, the gradients of the loss (its autograd backward only
#   multiplies them by the incoming gradient);
# - _linear_cross_entropy_batch_chunked_no_reduction returns the per-row losses (its backward
#   re-runs torch's chunked Python loop, which records as ordinary aten ops).
# Each row n has the signed weight c_n: -w[t_n] / sum(w[t]) for mean, -w[t_n] for sum, +w[t_n] for
# the per-row losses, and 0 where t_n == ignore_index.  A chunk computes the shifted logits
# s = x W^T + b - max, adds c.s[t] and subtracts c.log(sum exp s) from the loss, and with
# P = exp(s) * (c / sum exp s) (the softmax scaled by c) accumulates the gradients
# b: -sum_n P + c scattered to t; input: c W[t] - P W; W: -P^T x + (x c) scattered to rows t.
# The loop here is a lax.scan over the full chunks plus the partial last one, with torch's
# per-chunk operation order, so memory stays bounded the same way and the cross-chunk sums add up
# in torch's order.  Only the single-dtype float32/float64 path is lowered: fp16/bf16 inputs (a
# float32 accumulator, with policy-dependent roundings) and calls torch rejects run eagerly.

try:
    import torch.nn.modules.linear_cross_entropy  # noqa: F401  (registers the torch_nn ops)
    _LCE_OPS = (torch.ops.torch_nn._linear_cross_entropy_batch_chunked.default,
                torch.ops.torch_nn._linear_cross_entropy_batch_chunked_no_reduction.default)
except (ImportError, AttributeError):   # a torch without the chunked ops
    _LCE_OPS = ()


def _check_lce(ctx: LoweringContext) -> Optional[str]:
    names = [a.name for a in ctx.op._schema.arguments]
    call = dict(zip(names, ctx.args), **ctx.kwargs)
    x, w, target = call["input"], call["linear_weight"], call["target"]
    bias, weight = call.get("linear_bias"), call.get("weight")
    reduced = ctx.op is _LCE_OPS[0]
    reduction = call["reduction"] if reduced else "none"
    label_smoothing = call["label_smoothing"] if reduced else 0.0
    chunk, policy, acc_dtype = call["batch_chunk_size"], call["acc_policy"], call["acc_dtype"]
    # (torch raises for most of the calls declined here: run eagerly, the op says how)
    if x.dtype not in (torch.float32, torch.float64) or w.dtype != x.dtype or acc_dtype != x.dtype:
        return "only the single-dtype float32/float64 chunked path is lowered"
    if len(x.shape) != 2 or len(w.shape) != 2 or target.shape != x.shape[:1] or w.shape[1] != x.shape[1]:
        return "unexpected operand shapes"
    if target.dtype != torch.int64 or w.shape[0] == 0 or not isinstance(chunk, int) or chunk <= 0:
        return "an invalid call"
    if reduction not in ("mean", "sum", "none") or (reduced and reduction == "none"):
        return "an invalid reduction"
    if label_smoothing > 0.0 or policy not in ("accurate", "balanced", "compact"):
        return "an invalid call"
    for t in (bias, weight):
        if t is not None and (not t.dtype.is_floating_point or t.shape != w.shape[:1]):
            return "an unexpected bias or class weight"
    return None


def _lce_chunked(ctx, x, w, target, bias, weight, reduction: str, ignore_index: int, chunk: int,
                 compact: bool, want_gi: bool, want_gw: bool, want_gb: bool):
    """(loss, grad_input, grad_linear_weight, grad_linear_bias) as torch's chunked loop computes
    them; the loss is per row for reduction "none" (and no gradients are computed then)."""
    dt = x.dtype
    n_rows, classes = x.shape[0], w.shape[0]
    ignored = target == ignore_index
    safe = jnp.where(ignored, 0, target) if not 0 <= ignore_index < classes else target
    # an out-of-range target: torch's first use of it raises (index_select of the class weights,
    # else the gather of the target logits)
    if weight is None:
        c = (~ignored).astype(dt)
        error = RuntimeError
        message = f"{ctx.op}: index {{value}} is out of bounds for dimension 1 with size {classes}"
    else:
        c = jnp.where(ignored, jnp.zeros((), dt), weight.astype(dt)[jnp.clip(safe, 0, classes - 1)])
        error, message = IndexError, f"{ctx.op}: index out of range in self"
    runtime_check((safe < 0) | (safe >= classes), error, message, safe)
    if reduction == "mean":
        d = c.sum()
        c = c / jnp.where(d == 0, jnp.asarray(jnp.nan, dt), -d)
    elif reduction == "sum":
        c = -c
    per_row = reduction == "none"
    bias_ = None if bias is None else bias.astype(dt)
    w_t = w.T

    def step(carry, rows):
        loss, gw, gb = carry
        xc, tc, cc = rows
        logits = jnp.matmul(xc, w_t, precision=_HIGHEST)
        if bias_ is not None:
            logits = logits + bias_
        s = logits - logits.max(axis=1, keepdims=True)
        picked = jnp.take_along_axis(s, tc[:, None], axis=1)[:, 0]
        e = xla_fixes.exp(s)
        denom = e.sum(axis=1)
        if per_row:
            return carry, (jnp.log(denom) - picked) * cc
        loss = loss + jnp.dot(cc, picked, precision=_HIGHEST)
        p = e * (cc / denom)[:, None]
        loss = loss - jnp.dot(cc, jnp.log(denom), precision=_HIGHEST)
        if want_gb:
            gb = (gb - p.sum(axis=0)).at[tc].add(cc)
        gi = None
        if want_gi:
            gi = w[tc] * cc[:, None] - jnp.matmul(p, w, precision=_HIGHEST)
        if want_gw:
            bulk = jnp.matmul(p.T, xc, precision=_HIGHEST)
            if compact:
                gw = (gw - bulk).at[tc].add(xc * cc[:, None])
            else:
                gw = gw - bulk.at[tc].add(-(xc * cc[:, None]))
        return (loss, gw, gb), gi

    carry = (jnp.zeros((), dt), jnp.zeros(w.shape if want_gw else (0, 0), dt),
             jnp.zeros(w.shape[:1] if want_gb else (0,), dt))
    full = n_rows // chunk
    pieces = []
    if full:
        span = full * chunk
        rows = (x[:span].reshape(full, chunk, -1), safe[:span].reshape(full, chunk),
                c[:span].reshape(full, chunk))
        carry, ys = lax.scan(step, carry, rows)
        if ys is not None:
            pieces.append(ys.reshape((span,) + ys.shape[2:]))
    if n_rows % chunk:
        start = full * chunk
        carry, y = step(carry, (x[start:], safe[start:], c[start:]))
        if y is not None:
            pieces.append(y)
    loss, gw, gb = carry
    if per_row:
        return jnp.concatenate(pieces) if pieces else jnp.zeros((0,), dt)
    if reduction == "mean" and n_rows == 0:
        loss = jnp.asarray(jnp.nan, dt)
    if want_gi:
        gi = jnp.concatenate(pieces) if pieces else jnp.zeros(x.shape, dt)
    else:
        gi = jnp.zeros((0, 0), dt)
    return loss, gi, gw, gb


if _LCE_OPS:
    @lowering(_LCE_OPS[0], check=_check_lce)
    def linear_cross_entropy_batch_chunked(ctx, x, w, target, bias, weight, reduction, ignore_index,
                                           label_smoothing, batch_chunk_size, acc_policy, acc_dtype,
                                           allow_retain_graph, compute_input_grad,
                                           compute_linear_weight_grad, compute_linear_bias_grad):
        return _lce_chunked(ctx, x, w, target, bias, weight, reduction, ignore_index,
                            batch_chunk_size, acc_policy == "compact", compute_input_grad,
                            compute_linear_weight_grad, compute_linear_bias_grad)

    @lowering(_LCE_OPS[1], check=_check_lce)
    def linear_cross_entropy_batch_chunked_no_reduction(ctx, x, w, target, bias, weight, ignore_index,
                                                        batch_chunk_size, acc_policy, acc_dtype):
        return _lce_chunked(ctx, x, w, target, bias, weight, "none", ignore_index, batch_chunk_size,
                            False, False, False, False)


@lowering(aten.native_dropout_backward.default)
def native_dropout_backward(ctx, grad, mask, scale):
    # torch's kernel: grad * mask * scale (the mask promoted to grad's dtype, then the scale)
    return grad * mask.astype(grad.dtype) * jnp.asarray(scale, grad.dtype)
