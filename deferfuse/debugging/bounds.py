"""Index bounds, checked before an indexing op runs.

torch checks these on CPU, but with messages that can name the wrong dimension, and on
accelerators only as a device assert that kills the process; XLA (defer mode) clamps
out-of-range gather indices and drops out-of-range scatter updates without a word.  Debug mode
checks them first, with one min/max pass over each index tensor, and names the first offending
value, the valid range, the dimension and the user's line.

Which ops, and what each allows, is data below: the schema says which argument is an index
but not which dimension it addresses nor whether negative indices wrap, so those are written
here per op, verified against torch's CPU kernels.  The error class matches the type torch
raises for that op (where torch raises IndexError for some layouts and RuntimeError for
others, the error is both).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

from ..errors import IndexBoundsError, IndexBoundsIndexError
from .checks import has_data, message, unravel

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class IndexUse:
    """One index tensor and what it indexes."""
    index: torch.Tensor
    arg: str                # its argument, as the user would recognise it: "index", "indices[1]"
    dim: Optional[int]      # the indexed dimension of the source; None: the flattened source (take)
    size: int               # the number of valid positions
    wraps: bool             # negative indices count from the end (-size..size-1)


@dataclasses.dataclass(frozen=True)
class BoundsRule:
    uses: Callable[[dict[str, Any]], list[IndexUse]]
    error: type


_RULES: dict[Any, BoundsRule] = {}


def rule_for(func: torch._ops.OpOverload) -> Optional[BoundsRule]:
    return _RULES.get(func.overloadpacket)


def _rule(packets: tuple, error: type):
    def register(uses: Callable[[dict[str, Any]], list[IndexUse]]):
        for packet in packets:
            if packet in _RULES:
                raise RuntimeError(f"two bounds rules for {packet}")
            _RULES[packet] = BoundsRule(uses, error)
        return uses
    return register


def _dim_size(source: torch.Tensor, dim: int) -> Optional[tuple[int, int]]:
    """(normalized dim, its size); None when the dim is invalid (torch reports that itself)."""
    rank = max(source.dim(), 1)  # a 0-dim tensor indexes like a 1-element vector
    if not -rank <= dim < rank:
        return None
    dim %= rank
    return dim, (source.shape[dim] if source.dim() else 1)


def _along(source_arg: str, index_arg: str, wraps: bool):
    def uses(bound: dict[str, Any]) -> list[IndexUse]:
        source, index, dim = bound.get(source_arg), bound.get(index_arg), bound.get("dim", 0)
        found = _dim_size(source, dim) if isinstance(source, torch.Tensor) else None
        if found is None or not isinstance(index, torch.Tensor):
            return []
        return [IndexUse(index, index_arg, found[0], found[1], wraps)]
    return uses


# torch raises RuntimeError for these
_rule((aten.gather, aten.scatter, aten.scatter_, aten.scatter_add, aten.scatter_add_,
       aten.scatter_reduce, aten.scatter_reduce_), IndexBoundsError)(_along("self", "index", False))
_rule((aten.embedding_bag, aten._embedding_bag, aten._embedding_bag_forward_only),
      IndexBoundsError)(_along("weight", "indices", False))
# torch raises IndexError or RuntimeError depending on the layout and the index dtype
_rule((aten.index_select, aten.index_add, aten.index_add_),
      IndexBoundsIndexError)(_along("self", "index", False))
# torch raises IndexError for these
_rule((aten.embedding,), IndexBoundsIndexError)(_along("weight", "indices", False))
_rule((aten.index_copy, aten.index_copy_), IndexBoundsIndexError)(_along("self", "index", False))
_rule((aten.index_fill, aten.index_fill_), IndexBoundsIndexError)(_along("self", "index", True))


@_rule((aten.take,), IndexBoundsIndexError)
def _take(bound: dict[str, Any]) -> list[IndexUse]:
    source, index = bound.get("self"), bound.get("index")
    if not isinstance(source, torch.Tensor) or not isinstance(index, torch.Tensor):
        return []
    return [IndexUse(index, "index", None, source.numel(), True)]


@_rule((aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_), IndexBoundsIndexError)
def _advanced(bound: dict[str, Any]) -> list[IndexUse]:
    """x[i, j] and x[i, j] = v: the k-th index addresses the k-th dimension; a boolean mask
    addresses as many dimensions as it has (torch checks its shape itself), None one."""
    source, indices = bound.get("self"), bound.get("indices")
    if not isinstance(source, torch.Tensor) or not isinstance(indices, (list, tuple)):
        return []
    uses, dim = [], 0
    for position, index in enumerate(indices):
        if index is None:
            dim += 1
            continue
        if index.dtype in (torch.bool, torch.uint8):
            dim += index.dim()
            continue
        if dim < source.dim():
            uses.append(IndexUse(index, f"indices[{position}]", dim, source.shape[dim], True))
        dim += 1
    return uses


# -- the check ---------------------------------------------------------------------------------
def check(func: torch._ops.OpOverload, rule: BoundsRule, bound: dict[str, Any],
          args: tuple, kwargs: dict) -> None:
    for use in rule.uses(bound):
        index = use.index
        if not has_data(index) or index.numel() == 0 or index.dtype.is_floating_point \
                or index.dtype.is_complex or index.dtype == torch.bool:
            continue  # nothing to read, or torch rejects the dtype itself
        low = -use.size if use.wraps else 0
        smallest, largest = (int(v) for v in torch.aminmax(index))
        if low <= smallest and largest < use.size:
            continue
        _raise_metadata_error(func, args, kwargs)
        _report(func, rule, use, low, smallest, largest)


def _report(func, rule: BoundsRule, use: IndexUse, low: int, smallest: int, largest: int) -> None:
    flat = use.index.reshape(-1)
    bad = (flat < low) | (flat >= use.size)
    first = int(bad.to(torch.uint8).argmax())
    value = int(flat[first])
    position = unravel(first, use.index.shape)
    where = "the flattened input" if use.dim is None else f"dimension {use.dim}"
    if use.size == 0:
        valid = f"{where} is empty, so no index is valid"
    else:
        valid = f"valid indices are {low}..{use.size - 1}"
        if not use.wraps and value < 0:
            valid += f" ({func.overloadpacket} does not wrap negative indices)"
    what = (f"index {value} is out of bounds for {where} with size {use.size}; {valid}. "
            f"It is at position {position} of `{use.arg}` (shape {tuple(use.index.shape)}, "
            f"min {smallest}, max {largest})")
    raise rule.error(message(func, what, "Fix the index where it is computed (or clamp it, or "
                                         "check the size of the tensor it indexes)."))


def _raise_metadata_error(func, args: tuple, kwargs: dict) -> None:
    """If torch rejects this call for its shapes or dtypes, raise torch's own error, as strict
    mode would: those checks come before any index is read.  Meta tensors say whether the call
    is invalid; the real op then raises torch's error (its type can differ from the meta
    kernel's), on the host, before any kernel could read an index."""
    def to_meta(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
        if isinstance(a, (list, tuple)):
            return type(a)(to_meta(x) for x in a)
        return a
    try:
        func(*to_meta(args), **{k: to_meta(v) for k, v in kwargs.items()})
    except NotImplementedError:
        return  # no meta kernel: nothing to learn
    except Exception:  # noqa: BLE001 - the call is invalid apart from its indices
        func(*args, **kwargs)  # raises torch's error (annotated by DebugMode)
