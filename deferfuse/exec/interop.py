"""torch <-> JAX through DLPack.  A crossing that had to copy is counted, never hidden."""

from __future__ import annotations

import torch

from ..stats import STATS
from .._lazy import lazy_import

jax = lazy_import("jax", globals(), "jax")


def to_jax(t: torch.Tensor) -> jax.Array:
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        STATS.dlpack_copies += 1
        t = t.contiguous()
    arr = jax.dlpack.from_dlpack(t)
    if t.numel() and arr.unsafe_buffer_pointer() != t.data_ptr():
        STATS.dlpack_copies += 1
    return arr


def to_torch(a: jax.Array) -> torch.Tensor:
    return torch.from_dlpack(a)
