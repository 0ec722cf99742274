"""Debug mode's checks on written memory (before an op) and on NaN/Inf (after it).

Overlap: an op that writes a tensor while reading another view of the same memory reads
values it has already overwritten, in an order that depends on the kernel.  torch detects the
simple cases (both tensors dense) and silently computes something for the rest; we check every
pair of a written tensor and another tensor argument that share a storage, element by element
when their layouts interleave.  The identical view (``x.add_(x)``) is allowed, as in torch, and
so is a 0-dim tensor that the kernel reads as a number before writing (``x.fill_(x[0])``).

NaN/Inf (setting ``check_nans``): after each op, floating-point outputs are checked; an op is
reported only if none of its inputs held NaN/Inf (a non-finite Python number counts as one, so
``masked_fill(mask, -inf)`` is not reported), so the error names the op that *produced* them.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Iterator, Optional

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_dense

from ..capture.tensor import DeferredTensor
from ..errors import NonFiniteError, OverlapError
from . import backward, scopes
from .source import user_source

# Beyond this many elements per tensor, an interleaved overlap is not computed element by element
# (like torch's "too hard to tell"): it is reported only if both tensors are dense.
_EXACT_OVERLAP_LIMIT = 1 << 24


# -- helpers shared with bounds.py ------------------------------------------------------------
_MISSING = object()


def bind(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by schema name, defaults filled in."""
    bound: dict[str, Any] = {}
    positional = iter(args)
    for arg in func._schema.arguments:
        value = next(positional, _MISSING) if not arg.kwarg_only else _MISSING
        if value is _MISSING:
            if arg.name in kwargs:
                value = kwargs[arg.name]
            elif arg.has_default_value():
                value = arg.default_value
            else:
                continue
        bound[arg.name] = value
    return bound


def has_data(t: Any) -> bool:
    """A tensor whose values we can read (not a meta, fake or functional tensor)."""
    return isinstance(t, torch.Tensor) and not t.is_meta and (
        type(t) in (torch.Tensor, torch.nn.Parameter) or isinstance(t, DeferredTensor))


def tensors_of(value: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(suffix, tensor) for a tensor argument or each tensor of a list argument."""
    if isinstance(value, torch.Tensor):
        yield "", value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if isinstance(item, torch.Tensor):
                yield f"[{i}]", item


def message(func: Any, what: str, todo: str) -> str:
    return f"{func}: {what}\n  at {place()}\n  {todo}"


def place() -> str:
    """Where the op runs, in words: the user's file:line and the running module; in backward,
    the ``backward()`` line and the forward line and module that recorded the autograd node."""
    text = user_source() or "an unknown line"
    in_backward = backward.describe_current()
    if in_backward is not None:
        return f"{text},\n  {in_backward}"
    scope = scopes.current()
    return text if scope is None else f"{text} in module {scope}"


# -- overlapping writes -----------------------------------------------------------------------
def check_overlap(func: torch._ops.OpOverload, info, bound: dict[str, Any]) -> None:
    if torch.Tag.inplace_view in func.tags:
        return  # set_, resize_, t_ ... change metadata, they do not write elements
    written = [(name + suffix, t) for name in info.written if name in bound
               for suffix, t in tensors_of(bound[name]) if has_data(t) and t.numel()]
    if not written:
        return
    by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
    read_as_number = _read_as_number(func)
    for name, value in bound.items():
        if name in info.written:
            continue
        for suffix, t in tensors_of(value):
            if has_data(t) and t.numel() and not (name in read_as_number and t.dim() == 0):
                by_storage.setdefault(_storage_key(t), []).append((name + suffix, t))
    for written_name, w in written:
        for read_name, r in by_storage.get(_storage_key(w), ()):
            if r is w or _same_view(r, w):
                continue
            shared = _shared_element(w, r)
            if shared is not None:
                raise OverlapError(message(
                    func,
                    f"writes `{written_name}` (shape {tuple(w.shape)}, stride {w.stride()}, offset "
                    f"{w.storage_offset()}) while reading `{read_name}` (shape {tuple(r.shape)}, "
                    f"stride {r.stride()}, offset {r.storage_offset()}), another view of the same "
                    f"memory: {shared}; the result would depend on the order the kernel visits "
                    f"elements",
                    f"Read from a copy: pass `{read_name}.clone()`, or write into a new tensor."))


@functools.cache
def _read_as_number(func: torch._ops.OpOverload) -> frozenset[str]:
    """Tensor arguments that a sibling overload takes as a Scalar (fill_.Tensor's value,
    masked_fill_.Tensor's value): the kernel reads a 0-dim tensor there as a number before it
    writes anything.  Pointwise ops are the exception: their iterator reads it as a tensor."""
    if torch.Tag.pointwise in func.tags:
        return frozenset()
    packet = func.overloadpacket
    as_scalar = {a.name for name in packet.overloads()
                 for a in getattr(packet, name)._schema.arguments if str(a.type) == "number"}
    return frozenset(a.name for a in func._schema.arguments
                     if a.name in as_scalar and str(a.type) == "Tensor")


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.storage_offset() == b.storage_offset()
            and a.shape == b.shape and a.stride() == b.stride())


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    size = t.element_size()
    start = t.storage_offset() * size
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * size


def _shared_element(w: torch.Tensor, r: torch.Tensor) -> Optional[str]:
    """Where ``w`` and ``r`` (same storage) share memory, in words; None if they do not."""
    (w_start, w_end), (r_start, r_end) = _byte_span(w), _byte_span(r)
    if w_end <= r_start or r_end <= w_start:
        return None
    if w.dtype == r.dtype and max(w.numel(), r.numel()) <= _EXACT_OVERLAP_LIMIT:
        w_offsets, r_offsets = element_offsets(w), element_offsets(r)
        common = torch.isin(w_offsets, r_offsets)
        if not bool(common.any()):
            return None
        first = int(common.to(torch.uint8).argmax())
        return f"element {unravel(first, w.shape)} of the written tensor is also read"
    if is_dense(w) and is_dense(r):
        return f"bytes {max(w_start, r_start)}..{min(w_end, r_end) - 1} of the storage are in both"
    return None  # interleaved layouts too large to compare: torch does not check these either


def element_offsets(t: torch.Tensor) -> torch.Tensor:
    """The storage offset (in elements) of each of ``t``'s elements, flat, in ``t``'s order."""
    offsets = torch.tensor(t.storage_offset(), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return offsets.reshape(-1)


def unravel(flat: int, shape: torch.Size) -> tuple[int, ...]:
    position = []
    for size in reversed(shape):
        flat, rest = divmod(flat, size)
        position.append(rest)
    return tuple(reversed(position))


# -- NaN / Inf producers ----------------------------------------------------------------------
def _checks_values(t: Any) -> bool:
    return has_data(t) and (t.is_floating_point() or t.is_complex()) and t.numel() > 0


def _nonfinite(t: torch.Tensor) -> bool:
    # A finite sum means every element is finite (a NaN or an Inf makes the sum NaN or Inf): one
    # vectorized pass, ~25x faster than isfinite().all() on a 2^18-float tensor.  Only a sum that
    # is not finite (one that overflowed, or a real NaN/Inf) is looked at element by element.
    if bool(torch.isfinite(t.sum())):
        return False
    return not bool(torch.isfinite(t).all())


def _read_before_written(func, info) -> list[str]:
    # in-place ops read what they write; out= arguments (keyword-only) are only written
    kwarg_only = {a.name for a in func._schema.arguments if a.kwarg_only}
    return [name for name in info.written if name not in kwarg_only]


def nonfinite_written(func, info, bound: dict[str, Any]) -> set[str]:
    """Names of the written arguments that hold NaN/Inf before the op overwrites them."""
    found = set()
    for name in _read_before_written(func, info):
        for suffix, t in tensors_of(bound.get(name)):
            if _checks_values(t) and _nonfinite(t):
                found.add(name + suffix)
    return found


def _uninitialized(func) -> bool:
    # empty, empty_like, empty_strided, new_empty...: their memory is garbage by contract
    return "empty" in func._schema.name


def check_produced_nonfinite(func, info, bound: dict[str, Any], out: Any, before: set[str]) -> None:
    if _uninitialized(func):
        return
    outputs = [t for _, t in tensors_of(out) if _checks_values(t)]
    bad = [t for t in outputs if _nonfinite(t)]
    if not bad or _inputs_nonfinite(info, bound, before):
        return
    t = bad[0]
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    raise NonFiniteError(message(
        func,
        f"produced {nan} NaN and {inf} Inf values in an output of shape {tuple(t.shape)} "
        f"({t.dtype}) from finite inputs:\n    " + "\n    ".join(_summaries(info, bound)),
        "Check the inputs' range for this op (log/sqrt of negatives, division by zero, "
        "overflow in low precision); the setting check_nans (DEFERFUSE_CHECK_NANS) turns "
        "this check off."))


def _inputs_nonfinite(info, bound: dict[str, Any], before: set[str]) -> bool:
    if before:
        return True
    for name, value in bound.items():
        if name in info.written:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            return True
        if isinstance(value, complex) and not (math.isfinite(value.real) and math.isfinite(value.imag)):
            return True
        for _, t in tensors_of(value):
            if _checks_values(t) and _nonfinite(t):
                return True
    return False


def _summaries(info, bound: dict[str, Any], limit: int = 8) -> list[str]:
    lines = []
    for name, value in bound.items():
        tensors = list(tensors_of(value))
        for suffix, t in tensors:
            if name in info.written:  # its values are the op's output now
                lines.append(f"{name}{suffix}: {_shape(t)} (overwritten by this op; it held no NaN/Inf before)")
            else:
                lines.append(f"{name}{suffix}: {_summary(t)}")
        if not tensors and value is not None:
            lines.append(f"{name} = {value!r}")
    return lines if len(lines) <= limit else lines[:limit] + [f"... ({len(lines) - limit} more)"]


def _shape(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _summary(t: torch.Tensor) -> str:
    text = _shape(t)
    if not has_data(t) or t.numel() == 0:
        return text
    if t.is_complex():
        values = t.abs()
        text += f" max|x|={values.max().item():.6g}"
    else:
        values = t
        low, high = t.min().item(), t.max().item()
        text += f" min={low:.6g} max={high:.6g}" if t.is_floating_point() else f" min={low} max={high}"
    if t.is_floating_point() or t.is_complex():
        text += f" has_nan={bool(torch.isnan(values).any())} has_inf={bool(torch.isinf(values).any())}"
    return text

