"""The recorder's core: records aten ops into the pending graph and flushes it when observed.

``DeferMode`` is the TorchDispatchMode; ``Recorder`` holds the state of one defer context (the
storages it touched, what is pending) and does the work.  Each op is classified from its schema
(``classify.op_info``) and handled by kind:

  PURE       metadata from the meta cache; a node is recorded, DeferredTensors returned
  VIEW       no node: the output shares the input's storage and reads it lazily
  MUTATING   the functional variant is recorded, then written into the target's storage
  RANDOM     drawn eagerly from torch's generator (same stream as strict), fed in as a graph input
  DYNAMIC    its inputs are flushed and it runs eagerly (the output shape depends on data)
  OBSERVING  likewise; it returns Python values
A collective of torch.distributed is never recorded: it flushes, runs on torch's process group
and marks its tensors written (``collectives.py``).
Ops with no lowering use a torch._decomp decomposition when one exists, and otherwise run
eagerly after flushing their inputs (counted in stats().fallbacks).  So do ops whose metadata
meta tensors cannot give (no meta kernel, a meta kernel that rejects what the CPU kernel runs,
a data-dependent output shape).

Two kinds of memory need more than the storage model:

  opaque     a tensor that is not dense and strided (sparse, nested, quantized, mkldnn) or a
             subclass with its own __torch_dispatch__ has no storage to model: an op with one
             among its arguments or results runs at once on torch's kernel (``opaque.opaque``), after
             everything pending is flushed (its memory may be any storage's: a sparse tensor's
             values, a subclass's inner tensors)
  foreign    memory torch does not own (``from_numpy``, ``frombuffer``, DLPack imports, shared
             memory) may be written by code we never see, between two ops: each recorded read
             of it copies what it reads then, and is never cached (``storage.foreign``).  Writes into
             it land in it at once (the op that wrote is the end of its flush: ``land_foreign_writes``,
             called by DeferMode after each op), since its owner (a NumPy array) reads that memory
             without asking torch.

The Recorder is split by concern: this file holds its core (reading and writing storages,
converting arguments, the general dispatch by kind); ``fastpath.py``, ``mutation.py`` and
``at_once.py`` hold the fast path, views and writes, and ops run at once; ``flush.py`` computes
what is pending; ``mode.py`` holds DeferMode, which hands ops to the Recorder.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from typing import Any, Optional

import torch

from .. import config
from ..debugging.source import user_line
from ..errors import FallbackReason, FlushReason
from ..ir import graph
from ..ir.graph import StorageState, Value
from ..ir.meta import TensorMeta
from ..lower.registry import VALUE_ERRORS
from ..stats import STATS
from . import flush
from . import meta as meta_
from .at_once import AtOnceMixin, computed_args
from .classify import OpKind
from .handlers import catches
from .collectives import COLLECTIVE, CollectiveMixin
from .dispatch_keys import no_dispatch
from .fastpath import FastPathMixin
from .flush import flatten_detached
from .mutation import MutationMixin
from .opaque import NO_STORAGE_MESSAGE, QUANTIZED_DTYPES, NoStorage, opaque, opaque_in
from .opfacts import ACTS_BEFORE_CONVERTING, FACTS, decomposition_of, grad_mode_keyed, learn_facts
from .patches import READ_PATCHES
from .scalars import runtime_scalar, static_key
from .sized import SIZED, STATIC
from .storage import (ORPHANS, PLAIN, PLAIN_CACHE_SIZE, STATES_BY_PTR, drop_reads, exposed, flat_buffer,
                      flat_meta, foreign, forget_dead_plain, orphaned, raw_data_ptr, untyped_storage)
from .tensor import DeferredTensor
from .trees import restructure, undefined_where_masked

_epochs = itertools.count()


class Recorder(FastPathMixin, MutationMixin, AtOnceMixin, CollectiveMixin):
    """The state of one defer context."""

    def __init__(self) -> None:
        self.mode: Any = None   # (the DeferMode that hands it ops)
        # weak references to storages written since the last flush_all (a list, not a WeakSet:
        # one append per op is the hot path; duplicates and dead ones are dropped at flush)
        self.pending: list = []
        # user storages touched since everything was last flushed: held (their pending writes,
        # and the graph inputs pending nodes read, must outlive the user's tensors) until
        # release_states
        self.real_states: set[StorageState] = set()
        self.pending_nodes = 0
        self.record_source = config.get("record_source")
        self.max_pending = config.get("max_pending_nodes")
        # step boundaries (capture/steps.py): a program ends at an optimizer step's end, and a
        # loop with no optimizer is cut where it comes round (its anchor: (place, op))
        self.step_boundaries = config.get("step_boundaries")
        self.program_nodes = config.get("program_nodes") if self.step_boundaries else 0
        self.whole_blocks = 0          # open ``defer(span="block")`` blocks: no cuts inside
        self.loop_anchor: Optional[tuple] = None
        self.cut_at = 0                # the id of the last node recorded before the last cut
        self.last_node: Optional[graph.Node] = None
        self.check_at = self._bound()   # pending_nodes past which at_bound() runs (-1: every op)
        shortcuts = config.shortcuts()
        self.eager_unseen = shortcuts.unseen_ops_at_once
        self.eager_lone = shortcuts.lone_ops_at_once
        self.host_scalars = shortcuts.host_scalars_at_once
        # a default defer mode's segment tier (exec/segments.Segments), set by SegmentedDeferMode;
        # while at_once_segment, every op runs at once (run_at_once)
        self.segments: Any = None
        self.at_once_segment = False
        self.ops_at_once = 0   # ops run at once while the mode was on the stack (a block's first run)
        # the block tier's choice (exec/blocks.BlockChoice) of the outermost ``with`` block this
        # recorder records, and the steps that ended in this run of it: a second one means the
        # block holds a loop of steps, which the segment tier then chooses for (step_ended)
        self.block: Any = None
        self.block_steps = 0
        self.block_reads: set = set()   # the places of reads that computed values, this run
        # id(plain tensor) -> (weak ref, entry, site) of results of ops run at once where their
        # flushes were lone: one of them feeding a recorded op means that place fuses again
        self.at_once: dict[int, tuple] = {}
        self.active = True
        self.epoch = next(_epochs)
        self.sizing: set = set()      # data-dependent ops whose size rule is running
        self.guarding_reads = False   # this block holds READ_PATCHES (it wrote a plain tensor)
        self.foreign_written: list[StorageState] = []   # foreign memory an op wrote: landed after it
        # outputs of pending ops that check values (an index out of range): each is computed by
        # the next flush of everything even if nothing reads it, so its error is raised
        self.checked: list[Value] = []
        # where the defer scope was entered (handlers.scope_of): handlers around it do not make
        # an op that may raise run at once (set by modes.py)
        self.scope: Optional[tuple] = None

    # -- graph building ------------------------------------------------------------------------
    def _node(self, op: Any, args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...], key: Any,
              lowering: Any = None, inputs: Optional[tuple] = None, scalars: tuple = ()) -> tuple[Value, ...]:
        """A new pending node; returns its output Values."""
        self.pending_nodes += 1
        source = user_line() if self.record_source else None
        values = graph.emit(op, args, kwargs, outs, key, source, lowering, inputs, scalars)
        if values:   # (an op with no outputs, unbind of an empty dim, ends no loop)
            self.last_node = values[0].node
            if getattr(lowering, "raises", False):
                self.checked.append(values[0])
        return values

    def check_values(self, condition: torch.Tensor, error: type, message: str) -> None:
        """Record that every element of ``condition`` must hold, or the flush computing it raises
        ``error(message)`` naming the user's line: a check torch's kernel makes on values it
        can read, which it skips for a tensor subclass such as a deferred tensor (one_hot's
        classes: capture/patches.py).  Computed by the next flush of everything, read or not."""
        value, m = self.read(condition)
        (out,) = self._node(graph.VALUE_CHECK, (value, error, message), {}, (m,),
                            (graph.VALUE_CHECK, error, message), inputs=(value,))
        self.checked.append(out)

    def raises_here(self, entry: Any) -> bool:
        """Whether the op of ``entry`` can raise on its inputs' values and a handler in the
        user's code would catch it here: then it runs at once, so the error is raised on its
        line, inside the ``try`` (capture/handlers.py)."""
        return entry.raises and catches(sys._getframe(2), VALUE_ERRORS, self.scope)

    def _real(self, t: torch.Tensor) -> tuple[StorageState, TensorMeta]:
        """The state and metadata of a plain tensor, remembered for this context by the tensor
        (weakly): an optimizer step reads and writes each parameter several times.  Checked on
        every use against the tensor's memory and layout, which code we do not see can change
        (``p.data = q``); changes we do see clear the memory of them (``_forget_plain``)."""
        if self.at_once:
            self._unmark_lone(t)
        key = id(t)
        cached = PLAIN.get(key)
        if cached is not None and cached[0]() is t:
            m = cached[2]
            storage = untyped_storage(t)
            if storage.data_ptr() == cached[3] and storage.nbytes() == cached[4] and t.shape == m.shape \
                    and t.stride() == m.stride and t.storage_offset() == m.offset:
                return cached[1], m
        state, m = self.state_of_real(t), TensorMeta.of(t)
        if len(PLAIN) >= PLAIN_CACHE_SIZE:
            PLAIN.clear()
        storage = untyped_storage(t)
        ref = weakref.ref(t, lambda dead, key=key, forget=forget_dead_plain: forget(key, dead))
        PLAIN[key] = (ref, state, m, storage.data_ptr(), storage.nbytes())
        return state, m

    def _forget_plain(self) -> None:
        """Plain tensors' metadata or storages may have changed (an in-place view op, a resize,
        an op run eagerly): look them up again."""
        PLAIN.clear()

    def _unmark_lone(self, t: torch.Tensor) -> None:
        """``t``, a result of an op run at once because its flushes were lone, feeds a recorded
        op (or a view that may): at that place the op may fuse again, so record it there next
        time."""
        ran = self.at_once.pop(id(t), None)
        if ran is not None and ran[0]() is t:
            meta_.unmark_lone(ran[1], ran[2])

    def state_of_real(self, t: torch.Tensor) -> StorageState:
        if opaque(t):
            raise NoStorage(t.layout)
        storage = untyped_storage(t)
        ptr = storage.data_ptr()
        state = STATES_BY_PTR.get(ptr) if ptr else None
        if state is not None and raw_data_ptr(state.buffer) != ptr:
            # its storage's memory moved (share_memory_ swaps it) and this address is another's
            del STATES_BY_PTR[ptr]
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
            state = StorageState(numel, t.dtype, t.device, buffer=flat_buffer(t, ptr, numel),
                                 foreign=foreign(storage) or exposed(ptr))
            state.owner = weakref.ref(t._base if t._base is not None else t, orphaned(weakref.ref(state)))
            if ptr:
                STATES_BY_PTR[ptr] = state
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
        return flatten_detached(state)

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
        if state.poisoned is not None:
            flush.raise_poisoned(state)
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
                READ_PATCHES.hold()
        if state.epoch != self.epoch:
            self._enter_epoch(state)
        if state.poisoned is not None:
            if not m.covers_storage:
                flush.raise_poisoned(state)   # (the rest of it has no value)
            state.poisoned = None
        if value.meta.dtype != m.dtype:
            cast_meta = value.meta._replace(dtype=m.dtype)
            value = self._node(graph.CAST, (value, m.dtype), {}, (cast_meta,), (graph.CAST, m.dtype), inputs=(value,))[0]
        if m.covers_storage:
            state.contents = ("root", value, m)
        else:
            flat = self.flat(state)
            (new,) = self._node(graph.WRITE_VIEW, (flat, value, m), {}, (flat_meta(state),), (graph.WRITE_VIEW, m),
                                  inputs=(flat, value))
            state.contents = ("flat", new)
        state.changed()
        state.reads[m] = value
        self.pending.append(weakref.ref(state))
        if state.foreign:
            self.foreign_written.append(state)

    def land_foreign_writes(self) -> None:
        """Compute the pending contents of foreign memory (a ``from_numpy`` tensor written in
        place), so that its owner, which reads the memory without asking torch, sees what strict
        would have written there by now."""
        states = [s for s in dict.fromkeys(self.foreign_written) if s.contents is not None]
        self.foreign_written = []
        if states:
            flush.materialize_states(states, FlushReason.FOREIGN_WRITE, self)

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
        k = static_key(a, is_scalar_arg)
        if k is float:
            r = runtime_scalar(a)
            scalars.append(a)
            return r, r, float
        return a, a, k

    # -- dispatch ------------------------------------------------------------------------------
    def dispatch(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        STATS.ops_recorded += 1
        facts = FACTS.get(id(func))
        if facts is None:
            facts = learn_facts(func)
        info, special, _ = facts
        if special is COLLECTIVE:
            return self.run_collective(func, args, kwargs)
        if (info.composite_implicit or special is not None or info.kind in ACTS_BEFORE_CONVERTING) \
                and opaque_in(args, kwargs):
            # (other kinds find an opaque argument when they convert it, before doing anything)
            result = self.run_eager(func, info, args, kwargs, FlushReason.FALLBACK, FallbackReason.OPAQUE)
            if self.pending_nodes > self.check_at:
                self.at_bound()
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
        fallback = None
        try:
            result = self.dispatch_kind(func, info, args, kwargs)
        except meta_.NoMeta:
            # raised by this op's own metadata inference, before anything was recorded for it
            # (ops it re-dispatches catch their own)
            fallback = (FlushReason.DATA_DEPENDENT, FallbackReason.DATA_DEPENDENT) if info.dynamic \
                else (FlushReason.FALLBACK, FallbackReason.NO_META)
        except NoStorage:
            # an opaque argument (of a view, or found by the fast path) or result (a sparse
            # gradient from dense inputs): the storage model has nothing to say
            fallback = (FlushReason.FALLBACK, FallbackReason.OPAQUE)
        if fallback is not None:
            # (outside the except: an error torch's kernel raises is the user's, with no
            # deferfuse exception chained to it)
            result = self.run_eager(func, info, args, kwargs, *fallback)
        if self.pending_nodes > self.check_at:
            self.at_bound()
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
        facts = FACTS.get(id(func)) or learn_facts(func)
        key = (facts[2], key)
        if at_once_if_unseen and meta_.first_sighting(key, user_line()):
            return None
        if grad_mode_keyed(func):
            key = (key, torch.is_grad_enabled())
        try:
            entry = meta_.infer(func, key, margs, mkw)
        except NotImplementedError as error:
            # a result with no storage from dense arguments (embedding's sparse gradient):
            # what torch says when our metadata asks for its storage
            if NO_STORAGE_MESSAGE in str(error):
                raise NoStorage(func) from error
            raise
        if entry.lowering is None and (any(m.dtype in QUANTIZED_DTYPES for m in entry.tensor_outs)
                                       or any(a in QUANTIZED_DTYPES for a in itertools.chain(args, kwargs.values())
                                              if isinstance(a, torch.dtype))):
            # a quantized result (quantize_per_tensor's meta kernel gives a float one: the
            # quantized dtype it is asked for says it)
            raise NoStorage(func)
        return vargs, vkw, entry, key, inputs, scalars

    def record(self, func, info, args, kwargs) -> Any:
        found = self._entry(func, info, args, kwargs, self.eager_unseen and computed_args(args, kwargs))
        if found is None:
            # seen for the first time with its inputs computed: run it as strict does
            # (eager_unseen_ops), with no meta inference
            STATS.unseen_ops_run += 1
            return self.run_eager(func, info, args, kwargs, None, None)
        vargs, vkw, entry, key, inputs, scalars = found
        if entry.lowering is None and not entry.on_torch:
            return self.without_lowering(func, info, args, kwargs, entry)
        if entry.raises and self.raises_here(entry):
            STATS.raising_ops_run += 1
            return self.run_eager(func, info, args, kwargs, FlushReason.TRY_BLOCK, None)
        outputs = self._node(func, vargs, vkw, entry.tensor_outs, key, entry, inputs, scalars)
        return restructure(info, self._fresh_outputs(entry, outputs))

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
        decomposition = decomposition_of(func)
        if decomposition is None:
            return NotImplemented
        with self.mode.recording():
            result = decomposition(*args, **kwargs)
        if result is not NotImplemented:
            STATS.decompositions[str(func)] += 1
            result = undefined_where_masked(func, args, kwargs, result)
        return result

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
        if entry.lowering is None and not entry.on_torch:
            return self.without_lowering(func, info, args, kwargs, entry)
        if entry.raises and self.raises_here(entry):
            STATS.raising_ops_run += 1
            return self.run_eager(func, info, args, kwargs, FlushReason.TRY_BLOCK, None)
        outputs = self._node(func, vargs, vkw, entry.tensor_outs, key, entry, inputs, scalars)
        return restructure(info, self._fresh_outputs(entry, outputs))

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

    def flush_all(self, reason: FlushReason, detail: Optional[str] = None) -> None:
        states = self.pending_states()
        checked = [v for v in self.checked if v.result is None] if self.checked else []
        self.checked = []
        if states or checked:
            flush.materialize_states(states, reason, self, everything=True, detail=detail, checked=checked)
        self.pending_nodes = 0
        last = self.last_node
        self.cut_at = -1 if last is None else last.id
        self.release_states(keep_live=True)

    def release_states(self, keep_live: bool = False) -> None:
        """Nothing this recorder recorded is pending (everything was flushed, or the context
        ends, or its segment runs at once): the storages it touched are let go, with what they
        cached from its graphs (drop_reads), and each is entered afresh when next touched (its
        epoch).  Without this a context that never ends (TORCHTPU_MODE=defer) held every storage
        it ever read: on the zoo's Llama, the memory of each step's results that ran at once,
        ~13 MB a step.  A storage whose contents are still pending stays held; ``keep_live``
        (a flush of everything, the context going on): so does the storage of a live user
        tensor, with the reads it cached, as an optimizer's parameters are read again by the
        next program (re-entering 200 of them after each of an AdamW step's cuts cost ~13%)."""
        states = self.real_states
        if not states:
            return
        epoch = self.epoch
        held, let_go = set(), []
        for s in states:
            owner = s.owner
            if s.contents is not None or (keep_live and owner is not None and owner() is not None):
                held.add(s)
            else:
                let_go.append(s)
                if s.epoch == epoch:
                    s.epoch = -1
        drop_reads(let_go)
        self.real_states = held
        if ORPHANS:
            ORPHANS[:] = [ref for ref in ORPHANS if ref() is not None and ref() in held]

    def flushed(self) -> None:
        """A flush of part of what is pending ended (an inference loop reading each batch's
        result with .item() flushes only that): the storages it holds whose user tensors have
        gone since (ORPHANS) are let go, unless their contents are pending or pending nodes
        still read their graph inputs (a write to the memory must then keep what those read:
        snapshot_old_leaves); those are looked at again at the next flush.  The storages of
        live tensors (an optimizer's parameters) stay held, with the reads they cached."""
        if not ORPHANS or not self.active:
            return
        orphans = []
        while ORPHANS:   # (pop by pop: another thread's recorder may take some at the same time)
            try:
                orphans.append(ORPHANS.pop())
            except IndexError:
                break
        states, epoch = self.real_states, self.epoch
        for ref in orphans:
            s = ref()
            if s is None or s not in states:
                continue   # (gone, or another recorder's: let go when that one flushes everything)
            if s.contents is None:
                drop_reads((s,))   # (what it cached; its graph inputs no longer alive are unlisted)
                if not s.old_leaves:
                    states.discard(s)
                    if s.epoch == epoch:
                        s.epoch = -1
                    continue
            ORPHANS.append(ref)   # (still needed: looked at again at the next flush)

    # -- step boundaries (capture/steps.py) ----------------------------------------------------
    def _bound(self) -> int:
        """How many pending nodes may be recorded before ``at_bound`` must look."""
        if self.loop_anchor is not None:
            return -1
        if self.program_nodes > 0 and not self.whole_blocks:
            return min(self.max_pending, self.program_nodes)
        return self.max_pending

    def hold_whole_block(self, delta: int) -> None:
        """A ``defer(span="block")`` block opened (+1) or closed (-1): no step cuts inside."""
        self.whole_blocks += delta
        self.check_at = self._bound()

    def step_ended(self, place: Any) -> None:
        """An optimizer's step() ended (``place``: the user's call of it): the step's program
        ends here, and under the segment tier so does the segment."""
        if self.loop_anchor is not None:
            # (a loop with an optimizer: its steps bound it; no anchor needed)
            self.loop_anchor = None
            self.check_at = self._bound()
        if self.segments is not None and not self.whole_blocks:
            self.segments.observed(self, place, FlushReason.STEP)
            self.mode.settle()
        elif self.step_boundaries and not self.whole_blocks:
            self.flush_all(FlushReason.STEP)
            if self.block is not None:
                self.block.iteration_ended()
                self.block_steps += 1
                if self.block_steps >= 2:
                    self._segment_block(place, FlushReason.STEP)

    def read_ended(self, place: Any) -> None:
        """A read by the user's code computed pending values (it flushed) in a run of an
        outermost timed block: a second such read at the same place in one run means the block
        holds a loop (an evaluation loop printing a metric), whose iterations the segment tier
        then chooses for, as a second step's end does (step_ended)."""
        if self.block is None or self.segments is not None or self.whole_blocks or place is None:
            return
        self.block.iteration_ended()
        key = (place.code, place.line)
        if key in self.block_reads:
            self._segment_block(place, FlushReason.SYNC)
        else:
            self.block_reads.add(key)

    def _segment_block(self, place: Any, reason: FlushReason) -> None:
        """The block this recorder records holds a loop: from this boundary on its iterations
        are the segment tier's (capture/mode.DeferMode.segment).  Its iterations ran deferred
        already, first sightings included, so they try that way from their first run, as a
        block does (a block's exploration credit, no first-trial estimate), less what they
        have cost already (BlockChoice.loop_seed)."""
        if not config.shortcuts().segments_timed:
            return
        from ..exec.blocks import BLOCK_CREDIT_S
        from ..exec.segments import Segments
        self.block.holds_loop = True
        self.mode.segment(Segments(credit=BLOCK_CREDIT_S, trial_runs=0.0, seed=self.block.loop_seed()),
                          place, reason)

    def at_bound(self) -> None:
        """More nodes are pending than ``check_at``: past ``max_pending_nodes`` everything is
        flushed; past ``program_nodes`` with no step boundary, the loop being recorded is cut
        here, and from then on after each op where it comes round (its anchor)."""
        if self.pending_nodes > self.max_pending:
            self.flush_all(FlushReason.NODE_LIMIT)
            return
        if self.program_nodes <= 0 or self.whole_blocks:
            self.check_at = self._bound()
            return
        last = self.last_node
        anchor = self.loop_anchor
        if anchor is not None and last is not None and last.op is anchor[1] and last.source == anchor[0]:
            if last.id - self.cut_at >= self.program_nodes // 8:
                self.flush_all(FlushReason.LOOP)
        elif self.pending_nodes > self.program_nodes and last is not None:
            # no boundary in a whole program's worth of ops: a loop with no optimizer (or a new
            # one, its old anchor left behind); the op just recorded stands for its place in it
            self.loop_anchor = (last.source, last.op)
            self.check_at = -1
            self.flush_all(FlushReason.LOOP)
