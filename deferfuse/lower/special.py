"""Lowerings of torch.special's orthogonal polynomials, Bessel and Airy functions, erfcx and frexp.

torch's CPU kernels (ATen/native/Math.h) evaluate these in the input's floating dtype
(integers and bools promote to the default float dtype), so the rules here follow the same
methods in the same dtype:

* Orthogonal polynomials take ``n`` per element (cast to the common float dtype, then truncated to
  an integer as a C++ ``static_cast``; NaN, infinities and out-of-range values become INT64_MIN on
  x86, so the result is 0).  torch's special cases come first (n < 0, |x| == 1, ...), then a closed
  trigonometric form for Chebyshev polynomials with |x| < 1 and large n, then the three-term
  recurrence, which here is one ``lax.while_loop`` up to the largest n among the elements that
  need it, each element masked once its own n is reached (or, as torch stops, once it is NaN).
  In float32 the trigonometric forms use fdlibm's acosf, glibc's float acos, operation for
  operation: its result is multiplied by n, which would magnify an ulp of difference.
* Bessel, modified Bessel and Airy functions use the Cephes rational approximations torch uses,
  with the published coefficients, in the input dtype.
"""

from __future__ import annotations

import jax.numpy as jnp
import jax.scipy.special as jax_special
import torch
from jax import lax

from . import pointwise as _pw
from .registry import lowering

aten = torch.ops.aten
prims = torch.ops.prims

_check = _pw._check


# -- helpers ---------------------------------------------------------------------------------------
def _operands(ctx, x, n):
    """x and n in torch's computation dtype, broadcast; n truncated to int64 as C++ does."""
    x, n = jnp.broadcast_arrays(*_pw._through(ctx.out_dtype, x, n))
    return x, _pw._convert(n, jnp.int64)


def _f(dt, v):
    """An integer (or float) array as dtype ``dt``."""
    return jnp.asarray(v).astype(dt)


# fdlibm's acosf (the C library's float acos on glibc), in float32 operations: the Chebyshev
# closed forms multiply acos(x) by n, so one ulp of difference would grow n-fold
_ACOSF_PI, _ACOSF_PIO2_HI, _ACOSF_PIO2_LO = 3.1415925026e+00, 1.5707962513e+00, 7.5497894159e-08
_ACOSF_P = (1.6666667163e-01, -3.2556581497e-01, 2.0121252537e-01, -4.0055535734e-02, 7.9153501429e-04,
            3.4793309169e-05)
_ACOSF_Q = (-2.4033949375e+00, 2.0209457874e+00, -6.8828397989e-01, 7.7038154006e-02)


def _mul32(a, b):
    """a * b rounded to float32 as its own operation.  XLA's CPU backend contracts a multiply
    feeding an add into an FMA (one rounding instead of two), even through a float64 round trip;
    a select on the product keeps it apart (for NaN, p + 1 is NaN too)."""
    p = jnp.asarray(a, jnp.float32) * jnp.asarray(b, jnp.float32)
    return jnp.where(p == p, p, p + 1)


def _horner(z, coefficients):
    """c0 + z * (c1 + z * (... + z * cn)) in float32, each operation rounded as C rounds it."""
    out = jnp.full_like(z, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        out = c + _mul32(z, out)
    return out


def _acosf(x):
    f32 = jnp.float32
    c = lambda v: jnp.asarray(v, f32)  # noqa: E731
    mul = _mul32

    def ratio(z):
        return mul(z, _horner(z, _ACOSF_P)) / (1 + mul(z, _horner(z, _ACOSF_Q)))

    ax = jnp.abs(x)
    small = ax < 0.5
    # |x| < 0.5
    xs = jnp.where(small, x, 0)
    tiny = ax <= lax.bitcast_convert_type(jnp.uint32(0x23000000), f32)
    r = ratio(mul(xs, xs))
    v_small = jnp.where(tiny, c(_ACOSF_PIO2_HI) + c(_ACOSF_PIO2_LO),
                        c(_ACOSF_PIO2_HI) - (xs - (c(_ACOSF_PIO2_LO) - mul(xs, r))))
    # x <= -0.5
    zn = mul(1 + jnp.where(small, -0.5, jnp.minimum(x, 0)), 0.5)
    sn = jnp.sqrt(zn)
    v_neg = c(_ACOSF_PI) - mul(2, sn + (mul(ratio(zn), sn) - c(_ACOSF_PIO2_LO)))
    # x >= 0.5
    zp = mul(1 - jnp.where(small, 0.5, jnp.maximum(x, 0)), 0.5)
    sp = jnp.sqrt(zp)
    df = lax.bitcast_convert_type(lax.bitcast_convert_type(sp, jnp.uint32) & jnp.uint32(0xFFFFF000), f32)
    corr = (zp - mul(df, df)) / (sp + df)
    v_pos = mul(2, df + (mul(ratio(zp), sp) + corr))
    v = jnp.where(small, v_small, jnp.where(x < 0, v_neg, v_pos))
    v = jnp.where(x == 1, c(0.0), jnp.where(x == -1, c(_ACOSF_PI) + 2 * c(_ACOSF_PIO2_LO), v))
    return jnp.where(ax > 1, jnp.nan, v).astype(f32)


def _trig(dt):
    """acos/sin/cos as torch's scalar kernels call them: float64 is XLA's own; float32 uses
    fdlibm's acosf and sin/cos computed in float64 and rounded (glibc's are within an ulp)."""
    if jnp.dtype(dt) == jnp.float64:
        return jnp.arccos, jnp.sin, jnp.cos

    def wrap(fn):
        return lambda v: fn(v.astype(jnp.float64)).astype(dt)
    return _acosf, wrap(jnp.sin), wrap(jnp.cos)


def _recurrence(steps, p, q, step, *, nan_stop=True):
    """Apply ``(p, q) -> (q, step(j, p, q))`` for j = 0 .. steps - 1 per element (torch's loops,
    which also stop once q is NaN when ``nan_stop``); returns q.  Elements whose steps <= 0 keep
    their q."""
    def active(j, q):
        on = j < steps
        return on & ~jnp.isnan(q) if nan_stop else on

    def cond(carry):
        j, _, q = carry
        return jnp.any(active(j, q))

    def body(carry):
        j, p, q = carry
        on = active(j, q)
        r = step(j, p, q)
        return j + 1, jnp.where(on, q, p), jnp.where(on, r, q)

    if q.size == 0:
        return q
    _, _, q = lax.while_loop(cond, body, (jnp.int64(0), p, q))
    return q


def _cases(default, *cases):
    """The value of the first (mask, value) pair whose mask holds, else ``default``."""
    out = default
    for mask, value in reversed(cases):
        out = jnp.where(mask, jnp.asarray(value).astype(default.dtype), out)
    return out


def _sign_by_parity(n, value):
    return jnp.where(n % 2 == 0, value, -value)


# -- Chebyshev polynomials -------------------------------------------------------------------------
def _chebyshev(kind, x, n, *, shifted):
    dt = x.dtype
    acos, sin, cos = _trig(dt)
    mul = _mul32 if jnp.dtype(dt) == jnp.float32 else jnp.multiply
    one = jnp.ones_like(x)
    y = x + x - 1 if shifted else x          # the argument of the unshifted polynomial
    nf = _f(dt, n)
    odd_sign = _sign_by_parity(n, one)
    two_n_1 = _f(dt, n + n + 1)
    n_1 = _f(dt, n + 1)

    # the value at y == 1 and at y == -1 (x == 1 and x == 0 when shifted)
    at_one = {"t": one, "u": n_1, "v": one, "w": two_n_1}[kind]
    at_minus_one = {"t": odd_sign, "u": _sign_by_parity(n, n_1), "v": _sign_by_parity(n, two_n_1),
                    "w": odd_sign}[kind]
    if shifted:
        is_one, is_minus_one = x == 1, x == 0
    else:
        is_one, is_minus_one = (jnp.abs(x) == 1) & (x > 0), (jnp.abs(x) == 1) & (x < 0)

    threshold = {"t": 6, "u": 8, "v": 8, "w": 8}[kind] if not shifted else {"t": 6, "u": 6, "v": 6, "w": 4}[kind]
    trig = (n > threshold) & (jnp.abs(y) < 1)
    theta = acos(jnp.where(trig, y, 0))
    if kind == "t":
        closed = cos(mul(nf, theta))
    elif kind == "u":
        s = sin(theta)
        closed = jnp.where(s != 0, sin(mul(n_1, theta)) / s, n_1 * cos(mul(n_1, theta)) / y)
    elif kind == "v":
        half = theta / 2
        closed = jnp.where(sin(half) != 1, cos(mul(nf + 0.5, theta)) / cos(half), _sign_by_parity(n, two_n_1))
    else:
        half = theta / 2
        fallback = jnp.where(y > 0, two_n_1, odd_sign) if not shifted else odd_sign
        closed = jnp.where(cos(half) != 1, sin(mul(nf + 0.5, theta)) / sin(half), fallback)

    first = {"t": y, "u": y + y, "v": y + y - 1, "w": y + y + 1}[kind]
    special = (n < 0) | is_one | is_minus_one | trig
    steps = jnp.where(special | (n < 2), 0, n - 1)
    two_y = y + y
    value = _recurrence(steps, one, first, lambda j, p, q: two_y * q - p)
    return _cases(value, (n < 0, 0.0), (is_one, at_one), (is_minus_one, at_minus_one), (trig, closed),
                  (n == 0, 1.0), (n == 1, first))


def _chebyshev_rule(kind, shifted):
    def rule(ctx, x, n):
        return _chebyshev(kind, *_operands(ctx, x, n), shifted=shifted)
    rule.__qualname__ = f"{'shifted_' if shifted else ''}chebyshev_polynomial_{kind}"
    return rule


def _overloads(packet):
    return (packet.default, packet.x_scalar, packet.n_scalar)


for _kind in "tuvw":
    lowering(*_overloads(getattr(aten, f"special_chebyshev_polynomial_{_kind}")), check=_check)(
        _chebyshev_rule(_kind, False))
    lowering(*_overloads(getattr(aten, f"special_shifted_chebyshev_polynomial_{_kind}")), check=_check)(
        _chebyshev_rule(_kind, True))


# -- Hermite, Laguerre and Legendre polynomials ----------------------------------------------------
def _hermite_limit(dt):
    return 128 if jnp.dtype(dt) == jnp.float32 else 512


@lowering(*_overloads(aten.special_hermite_polynomial_h), check=_check)
def hermite_polynomial_h(ctx, x, n):
    x, n = _operands(ctx, x, n)
    dt = x.dtype
    too_big = n > _hermite_limit(dt)
    steps = jnp.where(too_big | (n < 2), 0, n - 1)
    # k = 2, 4, ..., 2n - 2
    value = _recurrence(steps, jnp.ones_like(x), x + x,
                        lambda j, p, q: (x + x) * q - _f(dt, 2 * j + 2) * p, nan_stop=False)
    return _cases(value, (n < 0, 0.0), (n == 0, 1.0), (n == 1, x + x), (too_big, jnp.nan))


@lowering(*_overloads(aten.special_hermite_polynomial_he), check=_check)
def hermite_polynomial_he(ctx, x, n):
    x, n = _operands(ctx, x, n)
    dt = x.dtype
    too_big = n > _hermite_limit(dt)
    steps = jnp.where(too_big | (n < 2), 0, n - 1)
    value = _recurrence(steps, jnp.ones_like(x), x, lambda j, p, q: x * q - _f(dt, j + 1) * p, nan_stop=False)
    return _cases(value, (n < 0, 0.0), (n == 0, 1.0), (n == 1, x), (too_big, jnp.nan))


@lowering(*_overloads(aten.special_laguerre_polynomial_l), check=_check)
def laguerre_polynomial_l(ctx, x, n):
    x, n = _operands(ctx, x, n)
    dt = x.dtype
    zero = jnp.abs(x) == 0
    steps = jnp.where(zero | (n < 2), 0, n - 1)

    def step(j, p, q):
        k = j + 1
        return _pw._divide((_f(dt, k + k) + (1 - x)) * q - _f(dt, k) * p, _f(dt, k + 1))
    value = _recurrence(steps, jnp.ones_like(x), 1 - x, step)
    return _cases(value, (n < 0, 0.0), (zero, 1.0), (n == 0, 1.0), (n == 1, 1 - x))


@lowering(*_overloads(aten.special_legendre_polynomial_p), check=_check)
def legendre_polynomial_p(ctx, x, n):
    x, n = _operands(ctx, x, n)
    dt = x.dtype
    one = jnp.ones_like(x)
    unit = jnp.abs(x) == 1
    steps = jnp.where(unit | (n < 2), 0, n - 1)

    def step(j, p, q):
        k = j + 1
        return _pw._divide(_f(dt, k + k + 1) * x * q - _f(dt, k) * p, _f(dt, k + 1))
    value = _recurrence(steps, one, x, step)
    at_unit = jnp.where((x > 0) | (n % 2 == 0), one, -one)
    return _cases(value, (n < 0, 0.0), (unit, at_unit), (n == 0, 1.0), (n == 1, x))


# -- erfcx, spherical Bessel j0, modified Bessel i0/i1, frexp --------------------------------------
_ERFCX_TERMS = 80


def _erfcx(x):
    """torch's calc_erfcx: JAX's erfcx (in float64) up to 4, where its erfc * exp(x * x) starts to
    underflow; above, the continued fraction 1/sqrt(pi) / (x + (1/2) / (x + 1 / (x + (3/2) / ...)))
    (80 terms: below 1e-16 relative error from 4 on); for x < 0, 2 exp(x * x) - erfcx(-x) with
    x * x rounded in the input dtype as torch computes it (the second term dropped below -6.1,
    inf below -26.7)."""
    dt = x.dtype
    x64 = x.astype(jnp.float64)
    square = (_mul32(x, x) if dt == jnp.float32 else x * x).astype(jnp.float64)
    ax = jnp.abs(x64)
    big = ax > 4
    t = jnp.where(big, ax, 5.0)
    cf = t
    for k in range(_ERFCX_TERMS, 0, -1):
        cf = t + (k / 2) / cf
    cf = (1 / jnp.sqrt(jnp.pi)) / cf
    positive = jnp.where(big, cf, jax_special.erfcx(jnp.where(big, 0.0, ax)))   # erfcx(|x|)
    # x < 0: 2 exp(x * x) - erfcx(-x), the term dropped below -6.1
    negative = jnp.where(x64 < -6.1, 2 * jnp.exp(square), 2 * jnp.exp(square) - positive)
    value = jnp.where(x64 < 0, negative, positive)
    value = jnp.where(x64 < -26.7, jnp.inf, value)
    value = jnp.where(x64 == jnp.inf, 0.0, value)
    return jnp.where(x != x, x64, value).astype(dt)


def _spherical_bessel_j0(x):
    # torch: 0 at +-inf, a Taylor polynomial in x * x below 0.5, sin(x) / x elsewhere
    xx = x * x
    series = 1 + xx * _horner(xx, (-1 / 6, 1 / 120, -1 / 5040, 1 / 362880, -1 / 39916800, 1 / 6227020800)) \
        if x.dtype == jnp.float32 else 1 + xx * _horner64(xx, (-1 / 6, 1 / 120, -1 / 5040, 1 / 362880,
                                                                 -1 / 39916800, 1 / 6227020800))
    value = jnp.where(jnp.abs(x) < 0.5, series, jnp.sin(x) / jnp.where(x == 0, 1, x))
    return jnp.where(jnp.isinf(x), jnp.zeros_like(x), value)


def _horner64(z, coefficients):
    out = jnp.full_like(z, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        out = c + z * out
    return out


def _i0(x):
    return lax.bessel_i0e(x) * jnp.exp(jnp.abs(x))


def _i1(x):
    return lax.bessel_i1e(x) * jnp.exp(jnp.abs(x))


for _op, _fn in {
    aten.special_erfcx.default: _erfcx, prims.erfcx.default: _erfcx,
    aten.special_spherical_bessel_j0.default: _spherical_bessel_j0,
    prims.spherical_bessel_j0.default: _spherical_bessel_j0,
    aten.special_modified_bessel_i0.default: _i0, aten.special_modified_bessel_i1.default: _i1,
}.items():
    lowering(_op, check=_check)(_pw._float_unary_rule(_fn))


def _frexp(x):
    """Mantissa in [0.5, 1) and int32 exponent, from the bits (XLA's CPU arithmetic flushes
    subnormals to zero, which frexp must not do); 0, inf and NaN give themselves and exponent 0."""
    dt = jnp.dtype(x.dtype)
    if dt == jnp.float64:
        uint, sint, bits, mant_bits, bias = jnp.uint64, jnp.int64, 64, 52, 1022
    else:
        x = x.astype(jnp.float32)
        uint, sint, bits, mant_bits, bias = jnp.uint32, jnp.int32, 32, 23, 126
    u = lax.bitcast_convert_type(x, uint)
    sign = u & uint(1 << (bits - 1))
    exp_field = ((u >> mant_bits) & uint((1 << (bits - 1 - mant_bits)) - 1)).astype(sint)
    frac = u & uint((1 << mant_bits) - 1)
    # subnormals: shift the fraction up until its leading one is the implicit bit
    shift = (lax.clz(frac) - (bits - 1 - mant_bits)).astype(sint)
    subnormal = (exp_field == 0) & (frac != 0)
    frac = jnp.where(subnormal, (frac << jnp.where(subnormal, shift, 0).astype(uint)) & uint((1 << mant_bits) - 1), frac)
    exponent = jnp.where(subnormal, 1 - shift - bias, exp_field - bias)
    mantissa = lax.bitcast_convert_type(sign | (uint(bias) << mant_bits) | frac, x.dtype)
    finite_nonzero = (exp_field != (1 << (bits - 1 - mant_bits)) - 1) & ((exp_field != 0) | subnormal)
    return jnp.where(finite_nonzero, mantissa, x), jnp.where(finite_nonzero, exponent, 0).astype(jnp.int32)


def _frexp_check(ctx):
    reason = _pw._dtype_reason(ctx)
    if reason is None and ctx.tensor_args()[0].dtype not in (torch.float32, torch.float64):
        return "frexp of float16/bfloat16 is not lowered"
    if reason is None:
        _pw._probe(ctx)
    return reason


@lowering(aten.frexp.Tensor, prims.frexp.default, check=_frexp_check)
def frexp(ctx, x):
    return _frexp(x)
