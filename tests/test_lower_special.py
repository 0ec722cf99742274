"""torch.special lowerings (deferfuse/lower/special.py) against strict PyTorch: orthogonal
polynomials (per-element n, broadcast with x), erfcx, spherical_bessel_j0, modified_bessel_i0/i1,
the Bessel functions j0, j1, y0, y1, modified_bessel_k0/k1 (and scaled), airy_ai and frexp, each
asserted lowered (no fallback, no decomposition)."""

from __future__ import annotations

import math

import pytest
import torch

import deferfuse
from oracle import check, lowered

NAN, INF = math.nan, math.inf
S = torch.special


@pytest.fixture(autouse=True)
def _no_disk_cache():
    with deferfuse.config.override(cache_dir=""):
        yield


POLYNOMIALS = [S.chebyshev_polynomial_t, S.chebyshev_polynomial_u, S.chebyshev_polynomial_v,
               S.chebyshev_polynomial_w, S.shifted_chebyshev_polynomial_t, S.shifted_chebyshev_polynomial_u,
               S.shifted_chebyshev_polynomial_v, S.shifted_chebyshev_polynomial_w, S.hermite_polynomial_h,
               S.hermite_polynomial_he, S.laguerre_polynomial_l, S.legendre_polynomial_p]


def _x(dtype):
    # the endpoints and zero (special cases), |x| < 1 (closed forms), |x| > 1 (growth), +-inf
    grid = torch.linspace(-2.5, 2.5, 41, dtype=torch.float64)
    edges = torch.tensor([1.0, -1.0, 0.0, -0.0, 0.5, 0.999, -0.999, 1e-3, 12.0, -12.0, INF, -INF], dtype=torch.float64)
    return torch.cat([grid, edges]).to(dtype)


N = [-3, -1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 13, 30, 129, 600]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_polynomials_broadcast_x_and_n(dtype):
    x = _x(dtype)[:, None]
    n = torch.tensor(N, dtype=dtype)[None, :]
    lowered(lambda x, n: tuple(f(x, n) for f in POLYNOMIALS), x, n)


def test_polynomials_of_integers_bools_and_scalars():
    xi = torch.tensor([[-3], [-1], [0], [1], [2], [5]])
    ni = torch.tensor([-1, 0, 1, 2, 3, 9, 12])
    xb = torch.tensor([True, False, True])
    lowered(lambda xi, ni, xb: tuple(f(xi, ni) for f in POLYNOMIALS) + tuple(f(xb, xb) for f in POLYNOMIALS)
            + tuple(f(xi.double() / 7, 11) for f in POLYNOMIALS) + tuple(f(0.25, ni) for f in POLYNOMIALS),
            xi, ni, xb)


def test_polynomials_nonfinite_and_fractional_n():
    # n truncates toward zero; NaN and infinite n (and NaN x with n < 2) give torch's values
    x = torch.tensor([0.3, -0.7, 1.5, NAN, NAN, 2.0, 0.3, -0.2])
    n = torch.tensor([2.7, 9.9, -0.5, 0.0, 1.0, NAN, INF, -INF])
    lowered(lambda x, n: tuple(f(x, n) for f in POLYNOMIALS), x, n)


def test_polynomials_zero_dim_and_empty():
    lowered(lambda x, n, e: tuple(f(x, n) for f in POLYNOMIALS) + tuple(f(e, n) for f in POLYNOMIALS),
            torch.tensor(0.3, dtype=torch.float64), torch.tensor(12.0, dtype=torch.float64),
            torch.empty(0, 3, dtype=torch.float64))


def test_polynomial_out_and_large_n():
    # the trigonometric forms at large n in float32 depend on the C library's acosf to the ulp
    x = torch.linspace(-0.99, 0.99, 199)
    n = torch.tensor([1000.0, 4097.0])[:, None]
    out = torch.empty(2, 199)
    lowered(lambda x, n, out: (S.chebyshev_polynomial_t(x, n, out=out), S.chebyshev_polynomial_u(x, n),
                               S.shifted_chebyshev_polynomial_w((x + 1) / 2, n)), x, n, out)


def _unary_inputs(dtype):
    values = torch.cat([torch.linspace(-30, 30, 601, dtype=torch.float64),
                        torch.logspace(-8, 8, 33, dtype=torch.float64), -torch.logspace(-8, 2, 21, dtype=torch.float64),
                        torch.tensor([0.0, -0.0, 0.4999, 0.5, -6.1, -6.2, -26.6, -26.8, 50.0, 50.5, 6e7,
                                      INF, -INF, NAN], dtype=torch.float64)])
    return values.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_erfcx_spherical_j0_modified_i0_i1(dtype):
    x = _unary_inputs(dtype)
    lowered(lambda x: (S.erfcx(x), S.spherical_bessel_j0(x), S.modified_bessel_i0(x), S.modified_bessel_i1(x),
                       S.erfcx(x[:, None] * x[:1])), x)


def test_unary_specials_of_integers_bools_and_empty():
    lowered(lambda i, b, e: (S.erfcx(i), S.spherical_bessel_j0(b), S.modified_bessel_i0(i), S.modified_bessel_i1(b),
                             S.erfcx(e), S.spherical_bessel_j0(torch.tensor(3))),
            torch.tensor([-7, -1, 0, 3, 40]), torch.tensor([True, False]), torch.empty(0, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_frexp(dtype):
    tiny = torch.finfo(dtype).tiny
    x = torch.tensor([0.0, -0.0, 1.0, -3.5, 0.75, 1e30, -1e-30, INF, -INF, NAN], dtype=dtype)
    subnormals = torch.tensor([tiny / 2, -tiny / 3, tiny / 2 ** 20, -tiny * torch.finfo(dtype).eps],
                              dtype=dtype)
    lowered(lambda x, s: (*torch.frexp(x), *torch.frexp(s), *x.frexp()), x, subnormals)


def test_frexp_out_and_zero_dim():
    lowered(lambda x, m, e: torch.frexp(x, out=(m, e)), torch.tensor(6.0), torch.empty(()), torch.empty((), dtype=torch.int32))


def test_frexp_of_integers_raises_like_strict():
    with pytest.raises(RuntimeError):
        torch.frexp(torch.tensor([1, 2]))
    check(lambda x: torch.frexp(x), torch.tensor([1, 2]))


BESSELS = [S.bessel_j0, S.bessel_j1, S.bessel_y0, S.bessel_y1, S.modified_bessel_k0, S.modified_bessel_k1,
           S.scaled_modified_bessel_k0, S.scaled_modified_bessel_k1, S.airy_ai]


def _bessel_inputs(dtype):
    # both sides of the branch points (5 for j/y, 2 for k, +-2.09 and 8.3203353 for Ai, 103.892
    # where Ai is 0, 1e-5 for j0), zeros of j0/j1, tiny and huge magnitudes, +-inf and NaN
    values = torch.cat([torch.linspace(-40, 40, 801, dtype=torch.float64),
                        torch.logspace(-30, 30, 61, dtype=torch.float64),
                        -torch.logspace(-30, 30, 61, dtype=torch.float64),
                        torch.tensor([0.0, -0.0, 5.0, 5.000001, 4.999999, 2.0, 2.000001, 1.999999, 8.0, 2.09, -2.09,
                                      2.0899999, -2.0900001, 8.3203353, 8.33, 103.892, 103.9, 1e-5, 9.99e-6,
                                      2.404825557695773, 3.831705970207512, -1000.0, 1e4, 1e-300, INF, -INF, NAN],
                                     dtype=torch.float64)])
    return values.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bessel_j_y_k_and_airy_ai(dtype):
    x = _bessel_inputs(dtype)
    lowered(lambda x: tuple(f(x) for f in BESSELS), x)


def test_bessel_j_y_k_and_airy_ai_of_integers_bools_zero_dim_empty_and_views():
    i = torch.tensor([-7, -2, -1, 0, 1, 2, 3, 5, 6, 9, 104, 2 ** 40])
    b = torch.tensor([True, False])
    grid = torch.linspace(-12, 12, 60, dtype=torch.float64).reshape(6, 10)
    lowered(lambda i, b, z, e, g: tuple(f(i) for f in BESSELS) + tuple(f(b) for f in BESSELS)
            + tuple(f(z) for f in BESSELS) + tuple(f(e) for f in BESSELS)
            + tuple(f(g.t()[::2]) for f in BESSELS),
            i, b, torch.tensor(3.5), torch.empty(0, 3), grid)


def test_bessel_prims_and_out():
    x = torch.linspace(-9, 9, 37)
    out = torch.empty(37)
    lowered(lambda x, out: (torch.ops.prims.bessel_j0(x), torch.ops.prims.bessel_j1(x.double()),
                            S.bessel_y0(x.abs() + 0.5, out=out)), x, out)


def test_bessel_of_half_raises_like_strict():
    # torch's CPU kernels are float32/float64 only
    with pytest.raises(RuntimeError):
        S.bessel_j0(torch.ones(2, dtype=torch.float16))
    check(lambda x: S.bessel_j0(x), torch.ones(2, dtype=torch.float16))
