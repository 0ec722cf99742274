"""The interceptor: records aten ops into the pending graph and flushes it when observed.

``DeferMode`` is the TorchDispatchMode; ``Recorder`` holds the state of one defer context (the
storages it touched, what is pending) and does the work.  Each op is classified from its schema
(``classify.op_info``) and handled by kind:

  PURE       metadata from the meta cache; a node is recorded, DeferredTensors returned
  VIEW       no node: the output shares the input's storage and reads it lazily
  MUTATING   the functional variant is recorded, then written into the target's storage
  RANDOM     drawn eagerly from torch's generator (same stream as strict), fed in as a graph input
  DYNAMIC    its inputs are flushed and it runs eagerly (the output shape depends on data)
  OBSERVING  likewise; it returns Python values
Ops with no lowering use a torch._decomp decomposition when one exists, and otherwise run
eagerly after flushing their inputs (counted in stats().fallbacks).  So do ops whose metadata
meta tensors cannot give (no meta kernel, a meta kernel that rejects what the CPU kernel runs,
a data-dependent output shape).

Two kinds of memory need more than the storage model:

  opaque     a tensor that is not dense and strided (sparse, nested, quantized, mkldnn) or a
             subclass with its own __torch_dispatch__ has no storage to model: an op with one
             among its arguments or results runs at once on torch's kernel (``_opaque``), after
             everything pending is flushed (its memory may be any storage's: a sparse tensor's
             values, a subclass's inner tensors)
  foreign    memory torch does not own (``from_numpy``, ``frombuffer``, DLPack imports, shared
             memory) may be written by code we never see, between two ops: each recorded read
             of it copies what it reads then, and is never cached (``_foreign``).  Writes into
             it are pending values of the graph, as for any storage, and land at the flush.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import sys
import threading
import weakref
from typing import Any, NamedTuple, Optional

import torch
from torch._prims_common.wrappers import _maybe_resize_out
from torch.utils._python_dispatch import TorchDispatchMode

from .. import config
from ..errors import FallbackReason, FlushReason
from ..exec import runtime
from ..debugging.source import forget_frames, user_line, user_line_from, user_source
from ..ir import graph
from ..ir.graph import Node, StorageState, Value
from ..ir.meta import TensorMeta
from ..lower.registry import RuntimeScalar
from ..lower.table import get_lowering
from ..stats import STATS
from . import meta as meta_
from .classify import OpKind, factory_options, functional_variant, op_info
from .sized import SIZED, STATIC
from .tensor import DeferredTensor
from .unroll import DECOMPOSITIONS, unroll_foreach

aten = torch.ops.aten
_LOCAL_SCALAR_DENSE = aten._local_scalar_dense.default
# (torch's own method: our code's reads of storages skip the wrapper of _READ_PATCHES)
_untyped_storage = torch._C.TensorBase.untyped_storage

# Storages with real memory, by data pointer, so every tensor over the same memory (a user
# tensor, its views, a materialized deferred tensor) shares one StorageState.
_STATES_BY_PTR: "weakref.WeakValueDictionary[int, StorageState]" = weakref.WeakValueDictionary()

_epochs = itertools.count()
_PYTHON_KEY = torch._C.DispatchKey.Python

@contextlib.contextmanager
def no_dispatch():
    """Run torch ops on real tensors with no dispatch or function mode intercepting them (our own
    machinery must not be recorded, nor trigger the plain-read write-backs).

    torch's C++ guard excludes its Python dispatch keys on this thread: the modes stay on the
    stack but are not called (``_recorder_on_stack`` sees the exclusion).  Popping the modes
    and pushing them back (``_disable_current_modes``) gives the same and costs ~8 us, once per
    flush."""
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        yield


# The flat buffer over a user tensor's storage, by id of the tensor that owns the view (the
# tensor itself, or its base): (weak reference to it, data pointer, numel, dtype, buffer).  A
# user storage gets a new StorageState in each defer context, but the same buffer object, so
# the DLPack view of it made for one flush (interop's cache, keyed by the tensor) serves the
# next ones: an optimizer's parameters are read by every step.  The buffer is a detached view,
# which does not keep the owner alive; the entry goes when the owner does.
_BUFFERS: dict[int, tuple] = {}

# id(plain tensor) -> (weak ref, StorageState, TensorMeta, data pointer, storage bytes): what
# Recorder._real worked out for a plain tensor, kept across blocks (an optimizer step touches
# the same 200 tensors in every block, ~15 us each to work out afresh) while the tensor lives.
# Checked on every use against the tensor's memory and layout, which code we do not see can
# change; changes we do see clear it (Recorder._forget_plain).  A block's exit drops what its
# states cached from the graph (_drop_reads), so an entry keeps no computed values alive.
_PLAIN: dict[int, tuple] = {}
_PLAIN_CACHE_SIZE = 4096   # plain tensors remembered before starting over
_AT_ONCE_LIMIT = 4096   # results of ops run at once that a context watches for consumers


def _forget_dead_plain(key: int, dead: Any) -> None:
    entry = _PLAIN.get(key)
    if entry is not None and entry[0] is dead:
        del _PLAIN[key]


def drop_reads(states: Any) -> None:
    """At a block's exit: what its storages cached from its graph (reads, graph inputs) goes,
    so that storages remembered across blocks (_PLAIN) keep no computed values alive; the next
    block reads their memory afresh anyway.  Graph inputs still alive (another thread's
    pending nodes may read them) stay listed for a write to snapshot."""
    for s in states:
        if s.contents is None:
            s.reads = {}
            s.leaf = None
            if s.old_leaves:
                s.old_leaves = [ref for ref in s.old_leaves if ref() is not None]


def _flat_buffer(t: torch.Tensor, ptr: int, numel: int) -> torch.Tensor:
    owner = t._base if t._base is not None else t
    key = id(owner)
    hit = _BUFFERS.get(key)
    if hit is not None and hit[0]() is owner and hit[1] == ptr and hit[2] == numel and hit[3] is t.dtype \
            and hit[4].device == t.device:
        return hit[4]
    buffer = t.detach().as_strided((numel,), (1,), 0)   # (detached: no autograd record)
    if ptr:
        _BUFFERS[key] = (weakref.ref(owner, lambda _ref: _BUFFERS.pop(key, None)), ptr, numel, t.dtype, buffer)
    return buffer


def _flat_meta(state: StorageState) -> TensorMeta:
    return TensorMeta((state.numel,), (1,), 0, state.dtype, state.device, state.numel)


# Views that set a lazy bit (x.conj() of a complex tensor, the negation view autograd makes):
# torch's schemas and tags do not mark them.
_LAZY_BIT_VIEWS = frozenset({aten._conj.default, aten._neg_view.default})
_LAZY_BIT_VIEW_IDS = frozenset(id(op) for op in _LAZY_BIT_VIEWS)

# Per op, what dispatch needs on every call: (OpInfo, our special form or None, the op's name
# for cache keys).  Keyed by id: OpOverloads are immortal singletons whose __hash__ is Python.
_FACTS: dict[int, tuple] = {}


def _facts(func: torch._ops.OpOverload) -> tuple:
    facts = _FACTS[id(func)] = (op_info(func), _special_form(func), str(func))
    return facts


# id(op) -> whether its calls are keyed by grad mode too (Lowering.grad_mode_keyed), asked only
# for calls that are recorded: the lowering table is not loaded for ops run at first sight
_GRAD_KEYED: dict[int, bool] = {}


def _grad_mode_keyed(func: torch._ops.OpOverload) -> bool:
    keyed = _GRAD_KEYED.get(id(func))
    if keyed is None:
        lowered = get_lowering(func)
        keyed = _GRAD_KEYED[id(func)] = lowered is not None and lowered.grad_mode_keyed
    return keyed


class _FastForm(NamedTuple):
    """What Recorder.record_fast needs of an op: its name for cache keys, per positional
    argument whether a float there is a runtime scalar, the names of its scalar arguments, and
    for an in-place op its functional twin (op, name, which inputs must not partially overlap
    the target: ``_overlap_rule``)."""
    name: str
    scalar_at: tuple
    scalar_names: frozenset
    functional: Any = None
    functional_name: str = ""
    overlap: Optional[str] = None
    view: bool = False


# Per op, its fast path's form, or None where it has none: a pure op with one tensor result
# that neither decomposes itself nor has a special form of ours, an in-place op whose
# functional twin is such an op and takes the same arguments (``_inplace_twin``), or a view op
# with one result (not the lazy conjugate and negative views).
_FAST: dict[int, Optional[_FastForm]] = {}
_UNSEEN = object()


def _fast_form(func: torch._ops.OpOverload) -> Optional[_FastForm]:
    info, special, name = _FACTS.get(id(func)) or _facts(func)
    form = None
    if not info.composite_implicit and special is None:
        scalar_at = tuple(n in info.scalar_args for n in info.arg_names)
        if info.kind is OpKind.PURE and info.returns == "one":
            form = _FastForm(name, scalar_at, info.scalar_args)
        elif info.kind is OpKind.VIEW and info.returns == "one" and id(func) not in _LAZY_BIT_VIEW_IDS:
            form = _FastForm(name, scalar_at, info.scalar_args, view=True)
        elif info.kind is OpKind.MUTATING:
            twin = _INPLACE_TWINS.get(id(func), _UNKNOWN)
            if twin is _UNKNOWN:
                twin = _inplace_twin(func, info)
            if twin is not None:
                functional, _, functional_name, name, overlap = twin
                form = _FastForm(name, scalar_at, info.scalar_args, functional, functional_name, overlap)
    _FAST[id(func)] = form
    return form


def _special_form(op: torch._ops.OpOverload):
    """Our own decomposition of ``op`` (capture/unroll.py), or None."""
    if op in DECOMPOSITIONS:
        return DECOMPOSITIONS[op]
    if op._schema.name.startswith("aten::_foreach_"):
        return lambda *args, **kwargs: unroll_foreach(op, args, kwargs)
    return None


def _decomposition(op: torch._ops.OpOverload):
    from torch._decomp import decomposition_table
    return decomposition_table.get(op)


class Recorder:
    """The state of one defer context."""

    def __init__(self) -> None:
        self.mode: Optional[DeferMode] = None
        # weak references to storages written since the last flush_all (a list, not a WeakSet:
        # one append per op is the hot path; duplicates and dead ones are dropped at flush)
        self.pending: list = []
        self.real_states: set[StorageState] = set()   # user storages touched (kept until exit)
        self.pending_nodes = 0
        self.record_source = config.get("record_source")
        self.max_pending = config.get("max_pending_nodes")
        self.eager_unseen = (config.get("eager_unseen_ops") and not config.get("always_compile")
                             and config.get("eager_first_runs") > 0)
        self.eager_lone = (config.get("eager_lone_ops") and config.get("lone_op_on_torch")
                           and not config.get("always_compile"))
        self.host_scalars = config.get("host_scalars_at_once") and not config.get("always_compile")
        # id(plain tensor) -> (weak ref, entry, site) of results of ops run at once where their
        # flushes were lone: one of them feeding a recorded op means that place fuses again
        self.at_once: dict[int, tuple] = {}
        self.active = True
        self.epoch = next(_epochs)
        self.sizing: set = set()      # data-dependent ops whose size rule is running
        self.guarding_reads = False   # this block holds _READ_PATCHES (it wrote a plain tensor)

    # -- graph building ------------------------------------------------------------------------
    def _node(self, op: Any, args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...], key: Any,
              lowering: Any = None, inputs: Optional[tuple] = None, scalars: tuple = ()) -> tuple[Value, ...]:
        """A new pending node; returns its output Values."""
        self.pending_nodes += 1
        source = user_line() if self.record_source else None
        return graph.emit(op, args, kwargs, outs, key, source, lowering, inputs, scalars)

    def _fast_node(self, op: Any, args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...], key: Any,
                   entry: Any, inputs: tuple, scalars: tuple) -> Value:
        """``_node`` for ``record_fast``, whose caller is ``_defer_dispatch``, called by torch:
        the user's frame (or torch's Python wrapper) is the one above those two, so the walk
        for the source line starts there."""
        self.pending_nodes += 1
        source = user_line_from(sys._getframe(3)) if self.record_source else None
        # (graph.emit for the one output the fast path's ops have, one call shorter)
        node = graph.Node(op, args, kwargs, outs, key, source, entry, inputs, scalars)
        value = graph.Value(node, 0, outs[0])
        node.out_refs = (weakref.ref(value),)
        return value

    def _real(self, t: torch.Tensor) -> tuple[StorageState, TensorMeta]:
        """The state and metadata of a plain tensor, remembered for this context by the tensor
        (weakly): an optimizer step reads and writes each parameter several times.  Checked on
        every use against the tensor's memory and layout, which code we do not see can change
        (``p.data = q``); changes we do see clear the memory of them (``_forget_plain``)."""
        if self.at_once:
            self._unmark_lone(t)
        key = id(t)
        cached = _PLAIN.get(key)
        if cached is not None and cached[0]() is t:
            m = cached[2]
            storage = _untyped_storage(t)
            if storage.data_ptr() == cached[3] and storage.nbytes() == cached[4] and t.shape == m.shape \
                    and t.stride() == m.stride and t.storage_offset() == m.offset:
                return cached[1], m
        state, m = self.state_of_real(t), TensorMeta.of(t)
        if len(_PLAIN) >= _PLAIN_CACHE_SIZE:
            _PLAIN.clear()
        storage = _untyped_storage(t)
        ref = weakref.ref(t, lambda dead, key=key: _forget_dead_plain(key, dead))
        _PLAIN[key] = (ref, state, m, storage.data_ptr(), storage.nbytes())
        return state, m

    def _forget_plain(self) -> None:
        """Plain tensors' metadata or storages may have changed (an in-place view op, a resize,
        an op run eagerly): look them up again."""
        _PLAIN.clear()

    def _unmark_lone(self, t: torch.Tensor) -> None:
        """``t``, a result of an op run at once because its flushes were lone, feeds a recorded
        op (or a view that may): at that place the op may fuse again, so record it there next
        time."""
        ran = self.at_once.pop(id(t), None)
        if ran is not None and ran[0]() is t:
            meta_.unmark_lone(ran[1], ran[2])

    def state_of_real(self, t: torch.Tensor) -> StorageState:
        if _opaque(t):
            raise _NoStorage(t.layout)
        storage = _untyped_storage(t)
        ptr = storage.data_ptr()
        state = _STATES_BY_PTR.get(ptr) if ptr else None
        if state is not None and _raw_data_ptr(state.buffer) != ptr:
            # its storage's memory moved (share_memory_ swaps it) and this address is another's
            del _STATES_BY_PTR[ptr]
            state = None
        if state is None or state.dtype != t.dtype or state.numel * t.element_size() != storage.nbytes():
            if state is not None:
                # The same memory seen as another dtype (complex's decomposition writes through
                # view_as_real of its result) or resized: the storage model has one dtype and
                # size per storage, so what is pending is written back first and the old state's
                # cached reads are dropped; the new state reads the memory as it then is.
                self.flush_all(FlushReason.FALLBACK)
                state.changed()
                self._forget_plain()
            numel = storage.nbytes() // t.element_size()
            state = StorageState(numel, t.dtype, t.device, buffer=_flat_buffer(t, ptr, numel),
                                 foreign=_foreign(storage))
            if ptr:
                _STATES_BY_PTR[ptr] = state
        self.real_states.add(state)
        return state

    def flat(self, state: StorageState) -> Value:
        contents = state.contents
        if contents is None:
            if state.foreign:
                # (a copy of what the memory holds now: the rest of a storage partly written,
                # or what an expanded view reads)
                with no_dispatch():
                    return graph.leaf(state.buffer.clone())
            if state.leaf is None:
                state.leaf = graph.leaf(state.buffer)
                state.old_leaves.append(weakref.ref(state.leaf))
            return state.leaf
        if contents[0] == "flat":
            return contents[1]
        self.pending_nodes += 1
        return _flatten_detached(state)

    def _enter_epoch(self, state: StorageState) -> None:
        # Between two defer contexts the memory behind a storage may have been written by plain
        # torch code we never saw: what an earlier context read from it is stale.
        if state.contents is None:
            state.reads = {}
            state.leaf = None
        state.epoch = self.epoch
        self.real_states.add(state)   # (its cached reads are dropped at the block's exit)

    def read(self, t: torch.Tensor) -> tuple[Value, TensorMeta]:
        if isinstance(t, DeferredTensor):
            state, m = t._storage, t._meta
        else:
            if t.is_conj() or t.is_neg():
                # a lazy conjugate/negative view: its values are not its memory's
                t = self._resolved(t)
                state, m = self.state_of_real(t), TensorMeta.of(t)
            else:
                state, m = self._real(t)
        if state.epoch != self.epoch:
            self._enter_epoch(state)
        value = state.reads.get(m)
        if value is None and state.foreign and state.contents is None:
            value = self._foreign_read(state, m)
        elif value is None:
            flat = self.flat(state)
            if m.dtype != state.dtype:
                # a real view of complex memory (view_as_real): the memory as the real dtype
                real = TensorMeta((2 * state.numel,), (1,), 0, m.dtype, state.device, 2 * state.numel)
                flat = self._node(graph.AS_REAL, (flat,), {}, (real,), (graph.AS_REAL,), inputs=(flat,))[0]
            value = self._node(graph.READ_VIEW, (flat, m), {}, (m,), (graph.READ_VIEW, m), inputs=(flat,))[0]
            state.reads[m] = value
        if isinstance(t, DeferredTensor) and (t.is_conj() or t.is_neg()):
            # a lazy conjugate or negative view of pending memory
            bits = (t.is_conj(), t.is_neg())
            value = self._node(graph.BITS, (value, *bits), {}, (m,), (graph.BITS, *bits), inputs=(value,))[0]
        return value, m

    def _foreign_read(self, state: StorageState, m: TensorMeta) -> Value:
        """What ``m`` reads of foreign memory, copied now (code we do not see may write it before
        the flush) and not cached: the next op copies it again.  The copy is of what ``m`` reads,
        not of the whole storage (a batch sliced out of a dataset's array)."""
        if m.dtype == state.dtype and m.numel <= state.numel:
            with no_dispatch():
                copy = state.buffer.as_strided(m.shape, m.stride, m.offset).clone(
                    memory_format=torch.contiguous_format)
            return graph.leaf(copy)
        # (an expanded view, or a real view of complex memory: the whole storage, read as usual)
        flat = self.flat(state)
        if m.dtype != state.dtype:
            real = TensorMeta((2 * state.numel,), (1,), 0, m.dtype, state.device, 2 * state.numel)
            flat = self._node(graph.AS_REAL, (flat,), {}, (real,), (graph.AS_REAL,), inputs=(flat,))[0]
        return self._node(graph.READ_VIEW, (flat, m), {}, (m,), (graph.READ_VIEW, m), inputs=(flat,))[0]

    def _resolved(self, t: torch.Tensor) -> torch.Tensor:
        (real,) = self.realize((t,), FlushReason.FALLBACK)
        with no_dispatch():
            return real.resolve_conj().resolve_neg()

    def write(self, target: torch.Tensor, value: Value, meta: Optional[TensorMeta] = None) -> None:
        """Record that ``target`` now holds ``value`` (``meta``: the target's, if known)."""
        if isinstance(target, DeferredTensor):
            state, m = target._storage, target._meta
        else:
            state, known = self._real(target)
            m = meta or known
            if not self.guarding_reads:
                # a plain tensor's contents become pending: Python-level reads must see them
                self.guarding_reads = True
                _READ_PATCHES.hold()
        if state.epoch != self.epoch:
            self._enter_epoch(state)
        if value.meta.dtype != m.dtype:
            cast_meta = value.meta._replace(dtype=m.dtype)
            value = self._node(graph.CAST, (value, m.dtype), {}, (cast_meta,), (graph.CAST, m.dtype), inputs=(value,))[0]
        if m.covers_storage:
            state.contents = ("root", value, m)
        else:
            flat = self.flat(state)
            (new,) = self._node(graph.WRITE_VIEW, (flat, value, m), {}, (_flat_meta(state),), (graph.WRITE_VIEW, m),
                                  inputs=(flat, value))
            state.contents = ("flat", new)
        state.changed()
        state.reads[m] = value
        self.pending.append(weakref.ref(state))

    def _fresh_outputs(self, entry, outputs: tuple[Value, ...]) -> list:
        """DeferredTensors for a node's outputs, with None where the op returned None."""
        values = iter(outputs)
        return [None if m is None else self.fresh(m, next(values)) for m in entry.outs]

    def fresh(self, m: TensorMeta, value: Value) -> DeferredTensor:
        state = StorageState(m.storage_numel, m.dtype, m.device, None, ("root", value, m))
        state.epoch = self.epoch
        state.reads[m] = value
        self.pending.append(weakref.ref(state))
        return DeferredTensor(m, state, self)

    # -- argument conversion -------------------------------------------------------------------
    def convert(self, op_scalar_args: frozenset, names: tuple, args: tuple, kwargs: dict):
        """(node args, node kwargs, meta args, meta kwargs, key parts, input values, runtime
        scalars) of a call."""
        vargs, margs, kargs = [], [], []
        found: list = []
        scalars: list = []
        for i, a in enumerate(args):
            name = names[i] if i < len(names) else None
            v, m, k = self._convert_one(a, name in op_scalar_args, found, scalars)
            vargs.append(v); margs.append(m); kargs.append(k)
        vkw, mkw, kkw = {}, {}, []
        for name, a in kwargs.items():
            v, m, k = self._convert_one(a, name in op_scalar_args, found, scalars)
            vkw[name] = v; mkw[name] = m; kkw.append((name, k))
        return tuple(vargs), vkw, tuple(margs), mkw, (tuple(kargs), tuple(kkw)), tuple(found), tuple(scalars)

    def _convert_one(self, a: Any, is_scalar_arg: bool, found: list, scalars: list):
        if isinstance(a, torch.Tensor):
            v, m = self.read(a)
            found.append(v)
            return v, m, m
        if isinstance(a, (list, tuple)):
            parts = [self._convert_one(x, is_scalar_arg, found, scalars) for x in a]
            return (type(a)(p[0] for p in parts), type(a)(p[1] for p in parts), tuple(p[2] for p in parts))
        k = _static_key(a, is_scalar_arg)
        if k is float:
            r = _runtime_scalar(a)
            scalars.append(a)
            return r, r, float
        return a, a, k

    # -- dispatch ------------------------------------------------------------------------------
    def _convert_fast(self, form: "_FastForm", args: tuple, kwargs: dict) -> Optional[tuple]:
        """``convert`` without the meta arguments (needed only when metadata is not cached):
        (node args, node kwargs, key, input values, runtime scalars), or None where an
        argument has no storage to model."""
        scalar_at = form.scalar_at
        n_named = len(scalar_at)
        vargs: list = []
        kparts: list = []
        found: list = []
        scalars: list = []
        epoch = self.epoch
        try:
            for i, a in enumerate(args):
                if type(a) is DeferredTensor:
                    m = a._meta
                    state = a._storage
                    v = state.reads.get(m) if state.epoch == epoch else None
                    if v is None or a._lazy_bits:
                        v, m = self.read(a)
                    vargs.append(v)
                    kparts.append(m)
                    found.append(v)
                elif type(a) is float and i < n_named and scalar_at[i]:
                    vargs.append(_SCALARS.get(a) or _runtime_scalar(a))
                    kparts.append(float)
                    scalars.append(a)
                elif type(a) is int:
                    # (dims and sizes: static, their own key; what _convert_one gives them)
                    vargs.append(a)
                    kparts.append(a)
                elif type(a) is list and _ints_only(a):
                    vargs.append(list(a))
                    kparts.append(tuple(a))
                else:
                    v, _, k = self._convert_one(a, i < n_named and scalar_at[i], found, scalars)
                    vargs.append(v)
                    kparts.append(k)
            vkw: dict = {}
            kkw: list = []
            for name, a in kwargs.items():
                v, _, k = self._convert_one(a, name in form.scalar_names, found, scalars)
                vkw[name] = v
                kkw.append((name, k))
        except _NoStorage:
            return None
        return tuple(vargs), vkw, (tuple(kparts), tuple(kkw)), tuple(found), tuple(scalars)

    def record_fast(self, func: torch._ops.OpOverload, form: "_FastForm", args: tuple, kwargs: dict) -> Any:
        """The commonest calls, in few frames: a pure op with one result, or an in-place op
        recorded as its functional twin, whose metadata is cached.  The same nodes, keys and
        results as the general path (``record``, ``_record_inplace``, ``record_view``), which
        this must stay equal to.  NotImplemented where the general path must run; nothing has
        been recorded then but cached reads of the arguments, which it reuses."""
        if form.view:
            return self._view_fast(func, form, args, kwargs)
        converted = self._convert_fast(form, args, kwargs)
        if converted is None:
            return NotImplemented
        vargs, vkw, key, found, scalars = converted
        if form.functional is None:
            key = (form.name, key)
            entry = meta_.cached(key)
            if entry is None or entry.lowering is None or entry.outs[0] is None:
                return NotImplemented
            STATS.ops_recorded += 1
            value = self._fast_node(func, vargs, vkw, entry.tensor_outs, key, entry, found, scalars)
            result = self.fresh(entry.outs[0], value)
        else:
            target = args[0] if args else None
            if type(target) is DeferredTensor:
                if target._meta.dtype != target._storage.dtype:
                    return NotImplemented
            elif not isinstance(target, torch.Tensor):
                return NotImplemented
            if target.is_conj() or target.is_neg():
                return NotImplemented
            # (a cached entry for the in-place call itself: torch's checks of it passed)
            if meta_.cached((form.name, key)) is None:
                return NotImplemented
            target_meta = key[0][0]
            key = (form.functional_name, key)
            entry = meta_.cached(key)
            if entry is None or entry.lowering is None or len(entry.tensor_outs) != 1:
                return NotImplemented
            out = entry.tensor_outs[0]
            if form.overlap is not None and _may_share_memory(target, args, kwargs):
                _check_no_partial_overlap([target], args, kwargs, form.overlap)
            _check_inplace_result(target, out.shape, out.dtype)
            STATS.ops_recorded += 1
            value = self._fast_node(form.functional, vargs, vkw, entry.tensor_outs, key, entry, found, scalars)
            self.write(target, value, target_meta)
            result = target
        if self.pending_nodes > self.max_pending:
            self.flush_all(FlushReason.NODE_LIMIT)
        return result

    def _view_fast(self, func, form: "_FastForm", args: tuple, kwargs: dict) -> Any:
        """``record_view`` for a view of a deferred tensor (no lazy bits) whose metadata is
        cached: a deferred tensor on the same storage with the view's metadata, no node; and
        for a view of a user tensor with no other tensor argument: the real view."""
        base = args[0] if args else None
        if type(base) is not DeferredTensor:
            if not isinstance(base, torch.Tensor) or isinstance(base, DeferredTensor) or kwargs:
                return NotImplemented
            for a in args[1:]:
                if isinstance(a, torch.Tensor) or type(a) in (list, tuple) and not _ints_only(a):
                    return NotImplemented
            # a view of a user tensor: a real view of its memory, made at once (record_view)
            if self.at_once:
                self._unmark_lone(base)
            STATS.ops_recorded += 1
            return func(*args)
        if base._lazy_bits:
            return NotImplemented
        converted = self._convert_fast(form, args, kwargs)
        if converted is None:
            return NotImplemented
        entry = meta_.cached((form.name, converted[2]))
        if entry is None:
            return NotImplemented
        out = entry.outs[0]
        state = base._storage
        if out is None or out.dtype != state.dtype:
            return NotImplemented
        STATS.ops_recorded += 1
        return DeferredTensor(out, state, self)

    def dispatch(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        STATS.ops_recorded += 1
        facts = _FACTS.get(id(func))
        if facts is None:
            facts = _facts(func)
        info, special, _ = facts
        if (info.composite_implicit or special is not None or info.kind in _ACTS_BEFORE_CONVERTING) \
                and _opaque_in(args, kwargs):
            # (other kinds find an opaque argument when they convert it, before doing anything)
            result = self.run_eager(func, info, args, kwargs, FlushReason.FALLBACK, FallbackReason.SPARSE)
            if self.pending_nodes > self.max_pending:
                self.flush_all(FlushReason.NODE_LIMIT)
            return result
        if info.composite_implicit:
            # Reaches us only from inside a decomposition (autograd handles it above us
            # otherwise).  Its own decomposition says what it really is: reshape is a view or
            # a copy depending on strides, which its schema cannot say.
            with self.mode.recording():
                result = func.decompose(*args, **kwargs)
            if result is not NotImplemented:
                STATS.ops_recorded -= 1
                return result
        if special is not None:
            # a foreach op or a fused optimizer step: recorded as the ops it is made of
            with self.mode.recording(), torch._C._AutoDispatchBelowAutograd():
                result = special(*args, **kwargs)
            if result is not NotImplemented:
                STATS.ops_recorded -= 1
                return result
        try:
            result = self.dispatch_kind(func, info, args, kwargs)
        except meta_.NoMeta:
            # raised by this op's own metadata inference, before anything was recorded for it
            # (ops it re-dispatches catch their own)
            if info.dynamic:
                result = self.run_eager(func, info, args, kwargs, FlushReason.DATA_DEPENDENT, FallbackReason.DATA_DEPENDENT)
            else:
                result = self.run_eager(func, info, args, kwargs, FlushReason.FALLBACK, FallbackReason.NO_META)
        except _NoStorage:
            # an opaque argument (of a view, or found by the fast path) or result (a sparse
            # gradient from dense inputs): the storage model has nothing to say
            result = self.run_eager(func, info, args, kwargs, FlushReason.FALLBACK, FallbackReason.SPARSE)
        if self.pending_nodes > self.max_pending:
            self.flush_all(FlushReason.NODE_LIMIT)
        return result

    def dispatch_kind(self, func, info, args, kwargs) -> Any:
        kind = info.kind
        if kind is OpKind.PURE:
            return self.record(func, info, args, kwargs)
        if kind is OpKind.VIEW:
            return self.record_view(func, info, args, kwargs)
        if kind is OpKind.MUTATING:
            return self.record_mutation(func, info, args, kwargs)
        if kind is OpKind.RANDOM:
            return self.run_random(func, info, args, kwargs)
        if kind is OpKind.DYNAMIC:
            return self.record_dynamic(func, info, args, kwargs)
        if kind is OpKind.OBSERVING:
            return self.run_observing(func, info, args, kwargs)
        if kind is OpKind.ALLOCATION:
            return self.run_allocation(func, info, args, kwargs)
        return self.run_inplace_view(func, info, args, kwargs)

    def _entry(self, func, info, args, kwargs, at_once_if_unseen: bool = False):
        """(node args, node kwargs, meta entry, key, input values, runtime scalars) of a call;
        None when ``at_once_if_unseen`` and this call is seen for the first time (the caller
        runs it eagerly, with no entry inferred)."""
        vargs, vkw, margs, mkw, key, inputs, scalars = self.convert(info.scalar_args, info.arg_names, args, kwargs)
        # (keyed by the op's name: hashing the OpOverload itself runs Python)
        facts = _FACTS.get(id(func)) or _facts(func)
        key = (facts[2], key)
        if at_once_if_unseen and meta_.first_sighting(key, user_line()):
            return None
        if _grad_mode_keyed(func):
            key = (key, torch.is_grad_enabled())
        try:
            entry = meta_.infer(func, key, margs, mkw)
        except NotImplementedError as error:
            # a result with no storage from dense arguments (embedding's sparse gradient):
            # what torch says when our metadata asks for its storage
            if _NO_STORAGE_MESSAGE in str(error):
                raise _NoStorage(func) from error
            raise
        if entry.lowering is None and (any(m.dtype in _QUANTIZED_DTYPES for m in entry.tensor_outs)
                                       or any(a in _QUANTIZED_DTYPES for a in itertools.chain(args, kwargs.values())
                                              if isinstance(a, torch.dtype))):
            # a quantized result (quantize_per_tensor's meta kernel gives a float one: the
            # quantized dtype it is asked for says it)
            raise _NoStorage(func)
        return vargs, vkw, entry, key, inputs, scalars

    def record(self, func, info, args, kwargs) -> Any:
        found = self._entry(func, info, args, kwargs, self.eager_unseen and _computed(args, kwargs))
        if found is None:
            # seen for the first time with its inputs computed: run it as strict does
            # (eager_unseen_ops), with no meta inference
            STATS.unseen_ops_run += 1
            return self.run_eager(func, info, args, kwargs, None, None)
        vargs, vkw, entry, key, inputs, scalars = found
        if entry.lowering is None:
            return self.without_lowering(func, info, args, kwargs, entry)
        outputs = self._node(func, vargs, vkw, entry.tensor_outs, key, entry, inputs, scalars)
        return _restructure(info, self._fresh_outputs(entry, outputs))

    def at_once_if_lone(self, func, args: tuple, kwargs: dict) -> Any:
        """Run a pure op at once on torch's kernel if its last flush at this place in the user's
        code was lone and its inputs are computed (eager_lone_ops); NotImplemented otherwise.
        Tried before recording, only for ops that have had a lone flush: the place is asked
        first, so elsewhere this costs one lookup."""
        site = user_line_from(sys._getframe(2))
        if (id(func), site) not in meta_.LONE_PLACES:
            return NotImplemented
        info = (_FACTS.get(id(func)) or _facts(func))[0]
        if info.kind is not OpKind.PURE:
            return NotImplemented
        tensors = _tensors_in(args, kwargs)
        if not _all_computed(tensors):
            return NotImplemented
        STATS.ops_recorded += 1
        STATS.lone_ops_run += 1
        if any(type(t) is not torch.Tensor for t in tensors):
            # (computed deferred tensors, or other subclasses: their data, as the kernel wants;
            # plain tensors, the common case, go as they are)
            args, kwargs = self.realize((args, kwargs), FlushReason.FALLBACK)
        out = func(*args, **kwargs)
        at_once = self.at_once
        if len(at_once) >= _AT_ONCE_LIMIT:
            # (a long block running such an op every iteration: keep the live results only,
            # and forget them all if they are live too; that only delays an unmarking)
            live = {k: v for k, v in at_once.items() if v[0]() is not None}
            self.at_once = at_once = live if len(live) < _AT_ONCE_LIMIT // 2 else {}
        for t in _tensors_in(out):
            at_once[id(t)] = (weakref.ref(t), func, site)
        return out

    def item_if_computed(self, t: torch.Tensor) -> Any:
        """``t.item()`` of a plain CPU tensor with no pending contents, read at once: what the
        general path (run_observing) does for it, without the way there.  NotImplemented
        otherwise."""
        if t.device.type != "cpu" or _opaque(t):
            return NotImplemented
        state = _STATES_BY_PTR.get(_untyped_storage(t).data_ptr())
        if state is not None and state.contents is not None:
            return NotImplemented
        STATS.ops_recorded += 1
        return _LOCAL_SCALAR_DENSE(t)

    def at_once_if_host_scalar(self, func, args: tuple, kwargs: dict) -> Any:
        """Run a pointwise op at once on torch's kernel when every tensor it touches is a plain
        CPU tensor of at most one element with computed contents (host_scalars_at_once);
        NotImplemented otherwise.  Scalar bookkeeping (an optimizer's ``step += 1`` then
        ``step.item()``) then costs a kernel call instead of a recorded node and a flush.
        Pending nodes that read a storage this op overwrites keep its old contents."""
        info = (_FACTS.get(id(func)) or _facts(func))[0]
        if not info.pointwise or info.random or info.kind not in (OpKind.PURE, OpKind.MUTATING):
            return NotImplemented
        states = []
        for t in _tensors_in(args, kwargs):
            if type(t) is not torch.Tensor or t.device.type != "cpu" or _opaque(t) or t.numel() > 1:
                return NotImplemented
            state = _STATES_BY_PTR.get(_untyped_storage(t).data_ptr())
            if state is not None:
                if state.contents is not None:
                    return NotImplemented
                states.append(state)
        if info.written and states:
            for t in _written_arguments(func, info, args, kwargs):
                state = _STATES_BY_PTR.get(_untyped_storage(t).data_ptr())
                if state is not None:
                    _snapshot_old_leaves(state)
                    state.old_leaves = []
                    state.changed()
        STATS.ops_recorded += 1
        STATS.host_scalar_ops_run += 1
        return func(*args, **kwargs)

    def without_lowering(self, func, info, args, kwargs, entry) -> Any:
        if entry is None or entry.reason != meta_.NO_JAX_DTYPE:
            try:
                result = self._decomposed(func, args, kwargs)
            except (RuntimeError, TypeError, ValueError, NotImplementedError):
                # a decomposition rejecting what torch's kernel runs (nan_to_num's reference
                # rejects complex inputs): the kernel decides, and raises torch's own error if
                # the call is invalid (what the decomposition recorded is never used)
                result = NotImplemented
            if result is not NotImplemented:
                return result
        reason = FallbackReason.NO_LOWERING if entry is None or entry.reason == "no lowering" else FallbackReason.CHECK_FAILED
        return self.run_eager(func, info, args, kwargs, FlushReason.FALLBACK, reason)

    def _decomposed(self, func, args, kwargs) -> Any:
        """``func`` recorded as its torch._decomp decomposition, or NotImplemented when it has
        none or it declines this call (adaptive_max_pool2d's does, for some sizes)."""
        decomposition = _decomposition(func)
        if decomposition is None:
            return NotImplemented
        with self.mode.recording():
            result = decomposition(*args, **kwargs)
        if result is not NotImplemented:
            STATS.decompositions[str(func)] += 1
            result = _undefined_where_masked(func, args, kwargs, result)
        return result

    def record_view(self, func, info, args, kwargs) -> Any:
        base = args[0]
        if not isinstance(base, DeferredTensor) and not any(
                isinstance(t, DeferredTensor) for t in _tensors_in(args[1:], kwargs)):
            # A view of a plain tensor is metadata only: make the real view now.  Its reads and
            # writes still go through the storage's state, and code that reads memory directly
            # (numpy(), C extensions) gets a real tensor rather than a data-less wrapper.
            if self.at_once:
                self._unmark_lone(base)
            return func(*args, **kwargs)
        if func in _LAZY_BIT_VIEWS:
            if not isinstance(base, DeferredTensor):
                return self.run_eager(func, info, args, kwargs, FlushReason.FALLBACK, FallbackReason.UNSUPPORTED_ALIASING)
            # the same memory, read through a conjugate or negative bit (toggled, as torch does):
            # reads apply it (read), writes through it run eagerly (record_mutation)
            view = DeferredTensor(base._meta, base._storage, self)
            conj, neg = base.is_conj(), base.is_neg()
            _set_bits(view, conj != (func is aten._conj.default), neg != (func is aten._neg_view.default))
            return view
        vargs, vkw, entry, key, inputs, scalars = self._entry(func, info, args, kwargs)
        state = base._storage if isinstance(base, DeferredTensor) else self.state_of_real(base)
        if any(o.dtype != state.dtype and not _real_view_of(o.dtype, state.dtype, func, base)
               for o in entry.tensor_outs):
            return self.run_eager(func, info, args, kwargs, FlushReason.FALLBACK, FallbackReason.UNSUPPORTED_ALIASING)
        views = [None if o is None else DeferredTensor(o, state, self) for o in entry.outs]
        if isinstance(base, DeferredTensor) and (base.is_conj() or base.is_neg()):
            # a view of a view with lazy bits has them too
            for v in views:
                if v is not None:
                    _set_bits(v, base.is_conj(), base.is_neg())
        return _restructure(info, views)

    def record_mutation(self, func, info, args, kwargs) -> Any:
        twin = _INPLACE_TWINS.get(id(func), _UNKNOWN)
        if twin is _UNKNOWN:
            twin = _inplace_twin(func, info)
        if twin is not None:
            result = self._record_inplace(func, twin, args, kwargs)
            if result is not NotImplemented:
                return result
        # Validate the call itself (torch's broadcasting and casting errors) on meta tensors.
        functional = functional_variant(func)
        try:
            vargs, vkw, entry, key, inputs, scalars = self._entry(func, info, args, kwargs)
        except meta_.NoMeta:
            if not (info.dynamic and functional in SIZED):
                raise
            # nonzero.out, masked_select.out: their functional twin finds the output's size
            entry = None
        targets = _written_arguments(func, info, args, kwargs)
        # (and writes through a real view of complex memory)
        lazy_targets = any(not isinstance(t, torch.Tensor) or t.is_conj() or t.is_neg()
                           or isinstance(t, DeferredTensor) and t._meta.dtype != t._storage.dtype
                           for t in targets)
        if functional is None and not lazy_targets and torch.Tag.nondeterministic_seeded not in func.tags:
            # no out-of-place twin (batch norm updating its running statistics): torch's own
            # decomposition, which writes with copy_ (random ops keep torch's generator: eager)
            result = self._decomposed(func, args, kwargs)
            if result is not NotImplemented:
                return result
        if functional is None or lazy_targets:
            # (a write through a lazy conjugate or negative view stores conj(value) or -value)
            return self.run_eager(func, info, args, kwargs, FlushReason.FALLBACK, FallbackReason.NO_LOWERING)
        is_out = bool(set(info.written) & set(kwargs)) and "self" not in info.written
        if is_out:
            f_kwargs = {k: v for k, v in kwargs.items() if k not in info.written}
            f_args = args
            options = factory_options(func, functional)
            if options:
                # a factory's out=: computed in the output's dtype, on its device
                f_kwargs.update(dtype=targets[0].dtype, device=targets[0].device)
        else:
            f_args, f_kwargs = args, kwargs
        overlap = _overlap_rule(info, functional)
        if overlap is not None:
            _check_no_partial_overlap(targets, args, kwargs, overlap)
        f_args, f_kwargs = _rebind(func, functional, f_args, f_kwargs)
        results = self.dispatch_functional(functional, f_args, f_kwargs)
        results = results if isinstance(results, (tuple, list)) else (results,)
        outs = entry.outs if entry is not None else tuple(_meta_of(r) for r in results)
        if is_out and (any(o is not None and tuple(r.shape) != tuple(o.shape) for r, o in zip(results, outs))
                       or not self._resize_outs(targets, outs, results if info.pointwise else None)):
            # out= whose kernel writes other shapes than its functional twin computes (batch
            # norm's saved statistics in eval), or that resizes an output with pending
            # contents: let torch do it (what was just recorded is never used)
            return self.run_eager(func, info, args, kwargs, FlushReason.FALLBACK, FallbackReason.UNSUPPORTED_ALIASING)
        for target, result in zip(targets, results):
            _check_inplace_result(target, tuple(result.shape), result.dtype)
        for target, result in zip(targets, results):
            value, _ = self.read(result)
            self.write(target, value)
        if not func._schema.returns:
            # out= ops writing a list of tensors (unbind_copy.int_out) return nothing
            return None
        if is_out:
            return targets[0] if len(targets) == 1 else tuple(targets)
        return args[0]

    def _record_inplace(self, func, twin: tuple, args: tuple, kwargs: dict) -> Any:
        """The common in-place op (``x.mul_(y)``), recorded as one node of its functional twin
        written into ``self``: the arguments are converted once for both ops, and no deferred
        tensor is made for the intermediate result.  NotImplemented where the general path
        (record_mutation) must decide."""
        target = args[0] if args else None
        if not isinstance(target, torch.Tensor) or target.is_conj() or target.is_neg() or (
                isinstance(target, DeferredTensor) and target._meta.dtype != target._storage.dtype):
            return NotImplemented
        functional, f_info, f_name, name, overlap = twin
        vargs, vkw, margs, mkw, key, inputs, scalars = self.convert(f_info.scalar_args, f_info.arg_names, args, kwargs)
        # torch's own checks of the in-place call (broadcasting into self), on meta tensors
        meta_.infer(func, (name, key), margs, mkw)
        key = (f_name, key)
        try:
            entry = meta_.infer(functional, key, margs, mkw)
        except meta_.NoMeta:
            return NotImplemented
        if entry.lowering is None or len(entry.tensor_outs) != 1:
            return NotImplemented
        out = entry.tensor_outs[0]
        if overlap is not None:
            _check_no_partial_overlap([target], args, kwargs, overlap)
        _check_inplace_result(target, out.shape, out.dtype)
        (value,) = self._node(functional, vargs, vkw, entry.tensor_outs, key, entry, inputs, scalars)
        self.write(target, value, margs[0])
        return target

    def _resize_outs(self, targets: list, outs: tuple, layouts: Optional[tuple] = None) -> bool:
        """Resize out= tensors of the wrong shape as torch's kernels do (resize_output: a
        warning unless the tensor was empty, then memory of the new size, laid out as ``outs``
        say, or for pointwise ops as their ``layouts``, the functional results: the CPU kernel
        lays them out like its inputs where the meta kernel says contiguous), or say that it
        cannot be done here: a resized storage must not have pending contents, whose write-back
        would land in memory of the old size."""
        if layouts is not None:
            outs = tuple(o if o is None else o._replace(stride=tuple(r.stride())) for o, r in zip(outs, layouts))
        wrong = [(t, o) for t, o in zip(targets, outs)
                 if o is not None and tuple(t.shape) != tuple(o.shape)]
        for t, _ in wrong:
            if isinstance(t, DeferredTensor) or t.layout is not torch.strided:
                return False
            ptr = _untyped_storage(t).data_ptr()
            state = _STATES_BY_PTR.get(ptr) if ptr else None
            if state is not None and state.contents is not None:
                return False
        self._forget_plain()
        with no_dispatch():
            for t, o in wrong:
                _maybe_resize_out(t, o.shape)
                if tuple(t.stride()) != tuple(o.stride) and o.is_dense:
                    # the layout torch's kernel gives the result (channels-last): resize_ made
                    # it contiguous, over the same memory
                    t.as_strided_(o.shape, o.stride)
        return True

    def dispatch_functional(self, func, args, kwargs):
        STATS.ops_recorded -= 1  # counted once, as the mutating op
        return self.dispatch(func, args, kwargs)

    def record_dynamic(self, func, info, args, kwargs) -> Any:
        sized = SIZED.get(func)
        if sized is not None and func not in self.sizing:
            # record it in a static form once the size of its output is known (the rule calls
            # its op again with that size: then it is recorded as usual)
            self.sizing.add(func)
            try:
                with self.mode.recording():
                    result = sized(self, args, kwargs)
            finally:
                self.sizing.discard(func)
            if result is None:
                return self.run_eager(func, info, args, kwargs, FlushReason.DATA_DEPENDENT,
                                      FallbackReason.DATA_DEPENDENT)
            if result is not STATIC:
                STATS.ops_recorded -= 1   # (counted as the ops it became)
                return result
        try:
            vargs, vkw, entry, key, inputs, scalars = self._entry(func, info, args, kwargs)
        except (meta_.NoMeta, NotImplementedError, RuntimeError,
                torch._subclasses.fake_tensor.DynamicOutputShapeException):
            return self.run_eager(func, info, args, kwargs, FlushReason.DATA_DEPENDENT,
                                  FallbackReason.DATA_DEPENDENT)
        if entry.lowering is None:
            return self.without_lowering(func, info, args, kwargs, entry)
        outputs = self._node(func, vargs, vkw, entry.tensor_outs, key, entry, inputs, scalars)
        return _restructure(info, self._fresh_outputs(entry, outputs))

    def run_allocation(self, func, info, args, kwargs) -> Any:
        """empty*: allocate real memory now; only the inputs' metadata matters."""
        vargs, vkw, entry, key, inputs, scalars = self._entry(func, info, args, kwargs)
        outs = [torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=m.device) for m in entry.tensor_outs]
        return _restructure(info, outs)

    def run_observing(self, func, info, args, kwargs) -> Any:
        reason = FlushReason.ITEM if func in (aten._local_scalar_dense.default, aten.is_nonzero.default) \
            else FlushReason.OBSERVING_OP
        return self.run_eager(func, info, args, kwargs, reason, None)

    def run_inplace_view(self, func, info, args, kwargs) -> Any:
        """t_, unsqueeze_, squeeze_, as_strided_, ...: new metadata over the same storage.

        For a deferred tensor the op is run on a meta tensor to learn the new metadata, then
        applied to the wrapper itself with dispatch disabled, so its shape changes in place as a
        plain tensor's would; its values are read from the storage through the new metadata.
        """
        target = args[0]
        self._forget_plain()
        if not isinstance(target, DeferredTensor):
            if any(isinstance(t, DeferredTensor) for t in _tensors_in(args[1:], kwargs)):
                return self.run_eager(func, info, args, kwargs, FlushReason.FALLBACK, FallbackReason.INPLACE_VIEW)
            # Metadata only: the storage, and what is pending for it, stay as they are (pending
            # contents are kept in storage terms, reads are keyed by the reader's metadata).
            with no_dispatch():
                return func(*args, **kwargs)
        if func is aten.resize_as_.default:
            # only the template's shape is read: resize_ to it (torch's resize_as_ does)
            template = args[1]
            memory_format = args[2] if len(args) > 2 else kwargs.get("memory_format")
            if memory_format is torch.preserve_format:
                memory_format = _suggested_memory_format(template)
            return self.run_inplace_view(aten.resize_.default, op_info(aten.resize_.default),
                                         (target, tuple(template.shape)), {"memory_format": memory_format})
        if any(isinstance(a, torch.Tensor) for a in _tensors_in(args[1:], kwargs)):
            raise NotImplementedError(
                f"{func} re-points a deferred tensor at other memory, which deferfuse does not support; "
                f"call deferfuse.sync() first or run this code under deferfuse.strict()")
        before = meta_.to_meta_tensor(target._meta)
        storage = _untyped_storage(before)
        try:
            func(before, *args[1:], **kwargs)
        except Exception as meta_error:
            # (meta kernels raise other types than the CPU kernel: AssertionError for t_ of a
            # 3-D tensor, where strict raises RuntimeError)
            if meta_.raise_as_torch_would(func, (target._meta, *args[1:]), kwargs, meta_error):
                return self.run_eager(func, info, args, kwargs, FlushReason.FALLBACK, FallbackReason.INPLACE_VIEW)
            raise
        after_storage = _untyped_storage(before)
        reach = before.storage_offset() + sum((n - 1) * st for n, st in zip(before.shape, before.stride())) + 1
        if after_storage._cdata != storage._cdata or after_storage.nbytes() != storage.nbytes() \
                or (before.numel() and reach > target._meta.storage_numel):
            raise NotImplementedError(
                f"{func} resizes a deferred tensor's storage, which deferfuse does not support; "
                f"call deferfuse.sync() first or run this code under deferfuse.strict()")
        new_meta = TensorMeta(tuple(before.shape), tuple(before.stride()), before.storage_offset(),
                              target._meta.dtype, target._meta.device, target._meta.storage_numel)
        with torch._C._DisableTorchDispatch():
            aten.as_strided_.default(target, new_meta.shape, new_meta.stride, new_meta.offset)
        target._meta = new_meta
        return target

    def run_random(self, func, info, args, kwargs) -> Any:
        if info.is_factory:
            return self.run_eager(func, info, args, kwargs, None, None)
        name = func._schema.name.split("::")[-1]
        if info.written == ("self",):
            target = args[0]
            placeholder = torch.empty_strided(target.shape, target.stride(), dtype=target.dtype, device=target.device)
            rest_args, rest_kwargs = self.realize((args[1:], kwargs), FlushReason.FALLBACK)
            out = func(placeholder, *rest_args, **rest_kwargs)
            self.write(target, graph.leaf(out.contiguous()))
            return target
        if name.endswith("_like"):
            placeholders = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                            if isinstance(a, torch.Tensor) else a for a in args]
            return func(*placeholders, **kwargs)
        if not info.written and get_lowering(func) is not None:
            # The tag is the schema's, for every backend: a lowering of a random-tagged op takes
            # only calls that draw no random numbers (the CPU flash attention kernel draws none,
            # and its checker declines dropout), so a call it takes is recorded as a pure op.
            vargs, vkw, entry, key, inputs, scalars = self._entry(func, info, args, kwargs)
            if entry.lowering is not None:
                outputs = self._node(func, vargs, vkw, entry.tensor_outs, key, entry, inputs, scalars)
                return _restructure(info, self._fresh_outputs(entry, outputs))
        return self.run_eager(func, info, args, kwargs, FlushReason.FALLBACK, FallbackReason.RANDOM)

    # -- eager execution -----------------------------------------------------------------------
    def run_eager(self, func, info, args, kwargs, flush_reason: Optional[FlushReason],
                  fallback_reason: Optional[FallbackReason]) -> Any:
        if fallback_reason is not None:
            STATS.fallbacks[str(func)] += 1
            STATS.fallback_reasons[fallback_reason.value] += 1
        written = _written_arguments(func, info, args, kwargs) if info.written else []
        if written:
            # pending ops that read what this op overwrites must see the old data
            self.flush_all(flush_reason or FlushReason.FALLBACK)
        # (an opaque result may hold its arguments' memory: sparse_coo_tensor keeps its values)
        exposes = info.kind not in _FRESH_RESULT_KINDS or fallback_reason is FallbackReason.SPARSE
        real_args, real_kwargs = self.realize((args, kwargs), flush_reason or FlushReason.FALLBACK, exposes)
        out = func(*real_args, **real_kwargs)
        if written:
            self._forget_plain()   # (an out= tensor may have been resized)
        for t in written:
            if isinstance(t, DeferredTensor):
                t._storage.changed()
            elif not _opaque(t):
                self.state_of_real(t).changed()
            else:
                # which memory it wrote we cannot tell (a sparse tensor's values, a subclass's
                # inner tensors): what was read from any memory may be stale
                _forget_all_reads()
        if written:
            real_written = _written_arguments(func, info, real_args, real_kwargs)
            return _map_returned(out, real_written, written)
        return out

    def realize(self, tree: Any, reason: FlushReason, exposes: bool = True) -> Any:
        """``tree`` with every DeferredTensor replaced by its data, pending storages written back
        (``exposes``: False where the data is only read, by an op whose results alias none of
        its arguments)."""
        tensors = _tensors_in(tree)
        states = []
        for t in tensors:
            if isinstance(t, DeferredTensor):
                states.append(t._storage)
            elif _opaque(t):
                # its memory may be any storage's (a sparse tensor's values, a subclass's
                # inner tensors), written by pending ops
                self.flush_all(reason)
            else:
                state = _STATES_BY_PTR.get(_untyped_storage(t).data_ptr())
                if state is not None:
                    states.append(state)
        materialize_states([s for s in states if s.contents is not None], reason, self)
        return _map_tensors(tree, lambda t: t._materialize(exposes=exposes) if isinstance(t, DeferredTensor) else t)

    # -- flushing ------------------------------------------------------------------------------
    def pending_states(self) -> list[StorageState]:
        """Live storages with pending contents, in record order (a WeakSet iterates by address,
        which would make equal programs give different signatures)."""
        found: dict[int, StorageState] = {}
        for ref in self.pending:
            s = ref()
            if s is not None and s.contents is not None:
                found[id(s)] = s
        states = list(found.values())
        self.pending = [weakref.ref(s) for s in states]
        states.sort(key=lambda s: (s.contents[1].node.id, s.contents[1].index))
        return states

    def flush_all(self, reason: FlushReason) -> None:
        states = self.pending_states()
        if states:
            materialize_states(states, reason, self, everything=True)
        self.pending_nodes = 0


def materialize_states(states: list[StorageState], reason: FlushReason, recorder: Optional[Recorder],
                       everything: bool = False) -> None:
    """Compute the contents of ``states`` and write them into their buffers (``everything``:
    they are all that is pending, so there is nothing to widen the flush to)."""
    states = [s for s in states if s.contents is not None]
    if not states:
        return
    snapshot, nodes = False, None
    if recorder is not None:
        states, snapshot, nodes = _widen(states, recorder, everything)
    STATS.flushes[reason.value] += 1
    with no_dispatch(), runtime.profile_range("deferfuse.flush"):
        targets: list[Value] = []
        for s in states:
            if s.contents[0] == "root" and not _is_plain_root(s):
                _flatten_detached(s)
                nodes = None   # (a new node to compute)
            targets.append(s.contents[1])
        if nodes is None:
            nodes = graph.ancestors(targets)
        all_states = states
        to_compute = [v for v in targets if v.result is None]
        trigger = user_source() if recorder is None or recorder.record_source else None
        # (whether this flush computes a target's result: then the memory is its own to adopt)
        fresh_results = [v.result is None for v in targets]
        computed = iter(runtime.execute(nodes, to_compute, reason.value, trigger) if to_compute else [])
        results = [(next(computed), True) if fresh else (v.result, False)
                   for v, fresh in zip(targets, fresh_results)]
        adopted: set[int] = set()
        for s, value, (result, fresh) in zip(all_states, targets, results):
            flat = result.reshape(-1)
            if s.buffer is None:
                if adopted and _raw_data_ptr(flat) in adopted:
                    flat = flat.clone()   # (another storage of this flush holds that memory)
                s.buffer = flat
                ptr = _untyped_storage(flat).data_ptr()
                if ptr:
                    _STATES_BY_PTR[ptr] = s
                s.owned = fresh and _adoptable(flat, s, adopted)
            elif s.owned and fresh and _adoptable(flat, s, adopted):
                _adopt(s, flat)
            else:
                if snapshot:
                    _snapshot_old_leaves(s)
                _write_back(s.buffer, flat)
                s.old_leaves = []
            value.result = result
            s.contents = None
            s.changed()
        _release(nodes)
    if recorder is not None:
        recorder.pending_nodes = max(0, recorder.pending_nodes - len(nodes))


# A flush computes what it needs, and with it every pending storage whose graph shares work with
# that (so nothing computed inside this computation is computed again later: a training step
# ending in loss.item() runs as one computation), or that reads memory this flush writes back
# (so it still sees the old contents).  Scalar bookkeeping (an optimizer's step counter read with
# .item()) instead copies the small memory it writes back for the pending readers of its old
# contents, so it never drags the rest of the pending graph along.
_SMALL_FLUSH_NODES = 64
_SNAPSHOT_BYTES = 1 << 16


def _widen(states: list[StorageState], recorder: Recorder,
           everything: bool = False) -> tuple[list[StorageState], bool, Optional[list[Node]]]:
    """(states to compute, whether to snapshot old memory before writing it back, and the
    pending nodes they need when that is known already)."""
    nodes = graph.ancestors([s.contents[1] for s in states])
    if everything:
        return states, False, nodes
    small = len(nodes) <= _SMALL_FLUSH_NODES and all(m.numel <= 1 for n in nodes for m in n.out_metas)
    if small and all(s.buffer is None or s.numel * s.dtype.itemsize <= _SNAPSHOT_BYTES for s in states):
        return states, True, nodes
    chosen = {id(s): s for s in states}
    others = [p for p in recorder.pending_states() if id(p) not in chosen]
    if not others:
        return states, False, nodes
    computed = _shared_work(nodes)
    written: set[int] = set()

    def note_written(s: StorageState) -> None:
        if s.buffer is not None:
            written.update(id(leaf) for leaf in (ref() for ref in s.old_leaves) if leaf is not None)

    for s in states:
        note_written(s)
    grew = True
    while grew and others:
        grew = False
        touches: dict[int, bool] = {}
        remaining = []
        for p in others:
            if _touches(p.contents[1].node, computed, written, touches):
                chosen[id(p)] = p
                _add_shared_work(p.contents[1].node, computed)
                note_written(p)
                grew = True
            else:
                remaining.append(p)
        others = remaining
    return list(chosen.values()), False, nodes if len(chosen) == len(states) else None


def _shared_work(nodes: list[Node]) -> set[int]:
    """Ids of the nodes whose work another storage could share: all but plain reads of memory."""
    return {n.id for n in nodes if not (n.op is graph.READ_VIEW and n.inputs[0].result is not None)}


def _add_shared_work(root: Node, computed: set[int]) -> None:
    """Add ``root`` and its pending ancestors to ``computed``, stopping at nodes already there
    (their ancestors are too), so including many storages walks the graph once."""
    stack = [root]
    while stack:
        node = stack.pop()
        if node.id in computed:
            continue
        if not (node.op is graph.READ_VIEW and node.inputs[0].result is not None):
            computed.add(node.id)
        stack.extend(v.node for v in node.inputs if v.result is None and v.node.id not in computed)


def _touches(root: Node, computed: set[int], written: set[int], memo: dict[int, bool]) -> bool:
    """Whether ``root`` or a pending node above it is computed by this flush or reads memory it
    writes back (iterative: pending graphs may be deep).  Plain loops rather than generators:
    a flush at the end of a training step walks every pending node through here."""
    stack = [(root, False)]
    pop, push = stack.pop, stack.append
    while stack:
        node, expanded = pop()
        nid = node.id
        if nid in memo:
            continue
        inputs = node.inputs
        if not expanded:
            if nid in computed:
                memo[nid] = True
                continue
            if written:
                hit = False
                for v in inputs:
                    if id(v) in written:
                        hit = True
                        break
                if hit:
                    memo[nid] = True
                    continue
            push((node, True))
            for v in inputs:
                if v.result is None:
                    above = v.node
                    if above.id not in memo:
                        push((above, False))
        else:
            found = False
            for v in inputs:
                if v.result is None and memo.get(v.node.id, False):
                    found = True
                    break
            memo[nid] = found
    return memo.get(root.id, False)


# Write-backs into user memory up to this size are one memmove on the calling thread.  torch's copy_
# splits a copy over its OpenMP threads, and right after an XLA computation those wait for
# cores that XLA's own threads are still spinning on: with the second core busy, an AdamW
# step's 150 copies of 256 KB took 4.3 ms by memmove and 9.4 ms by copy_ (python -m
# bench.adamw_parts --write-back-both); on an idle 2-core machine the two are within noise.
# Larger copies stay with copy_: on a machine with many cores its threads reach a memory
# bandwidth one thread does not.
_MEMMOVE_BYTES = 1 << 20
_raw_data_ptr = torch._C.TensorBase.data_ptr   # (not the wrapper of _READ_PATCHES)


def _write_back(buffer: torch.Tensor, flat: torch.Tensor) -> None:
    """Copy the computed contents ``flat`` into ``buffer``, the user's memory."""
    nbytes = flat.nbytes
    if nbytes <= _MEMMOVE_BYTES and flat.dtype == buffer.dtype and flat.device.type == "cpu" \
            and buffer.device.type == "cpu" and flat.numel() == buffer.numel() \
            and flat.is_contiguous() and buffer.is_contiguous():
        ctypes.memmove(_raw_data_ptr(buffer), _raw_data_ptr(flat), nbytes)
    else:
        buffer.copy_(flat)


# Kinds of ops that act on their tensor arguments before converting them (a random op draws
# from the generator; an in-place view op runs on a plain target at once; a size rule runs ops
# of its own): an opaque argument must be found first.
_ACTS_BEFORE_CONVERTING = frozenset({OpKind.RANDOM, OpKind.INPLACE_VIEW, OpKind.DYNAMIC})

# Kinds of ops whose results never alias their arguments' memory: running one on a deferred
# tensor's data does not hand that memory out (see StorageState.owned).
_FRESH_RESULT_KINDS = frozenset({OpKind.PURE, OpKind.OBSERVING, OpKind.DYNAMIC})


def _adoptable(flat: torch.Tensor, s: StorageState, adopted: set[int]) -> bool:
    """Whether a state may keep ``flat``, a result this flush computed, as its memory: its own
    (no other result of the flush lies in it), dense and of the storage's size and dtype."""
    if flat.device.type != "cpu" or flat.dtype != s.dtype or flat.numel() != s.numel \
            or not flat.is_contiguous():
        return False
    ptr = _raw_data_ptr(flat)
    if not ptr or ptr in adopted:
        return False
    adopted.add(ptr)
    return True


def _adopt(s: StorageState, flat: torch.Tensor) -> None:
    """The new contents of a storage whose memory nothing outside deferfuse has seen become its
    memory, instead of being copied into the old one (an optimizer's state, updated every step).
    Pending nodes that read the old memory keep it, unchanged, through their graph inputs."""
    old = _raw_data_ptr(s.buffer)
    if old and _STATES_BY_PTR.get(old) is s:
        del _STATES_BY_PTR[old]
    s.buffer = flat
    ptr = _raw_data_ptr(flat)
    if ptr:
        _STATES_BY_PTR[ptr] = s
    s.old_leaves = []


def _forget_all_reads() -> None:
    """Memory we cannot name was written: every storage with no pending contents reads its
    memory afresh (pending contents are the graph's, which the write did not touch)."""
    for s in list(_STATES_BY_PTR.values()):
        if s.contents is None:
            s.changed()


def _undefined_where_masked(op, args: tuple, kwargs: dict, result: Any) -> Any:
    """``result`` with None for each output whose ``output_mask`` entry is False, as torch's
    kernels return it: some decompositions (native_batch_norm_backward's grad_input) compute
    every output whatever the mask says."""
    if not isinstance(result, tuple):
        return result
    names = [a.name for a in op._schema.arguments]
    if "output_mask" not in names:
        return result
    mask = kwargs["output_mask"] if "output_mask" in kwargs else args[names.index("output_mask")]
    if len(mask) != len(result):
        return result
    return tuple(r if wanted else None for r, wanted in zip(result, mask))


def _snapshot_old_leaves(s: StorageState) -> None:
    """Pending nodes reading ``s.buffer`` through a graph input keep its current contents."""
    for ref in s.old_leaves:
        leaf = ref()
        if leaf is not None and leaf.result is not None:
            leaf.result = leaf.result.clone()


def _is_plain_root(s: StorageState) -> bool:
    _, value, m = s.contents
    return m.is_contiguous and m.offset == 0 and m.numel == s.numel


def _flatten_detached(s: StorageState) -> Value:
    _, value, m = s.contents
    (flat,) = graph.emit(graph.FLATTEN, (value, m), {}, (_flat_meta(s),), (graph.FLATTEN, m))
    s.contents = ("flat", flat)
    return flat


def _release(nodes: list[Node]) -> None:
    """Computed nodes drop their arguments, so the graph above them (and the tensors it holds)
    is freed now rather than when the last computed Value goes.  A node with an output still
    pending (an intermediate some cached read may ask for again) keeps them."""
    for node in nodes:
        # (a loop, not all() over a generator: this runs for every node of every flush)
        for ref in node.out_refs:
            v = ref()
            if v is not None and v.result is None:
                break
        else:
            node.args = ()
            node.kwargs = {}
            node.inputs = ()


def _non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """c10's ``is_non_overlapping_and_dense``."""
    return (t._meta if isinstance(t, DeferredTensor) else TensorMeta.of(t)).is_dense


def _may_share_memory(target: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether a tensor argument other than ``target`` itself may lie in ``target``'s memory
    (``_same_memory``, without building the list of tensors): an optimizer's in-place updates
    read other tensors almost always, and this runs before every one of them.  A list or dict
    argument answers yes; the full check then looks inside."""
    deferred = type(target) is DeferredTensor
    state = target._storage if deferred else None
    pointer = 0
    if not deferred and target.layout is torch.strided:
        pointer = _untyped_storage(target).data_ptr()
    for a in itertools.chain(args, kwargs.values()):
        if a is target:
            continue
        if type(a) is DeferredTensor:
            if a._storage is state:
                return True
        elif isinstance(a, torch.Tensor):
            if isinstance(a, DeferredTensor):
                return True      # (a subclass of ours: let the full check decide)
            if pointer and a.layout is torch.strided and _untyped_storage(a).data_ptr() == pointer:
                return True
        elif isinstance(a, (list, tuple, dict)):
            return True
    return False


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if isinstance(a, DeferredTensor) or isinstance(b, DeferredTensor):
        return isinstance(a, DeferredTensor) and isinstance(b, DeferredTensor) and a._storage is b._storage
    if a.layout is not torch.strided or b.layout is not torch.strided:
        return False
    return _untyped_storage(a).data_ptr() == _untyped_storage(b).data_ptr() != 0


def _partially_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """ATen's ``get_overlap_status(a, b) == Partial``: two distinct tensors over one storage,
    both non-overlapping and dense (anything else is 'too hard' and allowed), whose byte ranges
    intersect without being the same range with the same strides."""
    if a is b or not _same_memory(a, b) or a.numel() == 0 or b.numel() == 0:
        return False
    if not (_non_overlapping_and_dense(a) and _non_overlapping_and_dense(b)):
        return False
    a_begin, b_begin = a.storage_offset() * a.element_size(), b.storage_offset() * b.element_size()
    a_end, b_end = a_begin + a.numel() * a.element_size(), b_begin + b.numel() * b.element_size()
    if (a_begin, a_end) == (b_begin, b_end):
        return a.stride() != b.stride()
    return a_begin < b_end and b_begin < a_end


def _overlap_rule(info, functional) -> Optional[str]:
    """Which inputs of a write must not partially overlap the written tensor, as torch's kernels
    check it: every input for pointwise ops (TensorIterator) and copy_, the mask for masked_fill_
    (its value may be a view of the target; torch's index_put_ checks nothing, see
    test_regressions); None where nothing is checked."""
    if info.pointwise or functional is aten.copy.default:
        return "all"
    if functional is aten.masked_fill.Scalar or functional is aten.masked_fill.Tensor:
        return "mask"
    return None


def _check_no_partial_overlap(targets: list, args: tuple, kwargs: dict, rule: str = "all") -> None:
    """torch's kernels refuse to write a tensor that partially overlaps an input
    (``assert_no_partial_overlap``, the inputs ``rule`` names); meta kernels do not check it."""
    if rule == "mask":
        args, kwargs = (args[1:2], {}) if len(args) > 1 else ((), {"mask": kwargs.get("mask")})
    for target in targets:
        for t in _tensors_in(args, kwargs):
            if _partially_overlap(target, t):
                raise RuntimeError(
                    "unsupported operation: some elements of the input tensor and the written-to "
                    "tensor refer to a single memory location. Please clone() the tensor before "
                    "performing the operation.")


def _check_inplace_result(target: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    if tuple(shape) != tuple(target.shape):
        # what torch's kernels say when an in-place result would need a resize
        raise RuntimeError(f"output with shape {list(target.shape)} doesn't match the "
                           f"broadcast shape {list(shape)}")
    if dtype is not target.dtype and not torch.can_cast(dtype, target.dtype):
        # torch's rule for every in-place and out= result (TensorIterator's, and the
        # references' _safe_copy_out); meta kernels of in-place ops do not check it
        raise RuntimeError(f"result type {_type_name(dtype)} can't be cast to the "
                           f"desired output type {_type_name(target.dtype)}")


# In-place ops recorded as one node of their functional twin (Recorder._record_inplace), by
# id(op): (twin, its OpInfo, its name, the op's name, whether to check for partial overlap), or
# None where the general path applies.
_INPLACE_TWINS: dict[int, Optional[tuple]] = {}
_UNKNOWN = object()


def _inplace_twin(op: torch._ops.OpOverload, info) -> Optional[tuple]:
    """Whether ``op`` writes only ``self`` and its functional twin takes the same arguments the
    same way, so one conversion serves both: a pure, single-result, lowerable kind of op."""
    twin = None
    functional = functional_variant(op)
    if functional is not None and info.written == ("self",) and op._schema.returns \
            and torch.Tag.nondeterministic_seeded not in op.tags:
        f_info = op_info(functional)
        f_facts = _FACTS.get(id(functional)) or _facts(functional)
        same_arguments = (f_info.arg_names == info.arg_names and f_info.scalar_args == info.scalar_args
                          and _same_order(op, functional))
        if same_arguments and f_info.kind is OpKind.PURE and f_facts[1] is None \
                and not f_info.composite_implicit and f_info.returns == "one":
            twin = (functional, f_info, f_facts[2], str(op), _overlap_rule(info, functional))
    _INPLACE_TWINS[id(op)] = twin
    return twin


def _same_order(op, functional) -> bool:
    names = [a.name for a in op._schema.arguments]
    f_names = [a.name for a in functional._schema.arguments if not a.kwarg_only]
    return names[:len(f_names)] == f_names


def _rebind(op, functional, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments of ``op`` in the order of its functional variant, which may differ
    (polygamma_(self, n) is polygamma(n, self))."""
    if _same_order(op, functional):
        return args, kwargs
    names = [a.name for a in op._schema.arguments]
    f_names = [a.name for a in functional._schema.arguments if not a.kwarg_only]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    positional = tuple(bound.pop(n) for n in f_names if n in bound)
    return positional, bound


def _real_view_of(dtype: torch.dtype, storage_dtype: torch.dtype, func, base) -> bool:
    """A view that reads complex memory as its real dtype: view_as_real of a deferred tensor,
    or a view of such a view (deferred: a plain tensor's views are real views already)."""
    if not storage_dtype.is_complex or dtype != storage_dtype.to_real() or not isinstance(base, DeferredTensor):
        return False
    return func is aten.view_as_real.default or base._meta.dtype == dtype


def _suggested_memory_format(t: torch.Tensor) -> torch.memory_format:
    """The layout torch's resize_as_ keeps for preserve_format (ATen's suggest_memory_format)."""
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if t.dim() == 5 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def _set_bits(t: torch.Tensor, conj: bool, neg: bool) -> None:
    torch._C._set_conj(t, conj)
    torch._C._set_neg(t, neg)
    if type(t) is DeferredTensor:
        t._lazy_bits = conj or neg


def _meta_of(t: torch.Tensor) -> TensorMeta:
    return t._meta if isinstance(t, DeferredTensor) else TensorMeta.of(t)


def _type_name(dtype: torch.dtype) -> str:
    """The name torch's messages give a dtype (Float, Long, ComplexDouble)."""
    return torch.empty((), dtype=dtype, device="meta").type().split(".")[-1].replace("Tensor", "")


_NO_STORAGE_MESSAGE = "Cannot access storage of"   # (c10's TensorImpl::throw_cannot_access_storage)
_QUANTIZED_DTYPES = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})


class _NoStorage(Exception):
    """A tensor argument or result has no storage to model (``_opaque``): its op runs eagerly."""


# Per tensor subclass, whether it has a __torch_dispatch__ of its own (TwoTensor, the jagged
# NestedTensor, a user's wrapper): its ops must reach it.  nn.Parameter and other subclasses
# that only override Python methods are plain tensors to us.
_OWN_DISPATCH: dict[type, bool] = {}


def _opaque(t: torch.Tensor) -> bool:
    """Whether the storage model cannot stand for ``t``'s memory: not dense and strided (sparse,
    mkldnn, nested, quantized: its values are not its storage's elements in its dtype) or a
    subclass that dispatches its ops itself.  DeferredTensors are never opaque."""
    cls = type(t)
    if cls is not torch.Tensor and cls is not DeferredTensor:
        own = _OWN_DISPATCH.get(cls)
        if own is None:
            own = _OWN_DISPATCH[cls] = not issubclass(cls, DeferredTensor) and \
                getattr(cls, "__torch_dispatch__", None) is not torch._C._disabled_torch_dispatch_impl
        if own:
            return True
    return t.layout is not torch.strided or t.is_nested or t.is_quantized


def _opaque_in(args: tuple, kwargs: dict) -> bool:
    """Whether an opaque tensor is among the arguments (a loop over them rather than
    ``_tensors_in``, which builds a list: foreach ops pass hundreds)."""
    for group in (args, kwargs.values()):
        for a in group:
            if type(a) is DeferredTensor:
                continue
            if isinstance(a, torch.Tensor):
                if _opaque(a):
                    return True
            elif isinstance(a, (list, tuple)):
                if _opaque_in(a, {}):
                    return True
    return False


def _foreign(storage: torch.UntypedStorage) -> bool:
    """Whether a storage's memory is not torch's own, so that code we do not see may write it:
    memory torch allocated itself is resizable, memory it was handed is not (``from_numpy``,
    ``frombuffer``, DLPack imports, files mapped by ``torch.load(mmap=True)`` or
    ``UntypedStorage.from_file``, and also the storages of ``torch.load`` without mmap); memory
    shared with other processes (``share_memory_``, DataLoader workers' batches) is resizable
    but theirs to write too.  ~0.1 us, asked once per storage state."""
    return not storage.resizable() or storage.is_shared()


# -- helpers over argument trees ---------------------------------------------------------------
def _tensors_in(*trees: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    stack = list(trees)
    while stack:
        a = stack.pop()
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            stack.extend(a)
        elif isinstance(a, dict):
            stack.extend(a.values())
    return found


def _map_tensors(tree: Any, fn) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_tensors(x, fn) for x in tree)
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    return tree


def _written_arguments(func, info, args, kwargs) -> list:
    found = []
    names = info.arg_names
    for name in info.written:
        if name in kwargs:
            value = kwargs[name]
        else:
            i = names.index(name)
            if i >= len(args):
                continue
            value = args[i]
        # a written Tensor[] (foreach ops, fused optimizers) writes each of its tensors
        found.extend(value) if isinstance(value, (list, tuple)) else found.append(value)
    return found


def _map_returned(out: Any, real_written: list, written: list) -> Any:
    def swap(t):
        for r, w in zip(real_written, written):
            if t is r:
                return w
        return t
    return _map_tensors(out, swap)


def _restructure(info, outs: list) -> Any:
    """Outputs in the structure the schema returns: one tensor, a list, or a tuple."""
    if info.returns == "one":
        return outs[0]
    return list(outs) if info.returns == "list" else tuple(outs)


# Tensor methods that read a plain tensor's memory without going through aten dispatch.  A user
# tensor written inside the context has its new contents pending; these must see them.
_PLAIN_READS: dict[str, FlushReason] = {
    "tolist": FlushReason.TOLIST,
    "numpy": FlushReason.NUMPY,
    "__array__": FlushReason.NUMPY,
    "__repr__": FlushReason.REPR,
    "__format__": FlushReason.REPR,
    "data_ptr": FlushReason.DATA_PTR,
    "untyped_storage": FlushReason.DATA_PTR,
    "__dlpack__": FlushReason.DATA_PTR,
    "__reduce_ex__": FlushReason.SERIALIZE,
    "__deepcopy__": FlushReason.SERIALIZE,
}

def _recorder_on_stack() -> Optional[Recorder]:
    """The recorder of a DeferMode on this thread's dispatch stack: none inside our own
    __torch_dispatch__ (which takes the mode off the stack) or no_dispatch() (which turns
    Python dispatch off)."""
    if torch._C._dispatch_tls_is_dispatch_key_excluded(_PYTHON_KEY):
        return None
    for i in range(torch._C._len_torch_dispatch_stack() - 1, -1, -1):
        mode = torch._C._get_dispatch_stack_at(i)
        if type(mode) is DeferMode:
            return mode.recorder
    return None


def _write_back_before_read(t: Any, reason: FlushReason) -> None:
    if not isinstance(t, torch.Tensor) or isinstance(t, DeferredTensor) or _opaque(t):
        return
    recorder = _recorder_on_stack()
    if recorder is None:
        return
    state = _STATES_BY_PTR.get(_untyped_storage(t).data_ptr())
    if state is not None and state.contents is not None:
        with no_dispatch():
            materialize_states([state], reason, recorder)


def _reading(original, reason: FlushReason):
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        _write_back_before_read(self, reason)
        return original(self, *args, **kwargs)
    return method


def _write_out_after(func, args: tuple, kwargs: dict) -> torch.Tensor:
    kwargs = dict(kwargs)
    out = kwargs.pop("out")
    result = func(*args, **kwargs)
    _maybe_resize_out(out, result.shape)
    return out.copy_(result)


def _out_written_after(original):
    # torch.linalg.matrix_rank(..., out=): under any dispatch mode its C++ composite takes the
    # tensor-subclass path, which rebinds the out tensor's handle to a new result instead of
    # writing into it, so the caller's tensor kept its old contents.  Computed functionally
    # here, then written into out= as torch's kernel writes it (sum_out: resized with its
    # warning, cast).
    @functools.wraps(original)
    def function(*args, **kwargs):
        if kwargs.get("out") is not None and _recorder_on_stack() is not None:
            return _write_out_after(original, args, kwargs)
        return original(*args, **kwargs)
    return function


_TENSOR_DATA = torch._C.TensorBase.__dict__["data"]


def _data_property():
    """``Tensor.data`` whose setter knows deferred tensors: ``p.data = q`` re-points ``p`` at
    ``q``'s memory without an aten op, and a deferred tensor has no memory until computed."""
    def get(self):
        return _TENSOR_DATA.__get__(self)

    def set_(self, value):
        recorder = _recorder_on_stack()
        if recorder is not None:
            if isinstance(self, DeferredTensor):
                raise NotImplementedError(
                    "deferfuse: assigning .data of a deferred tensor re-points it at other memory, which "
                    "deferfuse does not support; call deferfuse.sync() first or run this code under "
                    "deferfuse.strict()")
            if isinstance(value, DeferredTensor):
                # the value's memory, computed now (p.data = p.data - lr * p.grad)
                (value,) = recorder.realize((value,), FlushReason.DATA_PTR)
            recorder._forget_plain()
        _TENSOR_DATA.__set__(self, value)
    return property(get, set_, doc=_TENSOR_DATA.__doc__)


class _Patches:
    """Wrappers put on torch's classes while they are needed, shared by every thread: the
    first ``hold`` installs them, the last ``release`` restores torch's own attributes.  Other
    threads, and our own code (inside __torch_dispatch__ or no_dispatch(), where no DeferMode is
    on the dispatch stack), call through the wrappers to torch's methods after one check of the
    stack.  Setting an attribute of torch.Tensor touches every subclass's type cache (~0.3 us
    each warm, tens of microseconds right after a large kernel has emptied the caches), so each
    set is installed only when a block needs it."""

    def __init__(self, make) -> None:
        self.make = make           # () -> [(owner, name, wrapper)], called at the first hold
        self.lock = threading.Lock()
        self.holders = 0
        self.saved: list[tuple[Any, str, Any]] = []   # (owner, name, its own attribute or None)
        self.patches: Optional[list[tuple[Any, str, Any]]] = None

    def hold(self) -> None:
        with self.lock:
            self.holders += 1
            if self.holders > 1:
                return
            if self.patches is None:
                self.patches = self.make()
            for owner, name, patched in self.patches:
                self.saved.append((owner, name, owner.__dict__.get(name)))
                setattr(owner, name, patched)

    def release(self) -> None:
        with self.lock:
            self.holders -= 1
            if self.holders > 0:
                return
            for owner, name, own in reversed(self.saved):
                if own is None:
                    delattr(owner, name)
                else:
                    setattr(owner, name, own)
            self.saved.clear()


# While a defer block runs: ``p.data = q`` must know deferred tensors (q's memory does not
# exist yet), and torch.linalg.matrix_rank's out= must be written (under any dispatch mode its
# C++ composite drops it).
_BLOCK_PATCHES = _Patches(lambda: [
    (torch.linalg, "matrix_rank", _out_written_after(torch.linalg.matrix_rank)),
    (torch.Tensor, "data", _data_property())])

# While a block has written a plain tensor: the methods in _PLAIN_READS write its pending
# contents back before Python code reads its memory.  A block that only reads plain tensors
# (their memory is current; its results are deferred tensors, which materialize themselves)
# never installs them.
_READ_PATCHES = _Patches(lambda: [(torch.Tensor, name, _reading(getattr(torch.Tensor, name), reason))
                                  for name, reason in _PLAIN_READS.items()])





def _defer_dispatch(self, func, types, args=(), kwargs=None):
    """DeferMode.__torch_dispatch__: the fast path where the op has one, else the general one."""
    recorder = self.recorder
    kwargs = kwargs or {}
    if args and type(args[0]) is torch.Tensor and args[0].numel() <= 1:
        if func is _LOCAL_SCALAR_DENSE:
            # (an optimizer's step counter read with .item() every step)
            result = recorder.item_if_computed(args[0])
        elif recorder.host_scalars:
            result = recorder.at_once_if_host_scalar(func, args, kwargs)
        else:
            result = NotImplemented
        if result is not NotImplemented:
            return result
    if id(func) in meta_.LONE_OPS and recorder.eager_lone:
        result = recorder.at_once_if_lone(func, args, kwargs)
        if result is not NotImplemented:
            return result
    form = _FAST.get(id(func), _UNSEEN)
    if form is _UNSEEN:
        form = _fast_form(func)
    if form is not None:
        result = recorder.record_fast(func, form, args, kwargs)
        if result is not NotImplemented:
            return result
    return recorder.dispatch(func, args, kwargs)


class DeferMode(TorchDispatchMode):
    """Intercepts aten ops and hands them to a Recorder."""

    def __init__(self, recorder: Optional[Recorder] = None) -> None:
        super().__init__()
        self.recorder = recorder or Recorder()
        self.recorder.mode = self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _defer_dispatch(self, func, types, args, kwargs)

    @contextlib.contextmanager
    def recording(self):
        """Re-enter only the dispatch mode, from inside __torch_dispatch__ (decompositions)."""
        TorchDispatchMode.__enter__(self)
        try:
            yield
        finally:
            TorchDispatchMode.__exit__(self, None, None, None)

    def __enter__(self):
        result = super().__enter__()
        _BLOCK_PATCHES.hold()
        return result

    def __exit__(self, exc_type, exc_value, traceback):
        try:
            _BLOCK_PATCHES.release()
            # (a block leaves nothing pending in plain tensors: suspending one flushes it)
            if self.recorder.guarding_reads:
                self.recorder.guarding_reads = False
                _READ_PATCHES.release()
        finally:
            forget_frames()
            super().__exit__(exc_type, exc_value, traceback)


def _skip_dynamo_without_wrapper() -> None:
    """TorchDispatchMode wraps a subclass's __torch_dispatch__ in torch._disable_dynamo, so that
    Dynamo (inside a torch.compile'd function) never traces into it; the wrapper toggles frame
    evaluation twice per op, about a microsecond of the per-op cost.  Marking the code object
    as skipped, recursively, tells Dynamo the same for free.  Where this torch lacks the hook,
    the wrapper stays."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:
        return

    set_code_exec_strategy(_defer_dispatch.__code__,
                           _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    DeferMode.__torch_dispatch__ = _defer_dispatch   # (__init_subclass__ has run already)


_skip_dynamo_without_wrapper()


_SCALARS: dict[float, RuntimeScalar] = {}
_SCALARS_LIMIT = 256


def _runtime_scalar(a: float) -> RuntimeScalar:
    """A RuntimeScalar for ``a``, shared by the calls that pass the same value (they are
    immutable): a loop's constants then allocate nothing.  Zeros are not shared (0.0 and -0.0
    are equal keys), nor are nans (no nan equals a key)."""
    r = _SCALARS.get(a) if a else None
    if r is None:
        r = RuntimeScalar(a)
        if a:
            if len(_SCALARS) >= _SCALARS_LIMIT:
                _SCALARS.clear()
            _SCALARS[a] = r
    return r


def _ints_only(items) -> bool:
    for x in items:
        if type(x) is not int:
            return False
    return True


def _static_key(a: Any, is_scalar_arg: bool) -> Any:
    """The key part of a non-tensor argument: ``float`` (the type) for a runtime scalar."""
    if type(a) is float and is_scalar_arg:
        return float
    if isinstance(a, float):
        # key floats by their bits: -0.0 and nan must not collide
        return (float, a.hex())
    if type(a) is bool:
        # True == 1 and hash alike, but promote differently
        return (bool, a)
    return a


def _computed(args: tuple, kwargs: dict) -> bool:
    """Whether every tensor argument holds its values already (no pending writes into it)."""
    return _all_computed(_tensors_in(args, kwargs))


def _all_computed(tensors: list) -> bool:
    for t in tensors:
        if type(t) is DeferredTensor:
            if t._storage.contents is not None:
                return False
        elif _opaque(t):
            return False
        else:
            state = _STATES_BY_PTR.get(_untyped_storage(t).data_ptr())
            if state is not None and state.contents is not None:
                return False
    return True


def dispatch_outside_context(func, args, kwargs) -> Any:
    """An op on DeferredTensors with no defer context active: run it eagerly on their data."""
    info = op_info(func)
    tensors = _tensors_in(args, kwargs)
    for t in tensors:
        if isinstance(t, DeferredTensor) and t._storage.contents is not None:
            materialize_states([t._storage], FlushReason.ESCAPE, t._recorder if t._recorder.active else None)
    exposes = info.kind not in _FRESH_RESULT_KINDS

    def real(t):
        return t._materialize(exposes=exposes) if isinstance(t, DeferredTensor) else t
    real_args, real_kwargs = _map_tensors(args, real), _map_tensors(kwargs, real)
    out = func(*real_args, **real_kwargs)
    if info.written:
        written = _written_arguments(func, info, args, kwargs)
        for t in written:
            if isinstance(t, DeferredTensor):
                t._storage.changed()
        return _map_returned(out, _written_arguments(func, info, real_args, real_kwargs), written)
    return out
