"""Pointwise lowerings: arithmetic, math, comparison, logical, bitwise and casts (activations
are in activation.py; the operand helpers both use are in common.py).

Operands are read as torch's CPU kernels read them: cast to the op's common dtype, then widened
to the computation dtype (float32 for float16/bfloat16, torch's "opmath").  Where torch keeps a
scalar unrounded (mul and div by a 0-d operand, lerp weights, activation parameters) the rule
says so; elsewhere a scalar rounds to the common dtype first (half(x) < 0.1 compares halves).
Comparisons, min/max, clamp and where are exact and work in the promoted dtype.

Checkers decline complex dtypes.  Most also run torch's own CPU kernel on empty tensors of the
same dtypes (``common.probe``): meta functions accept dtype combinations the kernels reject (gelu of
int64, abs of bool, int64 ** -1), and declining would hand those to a decomposition that
computes something instead of raising what strict mode raises.  So the checker raises torch's
own exception, at record time, on the user's line.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import common
from . import xla_fixes
from .registry import lowering, runtime_check
from .._lazy import late, lazy_import

jnp = lazy_import("jax.numpy", globals(), "jnp")
jax_special = lazy_import("jax.scipy.special", globals(), "jax_special")
lax = lazy_import("jax.lax", globals(), "lax")
_jax_special = late(jax_special)
_jnp = late(jnp)
_lax = late(lax)

aten = torch.ops.aten


# -- dtype helpers (the shared ones are in common.py) ----------------------------------------------
def _second_operand(common_dtype, y):
    # torch's CPU mul and div read a 0-d second operand (Python scalar or 0-dim tensor) at
    # computation precision; add, sub, remainder and comparisons round it to the common dtype
    return common.wide(common_dtype, y) if jnp.ndim(y) == 0 else common.through(common_dtype, y)


def _promoted(ctx, *xs):
    return common.as_dtype(ctx.promoted_dtype, *xs)


# -- arithmetic ------------------------------------------------------------------------------------
@lowering(aten.add.Tensor, aten.add.Scalar, check=common.check)
def add(ctx, x, y, alpha=1):
    x, y, alpha = common.through(ctx.promoted_dtype, x, y, alpha)
    return x + alpha * y


@lowering(aten.sub.Tensor, aten.sub.Scalar, check=common.check)
def sub(ctx, x, y, alpha=1):
    x, y, alpha = common.through(ctx.promoted_dtype, x, y, alpha)
    return x - alpha * y


@lowering(aten.rsub.Tensor, aten.rsub.Scalar, check=common.check)
def rsub(ctx, x, y, alpha=1):
    x, y, alpha = common.through(ctx.promoted_dtype, x, y, alpha)
    return y - alpha * x


@lowering(aten.mul.Tensor, aten.mul.Scalar, check=common.check)
def mul(ctx, x, y):
    x, y = common.through(ctx.promoted_dtype, x), _second_operand(ctx.promoted_dtype, y)
    return x * y


@lowering(aten.div.Tensor, aten.div.Scalar, check=common.check)
def div(ctx, x, y):
    # the common dtype of true division is floating (int / int gives float32)
    x, y = common.through(ctx.out_dtype, x), _second_operand(ctx.out_dtype, y)
    return common.divide(x, y)


def _no_integer_division_by_zero(y):
    if not common.is_float(y.dtype):
        runtime_check(y == 0, RuntimeError, "ZeroDivisionError")


def _floor_divide(x, y):
    x, y = jnp.broadcast_arrays(x, y)
    if not common.is_float(x.dtype):
        _no_integer_division_by_zero(y)
        return jnp.floor_divide(x, y)
    # Python's algorithm, as torch's div_floor_floating uses: exact where floor(x / y) is not
    mod = lax.rem(x, y)
    quotient = (x - mod) / y
    quotient = jnp.where((mod != 0) & ((y < 0) != (mod < 0)), quotient - 1, quotient)
    floored = jnp.floor(quotient)
    floored = jnp.where(quotient - floored > 0.5, floored + 1, floored)
    floored = jnp.where(quotient != 0, floored, jnp.copysign(jnp.zeros_like(x), x / y))
    return jnp.where(y == 0, x / y, floored)


@lowering(aten.div.Tensor_mode, aten.div.Scalar_mode, check=common.check)
def div_mode(ctx, x, y, *, rounding_mode=None):
    if rounding_mode is None:
        return div(ctx, x, y)
    x, y = common.through(ctx.promoted_dtype, x), _second_operand(ctx.promoted_dtype, y)
    if rounding_mode == "trunc":
        if common.is_float(x.dtype):
            # torch rounds the quotient to float16/bfloat16 before truncating it
            return jnp.trunc(common.through(ctx.promoted_dtype, common.divide(x, y)))
        _no_integer_division_by_zero(y)
        return lax.div(*jnp.broadcast_arrays(x, y))
    return _floor_divide(x, y)


@lowering(aten.floor_divide.default, aten.floor_divide.Scalar, check=common.check)
def floor_divide(ctx, x, y):
    return _floor_divide(common.through(ctx.promoted_dtype, x), _second_operand(ctx.promoted_dtype, y))


@lowering(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor, check=common.check)
def remainder(ctx, x, y):
    x, y = jnp.broadcast_arrays(*common.through(ctx.promoted_dtype, x, y))
    _no_integer_division_by_zero(y)
    mod = lax.rem(x, y)
    return jnp.where((mod != 0) & ((y < 0) != (mod < 0)), mod + y, mod)


@lowering(aten.fmod.Tensor, aten.fmod.Scalar, check=common.check)
def fmod(ctx, x, y):
    x, y = jnp.broadcast_arrays(*common.through(ctx.promoted_dtype, x, y))
    _no_integer_division_by_zero(y)
    return lax.rem(x, y)


def _integer_power(base, exponent):
    """torch's integer pow: exponentiation by squaring with wrap-around; a negative exponent
    gives 1 for base 1, +-1 for base -1 and 0 otherwise."""
    nbits = exponent.dtype.itemsize * 8

    def square_step(_, carry):
        result, b, e = carry
        result = jnp.where((e & 1) == 1, result * b, result)
        return result, b * b, e >> 1

    e = jnp.where(exponent < 0, 0, exponent)
    result, _, _ = lax.fori_loop(0, nbits, square_step, (jnp.ones_like(base), base, e))
    if not jnp.issubdtype(exponent.dtype, jnp.signedinteger):
        return result
    odd = (exponent & 1) == 1
    negative = jnp.where(base == 1, 1, jnp.where(base == -1, jnp.where(odd, -1, 1), 0)).astype(base.dtype)
    return jnp.where(exponent < 0, negative, result)


@lowering(aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar, check=common.check)
def pow_(ctx, base, exponent):
    common_dtype = ctx.promoted_dtype
    static_exponent = isinstance(exponent, int) and not isinstance(exponent, bool)
    if static_exponent and exponent >= 0:
        # repeated multiplication: exact for integers (wrapping), and as torch special-cases x ** 2
        return lax.integer_pow(common.through(common_dtype, base), exponent)
    if type(exponent) is float and ctx.op is aten.pow.Tensor_Scalar and jnp.issubdtype(common_dtype, jnp.floating):
        # (a static exponent: capture/classify.py) torch's special cases, as its kernel has them
        # (pow_out: 0 fills ones, 1 copies; then squares, cubes, roots and reciprocals)
        b = common.through(common_dtype, base)
        special = {0.0: lambda: jnp.ones_like(b), 1.0: lambda: b, 0.5: lambda: jnp.sqrt(b),
                   -0.5: lambda: 1 / jnp.sqrt(b), 2.0: lambda: b * b, 3.0: lambda: b * b * b,
                   -1.0: lambda: 1 / b, -2.0: lambda: 1 / (b * b)}.get(exponent)
        if special is not None:
            return special()
    base, exponent = common.through(common_dtype, base, exponent)
    if common.is_int(common_dtype):
        return _integer_power(*jnp.broadcast_arrays(base, exponent))
    # XLA's pow is exp(y log x), whose error grows with |y log x| (5e-6 relative for float32
    # results near 1e30); computed in float64 it stays within torch's ulp
    result = jnp.power(base.astype(jnp.float64), exponent.astype(jnp.float64)).astype(base.dtype)
    if ctx.op is aten.pow.Tensor_Scalar:
        # torch special-cases these exponents (so (-inf) ** 0.5 is sqrt(-inf), nan)
        e = exponent
        result = jnp.select([e == 0.5, e == -0.5, e == 2, e == 3, e == -1, e == -2],
                            [jnp.sqrt(base), 1 / jnp.sqrt(base), base * base, base * base * base, 1 / base,
                             1 / (base * base)], result)
    if jnp.issubdtype(result.dtype, jnp.floating):
        # A negative base to a non-integer power is NaN.  Saying so explicitly also keeps XLA from
        # rewriting log(pow(a, e)) as e * log(|a|), which would turn that NaN into a number.
        # (C's pow gives -inf to a fractional power a signed infinity or zero, not NaN)
        negative_finite = (base < 0) & (base > -jnp.inf)
        result = jnp.where(negative_finite & (exponent != jnp.floor(exponent)), jnp.nan, result)
    return result


# -- unary math ------------------------------------------------------------------------------------


def _digamma(x):
    # torch: digamma(+-0) = -+inf; JAX gives nan at the pole
    return jnp.where(x == 0, jnp.copysign(jnp.inf, -x).astype(x.dtype), lax.digamma(x))


def _exp2(x):
    if x.dtype == jnp.float64:
        return jnp.exp2(x)
    # XLA's exp2(x) = exp(x ln 2) loses ~|x| ulps to the rounding of x ln 2 (2e-6 relative at x=100);
    # splitting off the integer part keeps the product small and the scaling exact
    n = jnp.round(x)
    finite = jnp.isfinite(x)
    scaled = jnp.ldexp(xla_fixes.exp((x - n) * math.log(2)), jnp.where(finite, n, 0).astype(jnp.int32))
    return jnp.where(finite, scaled, jnp.where(x > 0, x, jnp.where(x != x, x, 0)))


def _sinh(x):
    # XLA's sinh/cosh scale by exp(|x| - log 2), 12 ulps off torch's for large |x|; torch's
    # overflow to inf where exp(|x|) does
    exp_difference = 0.5 * (xla_fixes.exp(x) - xla_fixes.exp(-x))
    return jnp.where(jnp.abs(x) < 1, jnp.sinh(x), exp_difference)


def _cosh(x):
    return 0.5 * (xla_fixes.exp(x) + xla_fixes.exp(-x))


_FLOAT_UNARY = {
    aten.exp.default: xla_fixes.exp, aten.exp2.default: _exp2, aten.expm1.default: _jnp.expm1,
    aten.log.default: _jnp.log, aten.log2.default: _jnp.log2, aten.log10.default: _jnp.log10,
    aten.log1p.default: _jnp.log1p, aten.sqrt.default: _jnp.sqrt,
    aten.rsqrt.default: lambda x: 1 / jnp.sqrt(x), aten.reciprocal.default: lambda x: 1 / x,
    aten.sin.default: _jnp.sin, aten.cos.default: _jnp.cos, aten.tan.default: _jnp.tan,
    aten.asin.default: _jnp.arcsin, aten.acos.default: _jnp.arccos, aten.atan.default: _jnp.arctan,
    aten.sinh.default: _sinh, aten.cosh.default: _cosh, aten.tanh.default: _jnp.tanh,
    aten.asinh.default: _jnp.arcsinh, aten.acosh.default: _jnp.arccosh, aten.atanh.default: _jnp.arctanh,
    aten.erf.default: _lax.erf, aten.erfc.default: _lax.erfc, aten.erfinv.default: _lax.erf_inv,
    aten.lgamma.default: _lax.lgamma, aten.digamma.default: _digamma,
    aten.sigmoid.default: common.sigmoid,
    aten.i0.default: lambda x: lax.bessel_i0e(x) * xla_fixes.exp(jnp.abs(x)), aten.special_i0e.default: _lax.bessel_i0e,
    aten.special_i1.default: lambda x: lax.bessel_i1e(x) * xla_fixes.exp(jnp.abs(x)),
    aten.special_i1e.default: _lax.bessel_i1e,
    aten.special_ndtri.default: _jax_special.ndtri, aten.special_log_ndtr.default: _jax_special.log_ndtr,
    # the argument of a real number: pi for negatives, nan stays nan
    aten.angle.default: lambda x: jnp.where(x < 0, jnp.asarray(math.pi, x.dtype), jnp.where(x != x, x, 0)),
}


# torch evaluates the Bessel series (i0, i0e, i1, i1e) in float16/bfloat16 arithmetic for those
# dtypes, a few ulps from the float32 evaluation rounded once that this (and torch's own
# decomposition) computes.
for _op, _fn in _FLOAT_UNARY.items():
    lowering(_op, check=common.check)(common.float_unary_rule(_fn))


def _sign(x):
    if x.dtype == jnp.bool_:
        return x
    # not jnp.sign: torch's sign of NaN is 0
    return (x > 0).astype(x.dtype) - (x < 0).astype(x.dtype)


def _integers_unchanged(fn):
    return lambda x: fn(x) if common.is_float(x.dtype) else x


_SAME_DTYPE_UNARY = {
    aten.neg.default: _jnp.negative, aten.abs.default: _jnp.abs,
    aten.sign.default: _sign, aten.sgn.default: _sign,
    aten.floor.default: _integers_unchanged(_jnp.floor), aten.ceil.default: _integers_unchanged(_jnp.ceil),
    aten.trunc.default: _integers_unchanged(_jnp.trunc),
    aten.round.default: _integers_unchanged(_jnp.round),  # half to even, like nearbyint
    aten.frac.default: lambda x: x - jnp.trunc(x),
    aten.bitwise_not.default: _jnp.invert,
}


def _same_dtype_unary_rule(fn):
    def rule(ctx, x):
        return fn(common.through(ctx.out_dtype, x))
    rule.__qualname__ = f"same_dtype_unary[{getattr(fn, '__name__', 'fn')}]"
    return rule


for _op, _fn in _SAME_DTYPE_UNARY.items():
    lowering(_op, check=common.check)(_same_dtype_unary_rule(_fn))


@lowering(aten.round.decimals, check=common.check)
def round_decimals(ctx, x, *, decimals):
    x = common.through(ctx.out_dtype, x)
    # (torch's kernel: nearbyint(x * 10^d) / 10^d, or nearbyint(x / 10^-d) * 10^-d for d < 0)
    ten_power = 10.0 ** abs(decimals)
    scale = np.asarray(ten_power, dtype=x.dtype)
    if decimals < 0:
        return jnp.round(common.divided_by_constant(x, ten_power)) * scale
    return common.divided_by_constant(jnp.round(x * scale), ten_power)


@lowering(aten.logit.default, check=common.check)
def logit(ctx, x, eps=None):
    dt = ctx.out_dtype
    x = common.through(dt, x)
    if eps is not None and eps >= 0:
        low, high = common.logit_bounds(dt, eps)
        x = jnp.where(x < low, low, jnp.where(x > high, high, x))
    # torch rounds 1 - x and the ratio to float16/bfloat16 before the log
    one_minus = common.through(dt, 1 - x)
    return jnp.log(common.through(dt, x / one_minus))


@lowering(aten.isnan.default, check=common.check)
def isnan(ctx, x):
    return x != x


@lowering(aten.isinf.default, check=common.check)
def isinf(ctx, x):
    return jnp.isinf(x) if common.is_float(x.dtype) else jnp.zeros(x.shape, jnp.bool_)


@lowering(aten.isposinf.default, check=common.check)
def isposinf(ctx, x):
    return x == jnp.inf if common.is_float(x.dtype) else jnp.zeros(x.shape, jnp.bool_)


@lowering(aten.isneginf.default, check=common.check)
def isneginf(ctx, x):
    return x == -jnp.inf if common.is_float(x.dtype) else jnp.zeros(x.shape, jnp.bool_)


@lowering(aten.signbit.default, check=common.check)
def signbit(ctx, x):
    if common.is_float(x.dtype):
        return jnp.signbit(x)
    return x < 0 if jnp.issubdtype(x.dtype, jnp.signedinteger) else jnp.zeros(x.shape, jnp.bool_)


@lowering(aten.nan_to_num.default, check=common.check)
def nan_to_num(ctx, x, nan=None, posinf=None, neginf=None):
    if not common.is_float(x.dtype):
        return x
    info = jnp.finfo(x.dtype)
    nan, posinf, neginf = common.as_dtype(x.dtype, 0.0 if nan is None else nan, info.max if posinf is None else posinf,
                              info.min if neginf is None else neginf)
    return jnp.where(x != x, nan, jnp.where(x == jnp.inf, posinf, jnp.where(x == -jnp.inf, neginf, x)))


# -- binary math -----------------------------------------------------------------------------------
def _xlogy(x, y):
    return jnp.where(y != y, jnp.nan, jnp.where(x == 0, 0, x * jnp.log(y))).astype(x.dtype)


def _logaddexp(x, y, log1p_exp, scale):
    m = jnp.maximum(x, y)
    both_inf = jnp.isinf(x) & (x == y)
    return jnp.where(both_inf, x, m + log1p_exp(-jnp.abs(x - y)) * scale)


_FLOAT_BINARY = {
    aten.atan2.default: _jnp.arctan2, aten.hypot.default: _jnp.hypot,
    aten.copysign.Tensor: _jnp.copysign, aten.copysign.Scalar: _jnp.copysign,
    aten.xlogy.Tensor: _xlogy, aten.xlogy.Scalar_Self: _xlogy, aten.xlogy.Scalar_Other: _xlogy,
    aten.logaddexp.default: lambda x, y: _logaddexp(x, y, lambda d: jnp.log1p(xla_fixes.exp(d)), 1),
    aten.logaddexp2.default: lambda x, y: _logaddexp(x, y, lambda d: jnp.log1p(jnp.exp2(d)), 1 / math.log(2)),
}


def _float_binary_rule(fn):
    def rule(ctx, x, y):
        return fn(*common.through(ctx.out_dtype, x, y))
    rule.__qualname__ = f"float_binary[{getattr(fn, '__name__', 'fn')}]"
    return rule


for _op, _fn in _FLOAT_BINARY.items():
    lowering(_op, check=common.check)(_float_binary_rule(_fn))


# -- special functions of two arguments -----------------------------------------------------------
def _trigamma(x):
    # torch's calc_trigamma term by term: reflection below 1/2, six recurrence steps, then the
    # asymptotic series
    pi = math.pi
    reflect = x < 0.5
    sin_pi_x = jnp.sin(pi * x)
    result = jnp.where(reflect, -(pi * pi) / (sin_pi_x * sin_pi_x), jnp.zeros_like(x))
    x = jnp.where(reflect, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (x * x)
        x = x + 1
    ixx = 1 / (x * x)
    result = result + (1 + 1 / (2 * x) + ixx * (1 / 6 - ixx * (1 / 30 - ixx * (1 / 42)))) / x
    return jnp.where(reflect, -result, result)


_ZETA_A = (12.0, -720.0, 30240.0, -1209600.0, 47900160.0, -1.8924375803183791606e9, 7.47242496e10,
           -2.950130727918164224e12, 1.1646782814350067249e14, -4.5979787224074726105e15,
           1.8152105401943546773e17, -7.1661652561756670113e18)
_MACHEP = 1.11022302462515654042e-16


def _cephes_zeta(x, q):
    """torch's zeta series (Cephes), elementwise in float64: direct terms until q + i > 9 (and at
    least nine), then Euler-Maclaurin.  JAX's zeta takes a fixed number of direct terms, which
    loses all accuracy for q below about -8."""
    def active(c):
        i, a, _, _, done = c
        return ~done & ((i < 9) | (a <= 9))

    def body(c):
        i, a, b, s, done = c
        on = active(c)
        a2 = a + 1
        b2 = a2 ** -x
        s2 = s + b2
        converged = (-_MACHEP * s2 < b2) & (b2 < _MACHEP * s2)
        return (jnp.where(on, i + 1, i), jnp.where(on, a2, a), jnp.where(on, b2, b),
                jnp.where(on, s2, s), done | (on & converged))

    zeros = jnp.zeros_like(q)
    start = (zeros.astype(jnp.int32), q, zeros, q ** -x, jnp.zeros(q.shape, jnp.bool_))
    _, a, b, s, done = lax.while_loop(lambda c: jnp.any(active(c)), body, start)
    w = a
    s = jnp.where(done, s, s + b * w / (x - 1) - 0.5 * b)
    factor, k = jnp.ones_like(q), 0.0
    for coefficient in _ZETA_A:
        factor = factor * (x + k)
        b = b / w
        t = factor * b / coefficient
        s2 = s + t
        s = jnp.where(done, s, s2)
        done = done | (jnp.abs(t / s2) < _MACHEP)
        k += 1
        factor = factor * (x + k)
        b = b / w
        k += 1
    return s


def _hurwitz_zeta(x, q):
    """torch's zeta(x, q), special cases in its order: inf at x == 1, nan for x < 1, inf at the
    poles q = 0, -1, ..., nan for other q <= 0 unless x is an integer.  Computed in float64."""
    dtype = x.dtype
    x, q = x.astype(jnp.float64), q.astype(jnp.float64)
    pole = (q <= 0) & (q == jnp.floor(q))
    undefined = (x <= 1) | pole | (x != x) | (q != q) | (x == jnp.inf)
    z = _cephes_zeta(jnp.where(undefined, 2.0, x), jnp.where(undefined, 1.0, q))
    # x = inf: q ** -x is 1 at q == 1, inf below, and the series gives nan above
    z = jnp.where(x == jnp.inf, jnp.where(q == 1, 1.0, jnp.where(q < 1, jnp.inf, jnp.nan)), z)
    z = jnp.where((x != x) | (q != q), jnp.nan, z)
    z = jnp.where((q <= 0) & ~pole & (x != jnp.floor(x)), jnp.nan, z)
    z = jnp.where(pole, jnp.inf, z)
    z = jnp.where(x < 1, jnp.nan, z)
    return jnp.where(x == 1, jnp.inf, z).astype(dtype)


@lowering(aten.special_zeta.default, aten.special_zeta.other_scalar, aten.special_zeta.self_scalar, check=common.check)
def special_zeta(ctx, x, q):
    return _hurwitz_zeta(*jnp.broadcast_arrays(*common.through(ctx.out_dtype, x, q)))


@lowering(aten.polygamma.default, check=common.check)
def polygamma(ctx, n, x):
    x = common.through(ctx.out_dtype, x)
    if n == 0:
        return _digamma(x)
    if n == 1:
        return _trigamma(x)
    # torch: (-1) ** (n + 1) * n! * zeta(n + 1, x)
    sign = 1.0 if n % 2 else -1.0
    factor = sign * math.exp(math.lgamma(n + 1.0))
    return factor * _hurwitz_zeta(jnp.full_like(x, n + 1.0), x)


def _igamma_edges(a, x, value, upper):
    """torch's calc_igamma/calc_igammac special cases; ``value`` is JAX's result elsewhere."""
    nan = jnp.full_like(value, jnp.nan)
    lower_value = jnp.where(
        (a < 0) | (x < 0), nan,
        jnp.where(a == 0, jnp.where(x > 0, 1.0, nan),
                  jnp.where(x == 0, 0.0,
                            jnp.where(jnp.isinf(a), jnp.where(jnp.isinf(x), nan, 0.0),
                                      jnp.where(jnp.isinf(x), 1.0, value)))))
    if not upper:
        return lower_value.astype(value.dtype)
    # igammac: 1 - igamma at the special points, JAX's value elsewhere
    special = (a < 0) | (x < 0) | (a == 0) | (x == 0) | jnp.isinf(a) | jnp.isinf(x)
    return jnp.where(special, 1 - lower_value, value).astype(value.dtype)


@lowering(aten.igamma.default, check=common.check)
def igamma(ctx, a, x):
    a, x = jnp.broadcast_arrays(*common.through(ctx.out_dtype, a, x))
    return _igamma_edges(a, x, jax_special.gammainc(a, x), upper=False)


@lowering(aten.igammac.default, check=common.check)
def igammac(ctx, a, x):
    a, x = jnp.broadcast_arrays(*common.through(ctx.out_dtype, a, x))
    return _igamma_edges(a, x, jax_special.gammaincc(a, x), upper=True)


def _gcd(a, b):
    # Euclid on absolute values, as torch's calc_gcd
    a, b = jnp.abs(a), jnp.abs(b)

    def cond(carry):
        return jnp.any(carry[0] != 0)

    def body(carry):
        x, y = carry
        nonzero = x != 0
        safe = jnp.where(nonzero, x, 1)
        return jnp.where(nonzero, y % safe, x), jnp.where(nonzero, x, y)

    _, g = lax.while_loop(cond, body, (a, b))
    return g


@lowering(aten.gcd.default, check=common.check)
def gcd(ctx, a, b):
    return _gcd(*jnp.broadcast_arrays(*_promoted(ctx, a, b)))


@lowering(aten.lcm.default, check=common.check)
def lcm(ctx, a, b):
    a, b = jnp.broadcast_arrays(*_promoted(ctx, a, b))
    g = _gcd(a, b)
    # torch: g == 0 ? 0 : abs(a / g * b)
    return jnp.where(g == 0, 0, jnp.abs(lax.div(a, jnp.where(g == 0, 1, g)) * b)).astype(a.dtype)


@lowering(aten.nextafter.default, check=common.check)
def nextafter(ctx, x, y):
    # in the tensors' own dtype: the next float16 after x is not the next float32
    return jnp.nextafter(*_promoted(ctx, x, y))


@lowering(aten.heaviside.default, check=common.check)
def heaviside(ctx, x, values):
    x, values = _promoted(ctx, x, values)
    return jnp.where(x == 0, values, (x > 0).astype(x.dtype))


# maximum/minimum propagate NaN (as lax.max/min do); fmax/fmin ignore it.
_EXACT_BINARY = {
    aten.maximum.default: _jnp.maximum, aten.minimum.default: _jnp.minimum,
    aten.fmax.default: _jnp.fmax, aten.fmin.default: _jnp.fmin,
    aten.eq.Tensor: _jnp.equal, aten.eq.Scalar: _jnp.equal,
    aten.ne.Tensor: _jnp.not_equal, aten.ne.Scalar: _jnp.not_equal,
    aten.lt.Tensor: _jnp.less, aten.lt.Scalar: _jnp.less,
    aten.le.Tensor: _jnp.less_equal, aten.le.Scalar: _jnp.less_equal,
    aten.gt.Tensor: _jnp.greater, aten.gt.Scalar: _jnp.greater,
    aten.ge.Tensor: _jnp.greater_equal, aten.ge.Scalar: _jnp.greater_equal,
}


def _exact_binary_rule(fn):
    def rule(ctx, x, y):
        return fn(*_promoted(ctx, x, y))
    rule.__qualname__ = f"exact_binary[{fn.__name__}]"
    return rule


for _op, _fn in _EXACT_BINARY.items():
    lowering(_op, check=common.check)(_exact_binary_rule(_fn))


# -- logical and bitwise ---------------------------------------------------------------------------
def _truth(x):
    x = jnp.asarray(x)
    return x if x.dtype == jnp.bool_ else x != 0


@lowering(aten.logical_not.default, check=common.check)
def logical_not(ctx, x):
    return ~_truth(x)


_LOGICAL = {aten.logical_and.default: _jnp.logical_and, aten.logical_or.default: _jnp.logical_or,
            aten.logical_xor.default: _jnp.logical_xor}


def _logical_rule(fn):
    def rule(ctx, x, y):
        return fn(_truth(x), _truth(y))
    rule.__qualname__ = f"logical[{fn.__name__}]"
    return rule


for _op, _fn in _LOGICAL.items():
    lowering(_op, check=common.check)(_logical_rule(_fn))


def _shift_left(x, s):
    # torch: a shift by a negative amount or by the width or more gives 0
    nbits = x.dtype.itemsize * 8
    out_of_range = (s < 0) | (s >= nbits)
    return jnp.where(out_of_range, 0, lax.shift_left(x, jnp.where(out_of_range, 0, s))).astype(x.dtype)


def _shift_right(x, s):
    # torch: out-of-range shifts keep only the sign (arithmetic shift for signed types)
    max_shift = x.dtype.itemsize * 8 - (1 if jnp.issubdtype(x.dtype, jnp.signedinteger) else 0)
    out_of_range = (s < 0) | (s >= max_shift)
    return jnp.where(out_of_range, jnp.right_shift(x, max_shift), jnp.right_shift(x, jnp.where(out_of_range, 0, s)))


_BITWISE = {}
for _name, _fn in (("bitwise_and", _jnp.bitwise_and), ("bitwise_or", _jnp.bitwise_or),
                   ("bitwise_xor", _jnp.bitwise_xor), ("bitwise_left_shift", _shift_left),
                   ("bitwise_right_shift", _shift_right)):
    for _overload in ("Tensor", "Scalar", "Tensor_Scalar", "Scalar_Tensor"):
        if _overload in getattr(aten, _name).overloads():
            _BITWISE[getattr(getattr(aten, _name), _overload)] = _fn
_BITWISE.update({aten.__lshift__.Tensor: _shift_left, aten.__lshift__.Scalar: _shift_left,
                 aten.__rshift__.Tensor: _shift_right, aten.__rshift__.Scalar: _shift_right})


def _bitwise_rule(fn):
    def rule(ctx, x, y):
        x, y = _promoted(ctx, x, y)
        return fn(*jnp.broadcast_arrays(x, y))
    rule.__qualname__ = f"bitwise[{fn.__name__}]"
    return rule


for _op, _fn in _BITWISE.items():
    lowering(_op, check=common.check)(_bitwise_rule(_fn))


# -- clamp, where, lerp, addcmul -------------------------------------------------------------------
@lowering(aten.clamp.default, aten.clamp.Tensor, check=common.check)
def clamp(ctx, x, min=None, max=None):
    dt = ctx.out_dtype
    x = common.as_dtype(dt, x)
    if min is not None:
        x = common.at_least(x, common.as_dtype(dt, min))
    if max is not None:
        x = common.at_most(x, common.as_dtype(dt, max))
    return x


@lowering(aten.clamp_min.default, aten.clamp_min.Tensor, check=common.check)
def clamp_min(ctx, x, min):
    return clamp(ctx, x, min=min)


@lowering(aten.clamp_max.default, aten.clamp_max.Tensor, check=common.check)
def clamp_max(ctx, x, max):
    return clamp(ctx, x, max=max)


@lowering(aten.where.self, check=common.check)
def where(ctx, condition, x, y):
    x, y = common.as_dtype(ctx.out_dtype, x, y)
    return jnp.where(_truth(condition), x, y)


def _lerp(start, end, weight):
    # torch's two-sided form: exact at weight 0 and at weight 1
    return jnp.where(jnp.abs(weight) < 0.5, start + weight * (end - start),
                     end - (end - start) * (1 - weight))


@lowering(aten.lerp.Scalar, aten.lerp.Tensor, check=common.check)
def lerp(ctx, start, end, weight):
    start, end = common.through(ctx.out_dtype, start, end)
    weight = _second_operand(ctx.out_dtype, weight) if ctx.op is aten.lerp.Scalar else common.through(ctx.out_dtype, weight)
    return _lerp(start, end, weight)


@lowering(aten.addcmul.default, check=common.check)
def addcmul(ctx, x, t1, t2, *, value=1):
    x, t1, t2 = common.through(ctx.promoted_dtype, x, t1, t2)
    value = common.wide(ctx.promoted_dtype, value)
    return x + value * t1 * t2


@lowering(aten.addcdiv.default, check=common.check)
def addcdiv(ctx, x, t1, t2, *, value=1):
    x, t1, t2 = common.through(ctx.promoted_dtype, x, t1, t2)
    value = common.wide(ctx.promoted_dtype, value)
    return x + value * t1 / t2


# -- casts and copies ------------------------------------------------------------------------------


@lowering(aten._to_copy.default, check=common.supported_dtypes)
def to_copy(ctx, x, **_ignored):
    # layout, device and memory format do not change values; the core lays the result out
    return common.convert_any(x, ctx.out_dtype)


@lowering(aten.clone.default, check=common.supported_dtypes)
def clone(ctx, x, **_ignored):
    return x


@lowering(aten.copy.default, check=common.check)
def copy(ctx, x, src, non_blocking=False):
    return common.convert(jnp.broadcast_to(src, x.shape), ctx.out_dtype)


_C_TYPE_NAMES = {"float32": "float", "float64": "double", "float16": "c10::Half", "bfloat16": "c10::BFloat16",
                 "int32": "int", "int64": "int64_t", "int8": "int8_t", "uint8": "uint8_t", "int16": "int16_t"}


def _check_value_fits(value, dt):
    """torch's fill checks that a floating value converts to the tensor's dtype without
    overflow; a Python float is a runtime input here, so the check runs with the computation."""
    if not common.is_float(value.dtype) or dt == jnp.bool_ or dt == jnp.float64:
        return
    value = value.astype(jnp.float64)
    if common.is_float(dt):
        overflow = jnp.isfinite(value) & (jnp.abs(value) > float(jnp.finfo(dt).max))
    else:
        info = jnp.iinfo(dt)
        overflow = (value != value) | (value > float(info.max)) | (value < float(info.min))
    name = _C_TYPE_NAMES.get(jnp.dtype(dt).name, jnp.dtype(dt).name)
    runtime_check(overflow, RuntimeError, f"value cannot be converted to type {name} without overflow")


@lowering(aten.fill.Scalar, aten.fill.Tensor, check=common.check)
def fill(ctx, x, value):
    value = jnp.asarray(value)
    _check_value_fits(value, ctx.out_dtype)
    return jnp.broadcast_to(common.convert(value, ctx.out_dtype), x.shape)


@lowering(aten._conj_physical.default, check=common.supported_dtypes)
def conj_physical(ctx, x):
    # complex conjugate, exact; the identity for real dtypes
    return jnp.conj(x) if jnp.iscomplexobj(x) else x


@lowering(aten.zero.default, check=common.dtype_reason)
def zero(ctx, x):
    return jnp.zeros(x.shape, ctx.out_dtype)

