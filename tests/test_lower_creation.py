"""Creation lowerings (deferfuse/lower/creation.py) against strict PyTorch."""

from __future__ import annotations

import random

import pytest
import torch

import deferfuse
from oracle import check, run_both
from oracle import lowered as _lowered

INT_FLOAT_BOOL = [torch.bool, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                  torch.float32, torch.float64]


def lowered(fn, *inputs, **tol):
    return _lowered(fn, *inputs, compared=True, **tol)


def same_layout(fn, *inputs):
    """For empty*: contents are unspecified, so compare shape, dtype, strides and requires_grad."""
    deferfuse.reset_stats()
    expected, actual, _, _ = run_both(fn, *inputs)
    assert not deferfuse.stats()["fallbacks"]
    for e, a in zip(expected, actual):
        layout = (a.shape, a.dtype, a.stride(), a.requires_grad)
        assert layout == (e.shape, e.dtype, e.stride(), e.requires_grad)


@pytest.mark.parametrize("dtype", INT_FLOAT_BOOL)
def test_constant_factories(dtype):
    lowered(lambda: (torch.zeros(2, 3, dtype=dtype), torch.ones(4, dtype=dtype),
                     torch.zeros((), dtype=dtype), torch.ones(0, 3, dtype=dtype),
                     torch.full((2, 2), 7, dtype=dtype), torch.full((3,), 2.75, dtype=dtype),
                     torch.full((), True, dtype=dtype), torch.full((0,), -3, dtype=dtype),
                     torch.scalar_tensor(5, dtype=dtype), torch.eye(3, dtype=dtype),
                     torch.eye(2, 4, dtype=dtype), torch.eye(0, dtype=dtype)))


def test_complex_factories():
    lowered(lambda: (torch.zeros(2, dtype=torch.complex64), torch.ones(2, 2, dtype=torch.complex128),
                     torch.full((3,), 1 + 2j), torch.full_like(torch.zeros(2, dtype=torch.complex64), -1j),
                     torch.eye(2, dtype=torch.complex64)))


def test_full_infers_dtype_and_converts_like_torch():
    lowered(lambda: (torch.full((2,), True), torch.full((2,), 3), torch.full((2,), 2.5),
                     torch.full((2, 1), -2.7, dtype=torch.int64), torch.full((2,), 0.2, dtype=torch.bool),
                     torch.full((3,), float("nan")), torch.full((3,), float("-inf"), dtype=torch.float64),
                     torch.full((2,), 65504.0, dtype=torch.float16), torch.scalar_tensor(3),
                     torch.scalar_tensor(True), torch.full((2,), 300, dtype=torch.int16)))


def test_requires_grad_of_factories():
    def fn():
        made = (torch.zeros(2), torch.arange(3.), torch.full((2,), 1.5), torch.eye(2),
                torch.linspace(0, 1, 3), torch.ones(2, requires_grad=True),
                torch.full((2,), 2.0, requires_grad=True), torch.arange(3., requires_grad=True))
        return [t.requires_grad for t in made] + [t.detach() for t in made]
    lowered(fn)


def test_empty_factories_have_torchs_layout():
    base = torch.ones(2, 3, 4).permute(2, 0, 1)
    same_layout(lambda x: (torch.empty(2, 3), torch.empty(0, dtype=torch.int32),
                           torch.empty_strided((2, 3), (1, 2)), torch.empty_like(x),
                           torch.empty_like(x, memory_format=torch.contiguous_format),
                           x.new_empty((3, 2)), x.new_empty_strided((4,), (2,)),
                           torch.empty((2, 3, 4, 5), memory_format=torch.channels_last)), base)


@pytest.mark.parametrize("dtype", [None, torch.int32, torch.bool, torch.float64])
def test_like_and_new_factories(dtype):
    x = torch.arange(24.).reshape(2, 3, 4).permute(2, 0, 1)[1:]   # non-contiguous, offset

    def fn(x):
        outs = (torch.zeros_like(x, dtype=dtype), torch.ones_like(x, dtype=dtype),
                torch.full_like(x, 3, dtype=dtype), torch.full_like(x, 0.5, dtype=dtype),
                x.new_zeros((2, 0), dtype=dtype), x.new_ones(3, dtype=dtype),
                x.new_full((2,), 4, dtype=dtype), torch.zeros_like(x[0, 0, 0], dtype=dtype))
        return outs + tuple(torch.tensor(o.stride()) for o in outs)
    lowered(fn, x)


def test_full_like_of_integer_tensor_truncates():
    lowered(lambda x: (torch.full_like(x, 2.9), torch.full_like(x, -1.5), x.new_full((2,), 7.9)),
            torch.arange(6, dtype=torch.int32).reshape(2, 3))


ARANGES = [
    (5,), (5.,), (0,), (1, 5), (-3, 3), (1, 5, 0.5), (0, 1, 0.1), (10, 0, -3), (-1.5, 2.5, 0.25),
    (0, 10, 3), (0.5, 5, 1.5), (-0.5, 5, 1.7), (0, -1, -0.1), (1e6, 1e6 + 10, 0.7), (0, 1000, 0.01),
]


@pytest.mark.parametrize("dtype", [None, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                                   torch.float32, torch.float64])
def test_arange(dtype):
    kw = {} if dtype is None else {"dtype": dtype}
    cases = [a for a in ARANGES if not (dtype is not None and not dtype.is_floating_point
                                        and any(float(v) != int(v) for v in a[2:]) and abs(a[2]) < 1)]
    lowered(lambda: tuple(torch.arange(*a, **kw) for a in cases),
            exact=dtype in (None, torch.float32, torch.float64))


def test_arange_default_dtypes():
    lowered(lambda: (torch.arange(5), torch.arange(5.), torch.arange(1, 4.5), torch.arange(0, 3, 1)))


def test_arange_long_runs_in_parallel_chunks_like_torch():
    # past at::internal::GRAIN_SIZE torch splits the range across threads; vectors restart per chunk
    lowered(lambda: (torch.arange(0.3, 4000.3, 0.1), torch.arange(-7.0, 40000.0, 1 / 3, dtype=torch.float64)),
            exact=True)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_range_dtype_errors_match_torch():
    # the oracle requires defer to raise the exception type strict raises
    for fn in (lambda: torch.arange(3, dtype=torch.bool), lambda: torch.linspace(0, 1, 3, dtype=torch.bool),
               lambda: torch.logspace(0, 1, 3, dtype=torch.bool),
               lambda: torch.full((3,), 1e20, dtype=torch.half),
               lambda: torch.full((2, 2), 300, dtype=torch.uint8),
               lambda: torch.full((1,), 1e20, dtype=torch.half)):   # one element: torch does not check
        expected, actual, _, _ = run_both(fn)
        assert (expected is None) == (actual is None)


def _linspace_cases(seed: int, n: int):
    rng = random.Random(seed)
    cases = [(0, 1, 5), (0, 10, 7), (-5, 22, 82), (-21, 102, 28), (3, 3, 1), (2.5, 7, 1), (0, 1, 0),
             (0.7, 9.9, 5), (10, -10, 9), (-1e3, 1e3, 1001), (0, 1, 2), (1, 0, 3)]
    for _ in range(n):
        start, end = rng.randint(-200, 200), rng.randint(-200, 200)
        if rng.random() < 0.5:
            start, end = start + rng.random(), end - rng.random()
        cases.append((start, end, rng.randint(2, 300)))
    return cases


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8,
                                   torch.float32, torch.float64])
def test_linspace_matches_torch_bit_for_bit(dtype):
    cases = _linspace_cases(hash(str(dtype)) % 1000, 60)
    if dtype == torch.uint8:
        cases = [(abs(a), abs(b), n) for a, b, n in cases if max(abs(a), abs(b)) < 256]
    # exact: torch rounds each value once (a fused multiply-add); so do we
    lowered(lambda: tuple(torch.linspace(*c, dtype=dtype) for c in cases), exact=True)


@pytest.mark.parametrize("dtype", [None, torch.float16, torch.bfloat16])
def test_linspace_low_precision_and_default(dtype):
    lowered(lambda: tuple(torch.linspace(*c, dtype=dtype) for c in _linspace_cases(7, 10)))


@pytest.mark.parametrize("dtype", [None, torch.float64])
def test_logspace(dtype):
    lowered(lambda: (torch.logspace(0, 3, 4, dtype=dtype), torch.logspace(-2, 2, 9, base=2, dtype=dtype),
                     torch.logspace(1, -1, 7, base=0.5, dtype=dtype), torch.logspace(2, 3, 1, dtype=dtype),
                     torch.logspace(0, 1, 0, dtype=dtype), torch.logspace(-1.5, 2.25, 50, dtype=dtype)))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_integer_logspace(dtype):
    lowered(lambda: (torch.logspace(0, 3, 4, dtype=dtype), torch.logspace(0, 6, 13, base=2, dtype=dtype),
                     torch.logspace(1.9, 4, 7, dtype=dtype), torch.logspace(3, 0, 10, base=3, dtype=dtype),
                     torch.logspace(-2, 2, 5, base=2, dtype=dtype), torch.logspace(2, 2, 1, dtype=dtype)),
            exact=True)


@pytest.mark.parametrize("args", [(3, 3), (4, 6, -1), (5, 3, 2), (0, 0), (3, 4, 10), (4, 4, -10), (1, 1)])
def test_tri_indices(args):
    lowered(lambda: (torch.tril_indices(*args), torch.triu_indices(*args),
                     torch.tril_indices(*args, dtype=torch.int32)), exact=True)


def test_factories_feed_later_ops():
    lowered(lambda x: (x + torch.ones(3), x * torch.arange(3.), torch.eye(3) * x), torch.randn(3, 3))


@pytest.mark.filterwarnings("ignore:torch.range is deprecated")
@pytest.mark.parametrize("dtype", [None, torch.int64, torch.float64, torch.bfloat16])
def test_range(dtype):
    # (an integer range with a step below 1 truncates it to 0 and kills torch with SIGFPE)
    steps = (2, -1.5) if dtype == torch.int64 else (0.1, -0.75)
    lowered(lambda: (torch.range(0, 5, dtype=dtype), torch.range(0, 1, steps[0], dtype=dtype),
                     torch.range(0.5, 5, 1.5, dtype=dtype), torch.range(3, -3, steps[1], dtype=dtype)),
            exact=dtype != torch.bfloat16)


def test_empty_permuted_layout():
    same_layout(lambda: (torch.empty_permuted((2, 3, 4), (2, 0, 1)), torch.empty_permuted((0, 3), (1, 0))))


@pytest.mark.parametrize("dtype", [None, torch.int64, torch.float64])
def test_linspace_logspace_of_tensors(dtype):
    # start/end given as 0-dim tensors: runtime values, converted like Scalars
    lowered(lambda a, b: (torch.linspace(a, b, 7, dtype=dtype), torch.linspace(a, 2.5, 5, dtype=dtype),
                          torch.linspace(-1, b, 9, dtype=dtype))
            + ((torch.logspace(a, b, 6, dtype=dtype), torch.logspace(a, 1.5, 4, base=2, dtype=dtype))
               if dtype != torch.int64 else ()),
            torch.tensor(-3.7), torch.tensor(8.25), exact=dtype == torch.int64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_linspace_of_tensors_bit_for_bit(dtype):
    """With runtime endpoints, XLA turned the step's division by the constant steps - 1 into a
    multiplication by its reciprocal: an ulp off torch on about 1 float64 linspace in 6."""
    cases = [c for c in _linspace_cases(11, 40) if c[2] >= 2]
    starts = torch.tensor([float(c[0]) for c in cases], dtype=torch.float64)
    ends = torch.tensor([float(c[1]) for c in cases], dtype=torch.float64)
    lowered(lambda s, e: tuple(torch.linspace(s[i].to(dtype), e[i].to(dtype), c[2], dtype=dtype)
                               for i, c in enumerate(cases)),
            starts, ends, exact=True)


def test_linspace_wider_than_the_largest_double():
    """An infinite step: torch's fused multiply-add gives NaN at the ends and +-inf between."""
    f64 = torch.float64
    lowered(lambda a, b: (torch.linspace(a, b, 5, dtype=f64), torch.linspace(a, b * 0 + float("inf"), 5, dtype=f64)),
            torch.tensor(-1e308, dtype=torch.float64), torch.tensor(1e308, dtype=torch.float64),
            exact=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8])
@pytest.mark.parametrize("value", [1e308, 1e20, 70000.0, 300.0, -1.0, float("inf"), float("nan")])
def test_tensor_endpoints_that_do_not_fit_raise_like_strict(dtype, value):
    """A 0-dim tensor endpoint is converted to the output type as c10 converts a Scalar, which
    raises 'value cannot be converted to type ... without overflow'; defer computed on."""
    f64 = torch.float64
    check(lambda a, b: (torch.linspace(a, b, 3, dtype=dtype), torch.linspace(b, a * 1, 1, dtype=dtype),
                        torch.linspace(a, b, 0, dtype=dtype)),
          torch.tensor(value, dtype=f64), torch.tensor(1.0, dtype=f64))
    if dtype.is_floating_point:
        check(lambda a, b: (torch.logspace(a, b, 3, dtype=dtype), torch.logspace(a, b, 1, dtype=dtype)),
              torch.tensor(value, dtype=f64), torch.tensor(1.0, dtype=f64))
