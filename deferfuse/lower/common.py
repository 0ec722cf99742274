"""Helpers shared by more than one lowering family, so that no family imports another's private
names: families do ``from . import common`` and call ``common.through(...)``.

- checkers: the dtype checks and the CPU-kernel probe of the pointwise families (pointwise,
  activation, special, prims) and ``raise_like_cpu``;
- operands: reading operands as torch's CPU kernels read them (``through``, ``wide``), casts
  (``convert``, ``convert_any``), a division rounded once (``divide``), ``sigmoid``;
- nn: accumulation types, dtype checks and the index maps that nn forward and backward rules share;
- padding: torch's pad lists as per-dim (low, high) and pad-then-crop;
- reductions: axes, element counts, accumulation dtypes and checks that the reduction,
  normalization, order-statistics and segment families share.

A helper used by one family stays private in it.
"""

from __future__ import annotations

import math
import platform
from typing import Any, Optional, Sequence

import numpy as np
import torch

from . import dtypes as _dtypes
from . import xla_fixes
from .registry import LoweringContext, replay_on_cpu
from .._lazy import lazy_import

jnp = lazy_import("jax.numpy", globals(), "jnp")
lax = lazy_import("jax.lax", globals(), "lax")

_REDUCED_FLOATS = _dtypes.HALF_TYPES


def exact_div(a, b):
    """a / b, rounded once, as torch divides, where ``b`` is a scalar computed from constants.
    XLA's algebraic simplifier turns a division by a constant into a multiplication by its
    (rounded) reciprocal, an ulp off torch's quotient; the barrier keeps the divisor opaque
    while it runs.  Not for an array divided by a broadcast constant, which XLA rewrites after
    the barrier is gone: ``divided_by_constant``."""
    return a / lax.optimization_barrier(b)


def at_least(x, low):
    """max(x, low) as torch's clamp and relu take it: ``x`` where the two compare equal, so
    relu(-0.0) is -0.0 (XLA's max, IEEE's, gives +0.0); NaN propagates as through max."""
    return jnp.where(x == low, x, jnp.maximum(x, low))


def at_most(x, high):
    """min(x, high), ``x`` where the two compare equal (``at_least``)."""
    return jnp.where(x == high, x, jnp.minimum(x, high))


# Veltkamp's splitter for float64: 2^27 + 1
_SPLITTER = 134217729.0


def _split(a):
    c = _SPLITTER * a
    high = c - (c - a)
    return high, a - high


def _two_product(a, b):
    """(p, e) with p = fl(a * b) and p + e = a * b exactly (Dekker), for finite a * b."""
    p = a * b
    ah, al = _split(a)
    bh, bl = _split(b)
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def divided_by_constant(a, divisor: float):
    """``a / divisor`` rounded once, as torch's kernel divides, for a float32 or float64 array
    and a positive constant.  XLA computes ``x / c`` as ``x * (1 / c)`` (its simplifier, even
    past an optimization barrier once the array is broadcast), an ulp off: ``round(2.675,
    decimals=2)`` in float32 gave 268 * 0.01f = 2.6799998 where torch's 268 / 100 is 2.6800001.
    So the quotient is the product with the reciprocal, corrected by its exact remainder (the
    product's rounding error by Dekker's two-product, no division left for XLA to rewrite), in
    float64; a float32 operand is exact there, and float64 carries more than twice float32's
    bits, so the float64 quotient rounds to float32's own.  Magnitudes past the splitting's
    range (beyond 2^996, below 2^-960) keep the plain product."""
    dtype = a.dtype
    wide = a.astype(jnp.float64)
    reciprocal = 1.0 / divisor
    first = wide * reciprocal
    p, e = _two_product(first, jnp.float64(divisor))
    corrected = first + ((wide - p) - e) * reciprocal
    size = jnp.abs(first)
    q = jnp.where((size < 2.0 ** 996) & (size > 2.0 ** -960), corrected, first)
    return q.astype(dtype)


# -- checkers --------------------------------------------------------------------------------------
def dtype_reason(ctx):
    """Why the call is declined for its dtypes (complex, or no JAX equivalent), or None."""
    for m in [*ctx.tensor_args(), *ctx.out]:
        if m.dtype.is_complex:
            return "complex dtypes are not lowered"
        if not _dtypes.is_supported(m.dtype):
            return f"dtype {m.dtype} has no JAX equivalent"
    return None


def supported_dtypes(ctx):
    """For rules that handle complex values too (casts, copies, conj)."""
    for m in [*ctx.tensor_args(), *ctx.out]:
        if not _dtypes.is_supported(m.dtype):
            return f"dtype {m.dtype} has no JAX equivalent"
    return None


def probe(ctx):
    """Raise what torch's CPU kernel raises for these dtypes and static arguments.  Its dtype
    checks fire even on empty tensors, which keeps the probe cheap and free of data errors
    (division by zero); empty shapes still broadcast and halve (glu)."""
    if any(m.device.type != "cpu" for m in ctx.tensor_args()):
        return
    replay_on_cpu(ctx, empty=True)


def check(ctx):
    """The pointwise checker: decline complex and unsupported dtypes, else ``probe`` the kernel."""
    reason = dtype_reason(ctx)
    if reason is None:
        probe(ctx)
    return reason


def raise_like_cpu(ctx: LoweringContext) -> str:
    """Let torch's CPU kernel raise its own exception for this call (see registry.replay_on_cpu)."""
    return replay_on_cpu(ctx)


# -- operands as torch's kernels read them ---------------------------------------------------------
def opmath(dt):
    """torch's computation dtype for ``dt``: float32 for float16/bfloat16, else ``dt``."""
    dt = jnp.dtype(dt)
    return jnp.dtype(jnp.float32) if dt in _REDUCED_FLOATS else dt


def is_float(dt) -> bool:
    """Whether ``dt`` is a floating dtype."""
    return jnp.issubdtype(dt, jnp.floating)


def is_int(dt) -> bool:
    """Whether ``dt`` is an integer dtype."""
    return jnp.issubdtype(dt, jnp.integer)


def as_dtype(dt, *xs):
    """Arrays and Python/traced scalars as arrays of dtype ``dt``."""
    # (not getattr(x, "dtype", None) == dt: numpy reads None as float64)
    out = [x if hasattr(x, "dtype") and x.dtype == dt else _dtypes.cast(x, dt) for x in xs]
    return out[0] if len(out) == 1 else out


def through(common, *xs):
    """Operands as torch's kernels read them: cast to the op's common dtype (a scalar rounds to
    float16 there), then widened to the computation dtype (float32 for float16/bfloat16)."""
    common = jnp.dtype(common)
    out = [as_dtype(opmath(common), as_dtype(common, x)) for x in xs]
    return out[0] if len(out) == 1 else out


def wide(common, *xs):
    """Scalars that torch's kernels convert straight to the computation dtype, unrounded
    (mul/div by a scalar, lerp weights, addcmul values, activation parameters)."""
    return as_dtype(opmath(common), *xs)


def logit_bounds(dt, eps):
    """logit's clamp bounds (eps, 1 - eps) as torch rounds them in dtype ``dt``."""
    # torch: lo = eps and hi = 1 - eps in the tensor's dtype (in bfloat16, 1 - 1e-3 is 1)
    low = as_dtype(dt, eps)
    return through(dt, low, 1 - wide(dt, low))


# torch's CPU casts from floating to integral types are C++ static_casts; on x86 an out-of-range
# value or NaN becomes the "integer indefinite" INT_MIN of a 32-bit (or, for 64-bit targets,
# 64-bit) conversion, which narrower types then truncate.  XLA saturates instead.
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def convert(x, dt):
    """``x`` cast to ``dt`` as torch's CPU kernels cast (x86 out-of-range floats to ints too)."""
    x = jnp.asarray(x)
    dt = jnp.dtype(dt)
    if not (_X86 and is_float(x.dtype) and is_int(dt)):
        return _dtypes.cast(x, dt)
    wide = jnp.int64 if dt.itemsize == 8 or dt == jnp.uint32 else jnp.int32
    info = jnp.iinfo(wide)
    xf = x.astype(jnp.float32) if x.dtype in _REDUCED_FLOATS else x
    in_range = (xf >= float(info.min)) & (xf < -float(info.min))
    y = jnp.where(in_range, jnp.where(in_range, xf, 0).astype(wide), info.min)
    return y.astype(dt)


def convert_any(x, dt):
    """``convert`` that also takes complex values: to a real dtype torch keeps the real part
    (to bool: nonzero real or imaginary part)."""
    dt = jnp.dtype(dt)
    if jnp.iscomplexobj(x) and not jnp.issubdtype(dt, jnp.complexfloating):
        if dt == jnp.bool_:
            return x != 0
        x = jnp.real(x)
    return convert(x, dt)


_DEKKER_SPLIT = 134217729.0   # 2 ** 27 + 1


def _product_error(a, b, p):
    """a * b - p exactly, for p = a * b rounded (Dekker's two-product, no FMA needed)."""
    def split(v):
        c = _DEKKER_SPLIT * v
        high = c - (c - v)
        return high, v - high
    a_high, a_low = split(a)
    b_high, b_low = split(b)
    return ((a_high * b_high - p) + a_high * b_low + a_low * b_high) + a_low * b_low


def divide(x, y):
    """x / y rounded once, as torch divides.  XLA turns a division by a broadcast value into a
    multiplication by its reciprocal, which rounds twice (trunc(0.6 / 0.2) would become 3).
    Narrower floats divide in float64, which rounds to them exactly; float64 quotients get one
    correction step from their exact residual."""
    if jnp.shape(y) == jnp.broadcast_shapes(jnp.shape(x), jnp.shape(y)):
        return x / y
    if x.dtype != jnp.float64:
        return (x.astype(jnp.float64) / y.astype(jnp.float64)).astype(x.dtype)
    q = x / y
    p = q * y
    residual = (x - p) - _product_error(q, y, p)
    corrected = q + residual / y
    return jnp.where(jnp.isfinite(corrected), corrected, q)


def sigmoid(x):
    """1 / (1 + exp(-x)), with the exp torch computes."""
    return 1 / (1 + xla_fixes.exp(-x))


def float_unary_rule(fn):
    """A rule that applies ``fn`` to the operand read ``through`` the output dtype."""
    def rule(ctx, x):
        return fn(through(ctx.out_dtype, x))
    rule.__qualname__ = f"float_unary[{getattr(fn, '__name__', 'fn')}]"
    return rule


# -- nn helpers (forward and backward) -------------------------------------------------------------
_HALF_TYPES = _dtypes.HALF_TYPES
_F32 = np.dtype(np.float32)
_I64 = np.dtype(np.int64)


def acc(x):
    """``x`` in the type torch's CPU kernels compute in: float32 for half types, int64 for ints."""
    if x.dtype in _HALF_TYPES:
        return x.astype(_F32)
    if jnp.issubdtype(x.dtype, jnp.integer):
        return x.astype(_I64)
    return x


def check_dtypes(ctx: LoweringContext, tensors, *, floating: bool) -> Optional[str]:
    """Decline complex; replay calls the CPU kernels reject (mixed or bool dtypes, and integers
    where ``floating``) so that torch raises its own exception."""
    dtypes = {t.dtype for t in tensors if t is not None}
    if any(dt.is_complex for dt in dtypes):
        return "complex dtypes are not lowered"
    integral = not all(dt.is_floating_point for dt in dtypes)
    if len(dtypes) > 1 or torch.bool in dtypes or (floating and integral):
        return raise_like_cpu(ctx)
    return None


def adaptive_windows(in_size: int, out_size: int):
    """(gather indices (out, longest window), mask of real taps, window lengths) of adaptive
    pooling: window o covers [floor(o * in / out), ceil((o + 1) * in / out))."""
    o = np.arange(out_size)
    start = (o * in_size) // out_size
    end = -((-(o + 1) * in_size) // out_size)
    longest = int((end - start).max()) if out_size else 0
    taps = start[:, None] + np.arange(longest)[None, :]
    inside = taps < end[:, None]
    return np.minimum(taps, in_size - 1), inside, end - start


def nearest_source(out_size: int, in_size: int, scale: Optional[float]) -> np.ndarray:
    """torch's nearest_idx: exact for equal and doubled sizes, else floor(o * scale) in float32
    with scale = 1 / scale_factor when given, in / out otherwise."""
    o = np.arange(out_size)
    if out_size == in_size:
        return o
    if out_size == 2 * in_size:
        return o >> 1
    if scale is not None and scale > 0:
        s = np.float32(1.0 / scale)
    else:
        s = np.float32(in_size) / np.float32(out_size)
    return np.minimum(np.floor(o.astype(np.float32) * s).astype(np.int64), in_size - 1)


# -- padding ---------------------------------------------------------------------------------------
def pad_config(ndim: int, pad) -> list[tuple[int, int]]:
    """torch's pad list (last dim first, (low, high) pairs) as per-dim (low, high)."""
    config = [(0, 0)] * ndim
    for i in range(len(pad) // 2):
        config[ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1])
    return config


def pad_then_crop(x, padding, mode: str):
    """``x`` padded with ``mode`` by torch's pad list, cropping where a pad is negative."""
    config = pad_config(x.ndim, padding)
    grown = jnp.pad(x, [(max(lo, 0), max(hi, 0)) for lo, hi in config], mode=mode)
    crop = tuple(slice(max(-lo, 0), size - max(-hi, 0))
                 for (lo, hi), size in zip(config, grown.shape))
    return grown[crop]


# -- reductions ------------------------------------------------------------------------------------
def acc_dtype(dtype) -> np.dtype:
    """The dtype torch's CPU kernels accumulate ``dtype`` in."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if dtype in _HALF_TYPES else dtype


def axes(ndim: int, dim: Any, *, empty_means_all: bool = True) -> tuple[int, ...]:
    """The axes a reduction over ``dim`` covers (``empty_means_all``: what an empty list means)."""
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = [dim]
    if len(dim) == 0:
        return tuple(range(ndim)) if empty_means_all else ()
    if ndim == 0:
        return ()
    return tuple(sorted({d % ndim for d in dim}))


def broadcastable(shape: Sequence[int], full: Sequence[int]) -> bool:
    """Whether ``shape`` broadcasts to ``full`` (torch's rules: aligned at the last dim)."""
    if len(shape) > len(full):
        return False
    shape = (1,) * (len(full) - len(shape)) + tuple(shape)
    return all(s in (1, f) for s, f in zip(shape, full))


def count(shape: Sequence[int], axes: Sequence[int]) -> int:
    """How many elements a reduction over ``axes`` of ``shape`` covers."""
    return math.prod(shape[a] for a in axes)


def arg(ctx: LoweringContext, name: str, default: Any = None) -> Any:
    """An argument of the call by its schema name, whether passed by position or keyword."""
    for i, a in enumerate(ctx.op._schema.arguments):
        if a.name == name:
            if not a.kwarg_only and i < len(ctx.args):
                return ctx.args[i]
            return ctx.kwargs.get(name, default)
    raise KeyError(name)


def _tensor_dtypes(ctx: LoweringContext) -> list[torch.dtype]:
    return [t.dtype for t in ctx.tensor_args()]


def real_only(ctx: LoweringContext) -> Optional[str]:
    """Decline calls with complex inputs or outputs."""
    if any(dt.is_complex for dt in _tensor_dtypes(ctx)) or any(o.dtype.is_complex for o in ctx.out):
        return "complex dtypes are not lowered"
    return None


def max_with_identity(x, axes, keepdims):
    """jnp.max with -inf as identity, so that zero-size reductions trace."""
    # An explicit identity lets zero-size reductions trace; it never wins against real data
    # (XLA's max propagates NaN).
    return jnp.max(x, axis=axes, keepdims=keepdims, initial=-jnp.inf)
