"""The fast path: the commonest calls recorded in few frames.

A pure op with one result, an in-place op recorded as its functional twin, or a view with one
result, whose metadata is cached (``FastForm`` says what an op needs).  ``FastPathMixin`` holds
the Recorder's methods for them; they must stay equal to the general path in what they record.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, NamedTuple, Optional

import torch

from ..debugging.source import user_line_from
from ..errors import FlushReason
from ..ir import graph
from ..ir.graph import Value
from ..ir.meta import TensorMeta
from ..stats import STATS
from . import meta as meta_
from .classify import OpKind
from .mutation import check_inplace_result, check_no_partial_overlap, may_share_memory
from .opaque import NoStorage
from .opfacts import FACTS, INPLACE_TWINS, LAZY_BIT_VIEW_IDS, UNKNOWN, inplace_twin, learn_facts
from .scalars import SCALARS, ints_only, runtime_scalar
from .tensor import DeferredTensor


class FastForm(NamedTuple):
    """What Recorder.record_fast needs of an op: its name for cache keys, per positional
    argument whether a float there is a runtime scalar, the names of its scalar arguments, and
    for an in-place op its functional twin (op, name, which inputs must not partially overlap
    the target: ``overlap_rule``)."""
    name: str
    scalar_at: tuple
    scalar_names: frozenset
    functional: Any = None
    functional_name: str = ""
    overlap: Optional[str] = None
    view: bool = False


# Per op, its fast path's form, or None where it has none: a pure op with one tensor result
# that neither decomposes itself nor has a special form of ours, an in-place op whose
# functional twin is such an op and takes the same arguments (``inplace_twin``), or a view op
# with one result (not the lazy conjugate and negative views).
FAST: dict[int, Optional[FastForm]] = {}
UNSEEN = object()


def fast_form(func: torch._ops.OpOverload) -> Optional[FastForm]:
    info, special, name = FACTS.get(id(func)) or learn_facts(func)
    form = None
    if not info.composite_implicit and special is None:
        scalar_at = tuple(n in info.scalar_args for n in info.arg_names)
        if info.kind is OpKind.PURE and info.returns == "one":
            form = FastForm(name, scalar_at, info.scalar_args)
        elif info.kind is OpKind.VIEW and info.returns == "one" and id(func) not in LAZY_BIT_VIEW_IDS:
            form = FastForm(name, scalar_at, info.scalar_args, view=True)
        elif info.kind is OpKind.MUTATING:
            twin = INPLACE_TWINS.get(id(func), UNKNOWN)
            if twin is UNKNOWN:
                twin = inplace_twin(func, info)
            if twin is not None:
                functional, _, functional_name, name, overlap = twin
                form = FastForm(name, scalar_at, info.scalar_args, functional, functional_name, overlap)
    FAST[id(func)] = form
    return form


class FastPathMixin:
    """The Recorder's fast path (``record_fast``, called by DeferMode's dispatch first)."""

    def _fast_node(self, op: Any, args: tuple, kwargs: dict, outs: tuple[TensorMeta, ...], key: Any,
                   entry: Any, inputs: tuple, scalars: tuple) -> Value:
        """``_node`` for ``record_fast``, whose caller is mode.py's ``_record``, called by
        ``_defer_dispatch``, called by torch: the user's frame (or torch's Python wrapper) is the
        one above those, so the walk for the source line starts there."""
        self.pending_nodes += 1
        source = user_line_from(sys._getframe(4)) if self.record_source else None
        # (graph.emit for the one output the fast path's ops have, one call shorter)
        node = graph.Node(op, args, kwargs, outs, key, source, entry, inputs, scalars)
        value = graph.Value(node, 0, outs[0])
        node.out_refs = (weakref.ref(value),)
        self.last_node = node
        return value

    def _convert_fast(self, form: "FastForm", args: tuple, kwargs: dict) -> Optional[tuple]:
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
                    vargs.append(SCALARS.get(a) or runtime_scalar(a))
                    kparts.append(float)
                    scalars.append(a)
                elif type(a) is int:
                    # (dims and sizes: static, their own key; what _convert_one gives them)
                    vargs.append(a)
                    kparts.append(a)
                elif type(a) is list and ints_only(a):
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
        except NoStorage:
            return None
        return tuple(vargs), vkw, (tuple(kparts), tuple(kkw)), tuple(found), tuple(scalars)

    def record_fast(self, func: torch._ops.OpOverload, form: "FastForm", args: tuple, kwargs: dict) -> Any:
        """The commonest calls, in few frames: a pure op with one result, or an in-place op
        recorded as its functional twin, whose metadata is cached.  The same nodes, keys and
        results as the general path (``record``, ``_record_inplace``, ``record_view``), which
        this must stay equal to.  NotImplemented where the general path must run; nothing has
        been recorded then but cached reads of the arguments, which it reuses."""
        if form.view:
            return self._view_fast(func, form, args, kwargs)
        if form.functional is not None and args and type(args[0]) is DeferredTensor \
                and args[0]._storage.poisoned is not None:
            return NotImplemented   # (a write into a value whose op failed: record_mutation)
        converted = self._convert_fast(form, args, kwargs)
        if converted is None:
            return NotImplemented
        vargs, vkw, key, found, scalars = converted
        if form.functional is None:
            key = (form.name, key)
            entry = meta_.cached(key)
            if entry is None or entry.lowering is None or entry.outs[0] is None or entry.raises:
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
            if entry is None or entry.lowering is None or len(entry.tensor_outs) != 1 or entry.raises:
                return NotImplemented
            out = entry.tensor_outs[0]
            if form.overlap is not None and may_share_memory(target, args, kwargs):
                check_no_partial_overlap([target], args, kwargs, form.overlap)
            check_inplace_result(target, out.shape, out.dtype)
            STATS.ops_recorded += 1
            value = self._fast_node(form.functional, vargs, vkw, entry.tensor_outs, key, entry, found, scalars)
            self.write(target, value, target_meta)
            result = target
        if self.pending_nodes > self.check_at:
            self.at_bound()
        return result

    def _view_fast(self, func, form: "FastForm", args: tuple, kwargs: dict) -> Any:
        """``record_view`` for a view of a deferred tensor (no lazy bits) whose metadata is
        cached: a deferred tensor on the same storage with the view's metadata, no node; and
        for a view of a user tensor with no other tensor argument: the real view."""
        base = args[0] if args else None
        if type(base) is not DeferredTensor:
            if not isinstance(base, torch.Tensor) or isinstance(base, DeferredTensor) or kwargs:
                return NotImplemented
            for a in args[1:]:
                if isinstance(a, torch.Tensor) or type(a) in (list, tuple) and not ints_only(a):
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
        if out is None or out.dtype != state.dtype or state.contents is None and state.buffer is not None:
            return NotImplemented   # (a view of a computed value is a real view: record_view)
        STATS.ops_recorded += 1
        return DeferredTensor(out, state, self)
