"""Scaled dot-product attention as it reaches aten on the CPU.

``F.scaled_dot_product_attention`` is CompositeImplicit: on the CPU it calls the flash-attention
kernel (``_scaled_dot_product_flash_attention_for_cpu``, and its backward under autograd) for
4-D inputs with contiguous rows (last stride 1), one head size, no dropout and a mask, if any,
that does not require grad; otherwise the math path, whose only op of its own is
``_safe_softmax`` (the rest are matmuls and pointwise ops).  Empty inputs reach neither: the
composite returns zeros itself.

What torch's CPU kernels compute (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp), followed
here:
- Scores are ``q @ k^T`` in the accumulation type (float32 for half types), with the positions
  ``j > i`` set to -inf when ``is_causal`` (aligned top-left, also when L != S), times the scale
  (``1 / sqrt(E)`` unless given, rounded to the accumulation type), plus the mask (2-D, or 4-D
  with batch and head dims of size 1 or full; float32 or the query's dtype).
- Grouped-query attention (fewer key/value heads): query head ``h`` reads key/value head
  ``h // (H / H_kv)``, as ``repeat_interleave`` would give.
- The softmax runs over blocks of 512 keys with a running maximum.  A row whose scores are all
  -inf (fully masked) keeps the sum 0 and maximum -inf; the kernel then takes sum 1 and maximum
  0, so its output is 0, its logsumexp 0, and (exp(-inf - 0) in the backward) its gradients 0.
  For half types the unnormalised probabilities ``exp(s - max)`` are rounded to the input type
  before the product with ``v`` (the sum is of the unrounded ones); the output is
  ``acc * (1 / sum)``.
- ``logsumexp`` is ``max + log(sum)`` of shape (B, H, L), in the accumulation type.
- The backward recomputes ``attn = exp(scale * q @ k^T + mask - logsumexp)`` (0 above the
  diagonal when causal); ``grad_attn = attn * (grad_out @ v^T - rowsum(grad_out * out))``;
  ``grad_v = attn^T @ grad_out``, ``grad_q = scale * grad_attn @ k``, ``grad_k = scale *
  grad_attn^T @ q``.  For half types ``attn`` and ``grad_attn`` are rounded to the input type
  before those products, and each gradient is accumulated in the input type over blocks (of
  queries for grad_k and grad_v, of 512 keys for grad_q), as the kernel's gemm calls with beta 1
  do.
- Dropout: the CPU kernel raises for ``dropout_p > 0`` (the checkers replay the call so that it
  raises here too).  ``F.scaled_dot_product_attention`` with dropout takes the math path, which
  draws its mask with ``bernoulli_``: the recorder draws that from torch's generator, so deferred
  dropout gives strict's numbers.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import numpy as np
import torch

from . import dtypes as _dtypes
from . import common, host_products, normalization, xla_fixes
from .registry import LoweringContext, lowering, replay_on_cpu
from .._lazy import lazy_import

jnp = lazy_import("jax.numpy", globals(), "jnp")
lax = lazy_import("jax.lax", globals(), "lax")

aten = torch.ops.aten

_HIGHEST = "highest"
_F32 = np.dtype(np.float32)
# The kernel's block sizes: keys per block, and queries per block by the query length (the
# backward accumulates its half-type gradients block by block).
_KV_BLOCK = 512


def _q_block(q_len: int) -> int:
    return 256 if q_len >= 768 else 64 if q_len >= 192 else 32


# -- checks --------------------------------------------------------------------------------------

def _arg(ctx: LoweringContext, index: int, name: str, default: Any = None) -> Any:
    if len(ctx.args) > index:
        return ctx.args[index]
    return ctx.kwargs.get(name, default)


def _check_attention(ctx: LoweringContext, q, k, v, mask, dropout_p, extra=()) -> Optional[str]:
    """Replay the calls torch's CPU kernel rejects (so that it raises its own error); decline
    those it runs but reads out of bounds for (shapes that do not match)."""
    if any(t.dtype.is_complex for t in (q, k, v)):
        return "complex attention is not lowered"
    if (not q.dtype.is_floating_point or len({q.dtype, k.dtype, v.dtype, *(t.dtype for t in extra)}) > 1
            or not len(q.shape) == len(k.shape) == len(v.shape) == 4
            or not q.shape[3] == k.shape[3] == v.shape[3] or dropout_p != 0.0):
        return _raise_like_cpu(ctx, q, k)
    if mask is not None:
        if (mask.dtype not in (torch.float32, q.dtype) or len(mask.shape) not in (2, 4)
                or not common.broadcastable(mask.shape, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))):
            return _raise_like_cpu(ctx, q, k)
    batch, heads = q.shape[:2]
    if k.shape[:3] != v.shape[:3] or k.shape[0] != batch or k.shape[1] == 0 or heads % k.shape[1]:
        return "query, key and value shapes that torch's kernel does not check"
    return None


def _raise_like_cpu(ctx: LoweringContext, q, k) -> str:
    """Let torch's CPU kernel raise its own error (registry.replay_on_cpu), unless it would
    divide by zero instead (no heads, or an empty sequence: the process dies of SIGFPE)."""
    if len(q.shape) == 4 == len(k.shape) and 0 in (q.shape[1], q.shape[2], k.shape[2]):
        return "torch's CPU kernel divides by zero on empty heads or sequences"
    return replay_on_cpu(ctx)


def _check_flash(ctx: LoweringContext) -> Optional[str]:
    q, k, v = ctx.args[:3]
    return _check_attention(ctx, q, k, v, ctx.kwargs.get("attn_mask"), _arg(ctx, 3, "dropout_p", 0.0))


def _check_flash_backward(ctx: LoweringContext) -> Optional[str]:
    grad_out, q, k, v, out, lse = ctx.args[:6]
    reason = _check_attention(ctx, q, k, v, ctx.kwargs.get("attn_mask"), _arg(ctx, 6, "dropout_p"),
                              extra=(grad_out, out))
    if reason is None and _dtypes.to_jax(lse.dtype) != _acc(q.dtype):
        return _raise_like_cpu(ctx, q, k)   # the kernel reads logsumexp as the accumulation type
    return reason


def _acc(dtype) -> np.dtype:
    """The type torch's kernel accumulates in: float32 for half types, else the input's."""
    dtype = _dtypes.to_jax(dtype) if isinstance(dtype, torch.dtype) else np.dtype(dtype)
    return _F32 if dtype in _dtypes.HALF_TYPES else dtype


# -- shared arithmetic ---------------------------------------------------------------------------

def _scale(scale: Optional[float], head_size: int, acc) -> Any:
    if scale is None:
        scale = 1.0 / math.sqrt(head_size) if head_size else math.inf
    return np.asarray(scale, acc)


def _rounded(x, dtype):
    """float32 ``x`` rounded to ``dtype`` (a half type), as the kernel's reduced-type buffers
    hold it; unchanged for the other types.

    Not ``x.astype(dtype).astype(float32)``: XLA may drop that pair of converts (it allows
    excess precision), and on the CPU it does inside its fused matmul kernels.  XLA keeps
    ``reduce_precision``, which flushes float16's subnormals to zero, so those are rounded on
    their own grid (multiples of 2**-24)."""
    if dtype not in _dtypes.HALF_TYPES:
        return x
    if np.dtype(dtype).name == "bfloat16":
        return lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
    subnormal = jnp.abs(x) < np.float32(2.0 ** -14)
    return jnp.where(subnormal, jnp.round(x * np.float32(2.0 ** 24)) * np.float32(2.0 ** -24),
                     lax.reduce_precision(x, exponent_bits=5, mantissa_bits=10))


def _widened(x):
    """``x`` in its accumulation type.  A half-type ``x`` is rounded again after widening: it
    may come from an op fused into the same computation, whose rounding to the half type XLA
    may otherwise skip (the same excess precision as in ``_rounded``)."""
    acc = _acc(x.dtype)
    return _rounded(x.astype(acc), x.dtype) if x.dtype != acc else x


def _grouped(q, kv_heads: int):
    """(B, H, L, E) -> (B, H_kv, G, L, E): the query heads that share a key/value head."""
    b, h, l, e = q.shape
    return q.reshape(b, kv_heads, h // kv_heads, l, e)


def _products(q, k, scale, mask, is_causal):
    """``scale * q @ k^T + mask`` of shape (B, H_kv, G, L, S), -inf above the diagonal when
    causal, in the accumulation type."""
    qk = jnp.einsum("bkgle,bkse->bkgls", _grouped(q, k.shape[1]), k, precision=_HIGHEST,
                    preferred_element_type=q.dtype)
    if is_causal:
        qk = jnp.where(_causal(qk.shape[-2:]), qk, -jnp.inf)
    qk = qk * scale
    if mask is not None:
        qk = qk + _widened(_grouped_mask(mask, q.shape, k.shape[1]))
    return qk


def _causal(shape):
    rows, cols = shape
    return np.arange(cols)[None, :] <= np.arange(rows)[:, None]


def _grouped_mask(mask, q_shape, kv_heads: int):
    b, h, l, _ = q_shape
    if mask.ndim == 2:
        return mask
    # (B or 1, H or 1, L or 1, S or 1) -> broadcastable against (B, H_kv, G, L, S)
    return mask.reshape(mask.shape[0], kv_heads if mask.shape[1] == h else 1,
                        h // kv_heads if mask.shape[1] == h else 1, *mask.shape[2:])


def _ungrouped(x):
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


# -- forward -------------------------------------------------------------------------------------

@lowering(aten._scaled_dot_product_flash_attention_for_cpu.default, check=_check_flash)
def flash_attention(ctx, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                    scale=None):
    if host_products.applies(ctx):   # (torch's own kernel, on the CPU: strict's bits)
        return host_products.flash_attention(ctx, query, key, value, is_causal, attn_mask, scale)
    dtype = query.dtype
    acc = _acc(dtype)
    q, k, v = (_widened(t) for t in (query, key, value))
    scores = _products(q, k, _scale(scale, query.shape[-1], acc), attn_mask, is_causal)
    # Over blocks of keys with a running maximum; one block unless a half type's rounding of the
    # probabilities depends on the blocks' maxima.
    size = scores.shape[-1]
    block = _KV_BLOCK if dtype in _dtypes.HALF_TYPES else max(size, 1)
    top = jnp.full(scores.shape[:-1], -jnp.inf, acc)
    total = jnp.zeros(scores.shape[:-1], acc)
    out = jnp.zeros(scores.shape[:-1] + v.shape[-1:], acc)
    for start in range(0, size, block):
        part = scores[..., start:start + block]
        new_top = jnp.maximum(top, jnp.max(part, axis=-1, initial=-jnp.inf))
        dead = new_top == -jnp.inf          # every score so far -inf: nothing is added
        safe_top = jnp.where(dead, 0, new_top)
        p = _softmax_exp(part - safe_top[..., None], dtype)
        rescale = jnp.where(dead, 1, xla_fixes.exp(top - safe_top))
        total = jnp.sum(p, axis=-1) + rescale * total
        out = out * rescale[..., None] + jnp.einsum(
            "bkgls,bkse->bkgle", _rounded(p, dtype), v[:, :, start:start + block], precision=_HIGHEST,
            preferred_element_type=acc)
        top = new_top
    # rows with nothing added: sum 1, maximum 0 (output 0, logsumexp 0)
    total = jnp.where(total == 0, 1, total)
    top = jnp.where(top == -jnp.inf, 0, top)
    out = out * (1 / total)[..., None]
    return _ungrouped(out), _ungrouped(top + jnp.log(total))


def _softmax_exp(x, dtype):
    """exp over one block of keys as the forward kernel computes it: for half types the columns
    that fill whole SIMD vectors go through torch's fast exponential (``fexp_u20``, accurate to
    about 1e-4, enough for a result rounded to a half type) and the remaining columns through
    the exact one."""
    lanes = _simd_lanes() if dtype in _dtypes.HALF_TYPES else 0
    whole = x.shape[-1] - x.shape[-1] % lanes if lanes else 0
    if whole == 0:
        return xla_fixes.exp(x)
    return jnp.concatenate([_fast_exp(x[..., :whole]), xla_fixes.exp(x[..., whole:])], axis=-1)


@functools.cache
def _simd_lanes() -> int:
    """float32 lanes of torch's CPU vectors, where its fast exponential is its own (x86); 0
    where it is the exact one."""
    return {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability(), 0)


# fexp_u20 (ATen's Vectorized<float>): 2**(x log2 e) with the fractional part's correction by a
# cubic, assembled in the float's bits (Malossi et al., "Fast exponential computation on SIMD
# architectures").
_FEXP_COEFFICIENTS = (0.00010703434948458272, 0.30354260500649682, -0.22433836478672356,
                      -0.079204240219773236)
_LOG2E = np.uint32(0x3FB8AA3B).view(np.float32)
_LN_FLT_MIN = np.uint32(0xC2AEAC50).view(np.float32)
_LN_FLT_MAX = np.uint32(0x42B17218).view(np.float32)


def _fma32(a, b, c):
    """float32 a * b + c with one rounding, as an FMA instruction computes it (the product of
    two floats is exact in float64)."""
    return (a.astype(jnp.float64) * b + c).astype(jnp.float32)


def _fast_exp(x):
    c0, c1, c2, c3 = (np.float32(c) for c in _FEXP_COEFFICIENTS)
    src = x * _LOG2E
    frac = src - jnp.floor(src)
    poly = _fma32(frac, _fma32(frac, _fma32(frac, np.float64(c3), np.float64(c2)), np.float64(c1)),
                  np.float64(c0))
    # 2**23 * (src - poly) + 2**23 * 127, truncated: the float whose bits are that integer
    bits = ((src - poly) * np.float32(2 ** 23) + np.float32(2 ** 23 * 127)).astype(jnp.int32)
    out = lax.bitcast_convert_type(bits, jnp.float32)
    out = jnp.where(x < _LN_FLT_MIN, np.float32(0), out)
    return jnp.where(x > _LN_FLT_MAX, np.float32(np.inf), out)


# -- backward ------------------------------------------------------------------------------------

@lowering(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, check=_check_flash_backward)
def flash_attention_backward(ctx, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
                             *, attn_mask=None, scale=None):
    if host_products.applies(ctx):
        return host_products.flash_attention_backward(ctx, grad_out, query, key, value, out, logsumexp,
                                                      is_causal, attn_mask, scale)
    dtype = query.dtype
    acc = _acc(dtype)
    q, k, v, g, o = (_widened(t) for t in (query, key, value, grad_out, out))
    kv_heads = k.shape[1]
    factor = _scale(scale, query.shape[-1], acc)
    scores = _products(q, k, factor, attn_mask, False)
    attn = xla_fixes.exp(scores - _grouped(logsumexp.astype(acc)[..., None], kv_heads))
    if is_causal:
        attn = jnp.where(_causal(attn.shape[-2:]), attn, 0)
    g_grouped = _grouped(g, kv_heads)
    row_sum = jnp.sum(g_grouped * _grouped(o, kv_heads), axis=-1, keepdims=True)
    grad_attn = attn * (jnp.einsum("bkgle,bkse->bkgls", g_grouped, v, precision=_HIGHEST,
                                   preferred_element_type=acc) - row_sum)
    attn, grad_attn = _rounded(attn, dtype), _rounded(grad_attn, dtype)
    q_grouped = _grouped(q, kv_heads)
    if dtype not in _dtypes.HALF_TYPES:
        grad_v = jnp.einsum("bkgls,bkgle->bkse", attn, g_grouped, precision=_HIGHEST,
                            preferred_element_type=acc)
        grad_k = factor * jnp.einsum("bkgls,bkgle->bkse", grad_attn, q_grouped, precision=_HIGHEST,
                                     preferred_element_type=acc)
        grad_q = factor * jnp.einsum("bkgls,bkse->bkgle", grad_attn, k, precision=_HIGHEST,
                                     preferred_element_type=acc)
        return _ungrouped(grad_q), grad_k, grad_v
    # Half types: the kernel adds each block's product into the gradient in the input type: for
    # grad_k and grad_v, block after block of queries of each query head sharing the key/value
    # head in turn; for grad_q, block after block of keys.
    q_len, kv_len = attn.shape[-2:]
    q_block = _q_block(q_len)
    rows = [(member, slice(start, start + q_block)) for member in range(attn.shape[2])
            for start in range(0, q_len, q_block)]
    grad_v = _accumulated(
        [jnp.einsum("bkls,bkle->bkse", attn[:, :, member, r], g_grouped[:, :, member, r],
                    precision=_HIGHEST, preferred_element_type=acc) for member, r in rows],
        v.shape, dtype)
    grad_k = _accumulated(
        [factor * jnp.einsum("bkls,bkle->bkse", grad_attn[:, :, member, r], q_grouped[:, :, member, r],
                             precision=_HIGHEST, preferred_element_type=acc) for member, r in rows],
        k.shape, dtype)
    grad_q = _accumulated(
        [factor * jnp.einsum("bkgls,bkse->bkgle", grad_attn[..., cols], k[:, :, cols], precision=_HIGHEST,
                             preferred_element_type=acc)
         for cols in (slice(start, start + _KV_BLOCK) for start in range(0, kv_len, _KV_BLOCK))],
        q_grouped.shape, dtype)
    return _ungrouped(grad_q), grad_k, grad_v


def _accumulated(parts: list, shape: tuple, dtype):
    """The sum of ``parts`` in order, rounded to ``dtype`` after each addition (a gemm with
    beta 1 into a half-type gradient); zeros of ``shape`` when there are none."""
    total = jnp.zeros(shape, jnp.float32)
    for part in parts:
        total = _rounded(total + part, dtype)
    return total


# -- the math path's softmax ---------------------------------------------------------------------

def _check_safe_softmax(ctx: LoweringContext) -> Optional[str]:
    x, dtype = ctx.args[0], _arg(ctx, 2, "dtype")
    result = dtype or x.dtype
    if result.is_complex or x.dtype.is_complex:
        return "complex softmax is not lowered"
    if not result.is_floating_point:
        return replay_on_cpu(ctx)   # "softmax_lastdim_kernel_impl" not implemented for 'Long'
    return None


@lowering(aten._safe_softmax.default, check=_check_safe_softmax)
def safe_softmax(ctx, x, dim, dtype=None):
    """softmax, with 0 (not NaN) for a row that is all -inf."""
    if dtype is not None:
        x = x.astype(_dtypes.to_jax(dtype))
    out = normalization.softmax(ctx, x, dim, False)
    axes = (dim % x.ndim,) if x.ndim else ()
    fully_masked = jnp.all(x == -jnp.inf, axis=axes, keepdims=True)
    return jnp.where(fully_masked, jnp.zeros((), out.dtype), out)
