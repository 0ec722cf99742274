"""Mutation and aliasing: views, in-place and out= ops, in-place view ops, and the overlap checks
torch's kernels make (which meta kernels do not).

``MutationMixin`` holds the Recorder's methods for them: a view shares its base's storage and
records no node; a write records the op's functional twin and writes its result into the
target's storage (``record_mutation``; the common ``x.mul_(y)`` as one node, ``_record_inplace``).
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import torch
from torch._prims_common.wrappers import _maybe_resize_out, _resize_output_check

from ..errors import FallbackReason, FlushReason
from ..ir import graph
from ..ir.graph import StorageState
from ..ir.meta import TensorMeta
from ..stats import STATS
from . import meta as meta_
from .classify import factory_options, functional_variant, op_info
from .dispatch_keys import no_dispatch
from .opfacts import INPLACE_TWINS, LAZY_BIT_VIEWS, UNKNOWN, inplace_twin, overlap_rule, rebind
from .sized import SIZED
from .storage import STATES_BY_PTR, untyped_storage
from .tensor import DeferredTensor, cannot_grow
from .trees import restructure, tensors_in, written_arguments

aten = torch.ops.aten


# In-place ops that write every element of their target whatever it held
OVERWRITES = frozenset({torch.ops.aten.copy_.default, torch.ops.aten.fill_.Scalar,
                        torch.ops.aten.fill_.Tensor, torch.ops.aten.zero_.default})


def unpoison(state: StorageState) -> None:
    """A poisoned storage (its op failed: capture/flush.poison) about to be written whole: it
    holds zeros until then, which the write replaces."""
    with no_dispatch():
        zeros = torch.zeros(state.numel, dtype=state.dtype, device=state.device)
    state.poisoned = None
    state.contents = ("flat", graph.leaf(zeros))
    state.changed()


def computed_view_base(base: Any) -> bool:
    """Whether ``base`` is a deferred tensor whose value is computed and plain to view: its
    views are then real views, plain tensors (no lazy bits, a storage of its own dtype)."""
    if type(base) is not DeferredTensor:
        return False
    state = base._storage
    return state.contents is None and state.buffer is not None and state.poisoned is None \
        and base._meta.dtype == state.dtype and not base._lazy_bits


def _non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """c10's ``is_non_overlapping_and_dense``."""
    return (t._meta if isinstance(t, DeferredTensor) else TensorMeta.of(t)).is_dense


def may_share_memory(target: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether a tensor argument other than ``target`` itself may lie in ``target``'s memory
    (``_same_memory``, without building the list of tensors): an optimizer's in-place updates
    read other tensors almost always, and this runs before every one of them.  A list or dict
    argument answers yes; the full check then looks inside."""
    deferred = type(target) is DeferredTensor
    state = target._storage if deferred else None
    pointer = 0
    if not deferred and target.layout is torch.strided:
        pointer = untyped_storage(target).data_ptr()
    for a in itertools.chain(args, kwargs.values()):
        if a is target:
            continue
        if type(a) is DeferredTensor:
            if a._storage is state:
                return True
        elif isinstance(a, torch.Tensor):
            if isinstance(a, DeferredTensor):
                return True      # (a subclass of ours: let the full check decide)
            if pointer and a.layout is torch.strided and untyped_storage(a).data_ptr() == pointer:
                return True
        elif isinstance(a, (list, tuple, dict)):
            return True
    return False


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if isinstance(a, DeferredTensor) or isinstance(b, DeferredTensor):
        return isinstance(a, DeferredTensor) and isinstance(b, DeferredTensor) and a._storage is b._storage
    if a.layout is not torch.strided or b.layout is not torch.strided:
        return False
    return untyped_storage(a).data_ptr() == untyped_storage(b).data_ptr() != 0


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


def check_no_partial_overlap(targets: list, args: tuple, kwargs: dict, rule: str = "all") -> None:
    """torch's kernels refuse to write a tensor that partially overlaps an input
    (``assert_no_partial_overlap``, the inputs ``rule`` names); meta kernels do not check it."""
    if rule == "mask":
        args, kwargs = (args[1:2], {}) if len(args) > 1 else ((), {"mask": kwargs.get("mask")})
    for target in targets:
        for t in tensors_in(args, kwargs):
            if _partially_overlap(target, t):
                raise RuntimeError(
                    "unsupported operation: some elements of the input tensor and the written-to "
                    "tensor refer to a single memory location. Please clone() the tensor before "
                    "performing the operation.")


def check_inplace_result(target: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    if tuple(shape) != tuple(target.shape):
        # what torch's kernels say when an in-place result would need a resize
        raise RuntimeError(f"output with shape {list(target.shape)} doesn't match the "
                           f"broadcast shape {list(shape)}")
    if dtype is not target.dtype and not torch.can_cast(dtype, target.dtype):
        # torch's rule for every in-place and out= result (TensorIterator's, and the
        # references' _safe_copy_out); meta kernels of in-place ops do not check it
        raise RuntimeError(f"result type {_type_name(dtype)} can't be cast to the "
                           f"desired output type {_type_name(target.dtype)}")


def real_view_of(dtype: torch.dtype, storage_dtype: torch.dtype, func, base) -> bool:
    """A view that reads complex memory as its real dtype: view_as_real of a deferred tensor,
    or a view of such a view (deferred: a plain tensor's views are real views already)."""
    if not storage_dtype.is_complex or dtype != storage_dtype.to_real() or not isinstance(base, DeferredTensor):
        return False
    return func is aten.view_as_real.default or base._meta.dtype == dtype


def suggested_memory_format(t: torch.Tensor) -> torch.memory_format:
    """The layout torch's resize_as_ keeps for preserve_format (ATen's suggest_memory_format)."""
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if t.dim() == 5 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def set_bits(t: torch.Tensor, conj: bool, neg: bool) -> None:
    torch._C._set_conj(t, conj)
    torch._C._set_neg(t, neg)
    if type(t) is DeferredTensor:
        t._lazy_bits = conj or neg


def meta_of(t: torch.Tensor) -> TensorMeta:
    return t._meta if isinstance(t, DeferredTensor) else TensorMeta.of(t)


def _type_name(dtype: torch.dtype) -> str:
    """The name torch's messages give a dtype (Float, Long, ComplexDouble)."""
    return torch.empty((), dtype=dtype, device="meta").type().split(".")[-1].replace("Tensor", "")


class MutationMixin:
    """The Recorder's views, writes and in-place view ops."""

    def record_view(self, func, info, args, kwargs) -> Any:
        base = args[0]
        if not isinstance(base, DeferredTensor) and not any(
                isinstance(t, DeferredTensor) for t in tensors_in(args[1:], kwargs)):
            # A view of a plain tensor is metadata only: make the real view now.  Its reads and
            # writes still go through the storage's state, and code that reads memory directly
            # (numpy(), C extensions) gets a real tensor rather than a data-less wrapper.
            if self.at_once:
                self._unmark_lone(base)
            return func(*args, **kwargs)
        if func in LAZY_BIT_VIEWS:
            if not isinstance(base, DeferredTensor):
                return self.run_eager(func, info, args, kwargs, FlushReason.FALLBACK, FallbackReason.UNSUPPORTED_ALIASING)
            # the same memory, read through a conjugate or negative bit (toggled, as torch does):
            # reads apply it (read), writes through it run eagerly (record_mutation)
            view = DeferredTensor(base._meta, base._storage, self)
            conj, neg = base.is_conj(), base.is_neg()
            set_bits(view, conj != (func is aten._conj.default), neg != (func is aten._neg_view.default))
            return view
        if computed_view_base(base) and not any(isinstance(t, DeferredTensor) for t in tensors_in(args[1:], kwargs)):
            # A view of a value computed already (loss.detach() after loss.item()): the real
            # view of its memory, a plain tensor as strict gives (the memory is handed out: a
            # later flush writes the storage's new contents into it rather than swap it)
            real = base._materialize(FlushReason.SYNC, exposes=True)
            with no_dispatch():
                return func(real, *args[1:], **kwargs)
        vargs, vkw, entry, key, inputs, scalars = self._entry(func, info, args, kwargs)
        state = base._storage if isinstance(base, DeferredTensor) else self.state_of_real(base)
        if any(o.dtype != state.dtype and not real_view_of(o.dtype, state.dtype, func, base)
               for o in entry.tensor_outs):
            return self.run_eager(func, info, args, kwargs, FlushReason.FALLBACK, FallbackReason.UNSUPPORTED_ALIASING)
        views = [None if o is None else DeferredTensor(o, state, self) for o in entry.outs]
        if isinstance(base, DeferredTensor) and (base.is_conj() or base.is_neg()):
            # a view of a view with lazy bits has them too
            for v in views:
                if v is not None:
                    set_bits(v, base.is_conj(), base.is_neg())
        return restructure(info, views)

    def record_mutation(self, func, info, args, kwargs) -> Any:
        if args and type(args[0]) is DeferredTensor and args[0]._storage.poisoned is not None \
                and func in OVERWRITES and args[0]._meta.covers_storage:
            # (a value whose op failed, written whole: the write makes it a value again)
            unpoison(args[0]._storage)
        twin = INPLACE_TWINS.get(id(func), UNKNOWN)
        if twin is UNKNOWN:
            twin = inplace_twin(func, info)
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
        targets = written_arguments(func, info, args, kwargs)
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
        overlap = overlap_rule(info, functional)
        if overlap is not None:
            check_no_partial_overlap(targets, args, kwargs, overlap)
        f_args, f_kwargs = rebind(func, functional, f_args, f_kwargs)
        results = self.dispatch_functional(functional, f_args, f_kwargs)
        results = results if isinstance(results, (tuple, list)) else (results,)
        if any(isinstance(r, (tuple, list)) for r in results):
            # a written Tensor[] comes back as a list among the twin's results (the AMP unscale's
            # (grads, found_inf)): flat, as written_arguments lists the targets
            results = [t for r in results for t in (r if isinstance(r, (tuple, list)) else (r,))]
        outs = entry.outs if entry is not None else tuple(meta_of(r) for r in results)
        if is_out and (any(o is not None and tuple(r.shape) != tuple(o.shape) for r, o in zip(results, outs))
                       or not self._resize_outs(func, targets, outs, results if info.pointwise else None)):
            # out= whose kernel writes other shapes than its functional twin computes (batch
            # norm's saved statistics in eval), or that resizes an output with pending
            # contents: let torch do it (what was just recorded is never used)
            return self.run_eager(func, info, args, kwargs, FlushReason.FALLBACK, FallbackReason.UNSUPPORTED_ALIASING)
        for target, result in zip(targets, results):
            check_inplace_result(target, tuple(result.shape), result.dtype)
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
        if entry.lowering is None or len(entry.tensor_outs) != 1 or entry.raises and self.raises_here(entry):
            return NotImplemented   # (one that may raise inside a try: the general path runs it)
        out = entry.tensor_outs[0]
        if overlap is not None:
            check_no_partial_overlap([target], args, kwargs, overlap)
        check_inplace_result(target, out.shape, out.dtype)
        (value,) = self._node(functional, vargs, vkw, entry.tensor_outs, key, entry, inputs, scalars)
        self.write(target, value, margs[0])
        return target

    def _resize_outs(self, func, targets: list, outs: tuple, layouts: Optional[tuple] = None) -> bool:
        """Resize out= tensors of the wrong shape as torch's kernels do (resize_output: a
        warning unless the tensor was empty, then memory of the new size, laid out as ``outs``
        say, or for pointwise ops as their ``layouts``, the functional results: the CPU kernel
        lays them out like its inputs where the meta kernel says contiguous), or say that it
        cannot be done here: a resized storage must not have pending contents, whose write-back
        would land in memory of the old size.  A deferred out= tensor takes its new shape within
        its storage, as ``resize_`` does (``r.resize_(0)`` then ``out=r``, the reuse torch's
        warning suggests); one whose storage would have to grow raises NotImplementedError."""
        if layouts is not None:
            outs = tuple(o if o is None else o._replace(stride=tuple(r.stride())) for o, r in zip(outs, layouts))
        wrong = [(t, o) for t, o in zip(targets, outs)
                 if o is not None and tuple(t.shape) != tuple(o.shape)]
        for t, _ in wrong:
            if t.layout is not torch.strided:
                return False
            if isinstance(t, DeferredTensor):
                continue
            ptr = untyped_storage(t).data_ptr()
            state = STATES_BY_PTR.get(ptr) if ptr else None
            if state is not None and state.contents is not None:
                return False
        self._forget_plain()
        for t, o in wrong:
            if isinstance(t, DeferredTensor):
                self._resize_deferred_out(func, t, o)
                continue
            with no_dispatch():
                _maybe_resize_out(t, o.shape)
                if tuple(t.stride()) != tuple(o.stride) and o.is_dense:
                    # the layout torch's kernel gives the result (channels-last): resize_ made
                    # it contiguous, over the same memory
                    t.as_strided_(o.shape, o.stride)
        return True

    def _resize_deferred_out(self, func, t: DeferredTensor, o: TensorMeta) -> None:
        """A deferred out= tensor given the result's shape (and dense layout) within its storage:
        torch's warning, then resize_ as ``run_inplace_view`` applies it to a deferred tensor."""
        _resize_output_check(t, o.shape)   # (torch's warning: resizing a non-empty out=)
        resize = aten.resize_.default
        try:
            self.run_inplace_view(resize, op_info(resize), (t, tuple(o.shape)), {})
        except NotImplementedError:
            raise cannot_grow(func, f"its out= tensor to shape {tuple(o.shape)} (a deferred tensor over "
                                    f"{t._meta.storage_numel} elements)") from None
        if tuple(t.stride()) != tuple(o.stride) and o.is_dense:
            strided = aten.as_strided_.default
            self.run_inplace_view(strided, op_info(strided), (t, tuple(o.shape), tuple(o.stride)), {})

    def dispatch_functional(self, func, args, kwargs):
        STATS.ops_recorded -= 1  # counted once, as the mutating op
        return self.dispatch(func, args, kwargs)

    def run_inplace_view(self, func, info, args, kwargs) -> Any:
        """t_, unsqueeze_, squeeze_, as_strided_, ...: new metadata over the same storage.

        For a deferred tensor the op is run on a meta tensor to learn the new metadata, then
        applied to the wrapper itself with dispatch disabled, so its shape changes in place as a
        plain tensor's would; its values are read from the storage through the new metadata.
        """
        target = args[0]
        self._forget_plain()
        if not isinstance(target, DeferredTensor):
            if any(isinstance(t, DeferredTensor) for t in tensors_in(args[1:], kwargs)):
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
                memory_format = suggested_memory_format(template)
            return self.run_inplace_view(aten.resize_.default, op_info(aten.resize_.default),
                                         (target, tuple(template.shape)), {"memory_format": memory_format})
        if any(isinstance(a, torch.Tensor) for a in tensors_in(args[1:], kwargs)):
            raise NotImplementedError(
                f"{func} re-points a deferred tensor at other memory, which deferfuse does not support; "
                f"call deferfuse.sync() first or run this code under deferfuse.strict()")
        before = meta_.to_meta_tensor(target._meta)
        storage = untyped_storage(before)
        try:
            func(before, *args[1:], **kwargs)
        except Exception as meta_error:
            # (meta kernels raise other types than the CPU kernel: AssertionError for t_ of a
            # 3-D tensor, where strict raises RuntimeError)
            if meta_.raise_as_torch_would(func, (target._meta, *args[1:]), kwargs, meta_error):
                return self.run_eager(func, info, args, kwargs, FlushReason.FALLBACK, FallbackReason.INPLACE_VIEW)
            raise
        after_storage = untyped_storage(before)
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
