"""FFT lowerings: the three aten primitives every torch.fft function reaches.

- ``_fft_r2c(x, dim, normalization, onesided)``: real -> complex, over ``dim``; with
  ``onesided`` the last dim of ``dim`` keeps ``n // 2 + 1`` frequencies.
- ``_fft_c2c(x, dim, normalization, forward)``: complex -> complex, forward (exp(-i...)) or
  backward (exp(+i...)), both unnormalized before ``normalization`` applies.
- ``_fft_c2r(x, dim, normalization, last_dim_size)``: a Hermitian half-spectrum -> real, the
  backward direction, with ``last_dim_size`` samples along the last dim of ``dim``.

``normalization`` is torch's ``fft_norm_mode``: 0 none, 1 by ``1/sqrt(n)``, 2 by ``1/n``, where
``n`` is the product of the signal sizes over ``dim`` (the real sizes, for c2r the output's).
The transforms are computed unnormalized with jnp.fft and scaled once here.  float32 signals
transform in complex64 and float64 ones in complex128, as torch does.  torch's CPU kernels accept
only float32/float64/complex64/complex128 (the torch.fft functions promote integers to float
before calling these), so other dtypes replay on CPU to raise torch's own error.

Not modelled: with an infinite input, which outputs are +-inf and which NaN (``inf - inf`` in a
butterfly) depends on the FFT algorithm, and XLA's differs from MKL's.  NaN inputs agree.

torch conjugates some of these results with a lazy conj view (``fft_r2c`` returns
``_fft_r2c(...).conj()`` for ifft/ihfft; hfft2/hfftn conjugate a c2c result before their c2r);
the capture resolves such views of pending tensors, so the rules never see them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .registry import LoweringContext, lowering, replay_on_cpu
from .._lazy import lazy_import

jnp = lazy_import("jax.numpy", globals(), "jnp")

aten = torch.ops.aten

_FFT_DTYPES = frozenset({torch.float32, torch.float64, torch.complex64, torch.complex128})


def _check_fft(ctx: LoweringContext) -> Optional[str]:
    x = ctx.args[0]
    if x.dtype not in _FFT_DTYPES:
        return replay_on_cpu(ctx)
    if 0 in x.shape or 0 in ctx.out[0].shape:
        return replay_on_cpu(ctx)   # torch's CPU (MKL) kernels reject empty signals and batches
    return None


def _axes(ndim: int, dims) -> tuple[int, ...]:
    return tuple(d % ndim for d in dims) if ndim else ()


def _complex_of(dtype) -> jnp.dtype:
    dtype = jnp.dtype(dtype)
    if dtype in (jnp.dtype(jnp.float64), jnp.dtype(jnp.complex128)):
        return jnp.dtype(jnp.complex128)
    return jnp.dtype(jnp.complex64)


def _real_of(dtype) -> jnp.dtype:
    return jnp.dtype(jnp.float64) if _complex_of(dtype) == jnp.complex128 else jnp.dtype(jnp.float32)


def _normalize(y, normalization: int, n: int):
    if normalization == 0 or n == 1:
        return y
    real = jnp.finfo(y.dtype).dtype
    scale = 1.0 / math.sqrt(n) if normalization == 1 else 1.0 / n
    return y * jnp.asarray(scale, real)


@lowering(aten._fft_r2c.default, check=_check_fft)
def fft_r2c(ctx, x, dim, normalization, onesided):
    axes = _axes(x.ndim, dim)
    x = x.astype(_real_of(x.dtype))
    if not axes:
        return x.astype(_complex_of(x.dtype))
    if onesided:
        y = jnp.fft.rfftn(x, axes=axes)
    else:
        y = jnp.fft.fftn(x.astype(_complex_of(x.dtype)), axes=axes)
    return _normalize(y, normalization, math.prod(x.shape[a] for a in axes))


@lowering(aten._fft_c2c.default, check=_check_fft)
def fft_c2c(ctx, x, dim, normalization, forward):
    axes = _axes(x.ndim, dim)
    x = x.astype(_complex_of(x.dtype))
    if not axes:
        return x
    if forward:
        y = jnp.fft.fftn(x, axes=axes)
    else:
        y = jnp.fft.ifftn(x, axes=axes, norm="forward")   # "forward": the inverse is unscaled
    return _normalize(y, normalization, math.prod(x.shape[a] for a in axes))


@lowering(aten._fft_c2r.default, check=_check_fft)
def fft_c2r(ctx, x, dim, normalization, last_dim_size):
    axes = _axes(x.ndim, dim)
    x = x.astype(_complex_of(x.dtype))
    sizes = [x.shape[a] for a in axes[:-1]] + [int(last_dim_size)]
    y = jnp.fft.irfftn(x, s=sizes, axes=axes, norm="forward")
    return _normalize(y, normalization, math.prod(sizes))
