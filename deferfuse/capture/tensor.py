"""DeferredTensor: a torch.Tensor with metadata now and data later.

It is a wrapper subclass, so every path that touches data goes through us: aten ops reach
``__torch_dispatch__`` and Python-level data access (``tolist``, ``numpy``, ``repr``, ``data_ptr``,
pickling) is overridden here to materialize first.  Once its context has ended, it behaves as an
ordinary tensor: ops on it run eagerly on its data.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..errors import FlushReason
from ..ir.graph import StorageState
from ..ir.meta import TensorMeta


_make_wrapper = torch.Tensor._make_wrapper_subclass
_CONTIGUOUS: dict[tuple, tuple] = {}   # shape -> the strides torch gives a new tensor of it
_CONTIGUOUS_LIMIT = 4096


def _contiguous_strides(shape: tuple) -> tuple:
    """The strides of a contiguous tensor of ``shape`` as torch lays it out (a dim of size 0 or
    1 steps by the product of the later dims' sizes, each counted as at least 1), remembered."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    contiguous = tuple(reversed(strides))
    if len(_CONTIGUOUS) >= _CONTIGUOUS_LIMIT:
        _CONTIGUOUS.clear()
    _CONTIGUOUS[shape] = contiguous
    return contiguous


class DeferredTensor(torch.Tensor):
    # (slots: one is made per recorded op, and a slot saves the instance dict a tensor would
    # otherwise allocate for these, ~0.17 us a tensor; other attributes still go to a dict)
    __slots__ = ("_meta", "_storage", "_recorder")
    _meta: TensorMeta
    _storage: StorageState
    _recorder: Any
    # whether torch's lazy conjugate or negative bit is set (our views set them, through
    # recorder._set_bits): the recorder's fast path reads this instead of asking torch twice
    _lazy_bits = False

    @staticmethod
    def __new__(cls, meta: TensorMeta, storage: StorageState, recorder: Any) -> "DeferredTensor":
        shape = meta.shape
        contiguous = _CONTIGUOUS.get(shape)
        if contiguous is None:
            contiguous = _contiguous_strides(shape)
        if meta.offset == 0 and meta.stride == contiguous:
            # (torch's defaults: each keyword argument parsed costs ~0.15 us, on every op)
            t = _make_wrapper(cls, shape, dtype=meta.dtype, device=meta.device)
        else:
            t = _make_wrapper(cls, shape, strides=meta.stride, storage_offset=meta.offset,
                              dtype=meta.dtype, device=meta.device)
        t._meta = meta
        t._storage = storage
        t._recorder = recorder
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from .recorder import dispatch_outside_context
        return dispatch_outside_context(func, args, kwargs or {})

    # -- materialization ---------------------------------------------------------------------
    def _materialize(self, reason: FlushReason = FlushReason.SYNC, exposes: bool = True) -> torch.Tensor:
        """The real data of this tensor (a view of its storage's buffer), computing it if needed.
        ``exposes``: the caller may keep the view (or a pointer to its memory), so the storage
        keeps that memory from now on (its later contents are copied into it); False for callers
        that only copy the data out."""
        storage = self._storage
        if storage.contents is not None:
            from .recorder import materialize_states
            materialize_states([storage], reason, self._recorder)
        if exposes:
            storage.owned = False
        m = self._meta
        buffer = storage.buffer
        if m.dtype != buffer.dtype:      # a real view of complex memory (view_as_real)
            buffer = torch.view_as_real(buffer).reshape(-1)
        data = torch.as_strided(buffer, m.shape, m.stride, m.offset)
        if self.is_conj():
            data = data._conj()           # (the lazy bits of a conjugate or negative view)
        if self.is_neg():
            data = data._neg_view()
        return data

    def _observe(self, reason: FlushReason, use, exposes: bool = True):
        """Materialize, then run ``use(data)`` with no dispatch mode active (torch calls made while
        reading the data, such as numpy()'s detach, must not be recorded).  ``exposes``: False
        where ``use`` only copies the data out."""
        from .recorder import no_dispatch
        with no_dispatch():
            return use(self._materialize(reason, exposes))

    # -- observation points ------------------------------------------------------------------
    def tolist(self):
        return self._observe(FlushReason.TOLIST, lambda d: d.tolist(), exposes=False)

    def numpy(self, *, force: bool = False):
        if self.requires_grad and not force:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. "
                               "Use tensor.detach().numpy() instead.")
        return self._observe(FlushReason.NUMPY, lambda d: d.detach().numpy(force=force))

    def __array__(self, dtype=None, copy=None):
        arr = self._observe(FlushReason.NUMPY, lambda d: d.detach().numpy())
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def data_ptr(self) -> int:
        return self._observe(FlushReason.DATA_PTR, lambda d: d.data_ptr())

    def untyped_storage(self):
        return self._observe(FlushReason.DATA_PTR, lambda d: d.untyped_storage())

    def __dlpack__(self, *args, **kwargs):
        # (torch's would export the wrapper, which has no memory: readers saw garbage)
        return self._observe(FlushReason.DATA_PTR, lambda d: d.__dlpack__(*args, **kwargs))

    def __repr__(self, *, tensor_contents: Optional[str] = None) -> str:
        text = self._observe(FlushReason.REPR, repr, exposes=False)
        if self.grad_fn is not None:
            text = text[:-1] + f", grad_fn=<{type(self.grad_fn).__name__}>)"
        elif self.requires_grad:
            text = text[:-1] + ", requires_grad=True)"
        if getattr(self, "_is_param", False):
            # nn.Parameter(deferred) is the deferred tensor marked as a parameter (torch's way
            # with tensor subclasses): it prints as a Parameter does
            text = "Parameter containing:\n" + text
        return text

    def _plain_copy(self) -> torch.Tensor:
        data = self._observe(FlushReason.SERIALIZE, lambda d: d.detach().clone(), exposes=False)
        return data.requires_grad_(self.requires_grad)

    def __reduce_ex__(self, protocol):
        return self._plain_copy().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        data = self._plain_copy()
        memo[id(self)] = data
        return data


def is_materialized(t: torch.Tensor) -> bool:
    """True for ordinary tensors and for deferred tensors whose data has been computed."""
    if isinstance(t, DeferredTensor):
        return t._storage.contents is None
    return True
