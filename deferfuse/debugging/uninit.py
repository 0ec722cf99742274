"""Reads of memory nothing wrote: the setting ``check_uninitialized`` of debug mode.

Memory that debug mode sees allocated without values (``empty*``, ``new_empty*``, the part a
``resize_`` or an ``out=`` resize adds to a storage) is tracked per storage as a boolean mask,
one entry per element as allocated, all False ("unwritten").  After every op that writes (the
schema's ``alias_info.is_write``: in-place and ``out=`` arguments), the elements it wrote are
set: a strided view of the mask over the written tensor is filled, or, for the ops that write
only some elements (``x[idx] = v``, ``scatter_``, ``masked_fill_``, ``index_copy_`` ...), the
same op is run on the mask with ``True`` as the value, so the marks are exact.  Before every
op, each tensor it reads whose storage is tracked must see only written elements (indexing ops
that read some rows, ``index_select``, ``gather``, ``x[idx]``, ``embedding``, ``take``, run on
the mask too, so only the rows they read count); else ``UninitializedReadError`` names the
reading op, its line, and the op and line that allocated the memory.  A storage whose elements
are all written is no longer tracked, so the usual ``torch.empty`` then ``copy_`` costs one
mask; with nothing tracked an op pays one dictionary test.

Reads are of every tensor argument but the written ones, except where the op is known to read
what it writes (pointwise in-place ops such as ``add_``, foreach updates, accumulating ones
such as ``index_add_`` and ``addmm_`` with ``beta`` not 0), views and ops that read only
metadata (``*_like``, ``new_*``).  Writes debug mode cannot see (through ``.numpy()``,
``data_ptr()``, another thread, a defer block's flush) are not marked: tracking ends whenever
debug mode is left, and stops while a defer block runs inside it (``pause``/``resume``, called
by deferfuse/modes.py).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..capture.classify import OpKind
from ..errors import UninitializedReadError
from .checks import element_offsets, message, tensors_of, unravel

aten = torch.ops.aten


class Allocation:
    """A tracked storage: which of its elements (``itemsize`` bytes each) were written."""

    __slots__ = ("mask", "ref", "itemsize", "op", "line")

    def __init__(self, mask: torch.Tensor, storage: Any, itemsize: int, op: Any, line: Any) -> None:
        self.mask = mask
        self.ref = StorageWeakRef(storage)
        self.itemsize = itemsize
        self.op = op
        self.line = line


_TRACKED: dict[int, Allocation] = {}   # a storage's StorageImpl address -> its allocation
_PRUNE_EVERY = 64
_registered = [0]


_paused = [0]   # defer blocks open above a debug mode: their writes land unseen, at flushes


def tracking() -> bool:
    """Whether any storage is tracked (if not, an op has nothing to check)."""
    return bool(_TRACKED)


def active() -> bool:
    """Whether debug mode tracks memory now (not while a defer block runs above it)."""
    return not _paused[0]


def clear() -> None:
    """Stop tracking everything (debug mode left: writes made meanwhile are not seen)."""
    _TRACKED.clear()


def pause() -> None:
    """A defer block starts above debug mode: what it writes reaches memory at its flushes,
    unseen, so nothing is tracked until it ends (and what was is forgotten)."""
    _paused[0] += 1
    _TRACKED.clear()


def resume() -> None:
    """That defer block ended."""
    _paused[0] = max(0, _paused[0] - 1)
    _TRACKED.clear()


def tracked_count() -> int:
    """How many live storages are tracked (some of their elements unwritten)."""
    return sum(1 for a in _TRACKED.values() if not a.ref.expired())


def _plain(t: Any) -> bool:
    """A dense tensor over a storage we can track (not meta, sparse, quantized or a subclass)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout is torch.strided \
        and not t.is_meta and not t.is_quantized


def _lookup(t: torch.Tensor) -> Optional[Allocation]:
    key = t.untyped_storage()._cdata
    allocation = _TRACKED.get(key)
    if allocation is not None and allocation.ref.expired():
        del _TRACKED[key]   # (freed; its address now names another storage)
        return None
    return allocation


def _register(storage: Any, mask: torch.Tensor, itemsize: int, op: Any, line: Any) -> None:
    _TRACKED[storage._cdata] = Allocation(mask, storage, itemsize, op, line)
    _registered[0] += 1
    if _registered[0] % _PRUNE_EVERY == 0:
        for key in [k for k, a in _TRACKED.items() if a.ref.expired()]:
            del _TRACKED[key]


# -- allocations ------------------------------------------------------------------------------
def allocated(func: Any, out: Any, line: Any) -> None:
    """An ``empty*`` op returned ``out``: its memory is unwritten."""
    for _, t in tensors_of(out):
        if _plain(t):
            storage = t.untyped_storage()
            itemsize = t.element_size()
            n = storage.nbytes() // itemsize
            if n:
                _register(storage, torch.zeros(n, dtype=torch.bool), itemsize, func, line)


def sizes_before(info: Any, bound: dict[str, Any]) -> list[tuple[torch.Tensor, int]]:
    """The written tensors' storage sizes before a mutating op, to see which ones it grows."""
    return [(t, t.untyped_storage().nbytes()) for name in info.written
            for _, t in tensors_of(bound.get(name)) if _plain(t)]


def _grown(func: Any, sizes: list[tuple[torch.Tensor, int]], line_of: Callable[[], Any]) -> None:
    for t, before in sizes:
        storage = t.untyped_storage()
        after = storage.nbytes()
        if after <= before:
            continue
        allocation = _lookup(t)
        itemsize = allocation.itemsize if allocation is not None else t.element_size()
        n = after // itemsize
        if allocation is not None:
            grown = torch.zeros(n, dtype=torch.bool)
            grown[:allocation.mask.numel()] = allocation.mask[:n]
            allocation.mask = grown
        else:
            mask = torch.zeros(n, dtype=torch.bool)
            mask[:before // itemsize] = True
            _register(storage, mask, itemsize, func, line_of())


# -- which elements a tensor covers in its allocation's mask ------------------------------------
def _mask_of(allocation: Allocation, t: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(a strided view of the mask over ``t``'s elements, or None; else the mask indices of the
    elements it touches, flat).  Elements of another size than allocated ones (a ``view(dtype)``)
    cover the allocated elements their bytes touch."""
    size, itemsize = t.element_size(), allocation.itemsize
    extent = (t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * size
    if extent > allocation.mask.numel() * itemsize:
        # (the storage grew in a way no op showed us: its new memory counts as written, so
        # that nothing is reported that we cannot be sure of)
        grown = torch.ones(-(-extent // itemsize), dtype=torch.bool)
        grown[:allocation.mask.numel()] = allocation.mask
        allocation.mask = grown
    mask = allocation.mask
    if size == itemsize:
        return torch.as_strided(mask, t.shape, t.stride(), t.storage_offset()), None
    if size % itemsize == 0:
        k = size // itemsize
        return torch.as_strided(mask, (*t.shape, k), (*(s * k for s in t.stride()), 1),
                                t.storage_offset() * k), None
    offsets = element_offsets(t) * size // itemsize
    return None, offsets.clamp(max=mask.numel() - 1)


def _unwritten(allocation: Allocation, t: torch.Tensor) -> Optional[torch.Tensor]:
    """The written flags of ``t``'s elements (any shape) when some are False, else None."""
    view, indices = _mask_of(allocation, t)
    flags = view if view is not None else allocation.mask[indices]
    return None if bool(flags.all()) else flags


def _mark_all(allocation: Allocation, t: torch.Tensor) -> None:
    view, indices = _mask_of(allocation, t)
    if view is not None:
        view.fill_(True)
    else:
        allocation.mask[indices] = True


# -- ops that read or write only some elements: the same op run on the mask ----------------------
_TRUE = None


def _true() -> torch.Tensor:
    global _TRUE
    if _TRUE is None:
        _TRUE = torch.tensor(True)
    return _TRUE


def _bool_of(t: Any) -> Any:
    return t.to(torch.bool) if isinstance(t, torch.Tensor) else t


# reads of part of an argument: packet -> (argument, the op on that argument's mask view)
_PARTIAL_READS: dict[Any, tuple[str, Callable]] = {
    aten.index_select: ("self", lambda m, b: aten.index_select(m, b["dim"], b["index"])),
    aten.gather: ("self", lambda m, b: aten.gather(m, b["dim"], b["index"])),
    aten.index: ("self", lambda m, b: aten.index(m, b["indices"])),
    aten.take: ("self", lambda m, b: aten.take(m, b["index"])),
    aten.embedding: ("weight", lambda m, b: aten.index_select(m, 0, b["indices"].reshape(-1))),
}

# writes of part of ``self``: packet -> the op marking them on self's mask view
_PARTIAL_WRITES: dict[Any, Callable] = {
    aten.index_put_: lambda m, b: m.index_put_(b["indices"], _true()),
    aten._index_put_impl_: lambda m, b: m.index_put_(b["indices"], _true()),
    aten.scatter_: lambda m, b: m.scatter_(b["dim"], b["index"], True),
    aten.scatter_add_: lambda m, b: m.scatter_(b["dim"], b["index"], True),
    aten.scatter_reduce_: lambda m, b: m.scatter_(b["dim"], b["index"], True),
    aten.index_copy_: lambda m, b: m.index_fill_(b["dim"], b["index"], True),
    aten.index_fill_: lambda m, b: m.index_fill_(b["dim"], b["index"], True),
    aten.index_add_: lambda m, b: m.index_fill_(b["dim"], b["index"], True),
    aten.index_reduce_: lambda m, b: m.index_fill_(b["dim"], b["index"], True),
    aten.masked_fill_: lambda m, b: m.masked_fill_(_bool_of(b["mask"]), True),
    aten.masked_scatter_: lambda m, b: m.masked_fill_(_bool_of(b["mask"]), True),
    aten.put_: lambda m, b: m.put_(b["index"], torch.ones(b["index"].shape, dtype=torch.bool)),
}

# in-place ops that read the elements they write, beyond pointwise ones: packet -> the op giving
# those elements' flags from self's mask view (None: all of self); a predicate says when
_READS_WRITTEN: dict[Any, tuple[Callable[[dict], bool], Optional[Callable]]] = {
    aten.index_add_: (lambda b: True, lambda m, b: aten.index_select(m, b["dim"], b["index"])),
    aten.index_reduce_: (lambda b: b.get("include_self", True),
                         lambda m, b: aten.index_select(m, b["dim"], b["index"])),
    aten.scatter_add_: (lambda b: True, lambda m, b: aten.gather(m, b["dim"], b["index"])),
    aten.scatter_reduce_: (lambda b: b.get("include_self", True),
                           lambda m, b: aten.gather(m, b["dim"], b["index"])),
    aten.scatter_: (lambda b: b.get("reduce") is not None,
                    lambda m, b: aten.gather(m, b["dim"], b["index"])),
    aten.index_put_: (lambda b: bool(b.get("accumulate")), lambda m, b: aten.index(m, b["indices"])),
    aten._index_put_impl_: (lambda b: bool(b.get("accumulate")), lambda m, b: aten.index(m, b["indices"])),
    aten.put_: (lambda b: bool(b.get("accumulate")), lambda m, b: aten.take(m, b["index"])),
    aten.addmm_: (lambda b: b.get("beta", 1) != 0, None),
    aten.addmv_: (lambda b: b.get("beta", 1) != 0, None),
    aten.addr_: (lambda b: b.get("beta", 1) != 0, None),
    aten.addbmm_: (lambda b: b.get("beta", 1) != 0, None),
    aten.baddbmm_: (lambda b: b.get("beta", 1) != 0, None),
    aten.cumsum_: (lambda b: True, None),
    aten.cumprod_: (lambda b: True, None),
    aten.renorm_: (lambda b: True, None),
}

_FOREACH_OVERWRITES = frozenset({"_foreach_copy_", "_foreach_zero_"})


@functools.cache
def _reads_self(func: Any) -> bool:
    """Whether an in-place op reads all of the elements it writes (add_, _foreach_mul_)."""
    name = func._schema.name.split("::")[-1]
    if torch.Tag.pointwise in func.tags:
        return True
    return name.startswith("_foreach_") and name.endswith("_") and name not in _FOREACH_OVERWRITES


@functools.cache
def _reads_data(func: Any) -> bool:
    """Whether the op reads its (non-written) tensor arguments' elements, not only their shapes."""
    name = func._schema.name.split("::")[-1]
    return not (name.endswith("_like") or name.startswith("new_") or name in ("resize_", "set_"))


@functools.cache
def _kwarg_only(func: Any) -> frozenset[str]:
    return frozenset(a.name for a in func._schema.arguments if a.kwarg_only)


# -- the checks -------------------------------------------------------------------------------
def check_reads(func: Any, info: Any, bound: dict[str, Any]) -> None:
    """Before an op: raise if it reads an element of tracked memory that nothing wrote."""
    if info.kind in (OpKind.VIEW, OpKind.ALLOCATION, OpKind.INPLACE_VIEW) or not _reads_data(func):
        return
    packet = func.overloadpacket
    partial = _PARTIAL_READS.get(packet)
    written = info.written
    for name, value in bound.items():
        if name in written:
            continue
        for suffix, t in tensors_of(value):
            if not _plain(t) or not t.numel():
                continue
            allocation = _lookup(t)
            if allocation is None:
                continue
            if partial is not None and partial[0] == name:
                flags = _partial_flags(allocation, t, partial[1], bound)
            else:
                flags = _unwritten(allocation, t)
            if flags is not None:
                _report(func, name + suffix, t, flags, allocation)
    if not written or written[0] in _kwarg_only(func):
        return   # (out= arguments are written, not read)
    rule = _READS_WRITTEN.get(packet)
    if rule is None and not _reads_self(func):
        return
    if rule is not None and not rule[0](bound):
        return
    for name in written:
        for suffix, t in tensors_of(bound.get(name)):
            if not _plain(t) or not t.numel():
                continue
            allocation = _lookup(t)
            if allocation is None:
                continue
            if rule is not None and rule[1] is not None:
                flags = _partial_flags(allocation, t, rule[1], bound)
            else:
                flags = _unwritten(allocation, t)
            if flags is not None:
                _report(func, name + suffix, t, flags, allocation)


def _partial_flags(allocation: Allocation, t: torch.Tensor, rule: Callable, bound: dict) -> Optional[torch.Tensor]:
    view, _ = _mask_of(allocation, t)
    if view is None or view.dim() != t.dim():
        return _unwritten(allocation, t)   # (another element size: the whole tensor counts)
    try:
        flags = rule(view, bound)
    except (RuntimeError, IndexError):
        return None   # (torch rejects the call: it raises its own error when the op runs)
    return None if bool(flags.all()) else flags


def after(func: Any, info: Any, bound: dict[str, Any], sizes: list, line_of: Callable[[], Any]) -> None:
    """After a mutating op: memory it added to a storage is unwritten (``line_of()``: the user's
    line, asked only then); what it wrote is written."""
    if sizes:
        _grown(func, sizes, line_of)
    if info.kind is OpKind.INPLACE_VIEW or not _TRACKED:
        return
    partial = _PARTIAL_WRITES.get(func.overloadpacket)
    for name in info.written:
        for _, t in tensors_of(bound.get(name)):
            if not _plain(t) or not t.numel():
                continue
            allocation = _lookup(t)
            if allocation is None:
                continue
            view, _ = _mask_of(allocation, t)
            if partial is not None and name == "self" and view is not None and view.dim() == t.dim():
                try:
                    partial(view, bound)
                except (RuntimeError, IndexError):
                    _mark_all(allocation, t)
            else:
                _mark_all(allocation, t)
            if bool(allocation.mask.all()):
                _TRACKED.pop(t.untyped_storage()._cdata, None)


def _report(func: Any, name: str, t: torch.Tensor, flags: torch.Tensor, allocation: Allocation) -> None:
    flat = flags.reshape(-1)
    missing = int((~flat).sum())
    first = int((~flat).to(torch.uint8).argmax())
    where = f"; the first at position {unravel(first, flags.shape)}" if flags.shape == t.shape else ""
    raise UninitializedReadError(message(
        func,
        f"reads {missing} element(s) of `{name}` (shape {tuple(t.shape)}, {t.dtype}) that nothing "
        f"has written{where}: its memory was allocated by {allocation.op} at "
        f"{allocation.line or 'an unknown line'}, whose contents are unspecified",
        "Write every element before reading it (torch.zeros or torch.full instead of torch.empty, "
        "or fill_/copy_ first); the setting check_uninitialized (DEFERFUSE_CHECK_UNINITIALIZED) "
        "turns this check off."))
