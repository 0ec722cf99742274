"""DeferredTensor: a torch.Tensor with metadata now and data later.

It is a wrapper subclass, so every path that touches data goes through us: aten ops reach
``__torch_dispatch__`` and Python-level data access (``tolist``, ``numpy``, ``repr``, ``data_ptr``,
pickling) is overridden here to materialize first.  The Python protocols torch answers in Python
(``format``, ``round``, ``deepcopy``, ``dir`` ...) run torch's own method on the computed data, so
that they answer as for a plain tensor (tests/test_protocols.py).  Once its context has ended, it
behaves as an ordinary tensor: ops on it run eagerly on its data (``dispatch_outside_context``).

Computing its data is the flush's job (capture/flush.py): this module imports it inside the
functions that need it, because the flush imports the debugging package, which imports this
module (the flush does not import this module: no circle).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Optional

import torch

from ..errors import FlushReason
from ..ir.graph import StorageState
from ..ir.meta import TensorMeta
from .classify import FRESH_RESULT_KINDS, op_info
from .dispatch_keys import no_dispatch
from .storage import show_to_numpy
from .trees import map_returned, map_tensors, tensors_in, written_arguments


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


class _Withheld:
    """A class attribute that reads as absent (``hasattr`` is False), hiding an inherited one."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: Optional[type] = None) -> Any:
        raise AttributeError(self.name)


class DeferredTensor(torch.Tensor):
    # (slots: one is made per recorded op, and a slot saves the instance dict a tensor would
    # otherwise allocate for these, ~0.17 us a tensor; other attributes still go to a dict)
    __slots__ = ("_meta", "_storage", "_recorder")
    _meta: TensorMeta
    _storage: StorageState
    _recorder: Any
    # whether torch's lazy conjugate or negative bit is set (our views set them, through
    # mutation.set_bits): the recorder's fast path reads this instead of asking torch twice
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
        return dispatch_outside_context(func, args, kwargs or {})

    # -- materialization ---------------------------------------------------------------------
    def _materialize(self, reason: FlushReason = FlushReason.SYNC, exposes: bool = True) -> torch.Tensor:
        """The real data of this tensor (a view of its storage's buffer), computing it if needed.
        ``exposes``: the caller may keep the view (or a pointer to its memory), so the storage
        keeps that memory from now on (its later contents are copied into it); False for callers
        that only copy the data out."""
        storage = self._storage
        if storage.contents is not None:
            from . import flush
            flush.materialize_states([storage], reason, self._recorder)
        if storage.poisoned is not None:
            from .flush import raise_poisoned
            raise_poisoned(storage)
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

    def __coerce_same_metadata_as_tangent__(self, expected_metadata: Any, expected_type: Any = None):
        """AOTAutograd's hook for a tangent whose type differs from the traced one: the backward of
        a graph compiled by ``torch.compile`` (traced with plain tensors) gets this tensor's data,
        computed now."""
        if expected_type is not None and expected_type is not torch.Tensor:
            return None
        with no_dispatch():
            return self._materialize(FlushReason.SYNC)

    def _observe(self, reason: FlushReason, use, exposes: bool = True):
        """Materialize, then run ``use(data)`` with no dispatch mode active (torch calls made while
        reading the data, such as numpy()'s detach, must not be recorded).  ``exposes``: False
        where ``use`` only copies the data out."""
        pending = self._storage.contents is not None
        with no_dispatch():
            result = use(self._materialize(reason, exposes))
        recorder = self._recorder
        if pending and recorder.active:
            from ..debugging.source import user_line   # (the debugging package imports us)
            if recorder.segments is not None:
                # (a read that computed its value ends a default defer mode's segment: printing
                # a loss, f"{loss:.4f}", as .item() does; exec/segments.Segments)
                recorder.segments.observed(recorder, user_line())
                recorder.mode.settle()   # (a segment at once runs with the mode off: SegmentedDeferMode)
            elif recorder.block is not None:
                recorder.read_ended(user_line())   # (a block around a loop: Recorder.read_ended)
        return result

    def _as_strict(self, reason: FlushReason, use, exposes: bool = True,
                   requires_grad: Optional[bool] = None):
        """Materialize, then run ``use(plain)`` on what strict PyTorch holds where we hold this
        tensor: a plain tensor over its memory, with its ``requires_grad`` (unless given) and its
        Python attributes, an ``nn.Parameter`` for a deferred parameter.  torch's own Python-level
        methods then answer as they answer in strict; on us they would take the path of an
        unknown subclass (``Tensor.__format__`` does not format its value, errors name
        DeferredTensor) and read a wrapper that has no memory of its own."""
        wants_grad = self.requires_grad if requires_grad is None else requires_grad

        def on_plain(data: torch.Tensor):
            plain = data.detach()
            if wants_grad:
                plain.requires_grad_()
            state = {k: v for k, v in self.__dict__.items() if k not in _OWN_ATTRIBUTES}
            if getattr(self, "_is_param", False):
                plain = torch.nn.Parameter(plain, wants_grad)
            plain.__dict__.update(state)
            return use(plain)
        return self._observe(reason, on_plain, exposes)

    # -- observation points ------------------------------------------------------------------
    def tolist(self):
        return self._observe(FlushReason.TOLIST, lambda d: d.tolist(), exposes=False)

    def numpy(self, *, force: bool = False):
        # (NumPy reads and writes that memory while the array lives: storage.show_to_numpy)
        return self._as_strict(FlushReason.NUMPY, lambda t: show_to_numpy(t, lambda: t.numpy(force=force)))

    def __array__(self, *args, **kwargs):
        # (torch's signature, whatever it is: numpy asks it for copy= and, refused, copies or
        # raises itself, as it does for a plain tensor)
        return self._as_strict(FlushReason.NUMPY,
                               lambda t: show_to_numpy(t, lambda: t.__array__(*args, **kwargs)))

    def as_subclass(self, cls):
        """A user's own subclass (``t.as_subclass(Tagged)``, and torch's ``__torch_function__``
        wrapping each result of a subclass's op): over the computed memory, as strict's is; the
        subclass's ops then read that memory as any plain tensor's."""
        if self.requires_grad and torch.is_grad_enabled():
            return _AsSubclass.apply(self, cls)   # (in the autograd graph, as strict's alias is)
        return self._observe(FlushReason.SYNC, lambda d: d.as_subclass(cls))

    def data_ptr(self) -> int:
        return self._observe(FlushReason.DATA_PTR, lambda d: d.data_ptr())

    def untyped_storage(self):
        return self._observe(FlushReason.DATA_PTR, lambda d: d.untyped_storage())

    def __dlpack__(self, *args, **kwargs):
        # (torch's would export the wrapper, which has no memory: readers saw garbage)
        return self._as_strict(FlushReason.DATA_PTR, lambda t: t.__dlpack__(*args, **kwargs))

    def __repr__(self, *, tensor_contents: Optional[str] = None) -> str:
        keywords = {} if tensor_contents is None else {"tensor_contents": tensor_contents}
        grad_fn = self.grad_fn
        if grad_fn is None:
            return self._as_strict(FlushReason.REPR, lambda t: t.__repr__(**keywords), exposes=False)
        text = self._as_strict(FlushReason.REPR, lambda t: t.__repr__(**keywords), exposes=False,
                               requires_grad=False)
        # strict's last suffix, placed (or wrapped onto a new line) as torch places it
        return torch._tensor_str._add_suffixes(text[:-1], [f"grad_fn=<{_grad_fn_name(grad_fn)}>"],
                                               len("tensor("), False)

    def __format__(self, format_spec: str) -> str:
        if self.dim() != 0 and not format_spec:
            return str(self)    # (object.__format__, torch's answer for these; it reads our repr)
        return self._as_strict(FlushReason.REPR, lambda t: t.__format__(format_spec), exposes=False)

    def __round__(self, *ndigits):
        # torch.Tensor has no __round__: round() raises, naming Tensor (not DeferredTensor)
        return self._as_strict(FlushReason.ITEM, lambda t: round(t, *ndigits), exposes=False)

    def __trunc__(self):
        # likewise math.trunc (math.floor and math.ceil go through __float__)
        return self._as_strict(FlushReason.ITEM, math.trunc, exposes=False)

    def __reduce_ex__(self, protocol):
        # (exposes: the reduction holds this memory; copy.copy shares it, as strict's does)
        return self._as_strict(FlushReason.SERIALIZE, lambda t: t.__reduce_ex__(protocol))

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]      # (torch calls a gradient's __deepcopy__ directly)
        if not self.is_leaf:
            return torch.Tensor.__deepcopy__(self, memo)    # raises torch's error, reading nothing
        grad = self.grad

        def deepcopy(plain: torch.Tensor) -> torch.Tensor:
            if grad is not None:
                plain.grad = grad          # (torch copies a leaf's gradient along with it)
            return copy.deepcopy(plain, memo)
        result = self._as_strict(FlushReason.SERIALIZE, deepcopy, exposes=False)
        memo[id(self)] = result
        return result

    def __dir__(self):
        return [name for name in torch.Tensor.__dir__(self) if name not in _OWN_NAMES]

    # C consumers of DLPack (tvm-ffi, ...) would read this wrapper's memory through torch's C
    # exchange table; without it they fall back to __dlpack__, which computes the data first
    # (the second name: the one tvm-ffi's add-on puts on torch.Tensor for older torch)
    __dlpack_c_exchange_api__ = _Withheld()
    __c_dlpack_exchange_api__ = _Withheld()


# Python attributes deferfuse keeps on an instance; _is_param is the type of the strict twin
class _AsSubclass(torch.autograd.Function):
    """``as_subclass`` of a deferred tensor that requires grad: the subclass over the computed
    memory, its gradient passed straight back."""

    @staticmethod
    def forward(ctx, x, cls):
        return x._observe(FlushReason.SYNC, lambda d: d.as_subclass(cls))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


_OWN_ATTRIBUTES = frozenset({"_is_param", "_lazy_bits"})
# names dir() lists for a DeferredTensor but not for a plain tensor
_OWN_NAMES = (frozenset(dir(DeferredTensor)) - frozenset(dir(torch.Tensor))) | _OWN_ATTRIBUTES


def _grad_fn_name(grad_fn) -> str:
    """The name strict's repr gives a tensor's grad_fn (as torch/_tensor_str.py names it)."""
    name = type(grad_fn).__name__
    return grad_fn.name().rsplit("::", 1)[-1] if name == "CppFunction" else name


def is_materialized(t: torch.Tensor) -> bool:
    """True for ordinary tensors and for deferred tensors whose data has been computed."""
    if isinstance(t, DeferredTensor):
        return t._storage.contents is None
    return True


def pending_node_id(t: torch.Tensor) -> Optional[int]:
    """The id of the recorded node whose result a pending deferred tensor's storage will hold
    (None for a computed or plain tensor): engine.watching's callback sees that node run."""
    if not isinstance(t, DeferredTensor) or t._storage.contents is None:
        return None
    return t._storage.contents[1].node.id


def computed_data(t: torch.Tensor) -> torch.Tensor:
    """The data of a computed tensor: a plain tensor itself; a computed deferred tensor's view of
    its storage's memory (nothing is flushed: ``is_materialized(t)`` must hold)."""
    if not isinstance(t, DeferredTensor):
        return t
    if t._storage.contents is not None:
        raise ValueError("computed_data() of a deferred tensor whose data is pending")
    with no_dispatch():
        return t._materialize(exposes=False)


def follow_layout(t: DeferredTensor, real: torch.Tensor) -> None:
    """A deferred tensor takes the shape, strides and offset that an eager op gave the real view
    of its memory it ran on (an in-place view op, ``t_`` or ``unsqueeze_``, outside a context or
    in a segment run at once; a kernel resizing an out= tensor within its storage)."""
    m = t._meta
    layout = (tuple(real.shape), tuple(real.stride()), real.storage_offset())
    if layout == (m.shape, m.stride, m.offset):
        return
    with torch._C._DisableTorchDispatch():
        torch.ops.aten.as_strided_.default(t, *layout)
    t._meta = m._replace(shape=layout[0], stride=layout[1], offset=layout[2])


def cannot_grow(func, what: str) -> NotImplementedError:
    """The error for an op that would grow a deferred tensor's storage (an out= tensor too small
    for its result): ``what`` says which tensor."""
    return NotImplementedError(
        f"{func} would grow {what}, whose storage is deferfuse's and cannot grow; pass an out= "
        f"tensor of the result's shape, or call deferfuse.sync() first, or run this code under "
        f"deferfuse.strict()")


def dispatch_outside_context(func, args, kwargs) -> Any:
    """An op on DeferredTensors with no defer context active: run it eagerly on their data."""
    from . import flush
    info = op_info(func)
    tensors = tensors_in(args, kwargs)
    for t in tensors:
        if isinstance(t, DeferredTensor) and t._storage.contents is not None:
            flush.materialize_states([t._storage], FlushReason.ESCAPE, t._recorder if t._recorder.active else None)
    exposes = info.kind not in FRESH_RESULT_KINDS

    def real(t):
        return t._materialize(exposes=exposes) if isinstance(t, DeferredTensor) else t
    real_args, real_kwargs = map_tensors(args, real), map_tensors(kwargs, real)
    out = func(*real_args, **real_kwargs)
    if info.written:
        written = written_arguments(func, info, args, kwargs)
        real_written = written_arguments(func, info, real_args, real_kwargs)
        for t, r in zip(written, real_written):
            if isinstance(t, DeferredTensor):
                t._storage.changed()
                if isinstance(r, torch.Tensor):
                    follow_layout(t, r)
        return map_returned(out, real_written, written)
    return out
