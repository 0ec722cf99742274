"""Processes: what a fork inherits, and what crosses to another process (and what a new thread
sees: ``threading.Thread.start`` computes the starting thread's pending work, as a fork does).

**Fork.**  A forked child is a copy of one thread of its parent: the thread that called
``os.fork()``, with deferfuse's modes on its dispatch stack.  Recording there goes wrong
(a DataLoader worker collated its batch into shared memory with a pending write, and the queue's
feeder thread sent the memory before anything computed it: zeros), and XLA there can deadlock
(JAX's threads did not survive the fork, and their locks may be held).  So:

- *before the fork*, the parent computes what is pending on the forking thread (flush reason
  ``sync``), so the child's copy of user tensors holds their values, as in strict;
- *in the child*, that thread leaves deferfuse's modes without flushing (``modes.reset_after_fork``):
  the child starts in strict mode with nothing pending, and the ``with`` blocks it is inside of end
  as strict blocks; the compile thread, which did not survive, is forgotten;
- where the parent had imported JAX (deferfuse imports it when it first compiles or loads a
  computation), the child never uses XLA: a defer block there, or ``set_mode("defer")``, runs its
  ops at once as strict does (warned once; ``stats()["blocks_run_at_once"]``), and a deferred
  tensor the child inherited pending (another thread's) is computed by torch's kernels.
  The parent's executables and JAX arrays stay untouched in the child: freeing them would run
  XLA's destructors there.

A spawned child starts afresh: it imports deferfuse (and reads ``TORCHTPU_MODE``) as any process.

**What crosses.**  ``torch.multiprocessing`` sends a tensor through ``ForkingPickler`` by moving
its storage into shared memory.  A DeferredTensor has no storage of its own (it is a wrapper), so
its reduction computes it and sends its data, moving that memory into shared memory as torch
moves a plain tensor's; the receiver gets a plain tensor.  ``multiprocessing.Queue`` pickles on a
feeder thread, where no defer mode is active and pending writes are not seen, so its ``put``
computes the tensors it is given (in lists, tuples and dicts) on the calling thread first.
Moving a storage into shared memory (``share_memory_()``, and every such reduction) copies its
bytes with torch's ``copy_``, which a defer block on that thread would record instead of run: the
copy runs unrecorded.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from typing import Any, Callable

import torch

from .capture.dispatch_keys import no_dispatch
from .errors import FlushReason
from .exec import backend
from .stats import STATS

log = logging.getLogger("deferfuse")

_installed = False
_install_lock = threading.Lock()
_warned_defer_at_once = False
# modes' functions, handed in by install(): this module sits beside modes, which imports it
_active_recorder: Callable[[], Any] = lambda: None
_reset_modes: Callable[[], None] = lambda: None


def forked_after_xla() -> bool:
    """Whether this process was forked from one that had imported JAX: XLA is not used here."""
    return backend.forked_after_xla


def install(active_recorder: Callable[[], Any], reset_modes: Callable[[], None]) -> None:
    """Register the fork handlers, the pickling reduction and the computing ``Queue.put``,
    once per process (called when deferfuse first pushes a mode).  ``active_recorder`` and
    ``reset_modes`` are modes' (the recorder of this thread's innermost defer block; leaving
    every mode after a fork)."""
    global _installed, _active_recorder, _reset_modes
    if _installed:
        return
    with _install_lock:
        if _installed:
            return
        _active_recorder, _reset_modes = active_recorder, reset_modes
        import multiprocessing.queues
        import multiprocessing.reduction
        from .capture.tensor import DeferredTensor
        multiprocessing.reduction.ForkingPickler.register(DeferredTensor, _reduce_deferred)
        for queue_type in (multiprocessing.queues.Queue, multiprocessing.queues.JoinableQueue):
            queue_type.put = _computing_put(queue_type.__dict__["put"])
        # (torch.to_dlpack is a C function that reads the wrapper's memory, which it has none
        # of: a consumer of its capsule crashed)
        torch.to_dlpack = torch.utils.dlpack.to_dlpack = _computing_to_dlpack(torch.utils.dlpack.to_dlpack)
        for name in ("_share_fd_cpu_", "_share_filename_cpu_"):
            setattr(torch.UntypedStorage, name, _copying_unrecorded(torch.UntypedStorage.__dict__[name]))
        threading.Thread.start = _computing_start(threading.Thread.start)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _installed = True


# -- fork -----------------------------------------------------------------------------------------
def _compute_pending(before: str) -> None:
    """Compute what is pending on this thread (flush reason ``sync``), so that another process
    or thread sees the values in memory, as it would under strict."""
    recorder = _active_recorder()
    if recorder is None or torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.Python):
        return   # (nothing pending here, or a call from inside deferfuse's own machinery)
    try:
        with no_dispatch():
            recorder.flush_all(FlushReason.SYNC)
    except Exception:  # noqa: BLE001 - a fork handler cannot raise; the error comes back at the next flush
        log.warning("deferfuse: computing pending work before %s failed; it sees the memory of "
                    "tensors with pending writes as it was", before, exc_info=True)


def _before_fork() -> None:
    _compute_pending("os.fork()")


# -- threads --------------------------------------------------------------------------------------
def _computing_start(start: Callable) -> Callable:
    """``threading.Thread.start`` computing this thread's pending work first.  The mode is per
    thread, so a thread started from a defer block (or under ``TORCHTPU_MODE=defer``) reads
    tensors' memory directly: a model built just before, whose initialization writes were still
    pending, trained on uninitialized memory there.  deferfuse's own compile thread is started
    in the middle of a flush and is left alone."""
    @functools.wraps(start)
    def computing_start(self, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_deferfuse_internal", False):
            _compute_pending("starting a thread")
        return start(self, *args, **kwargs)
    return computing_start


def _after_fork_in_child() -> None:
    global _warned_defer_at_once
    # (JAX's backend starts threads; importing it is where deferfuse's use of XLA begins)
    backend.forked_after_xla = backend.forked_after_xla or "jax" in sys.modules
    _warned_defer_at_once = False
    _reset_modes()
    executables = sys.modules.get("deferfuse.exec.executables")
    if executables is not None:   # (not imported: nothing compiled, nothing to forget)
        executables.after_fork_in_child()
    hostkernels = sys.modules.get("deferfuse.native.hostkernels")
    if hostkernels is not None:
        hostkernels.after_fork_in_child()


def note_defer_at_once() -> None:
    """A defer block (or default) in a child forked after JAX runs at once: count it, warn once."""
    global _warned_defer_at_once
    STATS.blocks_run_at_once += 1
    if not _warned_defer_at_once:
        _warned_defer_at_once = True
        log.warning("deferfuse: this process was forked from one that had started XLA, which "
                    "cannot be used safely after a fork; defer blocks here run their ops at once, "
                    "as strict does (use the 'spawn' start method for processes that should defer)")


# -- crossing -------------------------------------------------------------------------------------
def _reduce_deferred(t: torch.Tensor):
    """ForkingPickler's reduction of a DeferredTensor: torch's reduction of its data."""
    from torch.multiprocessing.reductions import reduce_tensor
    if t.requires_grad and not t.is_leaf:
        return reduce_tensor(t)   # (raises torch's error: autograd does not cross processes)
    with no_dispatch():
        # (a view with our lazy bits, so torch's reduction treats it as it treats strict's)
        data = t._materialize(FlushReason.SERIALIZE)
        if getattr(t, "_is_param", False):
            data = torch.nn.Parameter(data, requires_grad=t.requires_grad)
        else:
            data.requires_grad_(t.requires_grad)
        return reduce_tensor(data)


def _copying_unrecorded(original):
    """A storage's move into shared memory copies its bytes with torch's copy_, which a defer
    block recorded: the new memory stayed zeros (the storage's own contents then too, after the
    swap).  The copy is torch's business: under a defer block it runs unrecorded.  (Pending
    writes into the storage are written back before: reading a storage of a deferred tensor
    computes it, and a plain tensor's untyped_storage() writes its pending contents back.)"""
    def share(self, *args, **kwargs):
        if _active_recorder() is None:
            return original(self, *args, **kwargs)
        with no_dispatch():
            return original(self, *args, **kwargs)
    _like(share, original)
    return share


def _computing_to_dlpack(original):
    """``torch.to_dlpack`` that exports a DeferredTensor's data (computed first), as
    ``DeferredTensor.__dlpack__`` does."""
    def to_dlpack(tensor):
        from .capture.tensor import DeferredTensor
        if isinstance(tensor, DeferredTensor):
            with no_dispatch():
                tensor = tensor._materialize(FlushReason.DATA_PTR)
        return original(tensor)
    _like(to_dlpack, original)
    return to_dlpack


def _like(wrapper, original) -> None:
    wrapper.__name__, wrapper.__qualname__ = original.__name__, original.__qualname__
    wrapper.__doc__, wrapper.__wrapped__ = original.__doc__, original


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in ``obj`` and its lists, tuples (named ones too), dicts and sets."""
    found: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        a = stack.pop()
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple, set, frozenset)):
            stack.extend(a)
        elif isinstance(a, dict):
            stack.extend(a.values())
    return found


def _computing_put(original):
    def put(self, obj, block=True, timeout=None):
        recorder = _active_recorder()
        if recorder is not None:
            tensors = _tensors(obj)
            if tensors:
                with no_dispatch():
                    recorder.realize(tensors, FlushReason.SERIALIZE)
        return original(self, obj, block, timeout)
    _like(put, original)
    return put
