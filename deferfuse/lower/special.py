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
* Bessel j0, j1, y0, y1, modified Bessel k0, k1 (plain and exponentially scaled) and Airy Ai use
  the Cephes rational and Chebyshev approximations torch uses, with the published coefficients,
  the same branch points and special cases (y0/y1 -inf at 0 and NaN below; k0/k1 inf at 0, NaN
  below, 0 at inf; Ai NaN at +-inf, 0 above 103.892), in the input dtype.  Ai's Maclaurin series
  (|x| < 2.09) runs as one ``lax.while_loop``, each element stopping where torch's loop stops.
  In float32 the operations round as torch's build rounds them: fused multiply-adds where GCC
  contracts its expressions, divisions by scalars and square roots kept as divisions (XLA would
  take reciprocals).  Modified Bessel i0 and i1 are XLA's i0e and i1e, scaled back.
* erfcx, spherical Bessel j0 and frexp: see their functions.
"""

from __future__ import annotations

import torch

from . import common
from . import xla_fixes
from .registry import lowering
from .._lazy import lazy_import

jnp = lazy_import("jax.numpy", globals(), "jnp")
jax_special = lazy_import("jax.scipy.special", globals(), "jax_special")
lax = lazy_import("jax.lax", globals(), "lax")

aten = torch.ops.aten
prims = torch.ops.prims


# -- helpers ---------------------------------------------------------------------------------------
def _operands(ctx, x, n):
    """x and n in torch's computation dtype, broadcast; n truncated to int64 as C++ does."""
    x, n = jnp.broadcast_arrays(*common.through(ctx.out_dtype, x, n))
    return x, common.convert(n, jnp.int64)


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


def _fma(a, b, c):
    """a * b + c rounded once, as a fused multiply-add: in float32 through float64 (where the
    product is exact); in float64 XLA's CPU backend contracts the expression itself."""
    if jnp.result_type(a, b, c) == jnp.float32:
        a, b, c = (jnp.asarray(v, jnp.float32).astype(jnp.float64) for v in (a, b, c))
        return (a * b + c).astype(jnp.float32)
    return a * b + c


def _horner(z, coefficients, *, fused=False):
    """c0 + z * (c1 + z * (... + z * cn)) in float32, each operation rounded as C rounds it;
    ``fused``: each step one fused multiply-add, as GCC contracts torch's loops (-mfma)."""
    out = jnp.full_like(z, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        out = _fma(z, out, jnp.float32(c)) if fused else c + _mul32(z, out)
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
    lowering(*_overloads(getattr(aten, f"special_chebyshev_polynomial_{_kind}")), check=common.check)(
        _chebyshev_rule(_kind, False))
    lowering(*_overloads(getattr(aten, f"special_shifted_chebyshev_polynomial_{_kind}")), check=common.check)(
        _chebyshev_rule(_kind, True))


# -- Hermite, Laguerre and Legendre polynomials ----------------------------------------------------
def _hermite_limit(dt):
    return 128 if jnp.dtype(dt) == jnp.float32 else 512


@lowering(*_overloads(aten.special_hermite_polynomial_h), check=common.check)
def hermite_polynomial_h(ctx, x, n):
    x, n = _operands(ctx, x, n)
    dt = x.dtype
    too_big = n > _hermite_limit(dt)
    steps = jnp.where(too_big | (n < 2), 0, n - 1)
    # k = 2, 4, ..., 2n - 2
    value = _recurrence(steps, jnp.ones_like(x), x + x,
                        lambda j, p, q: (x + x) * q - _f(dt, 2 * j + 2) * p, nan_stop=False)
    return _cases(value, (n < 0, 0.0), (n == 0, 1.0), (n == 1, x + x), (too_big, jnp.nan))


@lowering(*_overloads(aten.special_hermite_polynomial_he), check=common.check)
def hermite_polynomial_he(ctx, x, n):
    x, n = _operands(ctx, x, n)
    dt = x.dtype
    too_big = n > _hermite_limit(dt)
    steps = jnp.where(too_big | (n < 2), 0, n - 1)
    value = _recurrence(steps, jnp.ones_like(x), x, lambda j, p, q: x * q - _f(dt, j + 1) * p, nan_stop=False)
    return _cases(value, (n < 0, 0.0), (n == 0, 1.0), (n == 1, x), (too_big, jnp.nan))


@lowering(*_overloads(aten.special_laguerre_polynomial_l), check=common.check)
def laguerre_polynomial_l(ctx, x, n):
    x, n = _operands(ctx, x, n)
    dt = x.dtype
    zero = jnp.abs(x) == 0
    steps = jnp.where(zero | (n < 2), 0, n - 1)

    def step(j, p, q):
        k = j + 1
        return common.divide((_f(dt, k + k) + (1 - x)) * q - _f(dt, k) * p, _f(dt, k + 1))
    value = _recurrence(steps, jnp.ones_like(x), 1 - x, step)
    return _cases(value, (n < 0, 0.0), (zero, 1.0), (n == 0, 1.0), (n == 1, 1 - x))


@lowering(*_overloads(aten.special_legendre_polynomial_p), check=common.check)
def legendre_polynomial_p(ctx, x, n):
    x, n = _operands(ctx, x, n)
    dt = x.dtype
    one = jnp.ones_like(x)
    unit = jnp.abs(x) == 1
    steps = jnp.where(unit | (n < 2), 0, n - 1)

    def step(j, p, q):
        k = j + 1
        return common.divide(_f(dt, k + k + 1) * x * q - _f(dt, k) * p, _f(dt, k + 1))
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
    negative = jnp.where(x64 < -6.1, 2 * xla_fixes.exp(square), 2 * xla_fixes.exp(square) - positive)
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
    return lax.bessel_i0e(x) * xla_fixes.exp(jnp.abs(x))


def _i1(x):
    return lax.bessel_i1e(x) * xla_fixes.exp(jnp.abs(x))


# -- Bessel J0, J1, Y0, Y1, modified Bessel K0, K1 (and scaled), Airy Ai -------------------------
# torch's kernels (Math.h) are Cephes' j0, j1, y0, y1, k0, k1, k0e, k1e and airy, evaluated in the
# input dtype; the coefficient tables below are Cephes' published ones, highest power first, as
# torch's loops ``p = p * z + C[i]`` (and chbevl's Clenshaw sums) read them.  torch's AVX2 CPU
# kernels are built with -mfma, and GCC contracts a product into the add or subtraction that uses
# it (the first product of ``a * b + c * d``; not x * x, which the polynomial loops also use):
# float32 follows that, with _fma where GCC fuses and _mul32 where it rounds the product, and
# matches torch bit for bit on about 99% of inputs (the rest an ulp or two off: double rounding
# in _fma, the C library's last bit); float64 leaves the contraction to XLA.  sin, cos, log and
# exp are computed in float64 and rounded for float32 (glibc's sinf, cosf, logf and expf are
# within an ulp, almost always the correctly rounded value).  A division by a scalar goes through
# _div and one by a square root through _over_sqrt: XLA would otherwise multiply by a reciprocal.
_J0_PP = (7.96936729297347051624e-04, 8.28352392107440799803e-02, 1.23953371646414299388e+00,
          5.44725003058768775090e+00, 8.74716500199817011941e+00, 5.30324038235394892183e+00,
          9.99999999999999997821e-01)
_J0_PQ = (9.24408810558863637013e-04, 8.56288474354474431428e-02, 1.25352743901058953537e+00,
          5.47097740330417105182e+00, 8.76190883237069594232e+00, 5.30605288235394617618e+00,
          1.00000000000000000218e+00)
_J0_QP = (-1.13663838898469149931e-02, -1.28252718670509318512e+00, -1.95539544257735972385e+01,
          -9.32060152123768231369e+01, -1.77681167980488050595e+02, -1.47077505154951170175e+02,
          -5.14105326766599330220e+01, -6.05014350600728481186e+00)
_J0_QQ = (6.43178256118178023184e+01, 8.56430025976980587198e+02, 3.88240183605401609683e+03,
          7.24046774195652478189e+03, 5.93072701187316984827e+03, 2.06209331660327847417e+03,
          2.42005740240291393179e+02)
_J0_RP = (-4.79443220978201773821e+09, 1.95617491946556577543e+12, -2.49248344360967716204e+14,
          9.70862251047306323952e+15)
_J0_RQ = (4.99563147152651017219e+02, 1.73785401676374683123e+05, 4.84409658339962045305e+07,
          1.11855537045356834862e+10, 2.11277520115489217587e+12, 3.10518229857422583814e+14,
          3.18121955943204943306e+16, 1.71086294081043136091e+18)
_J0_ZEROS_SQUARED = (5.78318596294678452118e+00, 3.04712623436620863991e+01)
_Y0_YP = (1.55924367855235737965e+04, -1.46639295903971606143e+07, 5.43526477051876500413e+09,
          -9.82136065717911466409e+11, 8.75906394395366999549e+13, -3.46628303384729719441e+15,
          4.42733268572569800351e+16, -1.84950800436986690637e+16)
_Y0_YQ = (1.04128353664259848412e+03, 6.26107330137134956842e+05, 2.68919633393814121987e+08,
          8.64002487103935000337e+10, 2.02979612750105546709e+13, 3.17157752842975028269e+15,
          2.50596256172653059228e+17)

_J1_PP = (7.62125616208173112003e-04, 7.31397056940917570436e-02, 1.12719608129684925192e+00,
          5.11207951146807644818e+00, 8.42404590141772420927e+00, 5.21451598682361504063e+00,
          1.00000000000000000254e+00)
_J1_PQ = (5.71323128072548699714e-04, 6.88455908754495404082e-02, 1.10514232634061696926e+00,
          5.07386386128601488557e+00, 8.39985554327604159757e+00, 5.20982848682361821619e+00,
          9.99999999999999997461e-01)
_J1_QP = (5.10862594750176621635e-02, 4.98213872951233449420e+00, 7.58238284132545283818e+01,
          3.66779609360150777800e+02, 7.10856304998926107277e+02, 5.97489612400613639965e+02,
          2.11688757100572135698e+02, 2.52070205858023719784e+01)
_J1_QQ = (7.42373277035675149943e+01, 1.05644886038262816351e+03, 4.98641058337653607651e+03,
          9.56231892404756170795e+03, 7.99704160447350683650e+03, 2.82619278517639096600e+03,
          3.36093607810698293419e+02)
_J1_RP = (-8.99971225705559398224e+08, 4.52228297998194034323e+11, -7.27494245221818276015e+13,
          3.68295732863852883286e+15)
_J1_RQ = (6.20836478118054335476e+02, 2.56987256757748830383e+05, 8.35146791431949253037e+07,
          2.21511595479792499675e+10, 4.74914122079991414898e+12, 7.84369607876235854894e+14,
          8.95222336184627338078e+16, 5.32278620332680085395e+18)
_J1_ZEROS_SQUARED = (1.46819706421238932572e+01, 4.92184563216946036703e+01)
_Y1_YP = (1.26320474790178026440e+09, -6.47355876379160291031e+11, 1.14509511541823727583e+14,
          -8.12770255501325109621e+15, 2.02439475713594898196e+17, -7.78877196265950026825e+17)
_Y1_YQ = (5.94301592346128195359e+02, 2.35564092943068577943e+05, 7.34811944459721705660e+07,
          1.87601316108706159478e+10, 3.88231277496238566008e+12, 6.20557727146953693363e+14,
          6.87141087355300489866e+16, 3.97270608116560655612e+18)

_PIO4, _3PIO4 = 0.785398163397448309615660845819875721, 2.356194490192344928846982537459627163
_SQ2OPI, _TWOOPI = 0.797884560802865355879892119868763737, 0.636619772367581343075535053490057448

# Chebyshev series: i0 and i1 on [0, 8] (in |x| / 2 - 2), k0 and k1 on [0, 2] (in x * x - 2) and
# the exponentially scaled k0 and k1 on (2, inf) (in 8 / x - 2)
_I0_A = (-4.41534164647933937950e-18, 3.33079451882223809783e-17, -2.43127984654795469359e-16,
         1.71539128555513303061e-15, -1.16853328779934516808e-14, 7.67618549860493561688e-14,
         -4.85644678311192946090e-13, 2.95505266312963983461e-12, -1.72682629144155570723e-11,
         9.67580903537323691224e-11, -5.18979560163526290666e-10, 2.65982372468238665035e-09,
         -1.30002500998624804212e-08, 6.04699502254191894932e-08, -2.67079385394061173391e-07,
         1.11738753912010371815e-06, -4.41673835845875056359e-06, 1.64484480707288970893e-05,
         -5.75419501008210370398e-05, 1.88502885095841655729e-04, -5.76375574538582365885e-04,
         1.63947561694133579842e-03, -4.32430999505057594430e-03, 1.05464603945949983183e-02,
         -2.37374148058994688156e-02, 4.93052842396707084878e-02, -9.49010970480476444210e-02,
         1.71620901522208775349e-01, -3.04682672343198398683e-01, 6.76795274409476084995e-01)
_I1_A = (2.77791411276104639959e-18, -2.11142121435816608115e-17, 1.55363195773620046921e-16,
         -1.10559694773538630805e-15, 7.60068429473540693410e-15, -5.04218550472791168711e-14,
         3.22379336594557470981e-13, -1.98397439776494371520e-12, 1.17361862988909016308e-11,
         -6.66348972350202774223e-11, 3.62559028155211703701e-10, -1.88724975172282928790e-09,
         9.38153738649577178388e-09, -4.44505912879632808065e-08, 2.00329475355213526229e-07,
         -8.56872026469545474066e-07, 3.47025130813767847674e-06, -1.32731636560394358279e-05,
         4.78156510755005422638e-05, -1.61760815825896745588e-04, 5.12285956168575772895e-04,
         -1.51357245063125314899e-03, 4.15642294431288815669e-03, -1.05640848946261981558e-02,
         2.47264490306265168283e-02, -5.29459812080949914269e-02, 1.02643658689847095384e-01,
         -1.76416518357834055153e-01, 2.52587186443633654823e-01)
_K0_A = (1.37446543561352307156e-16, 4.25981614279661018399e-14, 1.03496952576338420167e-11,
         1.90451637722020886025e-09, 2.53479107902614945675e-07, 2.28621210311945178607e-05,
         1.26461541144692592338e-03, 3.59799365153615016266e-02, 3.44289899924628486886e-01,
         -5.35327393233902768720e-01)
_K0_B = (5.30043377268626276149e-18, -1.64758043015242134646e-17, 5.21039150503902756861e-17,
         -1.67823109680541210385e-16, 5.51205597852431940784e-16, -1.84859337734377901440e-15,
         6.34007647740507060557e-15, -2.22751332699166985548e-14, 8.03289077536357521100e-14,
         -2.98009692317273043925e-13, 1.14034058820847496303e-12, -4.51459788337394416547e-12,
         1.85594911495471785253e-11, -7.95748924447710747776e-11, 3.57739728140030116597e-10,
         -1.69753450938905987466e-09, 8.57403401741422608519e-09, -4.66048989768794782956e-08,
         2.76681363944501510342e-07, -1.83175552271911948767e-06, 1.39498137188764993662e-05,
         -1.28495495816278026384e-04, 1.56988388573005337491e-03, -3.14481013119645005427e-02,
         2.44030308206595545468e+00)
_K1_A = (-7.02386347938628759343e-18, -2.42744985051936593393e-15, -6.66690169419932900609e-13,
         -1.41148839263352776110e-10, -2.21338763073472585583e-08, -2.43340614156596823496e-06,
         -1.73028895751305206302e-04, -6.97572385963986435018e-03, -1.22611180822657148235e-01,
         -3.53155960776544875667e-01, 1.52530022733894777053e+00)
_K1_B = (-5.75674448366501715755e-18, 1.79405087314755922667e-17, -5.68946255844285935196e-17,
         1.83809354436663880070e-16, -6.05704724837331885336e-16, 2.03870316562433424052e-15,
         -7.01983709041831346144e-15, 2.47715442448130437068e-14, -8.97670518232499435011e-14,
         3.34841966607842919884e-13, -1.28917396095102890680e-12, 5.13963967348173025100e-12,
         -2.12996783842756842877e-11, 9.21831518760500529508e-11, -4.19035475934189648750e-10,
         2.01504975519703286596e-09, -1.03457624656780970260e-08, 5.74108412545004946722e-08,
         -3.50196060308781257119e-07, 2.40648494783721712015e-06, -1.93619797416608296024e-05,
         1.95215518471351631108e-04, -2.85781685962277938680e-03, 1.03923736576817238437e-01,
         2.72062619048444266945e+00)

# Airy Ai: rational forms in 1 / zeta above 2.09, in 1 / zeta' (and its square) below -2.09
_AI_AN = (3.46538101525629032477e-01, 1.20075952739645805542e+01, 7.62796053615234516538e+01,
          1.68089224934630576269e+02, 1.59756391350164413639e+02, 7.05360906840444183113e+01,
          1.40264691163389668864e+01, 9.99999999999999995305e-01)
_AI_AD = (5.67594532638770212846e-01, 1.47562562584847203173e+01, 8.45138970141474626562e+01,
          1.77318088145400459522e+02, 1.64234692871529701831e+02, 7.14778400825575695274e+01,
          1.40959135607834029598e+01, 1.00000000000000000470e+00)
_AI_AFN = (-1.31696323418331795333e-01, -6.26456544431912369773e-01, -6.93158036036933542233e-01,
           -2.79779981545119124951e-01, -4.91900132609500318020e-02, -4.06265923594885404393e-03,
           -1.59276496239262096340e-04, -2.77649108155232920844e-06, -1.67787698489114633780e-08)
_AI_AFD = (1.33560420706553243746e+01, 3.26825032795224613948e+01, 2.67367040941499554804e+01,
           9.18707402907259625840e+00, 1.47529146771666414581e+00, 1.15687173795188044134e-01,
           4.40291641615211203805e-03, 7.54720348287414296618e-05, 4.51850092970580378464e-07)
_AI_AGN = (1.97339932091685679179e-02, 3.91103029615688277255e-01, 1.06579897599595591108e+00,
           9.39169229816650230044e-01, 3.51465656105547619242e-01, 6.33888919628925490927e-02,
           5.85804113048388458567e-03, 2.82851600836737019778e-04, 6.98793669997260967291e-06,
           8.11789239554389293311e-08, 3.41551784765923618484e-10)
_AI_AGD = (9.30892908077441974853e+00, 1.98352928718312140417e+01, 1.55646628932864612953e+01,
           5.47686069422975497931e+00, 9.54293611618961883998e-01, 8.64580826352392193095e-02,
           4.12656523824222607191e-03, 1.01259085116509135510e-04, 1.17166733214413521882e-06,
           4.91834570062930015649e-09)
_AI_C1, _AI_C2, _SQPII = 0.355028053887817239260, 0.258819403792806798405, 5.64189583547756286948e-01


def _mul_of(x):
    """The product as C rounds it in x's dtype (no FMA contraction in float32)."""
    return _mul32 if x.dtype == jnp.float32 else jnp.multiply


def _libm(x, fn):
    """sin, cos, log or exp of x as the C library computes it in x's dtype."""
    if x.dtype == jnp.float32:
        return fn(x.astype(jnp.float64)).astype(jnp.float32)
    return fn(x)


def _poly(z, coefficients):
    """torch's ``p = 0; for c in coefficients: p = p * z + c`` (highest power first)."""
    if z.dtype == jnp.float32:
        return _horner(z, coefficients[::-1], fused=True)
    return _horner64(z, coefficients[::-1])


def _chbevl(y, coefficients):
    """Cephes' chbevl: the Clenshaw sum of a Chebyshev series at y / 2, as torch's loops run it."""
    b0, b1, b2 = jnp.full_like(y, coefficients[0]), jnp.zeros_like(y), jnp.zeros_like(y)
    for c in coefficients[1:]:
        b2, b1 = b1, b0
        b0 = _fma(y, b1, -b2) + c
    return 0.5 * (b0 - b2)


def _div(x, y):
    """x / y for a scalar y, rounded once (XLA would multiply by the rounded reciprocal)."""
    return common.divide(x, jnp.asarray(y, x.dtype))


def _over_sqrt(a, x):
    """a / sqrt(x) rounded once (XLA would multiply by an approximate reciprocal square root;
    a select on the root, like _mul32's, keeps the division)."""
    r = jnp.sqrt(x)
    return a / jnp.where(r == r, r, r + 1)


def _guard(mask, x, value):
    """x where mask holds, else a harmless ``value`` (so the other branch's NaNs stay out)."""
    return jnp.where(mask, x, jnp.asarray(value, x.dtype))


def _hankel(x, w, pp, pq, qp, qq, phase, *, y):
    """The asymptotic form above 5: (P cos(x - phase) - (5 / x) Q sin(x - phase)) sqrt(2 / pi) / sqrt(x)
    (sin and cos exchanged, + for -, for y0 and y1); w = (5 / x)^2 as the caller rounds it."""
    mul = _mul_of(x)
    p = _poly(w, pp) / _poly(w, pq)
    q = mul(5 / x, _poly(w, qp) / _poly(w, qq))
    s, c = _libm(x - phase, jnp.sin), _libm(x - phase, jnp.cos)
    value = _fma(p, s, mul(q, c)) if y else _fma(p, c, -mul(q, s))
    return _over_sqrt(value * _SQ2OPI, x)


def _bessel_j0(x):
    mul = _mul_of(x)
    ax = jnp.abs(x)
    small = ax <= 5
    xs = _guard(small, ax, 1)
    xx = mul(xs, xs)
    near = mul(xx - _J0_ZEROS_SQUARED[0], xx - _J0_ZEROS_SQUARED[1]) * _poly(xx, _J0_RP) / _poly(xx, _J0_RQ)
    near = jnp.where(xs < 1e-5, 1 - xx / 4, near)
    xl = _guard(~small, ax, 10)
    far = _hankel(xl, 25 / mul(xl, xl), _J0_PP, _J0_PQ, _J0_QP, _J0_QQ, _PIO4, y=False)
    return jnp.where(small, near, far)


def _bessel_j1(x):
    mul = _mul_of(x)
    ax = jnp.abs(x)
    small = ax <= 5
    xs = _guard(small, x, 1)     # the series is odd in x: -j1(-x) exactly, -0 included
    xx = mul(xs, xs)
    near = _poly(xx, _J1_RP) / _poly(xx, _J1_RQ) * xs * (xx - _J1_ZEROS_SQUARED[0]) * (xx - _J1_ZEROS_SQUARED[1])
    xl = _guard(~small, ax, 10)
    far = _hankel(xl, mul(5 / xl, 5 / xl), _J1_PP, _J1_PQ, _J1_QP, _J1_QQ, _3PIO4, y=False)
    # torch: -j1(-x) for x < 0 (NaN stays NaN)
    return jnp.where(small, near, jnp.where(x < 0, -far, far))


def _bessel_y0(x):
    mul = _mul_of(x)
    small = x <= 5
    xs = _guard(small & (x > 0), x, 1)
    xx = mul(xs, xs)
    near = _fma(_TWOOPI * _libm(xs, jnp.log), _bessel_j0(xs), _poly(xx, _Y0_YP) / _poly(xx, _Y0_YQ))
    near = jnp.where(x == 0, -jnp.inf, jnp.where(x < 0, jnp.nan, near))
    xl = _guard(~small, x, 10)
    far = _hankel(xl, 25 / mul(xl, xl), _J0_PP, _J0_PQ, _J0_QP, _J0_QQ, _PIO4, y=True)
    return jnp.where(small, near, far)


def _bessel_y1(x):
    mul = _mul_of(x)
    small = x <= 5
    xs = _guard(small & (x > 0), x, 1)
    xx = mul(xs, xs)
    bracket = _fma(_bessel_j1(xs), _libm(xs, jnp.log), -(1 / xs))
    near = _fma(xs, _poly(xx, _Y1_YP) / _poly(xx, _Y1_YQ), mul(_TWOOPI, bracket))
    near = jnp.where(x == 0, -jnp.inf, jnp.where(x < 0, jnp.nan, near))
    xl = _guard(~small, x, 10)
    far = _hankel(xl, mul(5 / xl, 5 / xl), _J1_PP, _J1_PQ, _J1_QP, _J1_QQ, _3PIO4, y=True)
    return jnp.where(small, near, far)


def _i0_i1_small(x):
    """torch's modified_bessel_i0 and i1 for 0 <= x <= 8 (their Chebyshev series on [0, 8])."""
    mul = _mul_of(x)
    y = x / 2 - 2
    e = _libm(x, jnp.exp)
    return mul(e, _chbevl(y, _I0_A)), mul(mul(_chbevl(y, _I1_A), x), e)


def _bessel_k(x, order, *, scaled):
    """K0 or K1 (times exp(x) when ``scaled``): inf at 0, NaN below 0, a series in x * x - 2 with
    the log term up to 2, an exponentially scaled series in 8 / x - 2 above."""
    dt = x.dtype
    mul = _mul_of(x)
    small = x <= 2
    xs = _guard(small & (x > 0), x, 1)
    i0, i1 = _i0_i1_small(xs)
    series = _chbevl(_fma(xs, xs, -2), _K0_A if order == 0 else _K1_A)
    if order == 0 and not scaled:
        # torch writes log(0.5 * x) with a double 0.5: the log term is summed in float64
        wide = xs.astype(jnp.float64)
        near = (series.astype(jnp.float64) - jnp.log(0.5 * wide) * i0.astype(jnp.float64)).astype(dt)
    elif order == 0:
        near = _fma(-_libm(0.5 * xs, jnp.log), i0, series)
    else:
        near = _fma(_libm(0.5 * xs, jnp.log), i1, series / xs)
    if scaled:
        near = mul(near, _libm(xs, jnp.exp))
    xl = _guard(~small, x, 4)
    far = _chbevl(8 / xl - 2, _K0_B if order == 0 else _K1_B)
    far = _over_sqrt(far if scaled else _libm(-xl, jnp.exp) * far, xl)
    value = jnp.where(small, near, far)
    return jnp.where(x == 0, jnp.inf, jnp.where(x < 0, jnp.nan, value))


def _airy_ai(x):
    dt = x.dtype
    mul = _mul_of(x)
    sin, cos = (lambda v: _libm(v, jnp.sin)), (lambda v: _libm(v, jnp.cos))
    eps = float(jnp.finfo(dt).eps)

    # x < -2.09: the oscillating asymptotic form
    neg = x < -2.09
    xn = _guard(neg, x, -4)
    zeta = _div(-2 * xn * jnp.sqrt(-xn), 3)
    z = 1 / zeta
    zz = mul(z, z)
    t = zeta + jnp.asarray(0.25 * jnp.pi, dt)
    f = 1 + zz * _poly(zz, _AI_AFN) / _poly(zz, _AI_AFD)
    g = z * _poly(zz, _AI_AGN) / _poly(zz, _AI_AGD)
    oscillating = _over_sqrt(_SQPII, jnp.sqrt(-xn)) * _fma(sin(t), f, -mul(cos(t), g))

    # x >= 2.09: the decaying asymptotic form
    pos = x >= 2.09
    xp = _guard(pos, x, 4)
    zeta = _div(2 * xp * jnp.sqrt(xp), 3)
    w = 1 / zeta
    decaying = _SQPII * (_poly(w, _AI_AN) / _poly(w, _AI_AD)) / (2 * jnp.sqrt(jnp.sqrt(xp)) * _libm(zeta, jnp.exp))

    # otherwise the Maclaurin series f(z) and g(z) in z = x^3, until a term of f is below eps
    xs = _guard(~neg & ~pos, x, 0)
    z3 = xs * xs * xs

    def cond(carry):
        return jnp.any(carry[-1] > eps)

    def body(carry):
        k, m, n, f, g, t = carry
        on = t > eps
        m2 = _div(m * z3, k + 1)
        n2 = _div(n * z3, k + 2)
        m2 = _div(m2, k + 2)
        f2 = f + m2
        n2 = _div(n2, k + 3)
        g2 = g + n2
        t2 = jnp.abs(m2 / f2)
        keep = lambda new, old: jnp.where(on, new, old)  # noqa: E731
        return k + 3, keep(m2, m), keep(n2, n), keep(f2, f), keep(g2, g), keep(t2, t)

    one = jnp.ones_like(xs)
    _, _, _, f, g, _ = lax.while_loop(cond, body, (jnp.asarray(1, dt), one, xs, one, xs, one))
    series = _fma(_AI_C1, f, -mul(_AI_C2, g))

    # (torch also sums the series between 2.09 and 8.3203353, then returns the asymptotic form)
    value = jnp.where(neg, oscillating, jnp.where(pos, decaying, series))
    value = jnp.where(x > 103.892, 0, value)
    return jnp.where(jnp.isinf(x), jnp.nan, value)


for _op, _fn in {
    aten.special_erfcx.default: _erfcx, prims.erfcx.default: _erfcx,
    aten.special_spherical_bessel_j0.default: _spherical_bessel_j0,
    prims.spherical_bessel_j0.default: _spherical_bessel_j0,
    aten.special_modified_bessel_i0.default: _i0, aten.special_modified_bessel_i1.default: _i1,
    aten.special_bessel_j0.default: _bessel_j0, prims.bessel_j0.default: _bessel_j0,
    aten.special_bessel_j1.default: _bessel_j1, prims.bessel_j1.default: _bessel_j1,
    aten.special_bessel_y0.default: _bessel_y0, aten.special_bessel_y1.default: _bessel_y1,
    aten.special_modified_bessel_k0.default: lambda x: _bessel_k(x, 0, scaled=False),
    aten.special_modified_bessel_k1.default: lambda x: _bessel_k(x, 1, scaled=False),
    aten.special_scaled_modified_bessel_k0.default: lambda x: _bessel_k(x, 0, scaled=True),
    aten.special_scaled_modified_bessel_k1.default: lambda x: _bessel_k(x, 1, scaled=True),
    aten.special_airy_ai.default: _airy_ai,
}.items():
    lowering(_op, check=common.check)(common.float_unary_rule(_fn))


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
    reason = common.dtype_reason(ctx)
    if reason is None and ctx.tensor_args()[0].dtype not in (torch.float32, torch.float64):
        return "frexp of float16/bfloat16 is not lowered"
    if reason is None:
        common.probe(ctx)
    return reason


@lowering(aten.frexp.Tensor, prims.frexp.default, check=_frexp_check)
def frexp(ctx, x):
    return _frexp(x)
