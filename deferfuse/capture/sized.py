"""Data-dependent ops recorded after one small synchronization: the size of their output.

``nonzero``, ``masked_select``, indexing with a boolean mask and ``repeat_interleave`` have output shapes that depend
on values.  Rather than computing their inputs and running torch's kernel (which ends fusion
there), the recorder computes only the count that fixes the shape (one scalar: a flush with the
reason ``data_dependent``), then records the op in a static-shaped form (``nonzero_static``,
``index_select``) that lowers and fuses with what follows, as any other op.

Each rule takes the recorder and the call and returns the result, ``None`` to decline (the op
then runs eagerly, as before: torch's kernel also raises the user's errors), or ``STATIC`` for a
call whose output shape does not depend on values (indexing with integer indices only), which is
recorded as usual.  A rule sees every call of its op, also those torch's meta kernel accepts:
``repeat_interleave`` with an ``output_size`` that may not match the repeats.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..errors import FlushReason

aten = torch.ops.aten
STATIC = object()


def _count(recorder, mask: torch.Tensor) -> int:
    """The number of nonzero elements of ``mask``, computed now."""
    count = torch.count_nonzero(mask)
    (real,) = recorder.realize((count,), FlushReason.DATA_DEPENDENT)
    from .recorder import no_dispatch
    with no_dispatch():
        return int(real)


def _nonzero(recorder, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    (x,) = args
    if kwargs or x.dtype.is_complex:
        return None     # (count_nonzero of complex values is not lowered)
    return torch.nonzero_static(x, size=_count(recorder, x))


def _masked_select(recorder, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    x, mask = args
    if kwargs or mask.dtype != torch.bool:
        return None     # (torch's kernel gives the errors: a uint8 mask, a mask of floats)
    try:
        torch.broadcast_shapes(x.shape, mask.shape)
    except RuntimeError:
        return None
    x, mask = torch.broadcast_tensors(x, mask)
    flat_mask = mask.reshape(-1)
    where = torch.nonzero_static(flat_mask, size=_count(recorder, flat_mask)).reshape(-1)
    return x.reshape(-1).index_select(0, where)


def _index_with_masks(recorder, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """x[mask, i, ...]: each boolean mask becomes the integer indices of its true elements, as
    torch's indexing itself does, so only the number of those is synchronized."""
    x, indices = args
    if not any(i is not None and i.dtype == torch.bool for i in indices):
        return STATIC
    if kwargs:
        return None
    converted: list = []
    dim = 0
    for index in indices:
        if index is None or index.dtype != torch.bool:
            converted.append(index)
            dim += 1
            continue
        # (a 0-dim mask adds a dimension, a mask of another shape is an IndexError: torch's)
        if index.dim() == 0 or tuple(index.shape) != tuple(x.shape[dim:dim + index.dim()]):
            return None
        where = torch.nonzero_static(index, size=_count(recorder, index))
        converted.extend(where.unbind(1))
        dim += index.dim()
    return aten.index.Tensor(x, converted)


def _repeat_interleave(recorder, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    (repeats,) = args
    if set(kwargs) - {"output_size"} or repeats.dim() != 1 or repeats.dtype not in (torch.int32, torch.int64):
        return None
    total, least = repeats.sum(), repeats.min() if repeats.numel() else repeats.sum()
    real_total, real_least = recorder.realize((total, least), FlushReason.DATA_DEPENDENT)
    from .recorder import no_dispatch
    with no_dispatch():
        size, smallest = int(real_total), int(real_least)
    given = kwargs.get("output_size")
    if smallest < 0 or (given is not None and given != size):
        return None     # torch's kernel raises
    return aten.repeat_interleave.Tensor(repeats, output_size=size)


SIZED: dict[Any, Callable[..., Optional[torch.Tensor]]] = {
    aten.nonzero.default: _nonzero,
    aten.masked_select.default: _masked_select,
    aten.index.Tensor: _index_with_masks,
    aten.repeat_interleave.Tensor: _repeat_interleave,
}
