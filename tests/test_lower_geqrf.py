"""geqrf: its shape rule (aten.geqrf has no meta kernel) and its lowering (deferfuse/lower/linalg.py)
against strict PyTorch, out= included."""

from __future__ import annotations

import warnings

import pytest
import torch

import deferfuse
from oracle import lowered, run_both

FLOATS = [torch.float32, torch.float64]


def _matrices(dtype):
    g = torch.Generator().manual_seed(7)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)
    zero_col = r(6, 4)
    zero_col[:, 1] = 0                      # rank-deficient: a zero column
    reduced = r(5, 5)
    reduced[1:, 0] = 0                      # nothing below the diagonal: tau = 0, no reflection
    negated = -torch.eye(4, dtype=dtype)    # alpha < 0, nothing below it
    return dict(tall=r(6, 4), wide=r(3, 5), square=r(4, 4), batched=r(2, 3, 5, 4), row=r(1, 5),
                col=r(5, 1), big=r(40, 30), zero_col=zero_col, reduced=reduced, negated=negated,
                zeros=torch.zeros(3, 4, dtype=dtype))


@pytest.mark.parametrize("dtype", FLOATS)
def test_geqrf_values(dtype):
    mats = _matrices(dtype)
    names = list(mats)

    def fn(*xs):
        out = [torch.geqrf(x) for x in xs]
        t = xs[names.index("batched")]
        out += [torch.geqrf(t.mT),                # non-contiguous (column-major) input
                t[:, ::2, 1:].geqrf(),            # gappy, method form
                torch.geqrf(t[0, 1:, :3])]        # a slice with an offset
        return out
    lowered(fn, *mats.values(), compared=True)


@pytest.mark.parametrize("shape", [(0, 3), (3, 0), (0, 0), (2, 0, 3), (2, 3, 0), (0, 3, 4), (0, 0, 0)])
def test_geqrf_empty(shape):
    lowered(lambda x: torch.geqrf(x), torch.empty(shape, dtype=torch.float64), compared=True)


@pytest.mark.parametrize("shape", [(3, 4), (4, 3), (1, 3), (3, 1), (2, 5, 3), (2, 1, 5, 3),
                                   (0, 3), (3, 0), (0, 0), (2, 0, 3), (0, 3, 4)])
def test_geqrf_strides(shape):
    # the CPU kernel returns a batch of column-major matrices and a contiguous tau
    x = torch.randn(shape, dtype=torch.float64)
    expected = torch.geqrf(x)
    deferfuse.reset_stats()
    with deferfuse.defer():
        a, tau = torch.geqrf(x)
        inside = (a.stride(), tau.stride())
    assert not deferfuse.stats()["fallbacks"]
    want = (expected[0].stride(), expected[1].stride())
    assert inside == want
    assert (a.stride(), tau.stride()) == want


def test_geqrf_feeds_householder_product_and_ormqr():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, 4, generator=g, dtype=torch.float64)
    c = torch.randn(2, 6, 3, generator=g, dtype=torch.float64)

    def fn(x, c):
        a, tau = torch.geqrf(x)
        q = torch.linalg.householder_product(a, tau)
        return [q, q.mT @ x, torch.ormqr(a, tau, c, transpose=True), torch.linalg.qr(x).Q]
    lowered(fn, x, c, compared=True)


def _out_call(x, a, tau):
    result = torch.geqrf(x, out=(a, tau))
    assert result[0] is a and result[1] is tau
    return [a, tau, a.stride(), tau.stride()]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("case", ["right", "column_major", "wrong_size", "wrong_tau"])
def test_geqrf_out(dtype, case):
    x = torch.randn(2, 5, 3, dtype=dtype)
    a = {"right": torch.zeros(2, 5, 3), "column_major": torch.zeros(2, 3, 5).mT,
         "wrong_size": torch.zeros(2, 3, 5), "wrong_tau": torch.zeros(2, 5, 3)}[case].to(dtype)
    tau = torch.zeros((7,) if case == "wrong_tau" else (2, 3), dtype=dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lowered(_out_call, x, a, tau, compared=True)     # values and the out tensors' strides
    resized = [w for w in caught if "was resized" in str(w.message)]
    assert len(resized) == (2 if case in ("wrong_size", "wrong_tau") else 0)   # strict's and defer's


def test_geqrf_out_empty_strides():
    """Empty out= tensors take the result's layout (geqrf's `a` is column-major), as in strict."""
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    lowered(_out_call, x, torch.empty(0, dtype=torch.float64), torch.empty(0, dtype=torch.float64))


def test_geqrf_out_empty_values():
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    lowered(lambda x, a, tau: torch.geqrf(x, out=(a, tau)),
            x, torch.empty(0, dtype=torch.float64), torch.empty(0, dtype=torch.float64), compared=True)


def test_geqrf_out_other_dtype():
    # torch computes in the input's dtype and copies into wider or narrower out= tensors; the
    # derived out= rule leaves such calls to the kernel
    x = torch.randn(4, 3, dtype=torch.float64)
    expected, actual, _, _ = run_both(lambda x, a, t: torch.geqrf(x, out=(a, t)),
                                      x, torch.empty(4, 3, dtype=torch.float32), torch.empty(3, dtype=torch.float64))
    torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("make", [
    lambda: (torch.randn(3), None),                                   # fewer than 2 dims
    lambda: (torch.tensor(1.0), None),
    lambda: (torch.ones(3, 3, dtype=torch.int64), None),              # dtypes the kernel lacks
    lambda: (torch.ones(3, 3, dtype=torch.float16), None),
    lambda: (torch.ones(3, 3, dtype=torch.bfloat16), None),
    lambda: (torch.ones(3, 3, dtype=torch.bool), None),
    lambda: (torch.randn(3, 3), (torch.empty(0, dtype=torch.int64), torch.empty(0))),   # out= dtypes
    lambda: (torch.randn(3, 3), (torch.empty(0), torch.empty(0, dtype=torch.int32))),
    lambda: (torch.randn(3), (torch.empty(0), torch.empty(0))),
])
def test_geqrf_errors_match_torch(make):
    x, out = make()

    def fn(x):
        return torch.geqrf(x) if out is None else torch.geqrf(x, out=tuple(t.clone() for t in out))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected, actual, _, _ = run_both(fn, x)
    assert expected is None and actual is None      # both raised, the same exception type
