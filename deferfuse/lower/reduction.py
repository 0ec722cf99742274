"""Reduction and normalization lowerings: sum/mean/prod, max/min and their indices, var/std,
any/all, logsumexp, cumulative sums and products, softmax, layer and batch norm, vector norms.

Conventions shared by the rules below:
- torch's CPU kernels accumulate float16 and bfloat16 in float32 (``_acc_dtype``); integer and
  bool sums and products accumulate in int64 because that is the output dtype torch infers, which
  ``ctx.out_dtype`` already says.  Results are cast back to torch's dtype by the caller.
- An empty ``dim`` list means "every dim" for most reductions, but "no dim" for any/all.dims, so
  ``_axes`` takes that choice as an argument.  A 0-dim tensor accepts dim 0 and -1 and reduces
  over nothing.
- Where the meta kernel accepts a call that the CPU kernel rejects (max of an empty tensor,
  var of an integer tensor, ...), the checker replays the call on CPU stand-ins so the user gets
  torch's own exception at record time (``_raise_like_cpu``); the meta-derived shapes would
  otherwise let the call through.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np
import torch

from . import dtypes as _dtypes
from . import xla_fixes
from .registry import LoweringContext, lowering, replay_on_cpu, runtime_check
from .._lazy import lazy_import

jax = lazy_import("jax", globals(), "jax")
jnp = lazy_import("jax.numpy", globals(), "jnp")
lax = lazy_import("jax.lax", globals(), "lax")

aten = torch.ops.aten

_HALF_TYPES = _dtypes.HALF_TYPES


# -- helpers -------------------------------------------------------------------------------------

def _acc_dtype(dtype) -> np.dtype:
    """The dtype torch's CPU kernels accumulate ``dtype`` in."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if dtype in _HALF_TYPES else dtype


def _axes(ndim: int, dim: Any, *, empty_means_all: bool = True) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = [dim]
    if len(dim) == 0:
        return tuple(range(ndim)) if empty_means_all else ()
    if ndim == 0:
        return ()
    return tuple(sorted({d % ndim for d in dim}))


def _count(shape: Sequence[int], axes: Sequence[int]) -> int:
    return math.prod(shape[a] for a in axes)


def _arg(ctx: LoweringContext, name: str, default: Any = None) -> Any:
    """An argument of the call by its schema name, whether passed by position or keyword."""
    for i, a in enumerate(ctx.op._schema.arguments):
        if a.name == name:
            if not a.kwarg_only and i < len(ctx.args):
                return ctx.args[i]
            return ctx.kwargs.get(name, default)
    raise KeyError(name)


def _raise_like_cpu(ctx: LoweringContext) -> str:
    """Let torch's CPU kernel raise its own exception for this call (see registry.replay_on_cpu)."""
    return replay_on_cpu(ctx)


def _tensor_dtypes(ctx: LoweringContext) -> list[torch.dtype]:
    return [t.dtype for t in ctx.tensor_args()]


def _real_only(ctx: LoweringContext) -> Optional[str]:
    if any(dt.is_complex for dt in _tensor_dtypes(ctx)) or any(o.dtype.is_complex for o in ctx.out):
        return "complex dtypes are not lowered"
    return None


def _real_or_complex_sum(ctx: LoweringContext) -> Optional[str]:
    # Sums of complex numbers are exact to lower: only additions, no complex-multiply edge cases.
    if ctx.args[0].dtype.is_complex and not ctx.out[0].dtype.is_complex:
        return "complex to real"
    return None


def _floating_only(ctx: LoweringContext) -> Optional[str]:
    """For ops whose CPU kernels reject integer and bool inputs that the meta kernels accept."""
    reason = _real_only(ctx)
    if reason is None and not ctx.args[0].dtype.is_floating_point:
        return _raise_like_cpu(ctx)
    return reason


def _max_with_identity(x, axes, keepdims):
    # An explicit identity lets zero-size reductions trace; it never wins against real data
    # (XLA's max propagates NaN).
    return jnp.max(x, axis=axes, keepdims=keepdims, initial=-jnp.inf)


# -- sum, mean, prod -----------------------------------------------------------------------------

@lowering(aten.sum.default, aten.sum.dim_IntList, check=_real_or_complex_sum)
def sum_(ctx, x, dim=None, keepdim=False, *, dtype=None):
    return jnp.sum(x.astype(_acc_dtype(ctx.out_dtype)), axis=_axes(x.ndim, dim), keepdims=keepdim)


@lowering(aten.nansum.default, check=_real_only)
def nansum(ctx, x, dim=None, keepdim=False, *, dtype=None):
    x = x.astype(_acc_dtype(ctx.out_dtype))
    if jnp.issubdtype(x.dtype, jnp.floating):
        x = jnp.where(jnp.isnan(x), jnp.zeros((), x.dtype), x)
    return jnp.sum(x, axis=_axes(x.ndim, dim), keepdims=keepdim)


@lowering(aten.mean.default, aten.mean.dim, check=_real_or_complex_sum)
def mean(ctx, x, dim=None, keepdim=False, *, dtype=None):
    axes = _axes(x.ndim, dim)
    acc = _acc_dtype(ctx.out_dtype)
    # sum / n as torch does; n == 0 gives 0/0 = nan, like torch's mean of an empty tensor.
    total = jnp.sum(x.astype(acc), axis=axes, keepdims=keepdim)
    return total / jnp.asarray(_count(x.shape, axes), acc)


@lowering(aten.prod.default, aten.prod.dim_int, check=_real_only)
def prod(ctx, x, dim=None, keepdim=False, *, dtype=None):
    return jnp.prod(x.astype(_acc_dtype(ctx.out_dtype)), axis=_axes(x.ndim, dim), keepdims=keepdim)


@lowering(aten.count_nonzero.default, aten.count_nonzero.dim_IntList, check=_real_only)
def count_nonzero(ctx, x, dim=None):
    return jnp.sum(x != 0, axis=_axes(x.ndim, dim), dtype=jnp.int64)


@lowering(aten.nonzero_static.default, check=_real_only)
def nonzero_static(ctx, x, *, size, fill_value=-1):
    """The indices of the first ``size`` nonzero elements in row-major order, one row each,
    padded with rows of ``fill_value`` (a 0-dim input gives rows of no columns)."""
    if x.ndim == 0:
        return jnp.zeros((size, 0), jnp.int64)
    where = jnp.nonzero(x != 0, size=size, fill_value=fill_value)
    return jnp.stack(where, axis=1).astype(jnp.int64)


# -- max, min and their indices ------------------------------------------------------------------
# XLA's max/min propagate NaN and its argmax/argmin pick the first NaN, else the first extreme
# value, which is what torch's CPU kernels do.

@lowering(aten.amax.default, check=_real_only)
def amax(ctx, x, dim=(), keepdim=False):
    return jnp.max(x, axis=_axes(x.ndim, dim), keepdims=keepdim)


@lowering(aten.amin.default, check=_real_only)
def amin(ctx, x, dim=(), keepdim=False):
    return jnp.min(x, axis=_axes(x.ndim, dim), keepdims=keepdim)


def _check_full_reduction(ctx: LoweringContext) -> Optional[str]:
    # The meta kernel returns a 0-dim tensor for an empty input; the CPU kernel raises.
    if ctx.args[0].numel == 0:
        return _raise_like_cpu(ctx)
    return _real_only(ctx)


@lowering(aten.max.default, check=_check_full_reduction)
def max_(ctx, x):
    return jnp.max(x)


@lowering(aten.min.default, check=_check_full_reduction)
def min_(ctx, x):
    return jnp.min(x)


def _check_reduced_dim_nonempty(ctx: LoweringContext) -> Optional[str]:
    # CPU raises IndexError when the reduced dim has size 0; the meta kernel does not.
    x, dim = ctx.args[0], _arg(ctx, "dim")
    if x.shape and x.shape[dim % len(x.shape)] == 0:
        return _raise_like_cpu(ctx)
    return _real_only(ctx)


def _check_aminmax(ctx: LoweringContext) -> Optional[str]:
    if _arg(ctx, "dim") is None:
        return _check_full_reduction(ctx)
    return _check_reduced_dim_nonempty(ctx)


@lowering(aten.aminmax.default, check=_check_aminmax)
def aminmax(ctx, x, *, dim=None, keepdim=False):
    axes = _axes(x.ndim, dim)
    return jnp.min(x, axis=axes, keepdims=keepdim), jnp.max(x, axis=axes, keepdims=keepdim)


def _extreme_with_index(x, dim: int, keepdim: bool, find_max: bool):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    axis = dim % x.ndim
    arg = jnp.argmax if find_max else jnp.argmin
    index = arg(x, axis=axis, keepdims=True)
    values = jnp.take_along_axis(x, index, axis=axis)
    if not keepdim:
        index, values = jnp.squeeze(index, axis), jnp.squeeze(values, axis)
    return values, index


@lowering(aten.max.dim, check=_check_reduced_dim_nonempty)
def max_dim(ctx, x, dim, keepdim=False):
    return _extreme_with_index(x, dim, keepdim, find_max=True)


@lowering(aten.min.dim, check=_check_reduced_dim_nonempty)
def min_dim(ctx, x, dim, keepdim=False):
    return _extreme_with_index(x, dim, keepdim, find_max=False)


def _check_arg_extreme(ctx: LoweringContext) -> Optional[str]:
    if ctx.args[0].dtype == torch.bool:
        return _raise_like_cpu(ctx)          # CPU: "does not support bool input"
    if _arg(ctx, "dim") is not None:
        return _check_reduced_dim_nonempty(ctx)
    return _real_only(ctx)


def _arg_extreme(ctx, x, dim, keepdim, find_max: bool):
    arg = jnp.argmax if find_max else jnp.argmin
    if dim is None or x.ndim == 0:
        # over the flattened tensor; keepdim keeps every dim as size 1 (ctx.out_shape says so)
        return arg(x.reshape(-1)).reshape(ctx.out_shape)
    return arg(x, axis=dim % x.ndim, keepdims=keepdim)


@lowering(aten.argmax.default, check=_check_arg_extreme)
def argmax(ctx, x, dim=None, keepdim=False):
    return _arg_extreme(ctx, x, dim, keepdim, find_max=True)


@lowering(aten.argmin.default, check=_check_arg_extreme)
def argmin(ctx, x, dim=None, keepdim=False):
    return _arg_extreme(ctx, x, dim, keepdim, find_max=False)


# -- var, std ------------------------------------------------------------------------------------

def _var_mean(x, dim, correction, keepdim):
    """(variance, mean) in the accumulation dtype.  ``correction`` is an int, None (meaning 1),
    or a runtime float; the divisor is max(n - correction, 0) as in torch, so n <= correction
    gives inf or nan."""
    axes = _axes(x.ndim, dim)
    x = x.astype(_acc_dtype(x.dtype))
    n = _count(x.shape, axes)
    mean_kept = jnp.sum(x, axis=axes, keepdims=True) / jnp.asarray(n, x.dtype)
    centred = x - mean_kept
    squares = jnp.sum(centred * centred, axis=axes, keepdims=True)
    correction = 1 if correction is None else correction
    divisor = jnp.maximum(jnp.asarray(n - correction, x.dtype), 0)
    variance, mean_kept = squares / divisor, _welford_mean(x, mean_kept, axes)
    if not keepdim:
        variance, mean_kept = jnp.squeeze(variance, axes), jnp.squeeze(mean_kept, axes)
    return variance, mean_kept


def _welford_mean(x, mean_kept, axes):
    """The mean that var_mean returns.  torch computes it with Welford's update
    m += (x - m) / k, where an infinite element turns every later update into inf - inf = nan:
    the mean is infinite only when the single infinite element is the last one reduced."""
    if not axes or _count(x.shape, axes) == 0:
        return mean_kept
    infinite = jnp.sum(jnp.isinf(x), axis=axes, keepdims=True)
    last = x[tuple(slice(-1, None) if d in axes else slice(None) for d in range(x.ndim))]
    keep = (infinite == 0) | ((infinite == 1) & jnp.isinf(last))
    return jnp.where(keep, mean_kept, jnp.asarray(jnp.nan, x.dtype))


@lowering(aten.var.correction, check=_floating_only)
def var(ctx, x, dim=None, *, correction=None, keepdim=False):
    return _var_mean(x, dim, correction, keepdim)[0]


@lowering(aten.std.correction, check=_floating_only)
def std(ctx, x, dim=None, *, correction=None, keepdim=False):
    return jnp.sqrt(_var_mean(x, dim, correction, keepdim)[0])


@lowering(aten.var_mean.correction, check=_floating_only)
def var_mean(ctx, x, dim=None, *, correction=None, keepdim=False):
    return _var_mean(x, dim, correction, keepdim)


@lowering(aten.std_mean.correction, check=_floating_only)
def std_mean(ctx, x, dim=None, *, correction=None, keepdim=False):
    variance, mean_ = _var_mean(x, dim, correction, keepdim)
    return jnp.sqrt(variance), mean_


# -- any, all ------------------------------------------------------------------------------------
# The result is bool (uint8 for uint8 inputs: the caller's cast of a bool gives 0/1).  NaN is
# nonzero, hence true, as in torch.

@lowering(aten.any.default, aten.any.dim, aten.any.dims, check=_real_only)
def any_(ctx, x, dim=None, keepdim=False):
    return jnp.any(x != 0, axis=_axes(x.ndim, dim, empty_means_all=False), keepdims=keepdim)


@lowering(aten.all.default, aten.all.dim, aten.all.dims, check=_real_only)
def all_(ctx, x, dim=None, keepdim=False):
    return jnp.all(x != 0, axis=_axes(x.ndim, dim, empty_means_all=False), keepdims=keepdim)


# -- logsumexp -----------------------------------------------------------------------------------

def _check_logsumexp(ctx: LoweringContext) -> Optional[str]:
    if len(_arg(ctx, "dim")) == 0:
        return _raise_like_cpu(ctx)   # CPU rejects dim=[]; the meta kernel returns a shape
    return _real_only(ctx)


@lowering(aten.logsumexp.default, check=_check_logsumexp)
def logsumexp(ctx, x, dim, keepdim=False):
    axes = _axes(x.ndim, dim)
    x = x.astype(_acc_dtype(ctx.out_dtype))
    # torch shifts by the max, with infinite maxima replaced by 0 so that all -inf rows give
    # -inf (not nan) and a +inf anywhere gives +inf.
    shift = _max_with_identity(x, axes, keepdims=True)
    shift = jnp.where(jnp.isinf(shift), jnp.zeros((), x.dtype), shift)
    total = jnp.sum(xla_fixes.exp(x - shift), axis=axes, keepdims=True)
    out = jnp.log(total) + shift
    return out if keepdim else jnp.squeeze(out, axes)


# -- cumulative ----------------------------------------------------------------------------------

def _cumulative(ctx, x, dim, op):
    x = x.astype(_acc_dtype(ctx.out_dtype))
    if x.ndim == 0:
        return x
    return op(x, axis=dim % x.ndim)


@lowering(aten.cumsum.default, check=_real_or_complex_sum)
def cumsum(ctx, x, dim, *, dtype=None):
    return _cumulative(ctx, x, dim, jnp.cumsum)


@lowering(aten.cumprod.default, check=_real_only)
def cumprod(ctx, x, dim, *, dtype=None):
    return _cumulative(ctx, x, dim, jnp.cumprod)


# -- softmax -------------------------------------------------------------------------------------
# Written out rather than through jax.nn so that edge cases follow torch's formula: a row that is
# all -inf, or holds +inf or nan, becomes nan.

def _check_softmax(ctx: LoweringContext) -> Optional[str]:
    x = ctx.args[0]
    if _arg(ctx, "half_to_float") and x.device.type == "cpu":
        return _raise_like_cpu(ctx)   # CPU does not support it; the meta kernel does
    if not x.dtype.is_floating_point and x.device.type == "cpu":
        return _raise_like_cpu(ctx)   # softmax of integers: the meta kernel allows it
    return _real_only(ctx)


def _shifted(x, dim):
    axes = _axes(x.ndim, dim)
    x = x.astype(_acc_dtype(x.dtype))
    return x - _max_with_identity(x, axes, keepdims=True), axes


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
    grad, input_dtype = ctx.args[0], _arg(ctx, "input_dtype")
    if grad.dtype != input_dtype or ctx.args[1].dtype != grad.dtype:
        # CPU raises for most mixed dtypes, and where it does not, its result dtype differs from
        # the meta kernel's, which the recorded metadata follows.
        return _raise_like_cpu(ctx)
    return _real_only(ctx)


@lowering(aten._softmax_backward_data.default, check=_check_softmax_backward)
def softmax_backward(ctx, grad, output, dim, input_dtype):
    acc = _acc_dtype(grad.dtype)
    grad, output = grad.astype(acc), output.astype(acc)
    axes = _axes(grad.ndim, dim)
    return output * (grad - jnp.sum(grad * output, axis=axes, keepdims=True))


@lowering(aten._log_softmax_backward_data.default, check=_check_softmax_backward)
def log_softmax_backward(ctx, grad, output, dim, input_dtype):
    acc = _acc_dtype(grad.dtype)
    grad, output = grad.astype(acc), output.astype(acc)
    axes = _axes(grad.ndim, dim)
    return grad - xla_fixes.exp(output) * jnp.sum(grad, axis=axes, keepdims=True)


# -- layer norm ----------------------------------------------------------------------------------

def _affine(out, weight, bias, shape_of_param):
    if weight is not None:
        out = out * weight.astype(out.dtype).reshape(shape_of_param)
    if bias is not None:
        out = out + bias.astype(out.dtype).reshape(shape_of_param)
    return out


@lowering(aten.native_layer_norm.default, check=_real_only)
def native_layer_norm(ctx, x, normalized_shape, weight, bias, eps):
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    x = x.astype(_acc_dtype(x.dtype))
    n = _count(x.shape, axes)
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
    if not all(_arg(ctx, "output_mask")) or _arg(ctx, "weight") is None:
        return "only the full output_mask with a weight is lowered"
    return _real_only(ctx)


@lowering(aten.native_layer_norm_backward.default, check=_check_all_outputs)
def native_layer_norm_backward(ctx, grad_out, x, normalized_shape, mean_, rstd, weight, bias,
                               output_mask):
    acc = _acc_dtype(x.dtype)
    inner = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    outer = tuple(range(x.ndim - len(normalized_shape)))
    grad_out, x = grad_out.astype(acc), x.astype(acc)
    mean_, rstd = mean_.astype(acc), rstd.astype(acc)
    x_hat = (x - mean_) * rstd
    g = grad_out * weight.astype(acc)
    n = jnp.asarray(_count(x.shape, inner), acc)
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
    acc = _acc_dtype(x.dtype)
    mean_ = running_mean.astype(acc)
    invstd = 1 / jnp.sqrt(running_var.astype(acc) + jnp.asarray(eps, acc))
    nothing = jnp.zeros((0,), acc)
    return _batch_norm_apply(x, mean_, invstd, weight, bias), nothing, nothing


def _batch_norm_train(x, weight, bias, eps, running=()):
    """(output, save_mean, save_invstd, unbiased variance) from the batch statistics."""
    acc = _acc_dtype(x.dtype)
    axes = _batch_axes(x)
    xa = x.astype(acc)
    n = _count(x.shape, axes)
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
    training = _arg(ctx, "training")
    has_stats = _arg(ctx, "running_mean") is not None or _arg(ctx, "running_var") is not None
    if ctx.args[0].numel == 0 or len(ctx.args[0].shape) < 2:
        return "empty or 1-d batch norm input"
    if training and has_stats:
        # The running statistics are updated in place although the schema does not say so;
        # the decomposition writes them with copy_, which the recorder tracks.
        return "training with running statistics mutates them"
    if not training and (_arg(ctx, "running_mean") is None or _arg(ctx, "running_var") is None):
        return "eval mode without running statistics"
    return _real_only(ctx)


@lowering(aten.native_batch_norm.default, check=_check_batch_norm)
def native_batch_norm(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps):
    if training:
        return _batch_norm_train(x, weight, bias, eps)[:3]
    return _batch_norm_eval(x, weight, bias, running_mean, running_var, eps)


def _check_batch_norm_input(ctx: LoweringContext) -> Optional[str]:
    if ctx.args[0].numel == 0 or len(ctx.args[0].shape) < 2:
        return "empty or 1-d batch norm input"
    return _real_only(ctx)


@lowering(aten._native_batch_norm_legit_no_training.default, check=_check_batch_norm_input)
def native_batch_norm_no_training(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
    return _batch_norm_eval(x, weight, bias, running_mean, running_var, eps)


def _check_training_only(ctx: LoweringContext) -> Optional[str]:
    if not _arg(ctx, "training"):
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
    if not all(_arg(ctx, "output_mask")) or _arg(ctx, "weight") is None:
        return "only the full output_mask with a weight is lowered"
    train = _arg(ctx, "train")
    needed = ("save_mean", "save_invstd") if train else ("running_mean", "running_var")
    if any(_arg(ctx, name) is None for name in needed):
        return "statistics missing"
    return _check_batch_norm_input(ctx)


@lowering(aten.native_batch_norm_backward.default, check=_check_batch_norm_backward)
def native_batch_norm_backward(ctx, grad_out, x, weight, running_mean, running_var, save_mean,
                               save_invstd, train, eps, output_mask):
    acc = _acc_dtype(x.dtype)
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
        n = jnp.asarray(_count(x.shape, axes), acc)
        grad_input = scale * (grad_out - grad_bias.reshape(shape) / n
                              - x_hat * (grad_weight.reshape(shape) / n))
    else:
        grad_input = grad_out * scale
    return grad_input, grad_weight, grad_bias


# -- vector norms --------------------------------------------------------------------------------

def _norm_static(a, ord_, axes, keepdim):
    """||a||_ord over ``axes`` of ``a = |x|`` for an int ``ord_`` known while tracing."""
    if ord_ == 0:
        return jnp.sum((a != 0).astype(a.dtype), axis=axes, keepdims=keepdim)
    if ord_ == 1:
        return jnp.sum(a, axis=axes, keepdims=keepdim)
    if ord_ == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=axes, keepdims=keepdim))
    p = jnp.asarray(ord_, a.dtype)
    return jnp.sum(a ** p, axis=axes, keepdims=keepdim) ** (1 / p)


def _norm_runtime(a, ord_, axes, keepdim):
    """The same for a float ``ord_`` that is a runtime input: every case is compiled and the
    value picks one at run time, so a changing ord never recompiles nor takes a wrong branch."""
    ord_ = ord_.astype(a.dtype)
    branches = [
        lambda a, p: jnp.max(a, axis=axes, keepdims=keepdim, initial=0),
        lambda a, p: jnp.min(a, axis=axes, keepdims=keepdim, initial=jnp.inf),
        lambda a, p: _norm_static(a, 0, axes, keepdim),
        lambda a, p: _norm_static(a, 1, axes, keepdim),
        lambda a, p: _norm_static(a, 2, axes, keepdim),
        lambda a, p: jnp.sum(a ** p, axis=axes, keepdims=keepdim) ** (1 / p),
    ]
    index = jnp.select([ord_ == jnp.inf, ord_ == -jnp.inf, ord_ == 0, ord_ == 1, ord_ == 2],
                       [0, 1, 2, 3, 4], 5)
    return lax.switch(index, branches, a, ord_)


@lowering(aten.linalg_vector_norm.default, check=_real_only)
def linalg_vector_norm(ctx, x, ord=2, dim=None, keepdim=False, *, dtype=None):
    a = jnp.abs(x.astype(_acc_dtype(ctx.out_dtype)))
    axes = _axes(x.ndim, dim)
    if isinstance(ord, int):
        return _norm_static(a, ord, axes, keepdim)
    return _norm_runtime(a, ord, axes, keepdim)


# -- scans with indices: cummax, cummin ----------------------------------------------------------
# torch's CPU kernel walks the dim keeping (value, index) and takes the current element when it
# is NaN, or when the running value is not NaN and the element is >= (cummax) or <= (cummin) it:
# ties take the later index, and the last NaN seen wins from then on.  That is the maximum over
# the prefix under the order (is NaN, value, index), which is associative, hence a parallel scan.

def _check_scan_with_index(ctx: LoweringContext) -> Optional[str]:
    return _real_only(ctx)


def _cum_extreme(x, dim, find_max: bool):
    index_shape = x.shape
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    axis = dim % x.ndim
    if x.size == 0:
        return x, jnp.zeros(index_shape, jnp.int64)
    index = lax.broadcasted_iota(jnp.int64, x.shape, axis)
    floating = jnp.issubdtype(x.dtype, jnp.floating)

    def combine(a, b):
        (av, ai), (bv, bi) = a, b   # b covers a later segment than a
        better = bv >= av if find_max else bv <= av
        if floating:
            better = jnp.isnan(bv) | (~jnp.isnan(av) & better)
        return jnp.where(better, bv, av), jnp.where(better, bi, ai)

    return lax.associative_scan(combine, (x, index), axis=axis)


@lowering(aten.cummax.default, check=_check_scan_with_index)
def cummax(ctx, x, dim):
    return _cum_extreme(x, dim, find_max=True)


@lowering(aten.cummin.default, check=_check_scan_with_index)
def cummin(ctx, x, dim):
    return _cum_extreme(x, dim, find_max=False)


# -- logcumsumexp --------------------------------------------------------------------------------
# torch accumulates in at::acc_type (double for float32 on CPU) with log1p(exp(min - max)) + max,
# keeping x when both are the same infinity, and propagates NaN; logaddexp in float64 as a
# parallel scan gives the same values up to the last rounding.

def _check_logcumsumexp(ctx: LoweringContext) -> Optional[str]:
    return _floating_only(ctx)   # CPU: "not implemented for 'Long'"; the meta kernel accepts


def _logaddexp(a, b):
    hi, lo = jnp.maximum(a, b), jnp.minimum(a, b)
    same_inf = (hi == lo) & jnp.isinf(hi)
    out = hi + jnp.log1p(xla_fixes.exp(lo - hi))
    return jnp.where(same_inf, hi, out)     # NaN propagates through max/min and the sum


@lowering(aten.logcumsumexp.default, check=_check_logcumsumexp)
def logcumsumexp(ctx, x, dim):
    x = x.astype(jnp.float64)
    if x.ndim == 0 or x.size == 0:
        return x
    return lax.associative_scan(_logaddexp, x, axis=dim % x.ndim)


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
        return _raise_like_cpu(ctx)          # CPU: "median_cpu" not implemented for 'Bool'
    if len(ctx.args) > 1 and x.shape and x.shape[ctx.args[1] % len(x.shape)] == 0:
        return _raise_like_cpu(ctx)          # IndexError: reduction dim of size 0
    if len(ctx.args) == 1 and x.numel == 0 and not (x.dtype.is_floating_point
                                                    or x.dtype == torch.int64):
        # torch gives NaN cast to the dtype: int64's minimum; other widths are the compiler's
        return "median of an empty integer tensor narrower than int64"
    return _real_only(ctx)


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
    x, dim = ctx.args[0], _arg(ctx, "dim", -1)
    if x.shape:
        size = x.shape[dim % len(x.shape)]
        if size == 0:
            return _raise_like_cpu(ctx)      # IndexError: reduction dim of size 0
        if size > _INSERTION_SORT_MAX:
            return "mode over more than 16 elements: std::sort's unstable order picks the index"
    return _real_only(ctx)


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
    x, k, dim = ctx.args[0], ctx.args[1], _arg(ctx, "dim", -1)
    size = x.shape[dim % len(x.shape)] if x.shape else 1
    if x.dtype == torch.bool or not 1 <= k <= size:
        return _raise_like_cpu(ctx)          # "not implemented for 'Bool'", "k out of range"
    if size > _KTHVALUE_MAX:
        return "kthvalue over more than 1024 elements (the exact quickselect is quadratic)"
    return _real_only(ctx)


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
    lengths, offsets = _arg(ctx, "lengths"), _arg(ctx, "offsets")
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
    axis = _arg(ctx, "axis", 0)
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
    initial = _arg(ctx, "initial")
    if isinstance(initial, complex):
        return "segment_reduce with a complex initial value"
    if (isinstance(initial, int) and not isinstance(initial, bool) and data.dtype != torch.float64
            and abs(initial) > torch.finfo(data.dtype).max):
        names = {torch.float32: "float", torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16"}
        raise RuntimeError(f"value cannot be converted to type {names[data.dtype]} without overflow")
    return None


def _check_segment_reduce(ctx: LoweringContext) -> Optional[str]:
    data, reduce = ctx.args[0], ctx.args[1]
    if _arg(ctx, "indices") is not None:
        return "indices based segment_reduce is not supported by torch"
    reason = _check_segment_common(ctx, data, reduce, forward=True)
    if reason is not None:
        return reason
    lengths = _arg(ctx, "lengths")
    if lengths is not None and not _arg(ctx, "unsafe", False) and math.prod(lengths.shape) == 0:
        return _raise_like_cpu(ctx)       # lengths.min() of an empty tensor
    if ctx.out[0].dtype != data.dtype:
        return "segment_reduce with an unexpected output dtype"
    axis = _arg(ctx, "axis", 0) % len(data.shape)
    bounds = lengths if lengths is not None else _arg(ctx, "offsets")
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
    axis = _arg(ctx, "axis", 0) % len(data.shape)
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
