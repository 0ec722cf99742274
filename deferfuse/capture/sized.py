"""Data-dependent ops recorded after one small synchronization: the size of their output.

``nonzero``, ``masked_select``, indexing with a boolean mask, ``repeat_interleave``, ``unique``,
``unique_consecutive`` and ``bincount`` have output shapes that depend
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
from .dispatch_keys import no_dispatch

aten = torch.ops.aten
STATIC = object()


def _count(recorder, mask: torch.Tensor) -> int:
    """The number of nonzero elements of ``mask``, computed now."""
    count = torch.count_nonzero(mask)
    (real,) = recorder.realize((count,), FlushReason.DATA_DEPENDENT)
    with no_dispatch():
        return int(real)


def _nonzero(recorder, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    (x,) = args
    if kwargs or x.dtype.is_complex:
        return None     # (count_nonzero of complex values is not lowered)
    count = _count(recorder, x)
    found = torch.nonzero_static(x, size=count)
    # torch's CPU kernel gives its result column-major, strides (1, count) (nonzero_out_cpu:
    # "default to fortran-contiguous output", gh-46224), where nonzero_static's is row-major; an
    # empty one as the kernel itself lays it out (found nothing in zeros of x's dimensions)
    if count:
        strides = (1, count)
    else:
        with no_dispatch():
            strides = torch.nonzero(torch.zeros((1,) * x.dim(), dtype=x.dtype)).stride()
    return found.new_empty_strided(found.shape, strides).copy_(found)


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
    with no_dispatch():
        size, smallest = int(real_total), int(real_least)
    given = kwargs.get("output_size")
    if smallest < 0 or (given is not None and given != size):
        return None     # torch's kernel raises
    return aten.repeat_interleave.Tensor(repeats, output_size=size)


def _groups(recorder, flat: torch.Tensor):
    """(group id of each element, number of groups) of a 1-d tensor whose equal neighbours form
    one group (NaN equals nothing, as in torch's unique)."""
    first = torch.ones(flat.shape[:1], dtype=torch.bool).narrow(0, 0, min(1, flat.shape[0]))
    starts = torch.cat([first, flat[1:] != flat[:-1]])
    return torch.cumsum(starts, 0) - 1, _count(recorder, starts)


def _by_group(flat: torch.Tensor, group: torch.Tensor, n: int, return_counts: bool):
    """(the value of each group, the size of each group or an empty tensor)."""
    values = flat.new_zeros((n,)).scatter(0, group, flat)
    counts = torch.zeros(n if return_counts else 0, dtype=torch.long)
    if return_counts:
        counts = counts.scatter_add(0, group, torch.ones_like(group))
    return values, counts


def _unique(recorder, args: tuple, kwargs: dict) -> Optional[tuple]:
    """torch.unique: sorted distinct values (torch's CPU kernel sorts even when not asked to;
    each NaN is distinct), the group of each input element, the size of each group."""
    x, sorted_, return_inverse, return_counts = _bind(aten._unique2.default, args, kwargs)
    if x.dtype.is_complex:
        return None
    ordered, order = torch.sort(x.reshape(-1), stable=True)
    group, n = _groups(recorder, ordered)
    values, counts = _by_group(ordered, group, n, return_counts)
    inverse = torch.zeros(0, dtype=torch.long)
    if return_inverse:
        inverse = torch.empty_like(group).scatter(0, order, group).reshape(x.shape)
    return values, inverse, counts


def _unique_consecutive(recorder, args: tuple, kwargs: dict) -> Optional[tuple]:
    x, return_inverse, return_counts, dim = _bind(aten.unique_consecutive.default, args, kwargs)
    if dim is not None or x.dtype.is_complex:
        return None
    flat = x.reshape(-1)
    group, n = _groups(recorder, flat)
    values, counts = _by_group(flat, group, n, return_counts)
    inverse = group.reshape(x.shape) if return_inverse else torch.zeros(0, dtype=torch.long)
    return values, inverse, counts


def _unique_unsorted_api(recorder, args: tuple, kwargs: dict) -> Optional[tuple]:
    """aten._unique (values, inverse): torch.unique's older form, used by some backward formulas."""
    x, sorted_, return_inverse = _bind(aten._unique.default, args, kwargs)
    result = _unique(recorder, (x, sorted_, return_inverse, False), {})
    return None if result is None else result[:2]


def _bincount(recorder, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """How often each value occurs (or the sum of its weights): as long as the largest value
    plus one, at least ``minlength``."""
    x, weights, minlength = _bind(aten.bincount.default, args, kwargs)
    if x.dim() != 1 or x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        return None
    if weights is not None and (weights.shape != x.shape or weights.dtype.is_complex
                                or weights.dtype in (torch.float16, torch.bfloat16)):
        return None
    if x.numel():
        largest, smallest = recorder.realize((x.max(), x.min()), FlushReason.DATA_DEPENDENT)
        with no_dispatch():
            largest, smallest = int(largest), int(smallest)
        if smallest < 0:
            return None                 # torch's kernel raises
        size = max(largest + 1, minlength)
    else:
        size = minlength
    if weights is None:
        return torch.zeros(size, dtype=torch.long).scatter_add(0, x.long(), torch.ones_like(x, dtype=torch.long))
    dtype = weights.dtype if weights.dtype in (torch.float32, torch.float64) else torch.float64
    return torch.zeros(size, dtype=dtype).scatter_add(0, x.long(), weights.to(dtype))


def _bind(op, args: tuple, kwargs: dict) -> list:
    """Every argument of ``op``, by position, defaults filled in."""
    schema = op._schema.arguments
    bound = list(args) + [kwargs.get(a.name, a.default_value) for a in schema[len(args):]]
    return bound


SIZED: dict[Any, Callable[..., Optional[torch.Tensor]]] = {
    aten.nonzero.default: _nonzero,
    aten.masked_select.default: _masked_select,
    aten.index.Tensor: _index_with_masks,
    aten.repeat_interleave.Tensor: _repeat_interleave,
    aten._unique2.default: _unique,
    aten.unique_consecutive.default: _unique_consecutive,
    aten._unique.default: _unique_unsorted_api,
    aten.bincount.default: _bincount,
}
