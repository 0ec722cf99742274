"""Deferred results report the strides strict PyTorch gives them, and their computed data lands
in that layout (capture/meta.py: where a Python meta function gives an op's metadata, the CPU
kernel itself, run on zeros of the call's layouts or on a miniature of a large call, says how
it lays its results out).

Each case is compared with strict's own result: the oracle compares strides (of every
dimension of more than one element) and storage offsets of the deferred tensor and of its
computed data; here the strides must be equal in every dimension too."""

from __future__ import annotations

import pytest
import torch

import deferfuse
from deferfuse.capture import meta
from oracle import check, landed, run_both, seeded_randn

aten = torch.ops.aten


def _same_layout(fn, *inputs):
    """check(), and every tensor result's full strides and offset as strict's, computed data too."""
    check(fn, *inputs)
    expected, actual, _, _ = run_both(fn, *inputs)
    expected = expected if isinstance(expected, (list, tuple)) else [expected]
    actual = actual if isinstance(actual, (list, tuple)) else [actual]
    for i, (e, a) in enumerate(zip(expected, actual)):
        for what, got in (("deferred", a), ("computed", landed(a))):
            assert (tuple(got.stride()), got.storage_offset()) == (tuple(e.stride()), e.storage_offset()), (
                f"result[{i}] {what}: strides {got.stride()} offset {got.storage_offset()}, "
                f"strict {e.stride()} offset {e.storage_offset()} (shape {tuple(e.shape)})")


def _layouts(n: int = 4) -> dict:
    """Awkward inputs of one broadcast shape (n+1, n) where they broadcast."""
    return {
        "transposed": seeded_randn(n, n + 1, seed=1).t(),
        "contiguous": seeded_randn(n + 1, n, seed=2) + 3,
        "broadcast": seeded_randn(1, n, seed=3).expand(n + 1, n),
        "sliced": seeded_randn(n + 1, 2 * n, seed=4)[:, ::2],
        "column": seeded_randn(n + 1, 1, seed=5),
    }


_PAIRS = [("transposed", "contiguous"), ("contiguous", "transposed"), ("broadcast", "transposed"),
          ("transposed", "broadcast"), ("sliced", "transposed"), ("column", "transposed")]


@pytest.mark.parametrize("n", [4, 300], ids=["small", "miniature"])
@pytest.mark.parametrize("a,b", _PAIRS, ids=["-".join(p) for p in _PAIRS])
def test_div_floor_lays_out_as_the_cpu_kernel(a, b, n):
    # (the reference torch runs on meta tensors ends in an op that orders its operands otherwise
    # than the CPU kernel's TensorIterator)
    x, y = _layouts(n)[a], _layouts(n)[b]
    _same_layout(lambda x, y: [torch.div(x, y, rounding_mode="floor"), torch.floor_divide(x, y)], x, y)


def test_div_floor_channels_last_0dim_and_empty():
    x = seeded_randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    _same_layout(lambda x, c: torch.div(x, c, rounding_mode="floor"), x, seeded_randn(3, 1, 1, seed=1) + 3)
    _same_layout(lambda c, x: torch.div(c, x, rounding_mode="floor"), seeded_randn(3, 1, 1, seed=1), x)
    _same_layout(lambda x, s: torch.div(x, s, rounding_mode="floor"), seeded_randn(5, 4).t(), torch.tensor(2.0))
    _same_layout(lambda s, t: torch.div(s, t, rounding_mode="floor"), torch.tensor(7.0), torch.tensor(2.0))
    _same_layout(lambda x, y: torch.div(x, y, rounding_mode="floor"), torch.randn(3, 0).t(), torch.randn(0, 3))


@pytest.mark.parametrize("n", [4, 300], ids=["small", "miniature"])
@pytest.mark.parametrize("which", ["input", "grad"])
def test_hardtanh_backward_lays_out_as_the_cpu_kernel(which, n):
    # (the CPU kernel is a TensorIterator over (grad_output, self): grad_output's layout leads)
    t, c = _layouts(n)["transposed"], _layouts(n)["contiguous"]
    x, g = (t, c) if which == "input" else (c, t)
    _same_layout(lambda g, x: [aten.hardtanh_backward(g, x, 0.0, 6.0), aten.hardtanh_backward(g, x, -1.0, 1.0)], g, x)

    def relu6_grad(x):
        x = x.detach().requires_grad_()
        return torch.autograd.grad(torch.nn.functional.relu6(x), x, torch.ones_like(x))[0]
    _same_layout(relu6_grad, t)


def test_hardtanh_backward_channels_last():
    x = seeded_randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    _same_layout(lambda g, x: aten.hardtanh_backward(g, x, 0.0, 6.0), seeded_randn(2, 3, 4, 5, seed=1), x)
    _same_layout(lambda g, x: aten.hardtanh_backward(g, x, 0.0, 6.0), x, seeded_randn(2, 3, 4, 5, seed=1))


@pytest.mark.parametrize("name", ["transposed", "sliced", "broadcast", "channels_last", "empty", "0-dim", "large"])
def test_all_and_any_over_no_dims_are_contiguous(name):
    # (the CPU kernel's reduction makes a fresh contiguous result; the meta function keeps the
    # input's strides)
    x = {"transposed": seeded_randn(3, 4).t(), "sliced": seeded_randn(3, 8)[:, ::2],
         "broadcast": seeded_randn(1, 4).expand(3, 4),
         "channels_last": seeded_randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
         "empty": torch.randn(3, 0).t(), "0-dim": torch.tensor(0.5),
         "large": seeded_randn(300, 301).t()}[name] > 0
    _same_layout(lambda x: [aten.all.dims(x, []), aten.any.dims(x, []), aten.all.dims(x, [0], True)], x)


@pytest.mark.parametrize("shape,dims", [((3, 5), None), ((2, 3, 4), None), ((2, 3, 4), (0, 2)),
                                        ((6, 3), "t"), ((4, 9), "sliced"),
                                        ((400, 300), None), ((300, 400), "t"),
                                        ((2, 3, 4, 5), "channels_last")])
def test_rfftn_is_contiguous_as_pocketfft_makes_it(shape, dims):
    # (torch's meta function lays out the result as MKL's and cuFFT's plans do; the large one in
    # float64: float32's rounding of a 400-point transform is beyond the default tolerance)
    x = seeded_randn(*shape, dtype=torch.float64 if len(shape) == 2 and shape[0] * shape[1] > 65536 else torch.float32)
    if dims == "t":
        x, dims = x.t(), None
    elif dims == "sliced":
        x, dims = x[:, ::2], None
    elif dims == "channels_last":
        x, dims = x.to(memory_format=torch.channels_last), None
    _same_layout(lambda x: [torch.fft.rfftn(x, dim=dims), torch.fft.rfft2(x), torch.fft.rfft(x, dim=0)], x)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_a_large_complex_fft_is_laid_out_as_the_kernel_lays_it_out(layout):
    # (a call of more than 65536 elements whose result is not its input's shape: the kernel runs
    # on a miniature of it, an FFT of two-element signals, and its layout is carried over)
    x = torch.complex(seeded_randn(300, 301, dtype=torch.float64), seeded_randn(300, 301, dtype=torch.float64, seed=2))
    x = x.t() if layout == "transposed" else x
    _same_layout(lambda x: [torch.fft.fftn(x), torch.fft.fft(x, dim=0), torch.fft.ihfft2(x.real)], x)


def test_only_python_meta_functions_are_checked_against_the_kernel():
    # (C++ meta code is the CPU kernel's own, a structured kernel's meta function or a kernel
    # for every device: its layout is the kernel's)
    assert meta._meta_kernel_is_python(aten.div.Tensor_mode)
    assert meta._meta_kernel_is_python(aten.hardtanh_backward.default)
    assert meta._meta_kernel_is_python(aten._fft_r2c.default)
    assert not meta._meta_kernel_is_python(aten.clone.default)


def test_probing_the_kernel_does_not_draw_from_the_users_generator():
    # a random op whose layout is learned on the CPU kernel: the user's numbers stay strict's
    x = seeded_randn(4, 5).t().abs() / 4
    torch.manual_seed(0)
    expected = [torch.bernoulli(x), torch.rand(3)]
    torch.manual_seed(0)
    with deferfuse.defer():
        actual = [torch.bernoulli(x), torch.rand(3)]
    for e, a in zip(expected, actual):
        assert torch.equal(e, a.clone()) and e.stride() == a.stride()


@pytest.mark.parametrize("name", ["2-D", "transposed", "3-D", "one", "none", "1-D", "0-dim"])
def test_nonzero_is_column_major_as_the_cpu_kernel_makes_it(name):
    # (recorded as nonzero_static once the count is known, whose result is row-major)
    x = {"2-D": torch.tensor([[4.0, -4.0], [0.0, 1.0]]), "transposed": seeded_randn(3, 4).t() > 0,
         "3-D": seeded_randn(2, 3, 4) > 0, "one": torch.tensor([[0.0, 2.0]]), "none": torch.zeros(2, 3),
         "1-D": seeded_randn(5) > 0, "0-dim": torch.tensor(3.0)}[name]
    _same_layout(lambda x: [torch.nonzero(x), torch.argwhere(x)], x)


def test_a_gradient_torch_lays_out_otherwise_under_any_dispatch_mode_has_the_modes_layout():
    """ormqr's backward formula takes an out-of-place path when its arguments are subclass-like,
    and every tensor is while any Python dispatch mode is on: its input gradient is column-major
    in plain strict and row-major under a mode that only runs each op.  Defer mode is a mode, so
    it gives the latter, with strict's values (docs/semantics.md, Known differences; the
    conformance sweep compares such gradients with strict's layout under a passive mode)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passive(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    a = seeded_randn(5, 5, seed=4).t()   # (column-major, as OpInfo's sample)
    tau, c = seeded_randn(5, seed=5), seeded_randn(5, 5, seed=6)

    def grad():
        x = a.detach().requires_grad_()
        return torch.autograd.grad(torch.ormqr(x, tau, c).sum(), [x])[0]

    plain = grad()
    with Passive():
        moded = grad()
    with deferfuse.defer():
        deferred = grad()
    assert plain.stride() != moded.stride()   # (torch's own behaviour; this test's premise)
    assert deferred.stride() == moded.stride() and landed(deferred).stride() == moded.stride()
    torch.testing.assert_close(landed(deferred), plain)
