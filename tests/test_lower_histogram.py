"""torch.histogram (deferfuse/lower/histogram.py) against strict PyTorch: both overloads (a bin
count, a tensor of edges), their out= forms, and the inputs where torch's CPU kernel has
something to say (empty and 0-dim inputs, collapsed ranges, NaN and inf, edges that are not
sorted), lowered with no fallback."""

from __future__ import annotations

import warnings

import pytest
import torch

import deferfuse
from oracle import check, run_both
from oracle import lowered as _lowered

NAN, INF = float("nan"), float("inf")
FLOATS = [torch.float32, torch.float64]


def lowered(fn, *inputs, exact=True, **tol):
    """Compared (bit for bit unless told otherwise: counts and linspace edges are exact), with
    nothing falling back to eager torch."""
    return _lowered(fn, *inputs, compared=True, decompositions=True, exact=exact, **tol)


def same_error(fn, *inputs, message=True):
    """strict raises; defer raises the same type (run_both checks it), with the same message
    where the error comes from the arguments alone."""
    strict = defer = None
    try:
        fn(*inputs)
    except Exception as exc:  # noqa: BLE001
        strict = exc
    assert strict is not None, "strict did not raise"
    expected, actual, _, _ = run_both(fn, *inputs)
    assert expected is None and actual is None
    if message:
        try:
            with deferfuse.config.override(always_compile=True), deferfuse.defer():
                fn(*inputs)
        except Exception as exc:  # noqa: BLE001
            defer = exc
        assert str(defer).splitlines()[0] == str(strict).splitlines()[0], (defer, strict)


def hist(*args, **kwargs):
    return lambda x: tuple(torch.histogram(x, *args, **kwargs))


# -- a bin count ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
def test_bin_ct(dtype):
    torch.manual_seed(0)
    x = torch.randn(200, dtype=dtype)
    for args, kwargs in [((1,), {}), ((5,), {}), ((100,), {}), ((), {}), ((7,), dict(range=(-1.0, 1.0))),
                         ((3,), dict(range=(10.0, 20.0))), ((4,), dict(range=(0.25, 0.25))),
                         ((6,), dict(range=[-0.3, 2.7])), ((9,), dict(range=(0.1, 0.1000001)))]:
        lowered(hist(*args, **kwargs), x)
    # integer-valued data puts many values exactly on edges, and the maximum on the last edge
    lowered(lambda x: (tuple(torch.histogram(x, 6)), tuple(torch.histogram(x, 3, range=(-3.0, 3.0)))),
            torch.randint(-3, 4, (100,)).to(dtype))
    lowered(hist(10), (torch.arange(30, dtype=dtype) / 7) ** 2)


@pytest.mark.parametrize("dtype", FLOATS)
def test_bin_ct_weight_density(dtype):
    torch.manual_seed(1)
    x, w = torch.randn(150, dtype=dtype), torch.rand(150, dtype=dtype)
    lowered(lambda x, w: tuple(torch.histogram(x, 8, weight=w)), x, w, exact=False)
    lowered(lambda x: tuple(torch.histogram(x, 8, density=True)), x, exact=False)
    lowered(lambda x, w: tuple(torch.histogram(x, 5, range=(-1.0, 2.0), weight=w, density=True)), x, w, exact=False)
    # the weight's shape does not matter, its element count does; NaN weights outside the range
    # are never added
    lowered(lambda x, w: tuple(torch.histogram(x.view(10, 15), 4, weight=w.view(150, 1))), x, w, exact=False)
    w2 = w.clone()
    w2[x > 1] = NAN
    lowered(lambda x, w: tuple(torch.histogram(x, 4, range=(-1.0, 1.0), weight=w)), x, w2, exact=False)


@pytest.mark.parametrize("dtype", FLOATS)
def test_bin_ct_awkward_inputs(dtype):
    def t(*values):
        return torch.tensor(values, dtype=dtype)

    lowered(hist(5), torch.empty(0, dtype=dtype))                       # edges [0, 1]
    lowered(hist(5, density=True), torch.empty(0, dtype=dtype))         # 0 / 0
    lowered(hist(5, range=(-1.0, 1.0)), torch.empty(0, 3, dtype=dtype))
    lowered(hist(3), torch.tensor(2.5, dtype=dtype))                    # 0-dim, widened range
    lowered(lambda x, w: tuple(torch.histogram(x, 3, weight=w, density=True)),
            torch.tensor(2.5, dtype=dtype), torch.tensor(4.0, dtype=dtype), exact=False)
    lowered(hist(4), t(2.0, 2.0, 2.0))                                   # all equal: widened by 0.5
    lowered(hist(1), t(-7.0))
    lowered(hist(4, range=(-1.0, 1.0)), t(1.0, -1.0, INF, -INF, NAN, 0.5, 0.0, -0.0, 1.0000001))
    lowered(hist(3, range=(5.0, 6.0)), t(1.0, 2.0))                      # range outside the data
    lowered(hist(3, range=(5.0, 6.0), density=True), t(1.0, 2.0))
    # non-contiguous and expanded inputs
    x = torch.randn(6, 8, dtype=dtype)
    lowered(hist(5), x.t())
    lowered(hist(5), x[:, ::3])
    lowered(hist(5, range=(-0.5, 0.5)), torch.randn(3, 1, dtype=dtype).expand(3, 4))
    # extreme values: a data range wider than the largest finite value gives infinite steps and
    # NaN edges, as in torch
    big = 3e38 if dtype is torch.float32 else 1.7e308
    lowered(hist(4), t(-big, big, 0.0, 1.0))
    lowered(hist(5, range=(-big, big)), t(-big, big, 0.0, 1.0))
    lowered(hist(3), t(1e30, 1e30 * (1 + 1e-6), -1e30))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("bins", [1, 2, 3, 5])
def test_collapsed_range(dtype, bins):
    """A range that an added 0.5 cannot widen in the input's dtype: all edges equal, and the CPU
    kernel's 0 / 0 sends the values on it to bin 1 (bin 0 when there is one bin)."""
    big = 1e30 if dtype is torch.float32 else 1e300
    lowered(hist(bins, range=(big, big)), torch.tensor([big, big, 1.0], dtype=dtype))
    lowered(hist(bins), torch.tensor([big, big], dtype=dtype))
    lowered(hist(bins, density=True), torch.tensor([big], dtype=dtype))


# -- a tensor of edges ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
def test_bins_tensor(dtype):
    torch.manual_seed(2)
    x = torch.randn(120, dtype=dtype)
    w = torch.rand(120, dtype=dtype)

    def e(*values):
        return torch.tensor(values, dtype=dtype)

    for edges in [e(-1.0, 0.0, 0.5, 2.0), e(0.0, 1.0), e(-3.0, -1.0, -1.0, 0.0, 3.0),        # an empty bin
                  torch.sort(torch.randn(40, dtype=dtype)).values, e(3.0, 2.0, 1.0),         # descending
                  e(1.0, NAN, 3.0), e(NAN, 0.0, 1.0), e(-INF, 0.0, INF), e(0.0, 2.0, 1.0, 3.0)]:
        lowered(lambda x, b: tuple(torch.histogram(x, b)), x, edges)
        lowered(lambda x, b, w: tuple(torch.histogram(x, b, weight=w, density=True)), x, edges, w, exact=False)
    # values on the edges: the last edge is in the last bin
    lowered(lambda x, b: tuple(torch.histogram(x, b)), e(-1.0, 0.0, 0.5, 2.0, 2.5, NAN, INF), e(-1.0, 0.0, 0.5, 2.0))
    lowered(lambda x, b: tuple(torch.histogram(x, b)), torch.empty(0, dtype=dtype), e(0.0, 1.0, 2.0))
    lowered(lambda x, b: tuple(torch.histogram(x, b)), torch.tensor(0.5, dtype=dtype), e(0.0, 1.0, 2.0))
    lowered(lambda x, b: tuple(torch.histogram(x, b)), x.view(12, 10).t()[::2], e(-1.0, 0.0, 1.0)[::2])


def test_edges_are_a_copy():
    """The edges returned for a tensor of edges are a new tensor: writing to them leaves the
    argument alone."""
    def program(x, b):
        h, e = torch.histogram(x, b)
        e.add_(1)
        return h, e, b
    lowered(program, torch.randn(20), torch.tensor([-1.0, 0.0, 1.0]))


# -- out= ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
def test_out(dtype):
    torch.manual_seed(3)
    x = torch.randn(50, dtype=dtype)

    def out_ct(x, h, e):
        r = torch.histogram(x, bins=5, out=(h, e))
        return tuple(r), h, e

    def out_tensor(x, b, h, e):
        r = torch.histogram(x, b, weight=x.abs(), density=True, out=(h, e))
        return tuple(r), h, e

    lowered(out_ct, x, torch.empty(5, dtype=dtype), torch.empty(6, dtype=dtype))
    lowered(out_ct, x, torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype))    # resized silently
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "An output with one or more elements was resized"
        lowered(out_ct, x, torch.zeros(3, 2, dtype=dtype), torch.zeros(9, dtype=dtype))
        lowered(out_tensor, x, torch.tensor([-1.0, 0.0, 2.0], dtype=dtype),
                torch.zeros(7, dtype=dtype), torch.zeros(1, dtype=dtype), exact=False)
    lowered(out_tensor, x, torch.tensor([-1.0, 0.0, 2.0], dtype=dtype),
            torch.zeros(2, dtype=dtype), torch.zeros(3, dtype=dtype), exact=False)


def test_out_warns_when_resizing():
    x = torch.randn(10)
    for mode in ("strict", "defer"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            h, e = torch.zeros(2), torch.zeros(2)
            if mode == "defer":
                with deferfuse.defer():
                    torch.histogram(x, 4, out=(h, e))
            else:
                torch.histogram(x, 4, out=(h, e))
        assert any("resized" in str(w.message) for w in caught), mode
        assert h.shape == (4,) and e.shape == (5,)


def test_pending_input():
    """The input is a pending result, and the histogram feeds more deferred work."""
    lowered(lambda x: torch.histogram(x * 2 + 1, 4, range=(0.0, 3.0)).hist * 3, torch.linspace(0, 1, 9))


# -- errors --------------------------------------------------------------------------------------

def test_argument_errors():
    x = torch.tensor([1.0, 2.0, 3.0])
    same_error(lambda x: torch.histogram(x, 0), x)
    same_error(lambda x: torch.histogram(x, -2), x)
    same_error(lambda x: torch.histogram(x, 3, range=(2.0, 1.0)), x)
    same_error(lambda x: torch.histogram(x, 3, range=(1.0, INF)), x)
    same_error(lambda x: torch.histogram(x, 3, range=(NAN, 1.0)), x)
    same_error(lambda x: torch.histogram(x, 3, range=(1.0, 2.0, 3.0)), x)
    same_error(lambda x: torch.histogram(x, 3, range=(-1e39, 1.0)), x)           # not a float
    same_error(lambda x: torch.histogram(x, 3, weight=torch.ones(2)), x)
    same_error(lambda x: torch.histogram(x, 3, weight=torch.ones(3, dtype=torch.float64)), x)
    same_error(lambda x: torch.histogram(x, torch.tensor([[0.0, 1.0]])), x)
    same_error(lambda x: torch.histogram(x, torch.tensor(1.0)), x)
    same_error(lambda x: torch.histogram(x, torch.tensor([0.0])), x)
    same_error(lambda x: torch.histogram(x, torch.empty(0)), x)
    same_error(lambda x: torch.histogram(x, torch.tensor([0.0, 1.0], dtype=torch.float64)), x)
    same_error(lambda x: torch.histogram(x, torch.tensor([0.0, 1.0]), weight=torch.ones(4)), x)


def test_dtype_errors():
    # integer and complex inputs: torch's NotImplementedError, at record time
    same_error(lambda x: torch.histogram(x, 3), torch.tensor([1, 2]))
    same_error(lambda x: torch.histogram(x, 3, range=(0.0, 3.0)), torch.tensor([1, 2]))
    same_error(lambda x: torch.histogram(x, torch.tensor([0, 1, 2])), torch.tensor([1, 2]))
    same_error(lambda x: torch.histogram(x, 3), torch.tensor([1.0, 2.0], dtype=torch.complex64))
    same_error(lambda x: torch.histogram(x, 3), torch.tensor([1.0, 2.0], dtype=torch.float16))


def test_half_precision_runs_eagerly():
    """Half types the kernel accepts (edges given, or a range) run torch's kernel: it counts in
    the input's dtype."""
    x = torch.tensor([1.0, 2.0, 2.5])
    for dtype in (torch.float16, torch.bfloat16):
        check(lambda x: tuple(torch.histogram(x, 3, range=(0.0, 3.0))), x.to(dtype), exact=True)
        check(lambda x: tuple(torch.histogram(x, torch.tensor([0.0, 1.0, 3.0], dtype=dtype))), x.to(dtype), exact=True)


@pytest.mark.parametrize("dtype", FLOATS)
def test_data_range_not_finite(dtype):
    """Without a range, infinite or NaN data make torch raise RuntimeError when the values run."""
    for values in ([1.0, INF], [-INF, 1.0], [1.0, NAN], [NAN]):
        same_error(lambda x: torch.histogram(x, 3), torch.tensor(values, dtype=dtype), message=False)
    # with a range they are simply outside it
    lowered(hist(3, range=(0.0, 2.0)), torch.tensor([1.0, INF, NAN, -INF], dtype=dtype))
