"""Attention written in JAX, as a drop-in for ``F.scaled_dot_product_attention``, and as a
Hugging Face ``transformers`` attention implementation (``register_with_transformers``).

``attention(query, key, value, mask, scale, is_causal)`` takes SDPA's layout, ``(batch, heads,
length, dim)``; key and value may have fewer heads (grouped-query attention), which are repeated
as SDPA's ``enable_gqa``.  ``mask`` is boolean (True: attend) or additive, broadcast to the
scores; ``scale`` defaults to ``1/sqrt(dim)``.  Scores and softmax are computed in float32 (float64
for float64 inputs).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import torch

from ..jax_op import jax_op


@jax_op("deferfuse_examples::attention")
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor] = None,
              scale: Optional[float] = None, is_causal: bool = False) -> torch.Tensor:
    heads, kv_heads = query.shape[-3], key.shape[-3]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads")
    if kv_heads != heads:
        key = jnp.repeat(key, heads // kv_heads, axis=-3)
        value = jnp.repeat(value, heads // kv_heads, axis=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    dt = jnp.promote_types(query.dtype, jnp.float32)   # (float64 stays float64)
    scores = jnp.einsum("...qd,...kd->...qk", query.astype(dt), key.astype(dt)) * scale
    big_negative = jnp.finfo(dt).min
    if is_causal:
        q, k = scores.shape[-2], scores.shape[-1]
        scores = jnp.where(jnp.tril(jnp.ones((q, k), bool)), scores, big_negative)
    if mask is not None:
        if mask.dtype == jnp.bool_:
            scores = jnp.where(mask, scores, big_negative)
        else:
            scores = scores + mask.astype(dt)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("...qk,...kd->...qd", weights, value.astype(dt))
    return out.astype(query.dtype)


def hf_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                 is_causal: Optional[bool] = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """An attention function for transformers' ``AttentionInterface``, as its SDPA one is
    (calls with dropout, a position bias or a softcap go to SDPA's)."""
    if dropout or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(query.shape[2] > 1 and attention_mask is None and is_causal)
    out = attention(query, key, value, attention_mask, scaling, is_causal)
    return out.transpose(1, 2).contiguous(), None


def register_with_transformers(name: str = "deferfuse_jax") -> str:
    """Register ``hf_attention`` as the attention implementation ``name`` (with SDPA's masks):
    ``Model.from_config(config, attn_implementation=name)`` or ``model.set_attn_implementation(name)``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    AttentionInterface.register(name, hf_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return name
