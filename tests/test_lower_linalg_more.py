"""pinv, Cholesky, triangular_solve, lu_unpack, det/slogdet lowerings (deferfuse/lower/linalg.py)
against strict PyTorch."""

from __future__ import annotations

import warnings

import pytest
import torch

import deferfuse
from oracle import check, run_both

FLOATS = [torch.float32, torch.float64]


def lowered(fn, *inputs, **tol):
    """check(), and assert that no op fell back to eager torch or went through torch._decomp."""
    deferfuse.reset_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # torch.cholesky's deprecation warning
        out = check(fn, *inputs, **tol)
    assert out is not None, "strict raised: nothing was compared"
    stats = deferfuse.stats()
    assert not stats["fallbacks"], stats["fallbacks"]
    assert not stats["decompositions"], stats["decompositions"]
    return out


def same_exception(fn, *inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected, actual, _, _ = run_both(fn, *inputs)
    assert expected is None and actual is None


def _inputs(dtype):
    g = torch.Generator().manual_seed(11)
    a = torch.randn(2, 4, 4, generator=g, dtype=dtype)
    pd = a @ a.mT + torch.eye(4, dtype=dtype)
    wide = torch.randn(3, 5, generator=g, dtype=dtype)
    b = torch.randn(2, 4, 3, generator=g, dtype=dtype)
    # exactly singular in both orientations (a zero pivot for LAPACK whatever its rounding)
    singular = torch.tensor([[1.0, 2, 3], [2, 4, 6], [0, 0, 1]], dtype=dtype)
    return a, pd, wide, b, singular


def _tol(dtype):
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else {}


@pytest.mark.parametrize("dtype", FLOATS)
def test_pinv(dtype):
    a, _, wide, _, singular = _inputs(dtype)

    def fn(a, wide, singular):
        return [torch.linalg.pinv(wide), torch.linalg.pinv(wide.t()), torch.pinverse(a),
                torch.linalg.pinv(a, hermitian=True), torch.linalg.pinv(singular),
                torch.linalg.pinv(wide, atol=torch.tensor(0.5, dtype=dtype)),
                torch.linalg.pinv(a, atol=torch.tensor([0.1, 2.0], dtype=torch.float64), rtol=torch.tensor(0.3)),
                torch.linalg.pinv(a[:, ::2, 1:], rtol=torch.tensor(0.2, dtype=dtype))]
    lowered(fn, a, wide, singular, **_tol(dtype))


@pytest.mark.parametrize("dtype", FLOATS)
def test_cholesky_family(dtype):
    a, pd, _, b, _ = _inputs(dtype)

    def fn(pd, b):
        L = torch.linalg.cholesky(pd)
        return [L, torch.linalg.cholesky_ex(pd, upper=True), torch.linalg.cholesky(pd.mT[0]),
                torch.cholesky(pd), torch.cholesky(pd, upper=True),
                torch.cholesky_inverse(L), torch.cholesky_inverse(L.mT, upper=True),
                torch.cholesky_solve(b, L), torch.cholesky_solve(b, L.mT, upper=True),
                torch.cholesky_solve(b[0], L)]      # broadcast batch
    lowered(fn, pd, b, **_tol(dtype))


@pytest.mark.parametrize("n", [5, 128])
def test_cholesky_ex_not_positive_definite(n):
    # torch (MKL) returns potf2's partial factor and the order of the first failing minor
    g = torch.Generator().manual_seed(n)
    b = torch.randn(3, n, n, generator=g, dtype=torch.float64)
    p = b @ b.mT + 0.1 * torch.eye(n, dtype=torch.float64)
    p[0, 1, 1] -= 1e4
    p[2, n - 1, n - 1] -= 1e4
    p[1, 0, 0] = float("nan")
    lowered(lambda p: [torch.linalg.cholesky_ex(p), torch.linalg.cholesky_ex(p, upper=True),
                       torch.linalg.cholesky_ex(p.float())], p, rtol=1e-4, atol=1e-4)


def test_cholesky_ex_above_128_falls_back():
    # MKL's blocked factorization leaves another (and not even reproducible) partial factor
    p = torch.eye(129, dtype=torch.float64)
    deferfuse.reset_stats()
    check(lambda p: list(torch.linalg.cholesky_ex(p)), p)
    assert "aten.linalg_cholesky_ex.default" in deferfuse.stats()["fallbacks"]


def test_cholesky_errors_match_torch():
    p = torch.eye(4, dtype=torch.float64)
    p[2, 2] = -1
    same_exception(lambda p: torch.linalg.cholesky(p), p)
    same_exception(lambda p: torch.cholesky(p), p)
    same_exception(lambda p: torch.cholesky_inverse(p), torch.zeros(3, 3))
    for fn in (torch.linalg.cholesky_ex, torch.cholesky_inverse, torch.linalg.pinv, torch.linalg.det,
               torch.linalg.slogdet, lambda x: torch.triangular_solve(x, x)):
        same_exception(fn, torch.ones(3, 3, dtype=torch.int64))


@pytest.mark.parametrize("dtype", FLOATS)
def test_triangular_solve_and_lu_unpack(dtype):
    a, _, wide, b, _ = _inputs(dtype)

    def fn(a, wide, b):
        lu, piv = torch.linalg.lu_factor(a)
        return [torch.triangular_solve(b, a), torch.triangular_solve(b[0], a, upper=False, transpose=True),
                torch.triangular_solve(b.mT, a.mT[:, :3, :3], unitriangular=True),
                torch.lu_unpack(lu, piv), torch.lu_unpack(*torch.linalg.lu_factor(wide)),
                torch.lu_unpack(*torch.linalg.lu_factor(wide.t())),
                torch.lu_unpack(lu, piv, unpack_data=False), torch.lu_unpack(lu, piv, unpack_pivots=False)]
    lowered(fn, a, wide, b, **_tol(dtype))


def test_lu_unpack_bad_pivots_raise_like_torch():
    same_exception(lambda lu, p: torch.lu_unpack(lu, p), torch.randn(3, 3), torch.tensor([1, 4, 3], dtype=torch.int32))


@pytest.mark.parametrize("dtype", FLOATS)
def test_det_slogdet(dtype):
    a, pd, _, _, singular = _inputs(dtype)

    def fn(a, pd, singular):
        return [torch.linalg.det(a), torch.linalg.slogdet(a), torch.logdet(pd), torch.det(a.mT),
                torch.linalg.slogdet(a[:, ::2, 1:3]), torch.linalg.det(singular), torch.linalg.slogdet(singular),
                # the LU and pivots that det's backward reads: of A^T when A is contiguous
                torch.ops.aten._linalg_det(a), torch.ops.aten._linalg_det(a.mT),
                torch.ops.aten._linalg_slogdet(a), torch.ops.aten._linalg_slogdet(a.mT)]
    lowered(fn, a, pd, singular, **_tol(dtype))


def test_det_slogdet_gradients():
    a = torch.randn(2, 4, 4, dtype=torch.float64)

    def fn(a):
        x = a.clone().requires_grad_()
        y = a.mT.clone().requires_grad_()
        total = (torch.linalg.det(x).sum() + torch.linalg.slogdet(x)[1].sum()
                 + torch.logdet(x @ x.mT).sum() + torch.linalg.det(y.mT).sum())
        total.backward()
        return [total, x.grad, y.grad]
    lowered(fn, a)


def test_empty_matrices():
    f64 = torch.float64
    lowered(lambda e, w, z: [torch.linalg.det(e), torch.linalg.slogdet(e), torch.linalg.pinv(w),
                             torch.linalg.cholesky_ex(e), torch.cholesky_inverse(e), torch.linalg.det(z),
                             torch.linalg.slogdet(z), torch.linalg.cholesky_ex(z),
                             torch.triangular_solve(torch.empty(0, 3, 2, dtype=f64), e)],
            torch.empty(0, 3, 3, dtype=f64), torch.empty(3, 0, dtype=f64), torch.empty(2, 0, 0, dtype=f64))
