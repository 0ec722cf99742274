"""Creation lowerings: factories (zeros, full, arange, linspace, eye, ...) and their *_like and
new_* forms.

A factory's output shape and dtype come from ``ctx.out`` (torch inferred them on meta tensors),
so the rules only compute values.  A factory's Scalar arguments are static Python numbers, but
full_like/new_full get runtime scalars and linspace.Tensor_Tensor and friends 0-dim tensors, so
the value arithmetic below is written for traced values throughout.

arange, range and linspace reproduce torch's CPU kernels (RangeFactoriesKernel.cpp,
RangeFactories.cpp) bit for bit, which integer outputs need and float outputs get for free:
- Integer outputs accumulate in int64 after truncating a float start/step (``Scalar::to``).
- Float outputs accumulate in double, and the compiler fused each ``start + step * i`` into one
  multiply-add, rounded once (``_fma_f64``).  We measured this on torch 2.13: rounding the
  product first disagrees with torch on ~10% of integer linspaces.
- arange writes SIMD vectors: a vector's first element is ``start + step * i0``, rounded to the
  output type, and the others add ``j * step`` to that (``_arange_base_index``).
- linspace computes the first half from ``start`` and the second half from ``end``.
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import torch
from torch.utils._python_dispatch import _disable_current_modes

from . import common
from . import dtypes as _dtypes
from .registry import LoweringContext, lowering, runtime_check
from .._lazy import lazy_import

jnp = lazy_import("jax.numpy", globals(), "jnp")
lax = lazy_import("jax.lax", globals(), "lax")

aten = torch.ops.aten

_F64 = np.dtype(np.float64)
_I64 = np.dtype(np.int64)
_HALF_TYPES = _dtypes.HALF_TYPES


def _check_strided(ctx: LoweringContext) -> Optional[str]:
    if ctx.kwargs.get("layout") not in (None, torch.strided):
        return "only strided layouts are lowered"
    if not all(_dtypes.is_supported(o.dtype) for o in ctx.out):
        return f"dtype {ctx.out[0].dtype} has no JAX equivalent"
    return None


def _check_real(ctx: LoweringContext) -> Optional[str]:
    if ctx.out[0].dtype.is_complex:
        return "complex ranges are not lowered"
    return _check_strided(ctx)


def _scalar(value, dtype):
    """A Scalar argument converted as ``Scalar::to<dtype>()`` does (truncating floats for
    integer types, nonzero test for bool)."""
    value = jnp.asarray(value)
    if jnp.dtype(dtype) == jnp.bool_:
        return value != 0
    return value.astype(dtype)


# c10's names for the types in "value cannot be converted to type ... without overflow"
_C10_NAMES = {"float32": "float", "float16": "c10::Half", "bfloat16": "c10::BFloat16",
              "int64": "int64_t", "int32": "int", "int16": "int16_t", "int8": "int8_t",
              "uint8": "uint8_t"}


def _checked_scalar(value, dtype):
    """_scalar of a runtime value (a 0-dim tensor passed as a Scalar), raising as c10's
    checked conversion does when the value does not fit ``dtype`` (NaN fits no integer type;
    infinities fit every float type).  Python numbers were checked when the op was recorded."""
    dtype = jnp.dtype(dtype)
    if isinstance(value, (bool, int, float)) or dtype.name not in _C10_NAMES:
        return _scalar(value, dtype)
    wide = jnp.asarray(value).astype(_F64)
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        failed = ~((wide >= float(info.min)) & (wide <= float(info.max)))
    else:
        largest = float(jnp.finfo(dtype).max)
        failed = jnp.isfinite(wide) & (jnp.abs(wide) > largest)
    runtime_check(failed, RuntimeError, f"value cannot be converted to type {_C10_NAMES[dtype.name]} without overflow")
    return _scalar(value, dtype)


# -- constant fills ------------------------------------------------------------------------------

def _filled(ctx: LoweringContext, value):
    return jnp.full(ctx.out_shape, _scalar(value, ctx.out_dtype), ctx.out_dtype)


# Allocations (their contents unspecified in torch) are zeros, as defer mode gives them
# (docs/semantics.md, "torch.empty* returns zeros").  The recorder never asks for these rules: it
# runs allocations eagerly (capture/classify.py, OpKind.ALLOCATION), so that code such as
# torch.load can re-point their results with set_(); they serve graphs that contain allocations,
# such as torch.compile's (compile/plan.py), where the allocation joins the partition.
@lowering(aten.empty.memory_format, aten.empty_strided.default, aten.empty_permuted.default,
          aten.new_empty.default, aten.new_empty_strided.default, aten.empty_like.default)
def empty(ctx, *args, **kwargs):
    return jnp.zeros(ctx.out_shape, ctx.out_dtype)


@lowering(aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default, check=_check_strided)
def zeros(ctx, *args, **kwargs):
    return jnp.zeros(ctx.out_shape, ctx.out_dtype)


@lowering(aten.ones.default, aten.ones_like.default, aten.new_ones.default, check=_check_strided)
def ones(ctx, *args, **kwargs):
    return jnp.ones(ctx.out_shape, ctx.out_dtype)


def _check_fill(ctx: LoweringContext) -> Optional[str]:
    fill = ctx.args[2] if ctx.op is aten.new_full.default else ctx.args[-1]
    if isinstance(fill, complex) and not ctx.out[0].dtype.is_complex:
        return "a complex fill of a real tensor is not lowered"
    if ctx.op is aten.full.default:
        # full refuses values the dtype cannot hold (1e20 as float16, 300 as uint8) where the
        # meta kernel does not, except on its one-element fast path.  A factory's fill value is
        # static, so replaying the call at (at most) two elements raises what torch raises.
        shape = ctx.out_shape if ctx.out[0].numel < 2 else [2]
        with _disable_current_modes():
            ctx.op(list(shape), fill, **ctx.kwargs)
    return _check_strided(ctx)


@lowering(aten.full.default, check=_check_fill)
def full(ctx, size, fill_value, **kwargs):
    return _filled(ctx, fill_value)


@lowering(aten.full_like.default, check=_check_fill)
def full_like(ctx, x, fill_value, **kwargs):
    return _filled(ctx, fill_value)


@lowering(aten.new_full.default, check=_check_fill)
def new_full(ctx, x, size, fill_value, **kwargs):
    return _filled(ctx, fill_value)


@lowering(aten.scalar_tensor.default, check=_check_fill)
def scalar_tensor(ctx, s, **kwargs):
    return _filled(ctx, s)


@lowering(aten.eye.default, aten.eye.m, check=_check_strided)
def eye(ctx, *args, **kwargs):
    n, m = ctx.out_shape
    return jnp.eye(n, m, dtype=ctx.out_dtype)


# -- ranges --------------------------------------------------------------------------------------

def _split(a):
    """Veltkamp split of float64 ``a`` into a high part of 26 significant bits and the rest, so
    that each part times an integer below 2**26 is exact."""
    t = a * 134217729.0  # 2**27 + 1
    high = t - (t - a)
    return high, a - high


def _fma_f64(a, b, c):
    """a * b + c rounded once (as a hardware FMA does), for float64 ``a`` and ``c`` and integral
    float64 ``b`` below 2**26 (beyond, within an ulp of it): the product is kept as an exact
    double-double sum.  The error-free transformations below rely on XLA neither contracting nor
    reassociating float arithmetic, as on CPU (the bit-exact linspace tests check it)."""
    a_high, a_low = _split(a)
    p_high, p_low = a_high * b, a_low * b          # both exact
    s = c + p_high
    # TwoSum: the exact rounding error of c + p_high
    bv = s - c
    err = (c - (s - bv)) + (p_high - bv)
    return s + (err + p_low)


_GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE: below it, parallel_for runs one chunk


def _arange_base_index(n: int, lanes: int) -> np.ndarray:
    """For each element of an arange, the index its value is computed from.

    torch's CPU arange fills each parallel chunk with SIMD vectors of ``lanes`` elements, two at a
    time, computing a vector's first element as ``start + step * i0`` and the rest as that value
    (rounded to the output type) plus ``j * step``; the chunk's tail is scalar code.  So element i
    has base index i0 and offset i - i0."""
    i = np.arange(n)
    threads = torch.get_num_threads()
    if n <= _GRAIN_SIZE or threads == 1:
        chunks = [(0, n)]
    else:  # at::parallel_for's split
        threads = min(threads, -(-n // _GRAIN_SIZE))
        size = -(-n // threads)
        chunks = [(b, min(n, b + size)) for b in range(0, n, size)]
    base = i.copy()
    for begin, end in chunks:
        vectorized = (i >= begin) & (i < begin + (end - begin) // (2 * lanes) * (2 * lanes))
        base[vectorized] = begin + (i[vectorized] - begin) // lanes * lanes
    return base


@functools.cache
def _simd_bytes() -> int:
    """The SIMD width torch's arange kernel uses on this machine, measured once: it is not what
    torch.backends.cpu.get_cpu_capability() suggests (AVX512 machines still run 32-byte vectors
    for arange on torch 2.13)."""
    start, step, n = 0.3, 0.1, 200
    with _disable_current_modes():
        probe = torch.arange(start, start + step * (n - 0.5), step, dtype=torch.float32).numpy()
    for lanes in (8, 16, 4, 32):
        base = _arange_base_index(n, lanes)
        first = (start + step * base).astype(np.float32).astype(np.float64)
        if np.array_equal(probe, (first + step * (np.arange(n) - base)).astype(np.float32)):
            return lanes * 4
    return 32


def _arange(ctx: LoweringContext, start, step):
    (n,) = ctx.out_shape
    dtype = ctx.out_dtype
    if jnp.issubdtype(dtype, jnp.integer):
        # The accumulate type of integers is int64: start and step are truncated to integers
        # before the (exact, wrapping) integer arithmetic.
        i = lax.iota(_I64, n)
        return _scalar(start, _I64) + i * _scalar(step, _I64)
    base = _arange_base_index(n, _simd_bytes() // jnp.dtype(dtype).itemsize)
    offset = jnp.asarray(np.arange(n) - base, _F64)
    base = jnp.asarray(base, _F64)
    if dtype in _HALF_TYPES:
        # float16/bfloat16 accumulate in float; their tolerance covers how that rounds.
        start, step = _scalar(start, jnp.float32), _scalar(step, jnp.float32)
        first = (start + step * base.astype(jnp.float32)).astype(dtype)
        return first.astype(jnp.float32) + offset.astype(jnp.float32) * step
    # float32/64 accumulate in double, and the kernel's multiply-adds are fused (one rounding).
    start, step = _scalar(start, _F64), _scalar(step, _F64)
    first = _fma_f64(step, base, start).astype(dtype).astype(_F64)
    return _fma_f64(step, offset, first)


def _check_range(ctx: LoweringContext) -> Optional[str]:
    if ctx.out[0].dtype == torch.bool:
        return common.raise_like_cpu(ctx)
    return _check_real(ctx)


@lowering(aten.arange.default, check=_check_range)
def arange(ctx, end, **kwargs):
    return _arange(ctx, 0, 1)


@lowering(aten.arange.start, check=_check_range)
def arange_start(ctx, start, end, **kwargs):
    return _arange(ctx, start, 1)


@lowering(aten.arange.start_step, check=_check_range)
def arange_start_step(ctx, start, end, step=1, **kwargs):
    return _arange(ctx, start, step)


@lowering(aten.linspace.default, aten.linspace.Tensor_Tensor, aten.linspace.Tensor_Scalar,
          aten.linspace.Scalar_Tensor, check=_check_range)
def linspace(ctx, start, end, steps, **kwargs):
    dtype = ctx.out_dtype
    if steps == 0:
        return jnp.zeros(ctx.out_shape, dtype)
    start, end = _checked_scalar(start, dtype), _checked_scalar(end, dtype)
    if steps == 1:
        return jnp.full(ctx.out_shape, start, dtype)
    if dtype in _HALF_TYPES or jnp.dtype(dtype) == jnp.float32:
        return linspace_values(start, end, steps, dtype)
    # float64 and integer outputs compute in double; integers truncate the result.
    return linspace_values(start.astype(_F64), end.astype(_F64), steps, _F64).astype(dtype)


def linspace_values(start, end, steps: int, dtype):
    """torch.linspace(start, end, steps) for ``steps`` >= 2, as the CPU kernel computes it:
    the first half from ``start``, the second from ``end``.  ``start`` and ``end`` are traced
    scalars of ``dtype`` (a half type, float32 or float64)."""
    i = np.arange(steps)
    head = i < steps // 2
    if dtype in _HALF_TYPES:
        # c10::Half arithmetic rounds every intermediate to the type itself.
        step = common.exact_div(end - start, jnp.asarray(steps - 1, dtype))
        k = jnp.asarray(np.where(head, i, steps - i - 1), dtype)
        return jnp.where(head, start + step * k, end - step * k)
    k = jnp.asarray(np.where(head, i, steps - i - 1), _F64)
    if jnp.dtype(dtype) == jnp.float32:
        # step * i is exact in double for i < 2**29, so one rounding of the sum to float32
        # stands for the fused multiply-add (up to rare double-rounding ties).
        step = common.exact_div(end - start, jnp.asarray(steps - 1, jnp.float32)).astype(_F64)
        values = jnp.where(head, start.astype(_F64) + step * k, end.astype(_F64) - step * k)
        return values.astype(dtype)
    return _halves_f64(start, end, common.exact_div(end - start, jnp.asarray(steps - 1, _F64)), steps)


def _halves_f64(start, end, step, steps: int):
    """start + step * i for the first half of ``steps`` and end - step * (steps - 1 - i) for the
    second, each a fused multiply-add, in float64."""
    i = np.arange(steps)
    head = i < steps // 2
    k = jnp.asarray(np.where(head, i, steps - i - 1), _F64)
    fused = jnp.where(head, _fma_f64(step, k, start), _fma_f64(-step, k, end))
    # the exact multiply-add splits the step, which an infinite step (a range wider than the
    # largest double) turns into NaN; a fused multiply-add gives inf there, or NaN at k = 0
    plain = jnp.where(head, start + step * k, end - step * k)
    return jnp.where(jnp.isfinite(step), fused, plain)


@lowering(aten.range.default, aten.range.step, check=_check_range)
def range_(ctx, start, end, step=1, **kwargs):
    """The deprecated torch.range: end inclusive, and a plain (unvectorized) loop computing
    ``start + i * step`` in the accumulate type, the multiply-add fused."""
    (n,) = ctx.out_shape
    dtype = ctx.out_dtype
    if jnp.issubdtype(dtype, jnp.integer):
        return _scalar(start, _I64) + lax.iota(_I64, n) * _scalar(step, _I64)
    acc = jnp.float32 if dtype in _HALF_TYPES else _F64
    start, step = _scalar(start, acc), _scalar(step, acc)
    if acc == jnp.float32:
        return start + step * lax.iota(acc, n)
    return _fma_f64(step, lax.iota(_F64, n), start)


@lowering(aten.logspace.default, aten.logspace.Tensor_Tensor, aten.logspace.Tensor_Scalar,
          aten.logspace.Scalar_Tensor, check=_check_range)
def logspace(ctx, start, end, steps, base=10.0, **kwargs):
    """torch: start and end in the output type, the step and the exponent in double, and
    pow(double, double) cast to the output type.  Integer outputs truncate that power; XLA's pow
    is exact at integral exponents, and elsewhere within an ulp of libm's, so truncation agrees
    except for a power within an ulp of an integer at a fractional exponent."""
    dtype = ctx.out_dtype
    if steps == 0:
        return jnp.zeros(ctx.out_shape, dtype)
    if steps == 1:   # torch fills in pow(base, start): a checked Scalar conversion, but
        value = jnp.power(jnp.asarray(base, _F64), _scalar(start, _F64))
        if dtype in _HALF_TYPES:   # half types go through float, unchecked
            return jnp.full(ctx.out_shape, value.astype(jnp.float32), dtype)
        return jnp.full(ctx.out_shape, _checked_scalar(value, dtype), dtype)
    start, end = _checked_scalar(start, dtype), _checked_scalar(end, dtype)
    step = common.exact_div((end - start).astype(_F64), jnp.asarray(steps - 1, _F64))
    exponent = _halves_f64(start.astype(_F64), end.astype(_F64), step, steps)
    return jnp.power(jnp.asarray(base, _F64), exponent)


# -- index factories -----------------------------------------------------------------------------

def _tri_indices(row: int, col: int, offset: int, lower: bool) -> np.ndarray:
    r, c = np.indices((row, col))
    keep = (c - r <= offset) if lower else (c - r >= offset)
    return np.stack([r[keep], c[keep]])  # row-major order, as torch lists them


@lowering(aten.tril_indices.default, check=_check_strided)
def tril_indices(ctx, row, col, offset=0, **kwargs):
    return jnp.asarray(_tri_indices(row, col, offset, True).reshape(ctx.out_shape), ctx.out_dtype)


@lowering(aten.triu_indices.default, check=_check_strided)
def triu_indices(ctx, row, col, offset=0, **kwargs):
    return jnp.asarray(_tri_indices(row, col, offset, False).reshape(ctx.out_shape), ctx.out_dtype)
