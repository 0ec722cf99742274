"""Activation functions and the backward ops autograd emits for them (part of the pointwise family;
its operand helpers are in common.py).

Formulas follow torch's CPU kernels term by term, computed in float32 for float16/bfloat16 as
torch does.  Scalar parameters (slopes, thresholds, alpha) may be traced runtime values, so
they are converted to the computation dtype and never inspected in Python.
"""

from __future__ import annotations

import math

import torch

from . import common
from . import xla_fixes
from .registry import lowering
from .._lazy import lazy_import

jnp = lazy_import("jax.numpy", globals(), "jnp")
lax = lazy_import("jax.lax", globals(), "lax")

aten = torch.ops.aten

_SQRT1_2 = math.sqrt(0.5)
_GELU_TANH_BETA = math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5   # sqrt(2 / pi)
_GELU_TANH_KAPPA = 0.044715
_INV_SQRT_2PI = (2.0 / math.sqrt(math.pi)) * _SQRT1_2 * 0.5              # 1 / sqrt(2 pi)


def _tensors(ctx, *xs):
    """Tensor operands in the computation dtype: the result's, widened to float32 for
    float16/bfloat16 as torch's kernels compute."""
    return common.through(ctx.out_dtype, *xs)


def _params(ctx, *xs):
    """Scalar parameters, which torch converts straight to the computation dtype."""
    return common.wide(ctx.out_dtype, *xs)


def _rounded_params(ctx, *xs):
    """Scalar parameters that torch first rounds to the tensor's dtype (hardshrink's lambda: in
    bfloat16, 0.6 is 0.6015625 and hardshrink(0.6015625, 0.6) is 0)."""
    return common.through(ctx.out_dtype, *xs)


# -- forward ---------------------------------------------------------------------------------------
@lowering(aten.relu.default, check=common.check)
def relu(ctx, x):
    x = _tensors(ctx, x)
    return common.at_least(x, jnp.zeros((), x.dtype))     # (-0.0 stays -0.0; NaN propagates)


@lowering(aten.gelu.default, check=common.check)
def gelu(ctx, x, *, approximate="none"):
    x = _tensors(ctx, x)
    if approximate == "tanh":
        inner = _GELU_TANH_BETA * (x + _GELU_TANH_KAPPA * (x * x * x))
        return 0.5 * x * (1 + jnp.tanh(inner))
    return x * 0.5 * (1 + lax.erf(x * _SQRT1_2))


@lowering(aten.silu.default, check=common.check)
def silu(ctx, x):
    x = _tensors(ctx, x)
    return x / (1 + xla_fixes.exp(-x))


@lowering(aten.mish.default, check=common.check)
def mish(ctx, x):
    x = _tensors(ctx, x)
    return x * jnp.tanh(jnp.log1p(xla_fixes.exp(x)))


@lowering(aten.hardtanh.default, check=common.check)
def hardtanh(ctx, x, min_val=-1, max_val=1):
    # a clamp: exact, so the bounds round to the tensor's own dtype
    x, low, high = _tensors(ctx, x, min_val, max_val)
    return common.at_most(common.at_least(x, low), high)


@lowering(aten.hardsigmoid.default, check=common.check)
def hardsigmoid(ctx, x):
    x = _tensors(ctx, x)
    return jnp.minimum(jnp.maximum(x + 3, 0), 6) / 6


@lowering(aten.hardswish.default, check=common.check)
def hardswish(ctx, x):
    x = _tensors(ctx, x)
    return x * jnp.minimum(jnp.maximum(x + 3, 0), 6) / 6


@lowering(aten.leaky_relu.default, check=common.check)
def leaky_relu(ctx, x, negative_slope=0.01):
    x, slope = _tensors(ctx, x), _params(ctx, negative_slope)
    return jnp.where(x > 0, x, x * slope)


def _elu(x, alpha, scale, input_scale):
    return jnp.where(x <= 0, jnp.expm1(x * input_scale) * (alpha * scale), x * scale)


@lowering(aten.elu.default, check=common.check)
def elu(ctx, x, alpha=1, scale=1, input_scale=1):
    return _elu(_tensors(ctx, x), *_params(ctx, alpha, scale, input_scale))


@lowering(aten.celu.default, check=common.check)
def celu(ctx, x, alpha=1.0):
    # torch: elu(x, alpha, 1, 1 / alpha), the reciprocal taken in double precision
    alpha_c, inv_alpha = _params(ctx, alpha, 1 / jnp.asarray(alpha, jnp.float64))
    return _elu(_tensors(ctx, x), alpha_c, 1, inv_alpha)


@lowering(aten.softplus.default, check=common.check)
def softplus(ctx, x, beta=1, threshold=20):
    x, (beta, threshold) = _tensors(ctx, x), _params(ctx, beta, threshold)
    scaled = x * beta
    return jnp.where(scaled > threshold, x, jnp.log1p(xla_fixes.exp(scaled)) / beta)


@lowering(aten.threshold.default, check=common.check)
def threshold(ctx, x, threshold, value):
    x, (threshold, value) = _tensors(ctx, x), _params(ctx, threshold, value)
    return jnp.where(x <= threshold, value, x)


@lowering(aten.hardshrink.default, check=common.check)
def hardshrink(ctx, x, lambd=0.5):
    x, lambd = _tensors(ctx, x), _rounded_params(ctx, lambd)
    return jnp.where((x >= -lambd) & (x <= lambd), 0, x)


@lowering(aten.softshrink.default, check=common.check)
def softshrink(ctx, x, lambd=0.5):
    x, lambd = _tensors(ctx, x), _params(ctx, lambd)
    return jnp.where(x > lambd, x - lambd, jnp.where(x < -lambd, x + lambd, x * 0))


@lowering(aten.glu.default, check=common.check)
def glu(ctx, x, dim=-1):
    a, b = jnp.split(_tensors(ctx, x), 2, axis=dim)
    return a * common.sigmoid(b)


@lowering(aten.log_sigmoid_forward.default, check=common.check)
def log_sigmoid_forward(ctx, x):
    x = _tensors(ctx, x)
    z = xla_fixes.exp(-jnp.abs(x))
    out = jnp.minimum(x, 0) - jnp.log1p(z)
    buffer_shape = ctx.out[1].shape
    buffer = z if buffer_shape == x.shape else jnp.zeros(buffer_shape, x.dtype)
    return out, buffer


# -- backward --------------------------------------------------------------------------------------
@lowering(aten.threshold_backward.default, check=common.check)
def threshold_backward(ctx, grad, x, threshold):
    (grad, x), threshold = _tensors(ctx, grad, x), _params(ctx, threshold)
    return jnp.where(x <= threshold, 0, grad)


@lowering(aten.gelu_backward.default, check=common.check)
def gelu_backward(ctx, grad, x, *, approximate="none"):
    grad, x = _tensors(ctx, grad, x)
    if approximate == "tanh":
        x_sq = x * x
        inner = _GELU_TANH_BETA * (x + _GELU_TANH_KAPPA * x_sq * x)
        tanh_inner = jnp.tanh(inner)
        left, right = 0.5 * x, 1 + tanh_inner
        inner_derivative = _GELU_TANH_BETA * (1 + 3 * _GELU_TANH_KAPPA * x_sq)
        return grad * (0.5 * right + left * (1 - tanh_inner * tanh_inner) * inner_derivative)
    cdf = 0.5 * (1 + lax.erf(x * _SQRT1_2))
    pdf = xla_fixes.exp(-0.5 * x * x) * _INV_SQRT_2PI
    return grad * (cdf + x * pdf)


@lowering(aten.silu_backward.default, check=common.check)
def silu_backward(ctx, grad, x):
    grad, x = _tensors(ctx, grad, x)
    s = common.sigmoid(x)
    return grad * s * (1 + x * (1 - s))


@lowering(aten.mish_backward.default, check=common.check)
def mish_backward(ctx, grad, x):
    grad, x = _tensors(ctx, grad, x)
    tanh_softplus = jnp.tanh(jnp.log1p(xla_fixes.exp(x)))
    return grad * (tanh_softplus + x * common.sigmoid(x) * (1 - tanh_softplus * tanh_softplus))


@lowering(aten.sigmoid_backward.default, check=common.check)
def sigmoid_backward(ctx, grad, y):
    grad, y = _tensors(ctx, grad, y)
    if jnp.dtype(ctx.out_dtype) == jnp.float16:
        # torch's float16 kernel rounds 1 - y and grad * (1 - y) to float16 (bfloat16's does not)
        return _tensors(ctx, grad * _tensors(ctx, 1 - y)) * y
    return grad * (1 - y) * y


@lowering(aten.tanh_backward.default, check=common.check)
def tanh_backward(ctx, grad, y):
    grad, y = _tensors(ctx, grad, y)
    return grad * (1 - y * y)


@lowering(aten.hardtanh_backward.default, check=common.check)
def hardtanh_backward(ctx, grad, x, min_val, max_val):
    (grad, x), (low, high) = _tensors(ctx, grad, x), _params(ctx, min_val, max_val)
    return jnp.where((x <= low) | (x >= high), 0, grad)


@lowering(aten.hardsigmoid_backward.default, check=common.check)
def hardsigmoid_backward(ctx, grad, x):
    grad, x = _tensors(ctx, grad, x)
    return jnp.where((x > -3) & (x < 3), grad / 6, 0)


@lowering(aten.hardswish_backward.default, check=common.check)
def hardswish_backward(ctx, grad, x):
    grad, x = _tensors(ctx, grad, x)
    return jnp.where(x <= -3, 0, jnp.where(x < 3, grad * (x / 3 + 0.5), grad))


@lowering(aten.leaky_relu_backward.default, check=common.check)
def leaky_relu_backward(ctx, grad, x, negative_slope, self_is_result):
    (grad, x), slope = _tensors(ctx, grad, x), _params(ctx, negative_slope)
    return jnp.where(x > 0, grad, grad * slope)


@lowering(aten.elu_backward.default, check=common.check)
def elu_backward(ctx, grad, alpha, scale, input_scale, is_result, x):
    (grad, x), (alpha, scale, input_scale) = _tensors(ctx, grad, x), _params(ctx, alpha, scale, input_scale)
    negcoef = alpha * scale
    if is_result:   # x is elu's output
        negative = grad * input_scale * (x + negcoef)
    else:
        negative = grad * input_scale * negcoef * xla_fixes.exp(x * input_scale)
    return jnp.where(x <= 0, negative, grad * scale)


@lowering(aten.softplus_backward.default, check=common.check)
def softplus_backward(ctx, grad, x, beta, threshold):
    (grad, x), (beta, threshold) = _tensors(ctx, grad, x), _params(ctx, beta, threshold)
    z = xla_fixes.exp(x * beta)
    return jnp.where(x * beta > threshold, grad, grad * z / (z + 1))


@lowering(aten.hardshrink_backward.default, aten.softshrink_backward.default, check=common.check)
def shrink_backward(ctx, grad, x, lambd):
    (grad, x), lambd = _tensors(ctx, grad, x), _rounded_params(ctx, lambd)
    return jnp.where((x >= -lambd) & (x <= lambd), 0, grad)


@lowering(aten.logit_backward.default, check=common.check)
def logit_backward(ctx, grad, x, eps=None):
    grad, x = _tensors(ctx, grad, x)
    # torch rounds 1 - x and the denominator to float16/bfloat16
    derivative = grad / _tensors(ctx, x * _tensors(ctx, 1 - x))
    if eps is None or eps < 0:
        return jnp.where((x < 0) | (x > 1), jnp.nan, derivative)
    low, high = common.logit_bounds(ctx.out_dtype, eps)
    return jnp.where((x < low) | (x > high), 0, derivative)


@lowering(aten.log_sigmoid_backward.default, check=common.check)
def log_sigmoid_backward(ctx, grad, x, buffer):
    grad, x = _tensors(ctx, grad, x)
    negative = x < 0
    z = xla_fixes.exp(-jnp.abs(x))
    return grad * (jnp.where(negative, 1, 0) - jnp.where(negative, 1, -1) * (z / (1 + z)))


@lowering(aten.glu_backward.default, check=common.check)
def glu_backward(ctx, grad, x, dim):
    grad, x = _tensors(ctx, grad, x)
    a, b = jnp.split(x, 2, axis=dim)
    s = common.sigmoid(b)
    return jnp.concatenate([grad * s, grad * a * s * (1 - s)], axis=dim)
