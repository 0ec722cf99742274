"""Normalization lowerings: softmax and log_softmax (and their backwards), layer norm and batch
norm (forward, eval, training and backward).  Reductions, axes and dtype checks they share with
reduction.py are in common.py.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import common
from . import xla_fixes
from .registry import LoweringContext, lowering
from .._lazy import lazy_import

jax = lazy_import("jax", globals(), "jax")
jnp = lazy_import("jax.numpy", globals(), "jnp")
lax = lazy_import("jax.lax", globals(), "lax")

aten = torch.ops.aten


# -- softmax -------------------------------------------------------------------------------------
# Written out rather than through jax.nn so that edge cases follow torch's formula: a row that is
# all -inf, or holds +inf or nan, becomes nan.

def _check_softmax(ctx: LoweringContext) -> Optional[str]:
    x = ctx.args[0]
    if common.arg(ctx, "half_to_float") and x.device.type == "cpu":
        return common.raise_like_cpu(ctx)   # CPU does not support it; the meta kernel does
    if not x.dtype.is_floating_point and x.device.type == "cpu":
        return common.raise_like_cpu(ctx)   # softmax of integers: the meta kernel allows it
    return common.real_only(ctx)


def _shifted(x, dim):
    axes = common.axes(x.ndim, dim)
    x = x.astype(common.acc_dtype(x.dtype))
    return x - common.max_with_identity(x, axes, keepdims=True), axes


@lowering(aten._softmax.default, check=_check_softmax)
def softmax(ctx, x, dim, half_to_float):
    shifted, axes = _shifted(x, dim)
    e = xla_fixes.exp(shifted)
    return e / jnp.sum(e, axis=axes, keepdims=True)


@lowering(aten._log_softmax.default, check=_check_softmax)
def log_softmax(ctx, x, dim, half_to_float):
    shifted, axes = _shifted(x, dim)
    return shifted - jnp.log(jnp.sum(xla_fixes.exp(shifted), axis=axes, keepdims=True))


def _check_softmax_backward(ctx: LoweringContext) -> Optional[str]:
    grad, input_dtype = ctx.args[0], common.arg(ctx, "input_dtype")
    if grad.dtype != input_dtype or ctx.args[1].dtype != grad.dtype:
        # CPU raises for most mixed dtypes, and where it does not, its result dtype differs from
        # the meta kernel's, which the recorded metadata follows.
        return common.raise_like_cpu(ctx)
    return common.real_only(ctx)


@lowering(aten._softmax_backward_data.default, check=_check_softmax_backward)
def softmax_backward(ctx, grad, output, dim, input_dtype):
    acc = common.acc_dtype(grad.dtype)
    grad, output = grad.astype(acc), output.astype(acc)
    axes = common.axes(grad.ndim, dim)
    return output * (grad - jnp.sum(grad * output, axis=axes, keepdims=True))


@lowering(aten._log_softmax_backward_data.default, check=_check_softmax_backward)
def log_softmax_backward(ctx, grad, output, dim, input_dtype):
    acc = common.acc_dtype(grad.dtype)
    grad, output = grad.astype(acc), output.astype(acc)
    axes = common.axes(grad.ndim, dim)
    return grad - xla_fixes.exp(output) * jnp.sum(grad, axis=axes, keepdims=True)


# -- layer norm ----------------------------------------------------------------------------------

def _affine(out, weight, bias, shape_of_param):
    if weight is not None:
        out = out * weight.astype(out.dtype).reshape(shape_of_param)
    if bias is not None:
        out = out + bias.astype(out.dtype).reshape(shape_of_param)
    return out


@lowering(aten.native_layer_norm.default, check=common.real_only)
def native_layer_norm(ctx, x, normalized_shape, weight, bias, eps):
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    x = x.astype(common.acc_dtype(x.dtype))
    n = common.count(x.shape, axes)
    # torch gives mean 0 (and rstd nan) when normalized_shape is empty of elements
    mean_ = jnp.sum(x, axis=axes, keepdims=True) / jnp.asarray(max(n, 1), x.dtype)
    centred = x - mean_
    variance = jnp.sum(centred * centred, axis=axes, keepdims=True) / jnp.asarray(n, x.dtype)
    rstd = lax.rsqrt(variance + jnp.asarray(eps, x.dtype))
    out = _affine(centred * rstd, weight, bias, tuple(normalized_shape))
    return out, mean_, rstd


def _check_all_outputs(ctx: LoweringContext) -> Optional[str]:
    # A masked-out gradient is None in torch's result; the recorder keeps tensor outputs only,
    # so partial masks go to the decomposition, which returns the Nones itself.
    if not all(common.arg(ctx, "output_mask")) or common.arg(ctx, "weight") is None:
        return "only the full output_mask with a weight is lowered"
    return common.real_only(ctx)


@lowering(aten.native_layer_norm_backward.default, check=_check_all_outputs)
def native_layer_norm_backward(ctx, grad_out, x, normalized_shape, mean_, rstd, weight, bias,
                               output_mask):
    acc = common.acc_dtype(x.dtype)
    inner = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    outer = tuple(range(x.ndim - len(normalized_shape)))
    grad_out, x = grad_out.astype(acc), x.astype(acc)
    mean_, rstd = mean_.astype(acc), rstd.astype(acc)
    x_hat = (x - mean_) * rstd
    g = grad_out * weight.astype(acc)
    n = jnp.asarray(common.count(x.shape, inner), acc)
    grad_input = rstd * (g - jnp.sum(g, axis=inner, keepdims=True) / n
                         - x_hat * (jnp.sum(g * x_hat, axis=inner, keepdims=True) / n))
    grad_weight = jnp.sum(grad_out * x_hat, axis=outer)
    grad_bias = jnp.sum(grad_out, axis=outer)
    return grad_input, grad_weight, grad_bias


# -- batch norm ----------------------------------------------------------------------------------
# Input is (N, C, *spatial); statistics are per channel, over every other dim.  On CPU, torch
# returns save_mean/save_invstd of shape (0,) in eval mode while the meta kernels say (C,); the
# recorded metadata follows meta, so these rules return the running mean and inverse std there,
# as torch's CUDA kernels do.

def _channel_shape(x) -> tuple[int, ...]:
    return (1, x.shape[1]) + (1,) * (x.ndim - 2)


def _batch_axes(x) -> tuple[int, ...]:
    return (0,) + tuple(range(2, x.ndim))


def _batch_norm_apply(x, mean_, invstd, weight, bias):
    """x * alpha + beta per channel, the form torch's CPU kernel uses (it rounds differently
    from (x - mean) * invstd in half precision)."""
    acc = mean_.dtype
    alpha = invstd if weight is None else invstd * weight.astype(acc)
    beta = -mean_ * alpha
    if bias is not None:
        beta = beta + bias.astype(acc)
    shape = _channel_shape(x)
    return x.astype(acc) * alpha.reshape(shape) + beta.reshape(shape)


def _batch_norm_eval(x, weight, bias, running_mean, running_var, eps):
    """(output, save_mean, save_invstd): in eval mode torch's CPU kernel saves no statistics."""
    acc = common.acc_dtype(x.dtype)
    mean_ = running_mean.astype(acc)
    invstd = 1 / jnp.sqrt(running_var.astype(acc) + jnp.asarray(eps, acc))
    nothing = jnp.zeros((0,), acc)
    return _batch_norm_apply(x, mean_, invstd, weight, bias), nothing, nothing


def _batch_norm_train(x, weight, bias, eps, running=()):
    """(output, save_mean, save_invstd, unbiased variance) from the batch statistics."""
    acc = common.acc_dtype(x.dtype)
    axes = _batch_axes(x)
    xa = x.astype(acc)
    n = common.count(x.shape, axes)
    mean_ = jnp.sum(xa, axis=axes) / jnp.asarray(n, acc)
    centred = xa - mean_.reshape(_channel_shape(x))
    squares = jnp.sum(centred * centred, axis=axes)
    invstd = lax.rsqrt(squares / jnp.asarray(n, acc) + jnp.asarray(eps, acc))
    unbiased = squares / jnp.asarray(n - 1, acc)
    if acc != x.dtype and all(p is None or p.dtype == x.dtype for p in (weight, bias, *running)):
        # Unless a parameter is float32, torch's CPU kernel keeps the statistics in the input's
        # half type and normalizes with those rounded values.
        mean_, invstd = (v.astype(x.dtype).astype(acc) for v in (mean_, invstd))
    return _batch_norm_apply(x, mean_, invstd, weight, bias), mean_, invstd, unbiased


def _check_batch_norm(ctx: LoweringContext) -> Optional[str]:
    training = common.arg(ctx, "training")
    has_stats = common.arg(ctx, "running_mean") is not None or common.arg(ctx, "running_var") is not None
    if ctx.args[0].numel == 0 or len(ctx.args[0].shape) < 2:
        return "empty or 1-d batch norm input"
    if training and has_stats:
        # The running statistics are updated in place although the schema does not say so;
        # the decomposition writes them with copy_, which the recorder tracks.
        return "training with running statistics mutates them"
    if not training and (common.arg(ctx, "running_mean") is None or common.arg(ctx, "running_var") is None):
        return "eval mode without running statistics"
    return common.real_only(ctx)


@lowering(aten.native_batch_norm.default, check=_check_batch_norm)
def native_batch_norm(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps):
    if training:
        return _batch_norm_train(x, weight, bias, eps)[:3]
    return _batch_norm_eval(x, weight, bias, running_mean, running_var, eps)


def _check_batch_norm_input(ctx: LoweringContext) -> Optional[str]:
    if ctx.args[0].numel == 0 or len(ctx.args[0].shape) < 2:
        return "empty or 1-d batch norm input"
    return common.real_only(ctx)


@lowering(aten._native_batch_norm_legit_no_training.default, check=_check_batch_norm_input)
def native_batch_norm_no_training(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
    return _batch_norm_eval(x, weight, bias, running_mean, running_var, eps)


def _check_training_only(ctx: LoweringContext) -> Optional[str]:
    if not common.arg(ctx, "training"):
        return "eval mode is left to the decomposition"
    return _check_batch_norm_input(ctx)


@lowering(aten._native_batch_norm_legit.no_stats, check=_check_training_only)
def native_batch_norm_no_stats(ctx, x, weight, bias, training, momentum, eps):
    return _batch_norm_train(x, weight, bias, eps)[:3]


@lowering(aten._native_batch_norm_legit_functional.default, check=_check_training_only)
def native_batch_norm_functional(ctx, x, weight, bias, running_mean, running_var, training,
                                 momentum, eps):
    out, mean_, invstd, unbiased = _batch_norm_train(x, weight, bias, eps, (running_mean, running_var))
    acc = mean_.dtype
    keep = jnp.asarray(1 - momentum, acc)
    new_mean = momentum * mean_ + keep * running_mean.astype(acc)
    new_var = momentum * unbiased + keep * running_var.astype(acc)
    return out, mean_, invstd, new_mean, new_var


def _check_batch_norm_backward(ctx: LoweringContext) -> Optional[str]:
    if not all(common.arg(ctx, "output_mask")) or common.arg(ctx, "weight") is None:
        return "only the full output_mask with a weight is lowered"
    train = common.arg(ctx, "train")
    needed = ("save_mean", "save_invstd") if train else ("running_mean", "running_var")
    if any(common.arg(ctx, name) is None for name in needed):
        return "statistics missing"
    return _check_batch_norm_input(ctx)


@lowering(aten.native_batch_norm_backward.default, check=_check_batch_norm_backward)
def native_batch_norm_backward(ctx, grad_out, x, weight, running_mean, running_var, save_mean,
                               save_invstd, train, eps, output_mask):
    acc = common.acc_dtype(x.dtype)
    axes, shape = _batch_axes(x), _channel_shape(x)
    grad_out, x = grad_out.astype(acc), x.astype(acc)
    if train:
        mean_, invstd = save_mean.astype(acc), save_invstd.astype(acc)
    else:
        mean_ = running_mean.astype(acc)
        invstd = 1 / jnp.sqrt(running_var.astype(acc) + jnp.asarray(eps, acc))
    mean_, invstd = mean_.reshape(shape), invstd.reshape(shape)
    x_hat = (x - mean_) * invstd
    grad_bias = jnp.sum(grad_out, axis=axes)
    grad_weight = jnp.sum(grad_out * x_hat, axis=axes)
    scale = invstd * weight.astype(acc).reshape(shape)
    if train:
        n = jnp.asarray(common.count(x.shape, axes), acc)
        grad_input = scale * (grad_out - grad_bias.reshape(shape) / n
                              - x_hat * (grad_weight.reshape(shape) / n))
    else:
        grad_input = grad_out * scale
    return grad_input, grad_weight, grad_bias
