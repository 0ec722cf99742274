"""Reduction lowerings: sum/mean/prod, max/min and their indices, var/std, any/all, logsumexp,
cumulative sums, products, extremes and logcumsumexp, vector norms.  Softmax and the layer and
batch norms are in normalization.py, median/mode/kthvalue in order.py, segment_reduce in
segment.py; the helpers they share with this file are in common.py.

Conventions shared by the rules below:
- torch's CPU kernels accumulate float16 and bfloat16 in float32 (``common.acc_dtype``); integer and
  bool sums and products accumulate in int64 because that is the output dtype torch infers, which
  ``ctx.out_dtype`` already says.  Results are cast back to torch's dtype by the caller.
- An empty ``dim`` list means "every dim" for most reductions, but "no dim" for any/all.dims, so
  ``common.axes`` takes that choice as an argument.  A 0-dim tensor accepts dim 0 and -1 and reduces
  over nothing.
- Where the meta kernel accepts a call that the CPU kernel rejects (max of an empty tensor,
  var of an integer tensor, ...), the checker replays the call on CPU stand-ins so the user gets
  torch's own exception at record time (``common.raise_like_cpu``); the meta-derived shapes would
  otherwise let the call through.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import common
from . import xla_fixes
from .registry import LoweringContext, lowering
from .._lazy import lazy_import

jnp = lazy_import("jax.numpy", globals(), "jnp")
lax = lazy_import("jax.lax", globals(), "lax")

aten = torch.ops.aten


# -- helpers -------------------------------------------------------------------------------------

def _real_or_complex_sum(ctx: LoweringContext) -> Optional[str]:
    # Sums of complex numbers are exact to lower: only additions, no complex-multiply edge cases.
    if ctx.args[0].dtype.is_complex and not ctx.out[0].dtype.is_complex:
        return "complex to real"
    return None


def _floating_only(ctx: LoweringContext) -> Optional[str]:
    """For ops whose CPU kernels reject integer and bool inputs that the meta kernels accept."""
    reason = common.real_only(ctx)
    if reason is None and not ctx.args[0].dtype.is_floating_point:
        return common.raise_like_cpu(ctx)
    return reason


# -- sum, mean, prod -----------------------------------------------------------------------------

@lowering(aten.sum.default, aten.sum.dim_IntList, check=_real_or_complex_sum)
def sum_(ctx, x, dim=None, keepdim=False, *, dtype=None):
    return jnp.sum(x.astype(common.acc_dtype(ctx.out_dtype)), axis=common.axes(x.ndim, dim), keepdims=keepdim)


@lowering(aten.nansum.default, check=common.real_only)
def nansum(ctx, x, dim=None, keepdim=False, *, dtype=None):
    x = x.astype(common.acc_dtype(ctx.out_dtype))
    if jnp.issubdtype(x.dtype, jnp.floating):
        x = jnp.where(jnp.isnan(x), jnp.zeros((), x.dtype), x)
    return jnp.sum(x, axis=common.axes(x.ndim, dim), keepdims=keepdim)


@lowering(aten.mean.default, aten.mean.dim, check=_real_or_complex_sum)
def mean(ctx, x, dim=None, keepdim=False, *, dtype=None):
    axes = common.axes(x.ndim, dim)
    acc = common.acc_dtype(ctx.out_dtype)
    # sum / n as torch does; n == 0 gives 0/0 = nan, like torch's mean of an empty tensor.
    total = jnp.sum(x.astype(acc), axis=axes, keepdims=keepdim)
    return total / jnp.asarray(common.count(x.shape, axes), acc)


@lowering(aten.prod.default, aten.prod.dim_int, check=common.real_only)
def prod(ctx, x, dim=None, keepdim=False, *, dtype=None):
    return jnp.prod(x.astype(common.acc_dtype(ctx.out_dtype)), axis=common.axes(x.ndim, dim), keepdims=keepdim)


@lowering(aten.count_nonzero.default, aten.count_nonzero.dim_IntList, check=common.real_only)
def count_nonzero(ctx, x, dim=None):
    return jnp.sum(x != 0, axis=common.axes(x.ndim, dim), dtype=jnp.int64)


@lowering(aten.nonzero_static.default, check=common.real_only)
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

@lowering(aten.amax.default, check=common.real_only)
def amax(ctx, x, dim=(), keepdim=False):
    return jnp.max(x, axis=common.axes(x.ndim, dim), keepdims=keepdim)


@lowering(aten.amin.default, check=common.real_only)
def amin(ctx, x, dim=(), keepdim=False):
    return jnp.min(x, axis=common.axes(x.ndim, dim), keepdims=keepdim)


def _check_full_reduction(ctx: LoweringContext) -> Optional[str]:
    # The meta kernel returns a 0-dim tensor for an empty input; the CPU kernel raises.
    if ctx.args[0].numel == 0:
        return common.raise_like_cpu(ctx)
    return common.real_only(ctx)


@lowering(aten.max.default, check=_check_full_reduction)
def max_(ctx, x):
    return jnp.max(x)


@lowering(aten.min.default, check=_check_full_reduction)
def min_(ctx, x):
    return jnp.min(x)


def _check_reduced_dim_nonempty(ctx: LoweringContext) -> Optional[str]:
    # CPU raises IndexError when the reduced dim has size 0; the meta kernel does not.
    x, dim = ctx.args[0], common.arg(ctx, "dim")
    if x.shape and x.shape[dim % len(x.shape)] == 0:
        return common.raise_like_cpu(ctx)
    return common.real_only(ctx)


def _check_aminmax(ctx: LoweringContext) -> Optional[str]:
    if common.arg(ctx, "dim") is None:
        return _check_full_reduction(ctx)
    return _check_reduced_dim_nonempty(ctx)


@lowering(aten.aminmax.default, check=_check_aminmax)
def aminmax(ctx, x, *, dim=None, keepdim=False):
    axes = common.axes(x.ndim, dim)
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
        return common.raise_like_cpu(ctx)          # CPU: "does not support bool input"
    if common.arg(ctx, "dim") is not None:
        return _check_reduced_dim_nonempty(ctx)
    return common.real_only(ctx)


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
    axes = common.axes(x.ndim, dim)
    x = x.astype(common.acc_dtype(x.dtype))
    n = common.count(x.shape, axes)
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
    if not axes or common.count(x.shape, axes) == 0:
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

@lowering(aten.any.default, aten.any.dim, aten.any.dims, check=common.real_only)
def any_(ctx, x, dim=None, keepdim=False):
    return jnp.any(x != 0, axis=common.axes(x.ndim, dim, empty_means_all=False), keepdims=keepdim)


@lowering(aten.all.default, aten.all.dim, aten.all.dims, check=common.real_only)
def all_(ctx, x, dim=None, keepdim=False):
    return jnp.all(x != 0, axis=common.axes(x.ndim, dim, empty_means_all=False), keepdims=keepdim)


# -- logsumexp -----------------------------------------------------------------------------------

def _check_logsumexp(ctx: LoweringContext) -> Optional[str]:
    if len(common.arg(ctx, "dim")) == 0:
        return common.raise_like_cpu(ctx)   # CPU rejects dim=[]; the meta kernel returns a shape
    return common.real_only(ctx)


@lowering(aten.logsumexp.default, check=_check_logsumexp)
def logsumexp(ctx, x, dim, keepdim=False):
    axes = common.axes(x.ndim, dim)
    x = x.astype(common.acc_dtype(ctx.out_dtype))
    # torch shifts by the max, with infinite maxima replaced by 0 so that all -inf rows give
    # -inf (not nan) and a +inf anywhere gives +inf.
    shift = common.max_with_identity(x, axes, keepdims=True)
    shift = jnp.where(jnp.isinf(shift), jnp.zeros((), x.dtype), shift)
    total = jnp.sum(xla_fixes.exp(x - shift), axis=axes, keepdims=True)
    out = jnp.log(total) + shift
    return out if keepdim else jnp.squeeze(out, axes)


# -- cumulative ----------------------------------------------------------------------------------

def _cumulative(ctx, x, dim, op):
    x = x.astype(common.acc_dtype(ctx.out_dtype))
    if x.ndim == 0:
        return x
    return op(x, axis=dim % x.ndim)


@lowering(aten.cumsum.default, check=_real_or_complex_sum)
def cumsum(ctx, x, dim, *, dtype=None):
    return _cumulative(ctx, x, dim, jnp.cumsum)


@lowering(aten.cumprod.default, check=common.real_only)
def cumprod(ctx, x, dim, *, dtype=None):
    return _cumulative(ctx, x, dim, jnp.cumprod)


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


@lowering(aten.linalg_vector_norm.default, check=common.real_only)
def linalg_vector_norm(ctx, x, ord=2, dim=None, keepdim=False, *, dtype=None):
    a = jnp.abs(x.astype(common.acc_dtype(ctx.out_dtype)))
    axes = common.axes(x.ndim, dim)
    if isinstance(ord, int):
        return _norm_static(a, ord, axes, keepdim)
    return _norm_runtime(a, ord, axes, keepdim)


# -- scans with indices: cummax, cummin ----------------------------------------------------------
# torch's CPU kernel walks the dim keeping (value, index) and takes the current element when it
# is NaN, or when the running value is not NaN and the element is >= (cummax) or <= (cummin) it:
# ties take the later index, and the last NaN seen wins from then on.  That is the maximum over
# the prefix under the order (is NaN, value, index), which is associative, hence a parallel scan.

def _check_scan_with_index(ctx: LoweringContext) -> Optional[str]:
    return common.real_only(ctx)


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
