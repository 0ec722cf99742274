"""The fused ops behind torch.nn's transformer "fast paths", as their CPU kernels compute them.

In eval mode, with grad off (or no input requiring grad), ``nn.TransformerEncoderLayer`` (and
so ``nn.TransformerEncoder``) calls ``aten._transformer_encoder_layer_fwd`` when
``batch_first``, the attention has biases and one embedding size, the activation is relu or gelu,
both norms share one eps, the heads are even in number and no hooks are attached.
``nn.MultiheadAttention`` calls ``aten._native_multi_head_attention`` under like conditions for
self-attention (query, key and value the same tensor) with boolean masks only.  Both modules turn
their masks into float masks (0 / -inf) first, and ``merge_masks`` passes them on as: a key
padding mask alone, (B, T) with ``mask_type`` 1; an attention mask, expanded to (B, H, T, T) (plus
the padding mask, added) with ``mask_type`` 2.

``_native_multi_head_attention(query, key, value, E, H, qkv_weight, qkv_bias, proj_weight,
proj_bias, mask, need_weights, average_attn_weights, mask_type)``, for (B, T, E) inputs of one
shape (aten/src/ATen/native/transformers/attention.cpp):
- ``q, k, v`` are ``query``, ``key``, ``value`` times the thirds of ``qkv_weight`` (transposed),
  plus the thirds of ``qkv_bias``, split into H heads of E / H; ``q`` is then multiplied by
  ``1 / sqrt(E / H)``, computed in the input's dtype.
- The scores ``q @ k^T`` go through a masked softmax over the keys.  The mask is first converted
  to bool (any nonzero value, NaN included, masks a position: a float mask of 0.5 masks as -inf
  does); it may be (T, T) with ``mask_type`` 0, (B, T) with ``mask_type`` 1, or (B, H, T, T) with
  any ``mask_type``; anything else raises.  A fully masked row has the sum 0 and comes out NaN
  (``0 * (1 / 0)``), not 0 as in the SDPA kernels.
- The output is the heads' ``probs @ v``, merged back to (B, T, E), times ``proj_weight``
  (transposed) plus ``proj_bias``: (B, T, P) for a (P, E) ``proj_weight``.  The weights are the
  probabilities (B, H, T, T), or their mean over the heads (B, T, T) with
  ``average_attn_weights``; undefined (None) without ``need_weights``.

``_transformer_encoder_layer_fwd`` is the layer around that attention (its weights undefined):
with ``norm_first``, ``x = src + attn(norm1(src)); out = x + ffn(norm2(x))``; otherwise
``x = norm1(src + attn(src)); out = norm2(x + ffn(x))``, where the norms are layer norms over E
with ``eps`` and ``ffn(x) = act(x @ w1^T + b1) @ w2^T + b2``, ``act`` being exact (erf) gelu with
``use_gelu`` (also for an ``nn.GELU(approximate="tanh")`` module), else relu.  An empty ``src``
comes back cloned, unchecked.

Declined (counted eager fallbacks):
- float16 and bfloat16: the kernels round every intermediate to the half type;
- an empty query in ``_native_multi_head_attention``: the CPU kernel's weights are then
  undefined (None) where the meta kernel gives an empty tensor.  (Without ``need_weights`` they
  are None too; capture/meta.py corrects that metadata, and the weights are left out here);
- an encoder layer on a ``src`` that is not contiguous: the meta kernel lays the output out as
  ``src``, the CPU kernel contiguously;
- no heads (the kernel divides by zero).
Nested tensors (``nn.TransformerEncoder(enable_nested_tensor=True)`` with a padding mask) never
reach these rules as nested: the recorder runs ops on them eagerly.  Calls the CPU kernel rejects
are replayed on it, so that they raise torch's own error on the user's line.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from . import activation, normalization, xla_fixes
from .registry import LoweringContext, lowering, replay_on_cpu
from .._lazy import lazy_import

jnp = lazy_import("jax.numpy", globals(), "jnp")

aten = torch.ops.aten

_HIGHEST = "highest"
_LOWERED = (torch.float32, torch.float64)


# -- checks --------------------------------------------------------------------------------------

def _named(ctx: LoweringContext) -> dict[str, Any]:
    """The call's arguments by their schema names, defaults filled in."""
    values = {a.name: a.default_value for a in ctx.op._schema.arguments if a.has_default_value()}
    values.update(zip((a.name for a in ctx.op._schema.arguments), ctx.args))
    values.update(ctx.kwargs)
    return values


def _check_attention(ctx: LoweringContext, query, others: tuple, embed_dim: int, num_heads: int,
                     params: dict[str, tuple], mask, mask_type) -> Optional[str]:
    """What both ops' kernels check of the attention: None when the call is valid and lowered.
    ``params`` maps each weight to the shape it must have."""
    if num_heads == 0:
        return "no heads: torch's kernel divides by zero"
    tensors = (query, *others, *(t for t, _ in params.values()))
    if query.dtype in (torch.float16, torch.bfloat16) and len({t.dtype for t in tensors}) == 1:
        return "half types are not lowered (the kernel rounds every step to the half type)"
    if (query.dtype not in _LOWERED or any(t.dtype != query.dtype for t in tensors)
            or len(query.shape) != 3 or any(t.shape != query.shape for t in others)
            or query.shape[2] != embed_dim or num_heads < 0 or embed_dim % num_heads
            or any(t.shape != shape for t, shape in params.values())):
        return replay_on_cpu(ctx)
    if mask is not None and not _mask_fits(mask.shape, mask_type, query.shape, num_heads):
        return replay_on_cpu(ctx)
    return None


def _mask_fits(shape: tuple, mask_type, query_shape: tuple, num_heads: int) -> bool:
    """Whether the masked softmax takes a mask of ``shape`` (see the module docstring)."""
    batch, length, _ = query_shape
    if len(shape) == 2:
        return (mask_type == 0 and shape == (length, length)) or (mask_type == 1 and shape == (batch, length))
    return shape == (batch, num_heads, length, length)


def _check_multi_head_attention(ctx: LoweringContext) -> Optional[str]:
    a = _named(ctx)
    query, embed_dim = a["query"], a["embed_dim"]
    if 0 in query.shape:
        return "an empty query: the CPU kernel's weights are undefined, the meta kernel's empty"
    proj_weight = a["proj_weight"]
    out_dim = proj_weight.shape[0] if len(proj_weight.shape) == 2 else -1
    params = {"qkv_weight": (a["qkv_weight"], (3 * embed_dim, embed_dim)),
              "qkv_bias": (a["qkv_bias"], (3 * embed_dim,)),
              "proj_weight": (proj_weight, (out_dim, embed_dim)),
              "proj_bias": (a["proj_bias"], (out_dim,))}
    reason = _check_attention(ctx, query, (a["key"], a["value"]), embed_dim, a["num_head"], params,
                              a["mask"], a["mask_type"])
    if reason is None and not a["need_weights"] and len(ctx.out) == 2:
        return "need_weights=False: the CPU kernel's weights are undefined, the meta kernel's empty"
    return reason


def _check_encoder_layer(ctx: LoweringContext) -> Optional[str]:
    a = _named(ctx)
    src, embed_dim = a["src"], a["embed_dim"]
    if 0 in src.shape:
        return None   # cloned, whatever the other arguments
    hidden = a["ffn_weight_1"].shape[0] if len(a["ffn_weight_1"].shape) == 2 else -1
    e = embed_dim
    params = {"qkv_weight": (a["qkv_weight"], (3 * e, e)), "qkv_bias": (a["qkv_bias"], (3 * e,)),
              "proj_weight": (a["proj_weight"], (e, e)), "proj_bias": (a["proj_bias"], (e,)),
              **{name: (a[name], (e,)) for name in ("norm_weight_1", "norm_bias_1", "norm_weight_2",
                                                    "norm_bias_2", "ffn_bias_2")},
              "ffn_weight_1": (a["ffn_weight_1"], (hidden, e)), "ffn_bias_1": (a["ffn_bias_1"], (hidden,)),
              "ffn_weight_2": (a["ffn_weight_2"], (e, hidden))}
    reason = _check_attention(ctx, src, (), embed_dim, a["num_heads"], params, a["mask"], a["mask_type"])
    if reason is None and ctx.out[0].stride != _contiguous_strides(src.shape):
        # (capture/meta.py takes the CPU kernel's layout for a call small enough to run; a
        # larger one keeps the meta kernel's)
        return ("a src that is not contiguous, too large for capture/meta.py to learn the CPU kernel's "
                "layout: the meta kernel lays the output out as src, the CPU kernel contiguously")
    return reason


def _contiguous_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


# -- arithmetic ----------------------------------------------------------------------------------

def _linear(x, weight, bias):
    return jnp.einsum("...i,oi->...o", x, weight, precision=_HIGHEST) + bias


def _query_scale(head_size: int, dtype) -> np.ndarray:
    """``1 / sqrt(head_size)`` as the kernel computes it: the root in the input's dtype, the
    quotient in double, rounded to the input's dtype."""
    dtype = np.dtype(dtype)
    return np.asarray(1.0 / float(np.sqrt(dtype.type(head_size))), dtype)


def _masked_out(mask, mask_type, scores_shape: tuple):
    """The positions the mask excludes, broadcastable to the scores (B, H, T, T)."""
    if mask is None:
        return None
    masked = mask if mask.dtype == jnp.bool_ else mask != 0    # (NaN is nonzero: masked)
    if masked.ndim == 4:
        return masked
    if mask_type == 0:
        return masked[None, None]
    return masked[:, None, None, :]


def _masked_softmax(scores, masked):
    """Softmax over the last axis of the positions not ``masked``; 0 at the masked positions, and
    NaN throughout a row with every position masked, as the kernel's ``0 * (1 / 0)`` gives."""
    if masked is None:
        masked = jnp.zeros((), jnp.bool_)
    top = jnp.max(jnp.where(masked, -jnp.inf, scores), axis=-1, keepdims=True)
    e = jnp.where(masked, jnp.zeros((), scores.dtype), xla_fixes.exp(scores - top))
    total = jnp.sum(e, axis=-1, keepdims=True)
    return jnp.where(total == 0, jnp.full((), jnp.nan, scores.dtype), e * (1 / total))


def _attention(query, key, value, num_heads: int, qkv_weight, qkv_bias, proj_weight, proj_bias,
               mask, mask_type):
    """(the projected output (B, T, P), the attention probabilities (B, H, T, T))."""
    batch, length, embed = query.shape
    head_size = embed // num_heads

    def heads(x, third: int):
        rows = slice(third * embed, (third + 1) * embed)
        y = _linear(x, qkv_weight[rows], qkv_bias[rows])
        return y.reshape(batch, length, num_heads, head_size).transpose(0, 2, 1, 3)

    q = heads(query, 0) * _query_scale(head_size, query.dtype)
    k, v = heads(key, 1), heads(value, 2)
    scores = jnp.einsum("bhld,bhsd->bhls", q, k, precision=_HIGHEST)
    probs = _masked_softmax(scores, _masked_out(mask, mask_type, scores.shape))
    merged = jnp.einsum("bhls,bhsd->blhd", probs, v, precision=_HIGHEST).reshape(batch, length, embed)
    return _linear(merged, proj_weight, proj_bias), probs


# -- the ops -------------------------------------------------------------------------------------

@lowering(aten._native_multi_head_attention.default, check=_check_multi_head_attention)
def native_multi_head_attention(ctx, query, key, value, embed_dim, num_head, qkv_weight, qkv_bias,
                                proj_weight, proj_bias, mask=None, need_weights=True,
                                average_attn_weights=True, mask_type=None):
    out, probs = _attention(query, key, value, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias,
                            mask, mask_type)
    if average_attn_weights:
        probs = jnp.sum(probs, axis=1) / np.asarray(num_head, probs.dtype)
    # (weights the metadata leaves undefined are left out)
    return (out, probs)[:len(ctx.out)]


@lowering(aten._transformer_encoder_layer_fwd.default, check=_check_encoder_layer)
def transformer_encoder_layer_fwd(ctx, src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight,
                                  proj_bias, use_gelu, norm_first, eps, norm_weight_1, norm_bias_1,
                                  norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1, ffn_weight_2,
                                  ffn_bias_2, mask=None, mask_type=None):
    if src.size == 0:
        return src

    def norm(x, weight, bias):
        return normalization.native_layer_norm(ctx, x, (embed_dim,), weight, bias, eps)[0]

    x = norm(src, norm_weight_1, norm_bias_1) if norm_first else src
    x = src + _attention(x, x, x, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask,
                         mask_type)[0]
    if not norm_first:
        x = norm(x, norm_weight_1, norm_bias_1)
    residual = x
    if norm_first:
        x = norm(x, norm_weight_2, norm_bias_2)
    hidden = _linear(x, ffn_weight_1, ffn_bias_1)
    hidden = activation.gelu(ctx, hidden) if use_gelu else activation.relu(ctx, hidden)
    x = residual + _linear(hidden, ffn_weight_2, ffn_bias_2)
    if not norm_first:
        x = norm(x, norm_weight_2, norm_bias_2)
    return x
