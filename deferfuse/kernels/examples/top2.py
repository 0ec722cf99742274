"""Two outputs, one of them integer: the two largest values of each row and their indices
(``jax.lax.top_k``), as ``torch.topk(x, 2)``.  Differentiable through the values; the indices
are not differentiable (autograd marks them so)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from ..jax_op import jax_op


@jax_op("deferfuse_examples::top2")
def top2(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values, indices = jax.lax.top_k(x, 2)
    return values, indices.astype(jnp.int64)
