"""pinv, Cholesky, triangular_solve, lu_unpack, det/slogdet lowerings (deferfuse/lower/linalg.py)
against strict PyTorch."""

from __future__ import annotations

import os
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


# -- linalg.lu, householder_product, ormqr, matrix_exp -------------------------------------------

def _qr_parts(dtype, *shape):
    """Householder reflectors and their scalars as torch.geqrf leaves them (computed eagerly,
    outside defer)."""
    g = torch.Generator().manual_seed(sum(shape))
    return torch.geqrf(torch.randn(*shape, generator=g, dtype=dtype))


@pytest.mark.parametrize("dtype", FLOATS)
def test_linalg_lu(dtype):
    a, _, wide, _, singular = _inputs(dtype)
    tall = torch.randn(3, 6, 4, dtype=dtype)

    def fn(a, wide, tall, singular):
        return [torch.linalg.lu(a), torch.linalg.lu(wide), torch.linalg.lu(tall), torch.linalg.lu(tall.mT),
                torch.linalg.lu(a[:, ::2, 1:]), torch.linalg.lu(singular), torch.linalg.lu(a.mT)]
    lowered(fn, a, wide, tall, singular, **_tol(dtype))


def test_linalg_lu_errors_match_torch():
    # torch's CPU kernel has no LU without pivoting
    same_exception(lambda a: torch.linalg.lu(a, pivot=False), torch.randn(3, 3))
    same_exception(lambda a: torch.linalg.lu(a), torch.ones(3, 3, dtype=torch.int64))
    same_exception(lambda a: torch.linalg.lu(a), torch.ones(3))


@pytest.mark.parametrize("dtype", FLOATS)
def test_householder_product(dtype):
    square, tau_s = _qr_parts(dtype, 2, 5, 5)
    tall, tau_t = _qr_parts(dtype, 6, 4)
    g = torch.Generator().manual_seed(3)
    rand, tau_r = torch.randn(2, 7, 5, generator=g, dtype=dtype), torch.randn(2, 3, generator=g, dtype=dtype)

    def fn(square, tau_s, tall, tau_t, rand, tau_r):
        return [torch.linalg.householder_product(square, tau_s), torch.linalg.householder_product(tall, tau_t),
                torch.linalg.householder_product(tall, tau_t[:2]),
                torch.linalg.householder_product(rand, tau_r),            # not orthogonal
                torch.linalg.householder_product(rand[:, ::2, 1:], tau_r[:, ::2]),
                torch.linalg.householder_product(tall, tau_t[:0])]        # no reflectors: identity columns
    lowered(fn, square, tau_s, tall, tau_t, rand, tau_r, **_tol(dtype))


@pytest.mark.parametrize("dtype", FLOATS)
def test_ormqr(dtype):
    tall, tau_t = _qr_parts(dtype, 2, 6, 4)
    wide, tau_w = _qr_parts(dtype, 3, 5)
    g = torch.Generator().manual_seed(5)
    c = torch.randn(2, 6, 3, generator=g, dtype=dtype)
    cw = torch.randn(3, 4, generator=g, dtype=dtype)
    rand, tau_r = torch.randn(4, 4, generator=g, dtype=dtype), torch.randn(4, generator=g, dtype=dtype)

    def fn(tall, tau_t, wide, tau_w, c, cw, rand, tau_r):
        out = []
        for transpose in (False, True):
            out += [torch.ormqr(tall, tau_t, c, transpose=transpose),
                    torch.ormqr(tall, tau_t, c.mT, left=False, transpose=transpose),
                    torch.ormqr(wide, tau_w, cw, transpose=transpose),
                    torch.ormqr(wide, tau_w, cw.mT[:, :3], left=False, transpose=transpose),
                    torch.ormqr(rand.mT, tau_r, rand, transpose=transpose),    # not orthogonal
                    torch.ormqr(rand[:, :2], tau_r[:2], rand[:2], left=False, transpose=transpose)]
        return out
    lowered(fn, tall, tau_t, wide, tau_w, c, cw, rand, tau_r, **_tol(dtype))


def test_householder_ormqr_errors_match_torch():
    a, tau = torch.randn(5, 5), torch.randn(3)
    same_exception(lambda a, t: torch.linalg.householder_product(a, t), torch.randn(4, 5), tau)
    same_exception(lambda a, t: torch.linalg.householder_product(a, t), a, torch.randn(6))
    same_exception(lambda a, t: torch.linalg.householder_product(a, t), a.long(), tau.long())
    # the meta kernel accepts these, torch's CPU kernel wants tau.shape[-1] == min(m, k)
    same_exception(lambda a, t: torch.ormqr(a, t, a), a, tau)
    same_exception(lambda a, t: torch.ormqr(a, t, a, left=False), a, tau)
    same_exception(lambda a, t: torch.ormqr(a, t, a[:4]), a, torch.randn(5))


def _scaled_to_norm(m, norm):
    norm = torch.as_tensor(norm, dtype=m.dtype)
    return m / m.abs().sum(-2).amax(-1)[..., None, None] * norm[..., None, None]


def test_matrix_exp_float64():
    g = torch.Generator().manual_seed(7)
    m = torch.randn(5, 5, generator=g, dtype=torch.float64)
    # one matrix takes the lowest Taylor degree whose bound covers its 1-norm (1, 2, 4, 8, 12, then
    # 18 with scaling and squaring); a batch always takes degree 18
    norms = [1e-17, 1e-9, 1e-5, 0.01, 0.2, 0.2996158913811580, 0.8, 7.0, 300.0]
    singles = [_scaled_to_norm(m, n) for n in norms]
    batch = _scaled_to_norm(torch.randn(3, 2, 4, 4, generator=g, dtype=torch.float64),
                            torch.tensor([[0.0, 0.01], [1.0, 40.0], [5.0, 0.3]], dtype=torch.float64))

    def fn(batch, *singles):
        return [torch.linalg.matrix_exp(batch), torch.matrix_exp(batch.mT), torch.matrix_exp(batch[:, :1, ::2, ::2])] + \
            [torch.linalg.matrix_exp(s) for s in singles]
    lowered(fn, batch, *singles)


def test_matrix_exp_small_and_empty():
    f64 = torch.float64
    lowered(lambda a, b, c, d: [torch.linalg.matrix_exp(a), torch.linalg.matrix_exp(b),
                                torch.linalg.matrix_exp(c), torch.linalg.matrix_exp(d)],
            torch.randn(3, 1, 1, dtype=f64), torch.randn(1, 1), torch.empty(0, 0, dtype=f64),
            torch.empty(0, 4, 4, dtype=f64))
    same_exception(lambda a: torch.linalg.matrix_exp(a), torch.randn(3, 4, dtype=f64))
    same_exception(lambda a: torch.linalg.matrix_exp(a), torch.ones(3, 3, dtype=torch.int64))


def test_matrix_exp_gradient():
    a = _scaled_to_norm(torch.randn(2, 3, 3, dtype=torch.float64), 2.0)

    def fn(a):
        x = a.clone().requires_grad_()
        y = torch.linalg.matrix_exp(x)
        (y * torch.linspace(-1, 1, 9, dtype=torch.float64).reshape(3, 3)).sum().backward()
        return [y, x.grad]
    lowered(fn, a)


def test_matrix_exp_float32_falls_back():
    # float32: the squarings amplify rounding (torch's loops vs XLA's fused multiply-adds) past
    # float32 tolerances, so the call runs torch's kernel
    a = _scaled_to_norm(torch.randn(2, 5, 5), 27.0)
    deferfuse.reset_stats()
    check(lambda a: torch.linalg.matrix_exp(a), a)
    assert "aten.linalg_matrix_exp.default" in deferfuse.stats()["fallbacks"]


def test_lu_householder_ormqr_empty():
    f64 = torch.float64
    e = torch.empty

    def fn(a, b, c, d, tau0, tau2):
        return [torch.linalg.lu(a), torch.linalg.lu(b), torch.linalg.lu(c),
                torch.linalg.householder_product(d, tau0), torch.linalg.householder_product(a[:, :, :0], tau2[:, :0]),
                torch.ormqr(d, tau0, d), torch.ormqr(a, tau2, a[:, :, :2])]
    lowered(fn, e(0, 3, 5, dtype=f64), e(3, 0, dtype=f64), e(2, 0, 0, dtype=f64), e(0, 0, dtype=f64),
            e(0, dtype=f64), e(0, 3, dtype=f64))


_BATCHED_FACTORIZATIONS = """
import torch, deferfuse
n = 128
b = torch.randn(3, n, n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
p = b @ b.mT + 0.1 * torch.eye(n, dtype=torch.float64)
p[0, 1, 1] -= 1e4
p[2, n - 1, n - 1] -= 1e4
p[1, 0, 0] = float("nan")
for _ in range(6):
    with deferfuse.config.override(always_compile=True), deferfuse.defer():
        out = [torch.linalg.cholesky_ex(p), torch.linalg.cholesky_ex(p, upper=True),
               torch.linalg.cholesky_ex(p.float())]
        out = [[t.clone() for t in group] for group in out]
print("done")
"""


def test_batched_factorizations_in_one_computation_never_hang():
    """jaxlib's batched LAPACK kernels split their batch over XLA's thread pool; with torch's
    OpenMP threads started, a computation holding several of them hung now and then (a test
    worker was lost to it).  They run one matrix at a time (linalg._per_matrix)."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "DEFERFUSE_CACHE_DIR"}
    env["DEFERFUSE_CACHE_DIR"] = ""
    done = subprocess.run([sys.executable, "-c", _BATCHED_FACTORIZATIONS], env=env, timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 0 and "done" in done.stdout, done.stderr[-2000:]
