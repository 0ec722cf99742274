"""Collectives of torch.distributed: flush points, never graph nodes.

An op of a communication namespace (``c10d``, the functional collectives, DTensor's) is not
recorded.  ``CollectiveMixin.run_collective`` gives it what strict PyTorch would:

  1. everything pending on this thread is computed (a flush whose reason is ``collective`` and
     whose explanation names the op), so the collective runs exactly where strict runs it and
     each rank issues its communication in its own program order (no new deadlock, and ranks
     may run different programs);
  2. its tensor arguments are realized as plain memory that deferfuse keeps from then on (a
     deferred tensor's buffer is marked exposed, so no later flush swaps another buffer in
     while an async collective still writes the old one);
  3. torch's own process group runs it (gloo, NCCL, ... unchanged);
  4. every tensor argument is treated as written, whatever the schema says (``c10d`` schemas
     declare no writes, yet ``allreduce_``, ``broadcast_`` and ``recv_`` write their tensors):
     what was read from that memory before is dropped, so later reads see the new contents.

Async work (``async_op=True``, ``Work.wait()``, ``wait_tensor``) needs nothing more: the tensors
it writes are real memory deferfuse will not move or write (nothing of theirs is pending), the
work object holds them alive, and reads after the wait read the memory then.

Tensors of foreign subclasses (``AsyncCollectiveTensor``, DTensor) reach a collective or any
other op as opaque arguments (``opaque.py``): their ops run on torch's kernels, through the
subclass's own ``__torch_dispatch__``.
"""

from __future__ import annotations

from typing import Any

from ..errors import FlushReason
from ..stats import STATS
from .opaque import opaque
from .storage import STATES_BY_PTR, forget_all_reads, untyped_storage
from .tensor import DeferredTensor
from .trees import map_returned, tensors_in

# Namespaces of torch's communication ops: c10d (the process-group ops dist.* call), the
# functional collectives (and their autograd forms), and DTensor's redistribution ops.
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor"})


class Collective:
    """The special form of a collective in the recorder's op facts (``opfacts.learn_facts``):
    a marker that dispatch routes to ``run_collective``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "COLLECTIVE"


COLLECTIVE = Collective()


def is_collective(func: Any) -> bool:
    """Whether ``func`` is a communication op (by its namespace, not by a list of names)."""
    return getattr(func, "namespace", None) in COLLECTIVE_NAMESPACES


def collective_name(func: Any) -> str:
    """``c10d::allreduce_`` for the op ``c10d.allreduce_.default``."""
    return func._schema.name


def mark_written(tensors: list) -> None:
    """Every tensor of a collective may have been written: what deferfuse read from its memory
    before (cached reads, graph inputs over it) is stale."""
    for t in tensors:
        if isinstance(t, DeferredTensor):
            state = t._storage
        elif opaque(t):
            # (which memory a subclass's collective wrote we cannot tell)
            forget_all_reads()
            continue
        else:
            state = STATES_BY_PTR.get(untyped_storage(t).data_ptr())
            if state is None:
                continue
        state.old_leaves = []
        state.changed()


class CollectiveMixin:
    """The Recorder's collectives."""

    def run_collective(self, func, args: tuple, kwargs: dict) -> Any:
        name = collective_name(func)
        STATS.collectives[name] += 1
        # Everything pending is computed first, not only the arguments' contents: pending nodes
        # reading an argument's memory must see its old contents, and a rank's program stops
        # here as strict's does.
        self.flush_all(FlushReason.COLLECTIVE, detail=name)
        tensors = tensors_in(args, kwargs)
        real_args, real_kwargs = self.realize((args, kwargs), FlushReason.COLLECTIVE)
        out = func(*real_args, **real_kwargs)
        # (contents only: a collective resizes nothing, so what the recorder remembers of plain
        # tensors' layouts stays true)
        mark_written(tensors)
        if any(isinstance(t, DeferredTensor) for t in tensors):
            # (a c10d op returns the tensors it wrote: the caller's, not their data)
            out = map_returned(out, tensors_in(real_args, real_kwargs), tensors)
        return out

    def run_collective_at_once(self, func, args: tuple, kwargs: dict) -> Any:
        """A collective in a segment that runs at once (nothing is pending): run it, then mark
        what it wrote."""
        STATS.collectives[collective_name(func)] += 1
        out = func(*args, **kwargs)
        mark_written(tensors_in(args, kwargs))
        return out


def suspended_for_foreign_code(recorder: Any, name: str, args: tuple, kwargs: dict) -> tuple:
    """Before ``name``, C++ code of torch.distributed that reads tensor memory directly (no aten
    op): everything pending computed, deferred arguments replaced by their memory."""
    recorder.flush_all(FlushReason.COLLECTIVE, detail=name)
    return recorder.realize((args, kwargs), FlushReason.COLLECTIVE)

