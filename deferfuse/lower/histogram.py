"""Histograms: histc lives in nn_backward; histogram's overloads here.

``torch.histogram`` has no meta kernel, so its output metadata comes from the shape rules below,
which also raise torch's own errors for the calls its CPU kernel (aten/src/ATen/native/
Histogram.cpp) rejects from their arguments alone, in the kernel's order:

- ``bins`` as a count: bins > 0; ``range`` of two finite values, min <= max, representable in
  the input's dtype; then the weight's dtype and element count.
- ``bins`` as a tensor of edges: the edges' dtype, a 1-D tensor of at least two edges; the
  weight.

Calls on dtypes the kernel does not implement (integers, complex; half types without a range)
get their metadata here and are then replayed on CPU by the checker, which raises torch's
NotImplementedError.  Half types that the kernel accepts are declined: it counts in the input's
dtype, one partial histogram per thread, which saturates; so are float32 inputs of more than
2**24 elements, for the same reason.

The lowerings reproduce the CPU kernel (cpu/HistogramKernel.cpp):
- Edges: from ``range``, or the data's min and max (NaN propagating: torch then raises, as it
  does for infinite data), or [0, 1] for empty data; an empty range widened by 0.5 each way, in
  double; then ``linspace`` in the input's dtype (creation.linspace's algorithm, torch's).
- An element inside [edges[0], edges[-1]] (NaN never is) goes to the bin that
  ``(x - left) * bins / (right - left)`` (in the input's dtype, truncated) selects, corrected by
  ``std::upper_bound`` over the two neighbouring edges; for edges given as a tensor,
  ``std::upper_bound`` over all of them.  Both are emulated step by step, so NaN or unsorted
  edges give torch's answer too.  The rightmost bin includes its right edge.
- When the range collapses in the input's dtype (edges all equal: 1e30 +- 0.5 in float32), the
  kernel's 0/0 truncates to INT64_MIN and its search window wraps to edges [-1, 2): elements land
  in bin 1 (bin 0 for a single bin).  That is what torch 2.13's CPU build does; we do the same.
- density: divided by the total, then by each bin's width, in the input's dtype.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from . import common, creation
from .registry import LoweringContext, lowering, replay_on_cpu, runtime_check, shape_rule
from .._lazy import lazy_import

jnp = lazy_import("jax.numpy", globals(), "jnp")

aten = torch.ops.aten

_F64 = np.dtype(np.float64)
_I64 = np.dtype(np.int64)
_LOWERED = (torch.float32, torch.float64)
_FLOAT_MAX = float(np.finfo(np.float32).max)
_EXACT_F32_COUNT = 1 << 24

# c10's names of dtypes, as torch's messages print them
_CPP_NAMES = {
    torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
    torch.bfloat16: "c10::BFloat16", torch.int64: "long int", torch.int32: "int",
    torch.int16: "short int", torch.int8: "signed char", torch.uint8: "unsigned char",
    torch.bool: "bool", torch.complex64: "c10::complex<float>", torch.complex128: "c10::complex<double>",
}


def _name(dtype: torch.dtype) -> str:
    return _CPP_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _fmt(v: float) -> str:
    return f"{v:g}"   # as a C++ stream prints a double


# -- output metadata and argument errors ---------------------------------------------------------

def _check_weight(x: torch.Tensor, weight: Optional[torch.Tensor]) -> None:
    """histogramdd_check_inputs's weight checks, on the input seen as (numel, 1)."""
    if weight is None:
        return
    if weight.dtype != x.dtype:
        raise RuntimeError(
            "torch.histogramdd: if weight tensor is provided, input tensor and weight tensor should have "
            f"the same dtype, but got input({_name(x.dtype)}), and weight({_name(weight.dtype)})")
    if weight.numel() != x.numel():
        raise RuntimeError(
            "torch.histogramdd: if weight tensor is provided it should have the same shape as the input "
            f"tensor excluding its innermost dimension, but got input with shape [{x.numel()}, 1] and "
            f"weight with shape [{weight.numel()}]")


def _check_bin_ct(bins: int) -> None:
    if bins <= 0:
        raise RuntimeError(f"torch.histogram(): bins must be > 0, but got {bins} for dimension 0")


def _outputs(x: torch.Tensor, bins: int, edges_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty((bins,), dtype=x.dtype, device="meta"),
            torch.empty((bins + 1,), dtype=edges_dtype, device="meta"))


@shape_rule(aten.histogram.bin_ct)
def _bin_ct_shapes(x, bins=100, *, range=None, weight=None, density=False):
    _check_bin_ct(bins)
    if range is not None:
        range = list(range)
        if len(range) != 2:
            raise RuntimeError("torch.histogramdd: for a 1-dimensional histogram range should have 2 "
                               f"elements, but got {len(range)}")
    elif x.numel() > 0 and x.dtype not in _LOWERED:
        return _outputs(x, bins, x.dtype)   # not implemented: the checker replays the call
    lo, hi = (float(range[0]), float(range[1])) if range is not None else (0.0, 1.0)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise RuntimeError(f"torch.histogramdd: dimension 0's range [{_fmt(lo)}, {_fmt(hi)}] is not finite")
    if lo > hi:
        raise RuntimeError("torch.histogramdd: min should not exceed max, but got "
                           f"min {_fmt(lo)} max {_fmt(hi)} for dimension 0")
    if lo == hi:
        lo, hi = lo - 0.5, hi + 0.5
    if x.dtype is torch.float32 and max(abs(lo), abs(hi)) > _FLOAT_MAX:
        raise RuntimeError("value cannot be converted to type float without overflow")
    _check_weight(x, weight)
    return _outputs(x, bins, x.dtype)


@shape_rule(aten.histogram.bins_tensor)
def _bins_tensor_shapes(x, bins, *, weight=None, density=False):
    if bins.dtype != x.dtype:
        raise RuntimeError(
            "torch.histogramdd: input tensor and bins tensors should have the same dtype, but got input "
            f"with dtype {_name(x.dtype)} and bins for dimension 0 with dtype {_name(bins.dtype)}")
    if bins.dim() != 1:
        raise RuntimeError("torch.histogramdd: bins tensor should have one dimension, but got "
                           f"{bins.dim()} dimensions in the bins tensor for dimension 0")
    if bins.numel() == 0:
        raise RuntimeError("torch.histogramdd: bins tensor should have at least 1 element, but got 0 "
                           "elements in the bins tensor for dimension 0")
    _check_weight(x, weight)
    _check_bin_ct(bins.numel() - 1)
    return _outputs(x, bins.numel() - 1, bins.dtype)


def _check(ctx: LoweringContext) -> Optional[str]:
    dtype = ctx.args[0].dtype
    if dtype is torch.float32 and math.prod(ctx.args[0].shape) > _EXACT_F32_COUNT:
        return "torch counts float32 histograms in float32, per thread, which saturates past 2**24"
    if dtype in _LOWERED:
        return None
    replay_on_cpu(ctx)   # integers and complex: torch's NotImplementedError, now
    return f"{dtype} histograms are not lowered (torch counts them in {dtype}, which saturates)"


# -- the kernel ----------------------------------------------------------------------------------

def _upper_bound(edges, x, first, length, steps: int):
    """``std::upper_bound(edges + first, edges + first + length, x) - edges``, elementwise over
    ``x`` (``first`` and ``length`` arrays like it), following libstdc++'s bisection exactly:
    ``steps`` must be at least the bit length of the longest ``length``."""
    last = edges.shape[0] - 1
    for _ in range(steps):
        half = length >> 1
        middle = first + half
        right = ~(x < edges[jnp.clip(middle, 0, last)]) & (length > 0)
        first = jnp.where(right, middle + 1, first)
        length = jnp.where(right, length - half - 1, half)
    return first


def _histogram(x, edges, weight, density: bool, linear: bool):
    """hist (and the edges as given) for 1-D ``edges`` of x's dtype, as the CPU kernel computes."""
    dtype = x.dtype
    flat = x.reshape(-1)
    n_edges = edges.shape[0]
    bins = n_edges - 1
    left, right = edges[0], edges[-1]
    inside = (flat >= left) & (flat <= right)
    if linear:
        # LINEAR_INTERPOLATION_WITH_LOCAL_SEARCH
        q = common.exact_div((flat - left) * jnp.asarray(bins, dtype), right - left)
        wild = ~jnp.isfinite(q)     # the cast gives INT64_MIN (x86's integer indefinite)
        pos = jnp.where(wild | ~inside, 0, q).astype(_I64)
        first = jnp.maximum(pos - 1, 0)
        length = jnp.minimum(pos + 2, n_edges) - first
        # INT64_MIN: pos - 1 wraps to INT64_MAX and pos + 2 stays below n_edges, so the window
        # starts at edges + INT64_MAX, which wraps to one element before edges[0], and is three
        # elements long (that element is never compared: x >= edges[0] sends the search right)
        first = jnp.where(wild, -1, first)
        length = jnp.where(wild, 3, length)
        found = _upper_bound(edges, flat, first, length, 2)
    else:
        # BINARY_SEARCH
        found = _upper_bound(edges, flat, jnp.zeros(flat.shape, _I64), jnp.full(flat.shape, n_edges, _I64),
                             int(n_edges).bit_length())
    pos = found - 1
    pos = jnp.where(pos == bins, bins - 1, pos)   # the rightmost bin includes its right edge
    pos = jnp.where(inside, pos, bins)            # dropped
    w = jnp.ones(flat.shape, dtype) if weight is None else weight.reshape(-1)
    hist = jnp.zeros((bins,), dtype).at[pos].add(w, mode="drop")
    if density:
        hist = common.exact_div(hist, hist.sum())
        hist = common.exact_div(hist, edges[1:] - edges[:-1])
    return hist, edges


@lowering(aten.histogram.bin_ct, check=_check)
def histogram_bin_ct(ctx, x, bins=100, range=None, weight=None, density=False):
    flat = x.reshape(-1)
    if range is not None:
        lo, hi = float(range[0]), float(range[1])
        if lo == hi:
            lo, hi = lo - 0.5, hi + 0.5
        lo, hi = jnp.asarray(lo, _F64), jnp.asarray(hi, _F64)
    elif flat.size:
        lo, hi = flat.min().astype(_F64), flat.max().astype(_F64)
        runtime_check(~(jnp.isfinite(lo) & jnp.isfinite(hi)), RuntimeError,
                      "torch.histogramdd: dimension 0's range (the data's min and max) is not finite")
        same = lo == hi
        lo, hi = jnp.where(same, lo - 0.5, lo), jnp.where(same, hi + 0.5, hi)
    else:
        lo, hi = jnp.asarray(0.0, _F64), jnp.asarray(1.0, _F64)
    edges = creation.linspace_values(lo.astype(x.dtype), hi.astype(x.dtype), bins + 1, x.dtype)
    return _histogram(x, edges, weight, density, linear=True)


@lowering(aten.histogram.bins_tensor, check=_check)
def histogram_bins_tensor(ctx, x, bins, weight=None, density=False):
    return _histogram(x, bins, weight, density, linear=False)
