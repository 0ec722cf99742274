"""Output metadata of an aten call, from meta tensors, cached by (op, input metadata).

The cache key holds the op, each tensor's ``TensorMeta`` and every static argument; a Python float
passed to a ``Scalar`` parameter enters the key by type only, since it is a runtime input of the
compiled computation and cannot change an output's shape or dtype.  Running the op on meta tensors
also raises torch's own shape and dtype errors, at record time, on the user's line.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from ..ir.meta import TensorMeta
from ..lower.registry import Lowering, LoweringContext, RuntimeScalar, get_lowering
from ..stats import STATS


@dataclasses.dataclass(frozen=True)
class MetaEntry:
    outs: tuple[Optional[TensorMeta], ...]   # None for an output that is not a tensor
    tensor_outs: tuple[TensorMeta, ...]      # the tensor outputs
    lowering: Optional[Lowering]              # None: no usable lowering
    reason: Optional[str]                     # why there is none
    ctx: LoweringContext


_CACHE: dict[Any, MetaEntry] = {}


def to_meta_tensor(m: TensorMeta) -> torch.Tensor:
    """A meta tensor with ``m``'s layout inside a storage of ``m.storage_numel`` elements."""
    base = torch.empty((m.storage_numel,), dtype=m.dtype, device="meta")
    return base.as_strided(m.shape, m.stride, m.offset)


def _to_meta(a: Any) -> Any:
    if isinstance(a, TensorMeta):
        return to_meta_tensor(a)
    if isinstance(a, RuntimeScalar):
        return a.value
    if isinstance(a, (list, tuple)):
        return type(a)(_to_meta(x) for x in a)
    if isinstance(a, torch.device):
        return torch.device("meta")
    return a


def _first_device(args: tuple, kwargs: dict) -> torch.device:
    stack = list(args) + list(kwargs.values())
    while stack:
        a = stack.pop(0)
        if isinstance(a, TensorMeta):
            return a.device
        if isinstance(a, (list, tuple)):
            stack[:0] = list(a)
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device)
    return torch.get_default_device()


def _meta_of_output(out: Any, device: torch.device) -> Optional[TensorMeta]:
    if isinstance(out, torch.Tensor):
        return TensorMeta.of(out, device)
    return None


def infer(op: torch._ops.OpOverload, key: Any, args: tuple, kwargs: dict) -> MetaEntry:
    """Metadata of ``op(*args, **kwargs)``, where tensors are given as TensorMeta.

    Raises what torch raises for invalid calls (shape mismatch, bad dtype, ...).
    """
    entry = _CACHE.get(key)
    if entry is not None:
        STATS.meta_cache_hits += 1
        return entry
    STATS.meta_cache_misses += 1
    device = _first_device(args, kwargs)
    meta_args = tuple(_to_meta(a) for a in args)
    meta_kwargs = {k: _to_meta(v) for k, v in kwargs.items()}
    if "device" in kwargs and kwargs["device"] is not None:
        meta_kwargs["device"] = torch.device("meta")
    try:
        result = op(*meta_args, **meta_kwargs)
    except Exception as meta_error:
        _raise_as_torch_would(op, args, kwargs, meta_error)
        raise
    results = result if isinstance(result, (tuple, list)) else (result,)
    outs = tuple(_meta_of_output(r, device) for r in results)
    tensor_outs = tuple(o for o in outs if o is not None)
    ctx = LoweringContext(op, args, kwargs, tensor_outs)
    lowering = get_lowering(op)
    reason: Optional[str] = None
    if lowering is None:
        reason = "no lowering"
    elif lowering.check is not None:
        reason = lowering.check(ctx)
        if reason is not None:
            lowering = None
    entry = MetaEntry(outs, tensor_outs, lowering, reason, ctx)
    _CACHE[key] = entry
    return entry


_SMALL = 1 << 16


def _raise_as_torch_would(op, args: tuple, kwargs: dict, meta_error: Exception) -> None:
    """Meta kernels sometimes raise another exception type than the real kernel (RuntimeError
    for IndexError).  For small inputs, run the op on zero-filled CPU tensors of the same
    metadata and raise what it raises; otherwise let the meta error stand."""
    tensors = [a for a in _walk(args, kwargs) if isinstance(a, TensorMeta)]
    if sum(t.storage_numel for t in tensors) > _SMALL:
        return

    def real(a: Any) -> Any:
        if isinstance(a, TensorMeta):
            return torch.zeros((a.storage_numel,), dtype=a.dtype).as_strided(a.shape, a.stride, a.offset)
        if isinstance(a, RuntimeScalar):
            return a.value
        if type(a) in (list, tuple):
            return type(a)(real(x) for x in a)
        return a

    try:
        op(*real(args), **{k: real(v) for k, v in kwargs.items()})
    except Exception as real_error:  # noqa: BLE001 - re-raised with torch's own type
        if type(real_error) is not type(meta_error):
            raise real_error from None


def _walk(args: tuple, kwargs: dict):
    stack = list(args) + list(kwargs.values())
    while stack:
        a = stack.pop()
        if type(a) in (list, tuple):
            stack.extend(a)
        else:
            yield a


def clear_cache() -> None:
    _CACHE.clear()
