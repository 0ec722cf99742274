"""FFT lowerings (deferfuse/lower/fft.py) against strict PyTorch.

ifft/ihfft of real signals and hfft2/hfftn conjugate an r2c/c2c result through a lazy conj view,
which the capture resolves: those paths are checked too.
"""

from __future__ import annotations

import pytest
import torch

import deferfuse
from oracle import check, run_both

FFT_OPS = ("_fft_r2c", "_fft_c2c", "_fft_c2r")


def fft_lowered(fn, *inputs, **tol):
    """check(), asserting that no FFT primitive fell back to eager torch."""
    deferfuse.reset_stats()
    out = check(fn, *inputs, **tol)
    assert out is not None, "strict raised: nothing was compared"
    fallbacks = deferfuse.stats()["fallbacks"]
    assert not [op for op in fallbacks if any(n in op for n in FFT_OPS)], fallbacks
    return out


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _spectra(dtype):
    return {
        "1d": _randn(7, dtype=dtype),
        "2d": _randn(3, 5, dtype=dtype, seed=1),
        "3d": _randn(2, 3, 4, dtype=dtype, seed=2),
        "transposed": _randn(6, 3, dtype=dtype, seed=3).t(),
        "sliced": _randn(4, 9, dtype=dtype, seed=4)[:, ::2],
        # NaN only: with an Inf, which outputs are inf and which NaN (inf - inf) depends on the
        # FFT algorithm's butterflies, and XLA's differs from MKL's (a documented limitation)
        "nan": torch.tensor([[1.0, float("nan"), 2.0], [3.0, 0.0, -1.0]], dtype=dtype),
    }


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
@pytest.mark.parametrize("name", list(_spectra(torch.complex64)))
def test_c2r_irfft_family(dtype, name):
    x = _spectra(dtype)[name]
    fns = [
        lambda x: torch.fft.irfft(x),
        lambda x: torch.fft.irfft(x, n=6, dim=0 if x.ndim == 1 else -2, norm="ortho"),
        lambda x: torch.fft.irfft(x, n=3, norm="forward"),
        lambda x: torch.fft.irfftn(x),
        lambda x: torch.fft.irfft2(x, norm="ortho") if x.ndim >= 2 else torch.fft.irfft(x, 1),
    ]
    fft_lowered(lambda x: [f(x) for f in fns], x)


def test_c2r_odd_last_dim_and_nonhermitian_dc():
    # the imaginary parts of the DC and Nyquist terms are ignored, as pocketfft does
    x = torch.complex(_randn(3, 4, seed=5), _randn(3, 4, seed=6))
    fft_lowered(lambda x: [torch.fft.irfft(x, n=7), torch.fft.irfft(x, n=6), torch.fft.irfftn(x, s=(5, 6))], x)


def test_c2r_dtype_is_torch_real_dtype():
    out = fft_lowered(lambda x: torch.fft.irfft(x), _randn(2, 5, dtype=torch.complex128))
    assert out.dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(_spectra(torch.float32)))
def test_r2c_rfft_and_fft_of_real(dtype, name):
    x = _spectra(dtype)[name]
    fns = [
        lambda x: torch.fft.rfft(x),
        lambda x: torch.fft.rfft(x, norm="ortho", dim=0),
        lambda x: torch.fft.fft(x, norm="forward"),
        lambda x: torch.fft.fft(x, n=5, dim=0),
        lambda x: torch.fft.rfftn(x, norm="ortho"),
        lambda x: torch.fft.rfft2(x) if x.ndim >= 2 else torch.fft.rfft(x, 10),
    ]
    out = fft_lowered(lambda x: [f(x) for f in fns], x)
    assert out[0].dtype == (torch.complex128 if dtype == torch.float64 else torch.complex64)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
@pytest.mark.parametrize("name", list(_spectra(torch.complex64)))
def test_c2c_forward_and_backward(dtype, name):
    x = _spectra(dtype)[name]
    fns = [
        lambda x: torch.fft.fft(x),
        lambda x: torch.fft.ifft(x, norm="ortho"),
        lambda x: torch.fft.fftn(x, norm="forward"),
        lambda x: torch.fft.ifftn(x),
        lambda x: torch.fft.ifft2(x, s=(3, 2)) if x.ndim >= 2 else torch.fft.ifft(x, 4),
        lambda x: torch.fft.fft(x, dim=0, n=3),
    ]
    fft_lowered(lambda x: [f(x) for f in fns], x)


def test_c2c_0dim_dim_list_is_identity():
    x = _randn(3, 4, dtype=torch.complex64)
    fft_lowered(lambda x: torch.ops.aten._fft_c2c(x, [], 2, False), x)


def test_inverse_of_real_goes_through_a_conj_view():
    # ifft/ihfft of a real signal is _fft_r2c(...).conj()
    x = _randn(3, 6)
    check(lambda x: [torch.fft.ifft(x), torch.fft.ihfft(x), torch.fft.hfft2(x.to(torch.complex64))], x)


def test_unsupported_dtypes_raise_like_cpu():
    x = _randn(4, 6, dtype=torch.complex64)
    expected = None
    try:
        torch.ops.aten._fft_c2r(x.to(torch.complex32), [1], 0, 10)
    except Exception as exc:  # noqa: BLE001
        expected = type(exc)
    with deferfuse.config.override(always_compile=True):
        with pytest.raises(expected or Exception):
            with deferfuse.defer():
                torch.ops.aten._fft_c2r(x.to(torch.complex32), [1], 0, 10)


def test_empty_signals_raise_like_cpu():
    x = torch.randn(0, 4, dtype=torch.complex64)
    expected, actual, _, _ = run_both(lambda x: torch.fft.irfft(x), x)   # same exception type
    assert expected is None and actual is None
