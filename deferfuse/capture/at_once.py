"""Ops run at once on torch's kernel instead of recorded.

``AtOnceMixin`` holds the Recorder's methods for them: a lone op at a place whose flushes were
lone (eager_lone_ops), host scalar bookkeeping (host_scalars_at_once), ``item()`` of computed
memory, random, observing and allocating ops, and the eager fallback (``run_eager``), with
``realize``, which gives the data of deferred tensors in an argument tree.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Optional

import torch

from ..debugging.source import user_line_from
from ..errors import FallbackReason, FlushReason
from ..ir import graph
from ..lower.table import get_lowering
from ..stats import STATS
from . import flush
from . import meta as meta_
from .classify import FRESH_RESULT_KINDS, OpKind
from .collectives import COLLECTIVE
from .opaque import opaque
from .opfacts import FACTS, LOCAL_SCALAR_DENSE, learn_facts
from .storage import STATES_BY_PTR, forget_all_reads, snapshot_old_leaves, untyped_storage
from .tensor import DeferredTensor, cannot_grow, follow_layout
from .trees import map_returned, map_tensors, restructure, tensors_in, written_arguments

aten = torch.ops.aten
AT_ONCE_LIMIT = 4096   # results of ops run at once that a context watches for consumers


def computed_args(args: tuple, kwargs: dict) -> bool:
    """Whether every tensor argument holds its values already (no pending writes into it)."""
    return all_computed(tensors_in(args, kwargs))


def all_computed(tensors: list) -> bool:
    for t in tensors:
        if type(t) is DeferredTensor:
            if t._storage.contents is not None:
                return False
        elif opaque(t):
            return False
        else:
            state = STATES_BY_PTR.get(untyped_storage(t).data_ptr())
            if state is not None and state.contents is not None:
                return False
    return True


class AtOnceMixin:
    """The Recorder's ops run at once, and ``realize``."""

    def at_once_if_lone(self, func, args: tuple, kwargs: dict) -> Any:
        """Run a pure op at once on torch's kernel if its last flush at this place in the user's
        code was lone and its inputs are computed (eager_lone_ops); NotImplemented otherwise.
        Tried before recording, only for ops that have had a lone flush: the place is asked
        first, so elsewhere this costs one lookup."""
        site = user_line_from(sys._getframe(3))   # (above mode.py's _record and _defer_dispatch)
        if (id(func), site) not in meta_.LONE_PLACES:
            return NotImplemented
        info = (FACTS.get(id(func)) or learn_facts(func))[0]
        if info.kind is not OpKind.PURE:
            return NotImplemented
        tensors = tensors_in(args, kwargs)
        if not all_computed(tensors):
            return NotImplemented
        STATS.ops_recorded += 1
        STATS.lone_ops_run += 1
        if any(type(t) is not torch.Tensor for t in tensors):
            # (computed deferred tensors, or other subclasses: their data, as the kernel wants;
            # plain tensors, the common case, go as they are)
            args, kwargs = self.realize((args, kwargs), FlushReason.FALLBACK)
        out = func(*args, **kwargs)
        at_once = self.at_once
        if len(at_once) >= AT_ONCE_LIMIT:
            # (a long block running such an op every iteration: keep the live results only,
            # and forget them all if they are live too; that only delays an unmarking)
            live = {k: v for k, v in at_once.items() if v[0]() is not None}
            self.at_once = at_once = live if len(live) < AT_ONCE_LIMIT // 2 else {}
        for t in tensors_in(out):
            at_once[id(t)] = (weakref.ref(t), func, site)
        return out

    def item_if_computed(self, t: torch.Tensor) -> Any:
        """``t.item()`` of a plain CPU tensor with no pending contents, read at once: what the
        general path (run_observing) does for it, without the way there.  NotImplemented
        otherwise."""
        if t.device.type != "cpu" or opaque(t):
            return NotImplemented
        state = STATES_BY_PTR.get(untyped_storage(t).data_ptr())
        if state is not None and state.contents is not None:
            return NotImplemented
        STATS.ops_recorded += 1
        return LOCAL_SCALAR_DENSE(t)

    def resolved_at_once(self, func, args: tuple, kwargs: dict) -> Any:
        """``clone`` of a plain conjugate or negative view with computed contents, run at once:
        torch's ``tolist`` resolves such a view through the dispatcher (a clone) and then reads
        the result's memory, which a deferred result does not have ("unallocated storage").
        NotImplemented otherwise."""
        t = args[0]
        if opaque(t) or not all_computed([t]):
            return NotImplemented
        STATS.ops_recorded += 1
        return func(*args, **kwargs)

    def at_once_if_host_scalar(self, func, args: tuple, kwargs: dict) -> Any:
        """Run a pointwise op at once on torch's kernel when every tensor it touches is a plain
        CPU tensor of at most one element with computed contents (host_scalars_at_once);
        NotImplemented otherwise.  Scalar bookkeeping (an optimizer's ``step += 1`` then
        ``step.item()``) then costs a kernel call instead of a recorded node and a flush.
        Pending nodes that read a storage this op overwrites keep its old contents."""
        info = (FACTS.get(id(func)) or learn_facts(func))[0]
        if not info.pointwise or info.random or info.kind not in (OpKind.PURE, OpKind.MUTATING):
            return NotImplemented
        states = []
        for t in tensors_in(args, kwargs):
            if type(t) is not torch.Tensor or t.device.type != "cpu" or opaque(t) or t.numel() > 1:
                return NotImplemented
            state = STATES_BY_PTR.get(untyped_storage(t).data_ptr())
            if state is not None:
                if state.contents is not None:
                    return NotImplemented
                states.append(state)
        if info.written and states:
            for t in written_arguments(func, info, args, kwargs):
                state = STATES_BY_PTR.get(untyped_storage(t).data_ptr())
                if state is not None:
                    snapshot_old_leaves(state)
                    state.old_leaves = []
                    state.changed()
        STATS.ops_recorded += 1
        STATS.host_scalar_ops_run += 1
        return func(*args, **kwargs)

    def run_at_once(self, func, args: tuple, kwargs: dict) -> Any:
        """An op of a segment that runs at once (exec/segments.Segments): on torch's kernel now,
        as strict runs it.  The segment started with nothing pending and records nothing, so
        every tensor holds its values: the op goes to torch as it is (a deferred tensor from
        before the segment answers with its data, as after its block), except a write, which
        run_eager also marks on the memory deferfuse tracks (what a later deferred segment
        read of it before is stale)."""
        info, special, _ = FACTS.get(id(func)) or learn_facts(func)
        if special is COLLECTIVE:
            return self.run_collective_at_once(func, args, kwargs)
        if info.written:
            return self.run_eager(func, info, args, kwargs, FlushReason.SYNC, None)
        return func(*args, **kwargs)

    def run_observing(self, func, info, args, kwargs) -> Any:
        reason = FlushReason.ITEM if func in (aten._local_scalar_dense.default, aten.is_nonzero.default) \
            else FlushReason.OBSERVING_OP
        if self.block is None or self.segments is not None:
            return self.run_eager(func, info, args, kwargs, reason, None)
        flushed = STATS.flushes[reason.value]
        result = self.run_eager(func, info, args, kwargs, reason, None)
        if reason is FlushReason.ITEM and STATS.flushes[reason.value] != flushed:
            # (.item() in a block around a loop: Recorder.read_ended)
            self.read_ended(user_line_from(sys._getframe(1)))
        return result

    def run_allocation(self, func, info, args, kwargs) -> Any:
        """empty*: allocate real memory now; only the inputs' metadata matters."""
        vargs, vkw, entry, key, inputs, scalars = self._entry(func, info, args, kwargs)
        outs = [torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=m.device) for m in entry.tensor_outs]
        return restructure(info, outs)

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
                return restructure(info, self._fresh_outputs(entry, outputs))
        return self.run_eager(func, info, args, kwargs, FlushReason.FALLBACK, FallbackReason.RANDOM)

    # -- eager execution -----------------------------------------------------------------------
    def run_eager(self, func, info, args, kwargs, flush_reason: Optional[FlushReason],
                  fallback_reason: Optional[FallbackReason]) -> Any:
        written = written_arguments(func, info, args, kwargs) if info.written else []
        if written:
            # pending ops that read what this op overwrites must see the old data
            self.flush_all(flush_reason or FlushReason.FALLBACK)
        # (an opaque result may hold its arguments' memory: sparse_coo_tensor keeps its values)
        exposes = info.kind not in FRESH_RESULT_KINDS or fallback_reason is FallbackReason.OPAQUE
        real_args, real_kwargs = self.realize((args, kwargs), flush_reason or FlushReason.FALLBACK, exposes)
        try:
            out = func(*real_args, **real_kwargs)
        except RuntimeError as exc:
            if "storage that is not resizable" in str(exc) and any(isinstance(t, DeferredTensor) for t in written):
                # (torch's kernel grew an out= tensor that is a view of deferfuse's memory)
                raise cannot_grow(func, "a deferred tensor it writes (an out= tensor too small for its result)") from exc
            raise
        if fallback_reason is not None:
            # (counted once it ran: a call torch rejects raised strict's error, and fell back
            # from nothing)
            STATS.fallbacks[str(func)] += 1
            STATS.fallback_reasons[fallback_reason.value] += 1
        if written:
            self._forget_plain()   # (an out= tensor may have been resized)
        for t in written:
            if isinstance(t, DeferredTensor):
                t._storage.changed()
            elif not opaque(t):
                self.state_of_real(t).changed()
            else:
                # which memory it wrote we cannot tell (a sparse tensor's values, a subclass's
                # inner tensors): what was read from any memory may be stale
                forget_all_reads()
        if written:
            real_written = written_arguments(func, info, real_args, real_kwargs)
            for t, r in zip(written, real_written):
                if isinstance(t, DeferredTensor) and isinstance(r, torch.Tensor):
                    follow_layout(t, r)
            return map_returned(out, real_written, written)
        return out

    def realize(self, tree: Any, reason: FlushReason, exposes: bool = True) -> Any:
        """``tree`` with every DeferredTensor replaced by its data, pending storages written back
        (``exposes``: False where the data is only read, by an op whose results alias none of
        its arguments)."""
        tensors = tensors_in(tree)
        states = []
        for t in tensors:
            if isinstance(t, DeferredTensor):
                states.append(t._storage)
            elif opaque(t):
                # its memory may be any storage's (a sparse tensor's values, a subclass's
                # inner tensors), written by pending ops
                self.flush_all(reason)
            else:
                state = STATES_BY_PTR.get(untyped_storage(t).data_ptr())
                if state is not None:
                    states.append(state)
        flush.materialize_states([s for s in states if s.contents is not None], reason, self)
        return map_tensors(tree, lambda t: t._materialize(exposes=exposes) if isinstance(t, DeferredTensor) else t)
