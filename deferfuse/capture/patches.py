"""Wrappers put on torch's classes while defer blocks need them.

``BLOCK_PATCHES`` while any block runs (``p.data = q`` knows deferred tensors; matrix_rank's
out= is written), ``READ_PATCHES`` while a block has written a plain tensor (Python-level reads
of its memory write its pending contents back first).  The wrappers find the block's recorder
on the dispatch stack by the type of its mode, which ``capture/mode.py`` registers here
(``register_mode``): the recorder holds READ_PATCHES, and the mode sits above the recorder.
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
from typing import Any, Optional

import torch
from torch._prims_common.wrappers import _maybe_resize_out

from ..debugging.source import is_internal
from ..errors import FlushReason
from . import flush
from .collectives import suspended_for_foreign_code
from .handlers import catches
from .dispatch_keys import PYTHON_KEY, no_dispatch
from .opaque import opaque
from .storage import STATES_BY_PTR, note_mapped_file, note_torch_memory, show_to_numpy, untyped_storage
from .tensor import DeferredTensor

# The TorchDispatchMode whose recorder the wrappers look for (DeferMode), set by capture/mode.py.
_mode_type: Optional[type] = None


def register_mode(mode_type: type) -> None:
    """Say which dispatch mode's recorder ``recorder_on_stack`` finds (capture/mode.py's DeferMode)."""
    global _mode_type
    _mode_type = mode_type


# Tensor methods that read a plain tensor's memory without going through aten dispatch.  A user
# tensor written inside the context has its new contents pending; these must see them.
PLAIN_READS: dict[str, FlushReason] = {
    "tolist": FlushReason.TOLIST,
    "__repr__": FlushReason.REPR,
    "__format__": FlushReason.REPR,
    "data_ptr": FlushReason.DATA_PTR,
    "untyped_storage": FlushReason.DATA_PTR,
    "__dlpack__": FlushReason.DATA_PTR,
    "__reduce_ex__": FlushReason.SERIALIZE,
    "__deepcopy__": FlushReason.SERIALIZE,
}


def recorder_on_stack() -> Any:
    """The recorder of a DeferMode on this thread's dispatch stack: none inside our own
    __torch_dispatch__ (which takes the mode off the stack) or no_dispatch() (which turns
    Python dispatch off)."""
    if torch._C._dispatch_tls_is_dispatch_key_excluded(PYTHON_KEY):
        return None
    for i in range(torch._C._len_torch_dispatch_stack() - 1, -1, -1):
        mode = torch._C._get_dispatch_stack_at(i)
        if isinstance(mode, _mode_type):   # (DeferMode, or the default mode's SegmentedDeferMode)
            return mode.recorder
    return None


def write_back_before_read(t: Any, reason: FlushReason) -> None:
    if not isinstance(t, torch.Tensor) or isinstance(t, DeferredTensor) or opaque(t):
        return
    recorder = recorder_on_stack()
    if recorder is None:
        return
    state = STATES_BY_PTR.get(untyped_storage(t).data_ptr())
    if state is not None and state.contents is not None:
        with no_dispatch():
            flush.materialize_states([state], reason, recorder)


# Reads that go through aten (``_local_scalar_dense``) and need no write-back, but end a default
# defer mode's segment: their wrappers only tell the mode (``SEGMENT_READS``).
SCALAR_READS = ("item", "__bool__", "__int__", "__float__")
# Reads whose C++ never warns about a tensor that requires grad (``float(loss)`` does: "Converting
# a tensor with requires_grad=True to a scalar ..."), so their wrappers need not catch warnings
# to give them the caller's location: ``loss.item()``, read every step of a training loop, then
# pays no ``catch_warnings`` (~3 us, and it resets the warnings filters' cache).
# (tests/test_modes.py checks that strict says nothing for these)
SILENT_READS = frozenset(("item", "__bool__", "__int__"))


class _SegmentReads(threading.local):
    """This thread's default defer mode under eager_segments (capture/mode.SegmentedDeferMode),
    which the read wrappers tell of each read by Python code, once the read returned; ``depth``:
    reads in progress (torch's ``__format__`` of a 0-dim tensor calls ``item()``: one read)."""

    def __init__(self) -> None:
        self.mode: Any = None
        self.depth = 0


SEGMENT_READS = _SegmentReads()


def _warning_at_caller(original, self, args, kwargs):
    """``original(self, ...)`` with the warnings torch's C++ raises (``float(loss)`` of a loss
    that requires grad: "Converting a tensor with requires_grad=True to a scalar ...") given the
    caller's location, as without this wrapper, rather than this file's."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = original(self, *args, **kwargs)
    if caught:
        frame = sys._getframe(2)   # (above this function and the read's wrapper; past nested
        while frame is not None and frame.f_code.co_filename == __file__:   # reads' wrappers)
            frame = frame.f_back
        if frame is not None:
            module = frame.f_globals
            for w in caught:
                warnings.warn_explicit(w.message, w.category, frame.f_code.co_filename, frame.f_lineno,
                                       module=module.get("__name__"),
                                       registry=module.setdefault("__warningregistry__", {}))
    return result


# Reads that hand the memory to NumPy (an array over it): wrapped for good when deferfuse is
# imported (install_memory_tracking), so that every array over torch's memory is known while it
# lives (storage.show_to_numpy): one made before a block, discarded or kept, decides how the
# block reads that memory.  ~1 us a call outside blocks.  Beside them, the two makers of
# memory that is not resizable but torch's own: torch.load and UntypedStorage.from_file.
NUMPY_READS = ("numpy", "__array__")
_numpy_lock = threading.Lock()
_numpy_installed = False


def install_memory_tracking() -> None:
    """Wrap torch.Tensor.numpy and __array__ (see NUMPY_READS), torch.load (its tensors' memory
    is torch's own: storage.note_torch_memory) and torch.UntypedStorage.from_file (a file
    mapped privately is torch's own memory too: storage.note_mapped_file), once per process.
    Done when deferfuse is imported: a checkpoint loaded, or an array made, before the first
    block would otherwise leave that memory foreign for good (a resumed run's optimizer flushed
    at each write of its state)."""
    global _numpy_installed
    if _numpy_installed:
        return
    with _numpy_lock:
        if not _numpy_installed:
            for name in NUMPY_READS:
                setattr(torch.Tensor, name, _reading(getattr(torch.Tensor, name), FlushReason.NUMPY,
                                                      numpy_view=True))
            torch.load = _loading(torch.load)
            torch.UntypedStorage.from_file = staticmethod(_mapping(torch.UntypedStorage.from_file))
            _numpy_installed = True


def _mapping(original):
    @functools.wraps(original)
    def from_file(*args, **kwargs):
        result = original(*args, **kwargs)
        if not (args[1] if len(args) > 1 else kwargs.get("shared", False)):
            note_mapped_file(result)
        return result
    return from_file


def _loading(original):
    @functools.wraps(original)
    def load(*args, **kwargs):
        result = original(*args, **kwargs)
        if not kwargs.get("mmap"):   # (a mapped file is the file's memory)
            stack = [result]
            while stack:
                item = stack.pop()
                if isinstance(item, torch.Tensor):
                    if type(item) is torch.Tensor or isinstance(item, torch.nn.Parameter):
                        note_torch_memory(item)
                elif isinstance(item, dict):
                    stack.extend(item.values())
                elif isinstance(item, (list, tuple)):
                    stack.extend(item)
        return result
    return load


def _reading(original, reason: Optional[FlushReason], numpy_view: bool = False):
    if numpy_view:
        plain = _reading(original, reason)

        @functools.wraps(original)
        def to_numpy(self, *args, **kwargs):
            if type(self) is DeferredTensor or opaque(self):
                return plain(self, *args, **kwargs)
            return show_to_numpy(self, lambda: plain(self, *args, **kwargs))
        return to_numpy

    may_warn = original.__name__ not in SILENT_READS

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        if reason is not None:
            write_back_before_read(self, reason)
        reads = SEGMENT_READS
        mode = reads.mode
        if mode is None or mode.suspended and is_internal(sys._getframe(1).f_code):
            # (no default mode, or a segment at once and a read inside torch, an optimizer's
            # step.item(), which can end no segment: the read alone, at strict's cost)
            if may_warn and self.requires_grad:
                return _warning_at_caller(original, self, args, kwargs)
            return original(self, *args, **kwargs)
        reads.depth += 1
        try:
            if may_warn and self.requires_grad:
                result = _warning_at_caller(original, self, args, kwargs)
            else:
                result = original(self, *args, **kwargs)
        finally:
            reads.depth -= 1
        if reads.depth == 0 and reads.mode is not None \
                and not torch._C._dispatch_tls_is_dispatch_key_excluded(PYTHON_KEY):
            reads.mode.after_read(sys._getframe(1))
        return result
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
        if kwargs.get("out") is not None and recorder_on_stack() is not None:
            return _write_out_after(original, args, kwargs)
        return original(*args, **kwargs)
    return function


def _one_hot_checked(original):
    """torch.nn.functional.one_hot: its C++ kernel checks the classes (``.min().item() >= 0``,
    ``.max().item() < num_classes``) only on tensors it can read, not on a subclass such as a
    deferred tensor, whose rows then came out all zeros where strict raises.  For a deferred
    input the two checks are recorded (Recorder.check_values), or, where a handler in the
    user's code would catch the error, the input is computed and torch checks it at once."""
    @functools.wraps(original)
    def one_hot(tensor, num_classes=-1):
        recorder = recorder_on_stack() if type(tensor) is DeferredTensor else None
        if recorder is not None and tensor.numel() > 0:
            if catches(sys._getframe(1), (RuntimeError,), recorder.scope):
                (tensor,) = recorder.realize((tensor,), FlushReason.TRY_BLOCK)
            elif num_classes >= 0:
                recorder.check_values((tensor >= 0).all(), RuntimeError, "Class values must be non-negative.")
                recorder.check_values((tensor < num_classes).all(), RuntimeError,
                                      "Class values must be smaller than num_classes.")
        return original(tensor, num_classes)
    return one_hot


def _traced_as_in_strict(original, name: str):
    """TorchScript's script/trace/save, torch.export's export/save, FX's symbolic_trace: machinery
    that traces a module itself (fake tensors, its own dispatch modes) or serializes it from C++
    (which reads parameter memory with no aten op).  Under defer mode it saved garbage (the
    parameters' pending contents were never written) and export aborted the process.  It runs as
    in strict: everything pending computed first, deferred arguments replaced by their memory,
    and no dispatch mode on torch's stack while it runs."""
    @functools.wraps(original)
    def function(*args, **kwargs):
        recorder = recorder_on_stack()
        if recorder is None:
            return original(*args, **kwargs)
        recorder.flush_all(FlushReason.FOREIGN_CODE, detail=name)
        args, kwargs = recorder.realize((args, kwargs), FlushReason.FOREIGN_CODE)
        with torch.utils._python_dispatch._disable_current_modes():
            return original(*args, **kwargs)
    return function


def _tracers() -> list:
    import torch.export
    import torch.fx
    found = [(torch.jit, n, _traced_as_in_strict(getattr(torch.jit, n), f"torch.jit.{n}"))
             for n in ("script", "trace", "trace_module", "save", "freeze")]
    found += [(torch.export, n, _traced_as_in_strict(getattr(torch.export, n), f"torch.export.{n}"))
              for n in ("export", "save", "load")]
    found.append((torch.fx, "symbolic_trace", _traced_as_in_strict(torch.fx.symbolic_trace, "torch.fx.symbolic_trace")))
    return found


def _with_memory(original):
    """A C++ function of torch.distributed that reads tensor memory itself, around aten ops it
    dispatches (DDP's parameter shape check fills a tensor with a broadcast and reads it
    through an accessor): it runs as strict runs it, with everything pending computed first
    and the dispatch mode off (its own collectives run on torch's process group as they are)."""
    @functools.wraps(original)
    def function(*args, **kwargs):
        recorder = recorder_on_stack()
        if recorder is None:
            return original(*args, **kwargs)
        with no_dispatch():
            args, kwargs = suspended_for_foreign_code(recorder, f"torch.distributed.{original.__name__}",
                                                      args, kwargs)
            return original(*args, **kwargs)
    return function


def _storage_resize(original):
    """``UntypedStorage.resize_``, which no aten op sees (FSDP2 frees an unsharded parameter's
    memory with ``resize_(0)`` and allocates it again before the next all-gather): what is
    pending is computed first (pending reads of the memory see it as it was), and what
    deferfuse knew of the memory is forgotten."""
    @functools.wraps(original)
    def resize_(self, size):
        recorder = recorder_on_stack()
        if recorder is None:
            return original(self, size)
        with no_dispatch():
            recorder.flush_all(FlushReason.DATA_PTR, detail="UntypedStorage.resize_")
            state = STATES_BY_PTR.pop(self.data_ptr(), None)
            result = original(self, size)
            if state is not None:
                state.old_leaves = []
                state.changed()
            recorder._forget_plain()
        return result
    return resize_


def _distributed_patches() -> list:
    if not torch.distributed.is_available():
        return []
    return [(torch.distributed, name, _with_memory(getattr(torch.distributed, name)))
            for name in ("_verify_params_across_processes",) if hasattr(torch.distributed, name)]


_TENSOR_DATA = torch._C.TensorBase.__dict__["data"]


def _data_property():
    """``Tensor.data`` whose setter knows deferred tensors: ``p.data = q`` re-points ``p`` at
    ``q``'s memory without an aten op, and a deferred tensor has no memory until computed."""
    def get(self):
        return _TENSOR_DATA.__get__(self)

    def set_(self, value):
        recorder = recorder_on_stack()
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


class Patches:
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
# exist yet), torch.linalg.matrix_rank's out= must be written (under any dispatch mode its
# C++ composite drops it), a storage resized by Python code is forgotten, and torch.distributed's
# C++ readers of memory see it computed.
BLOCK_PATCHES = Patches(lambda: [
    (torch.linalg, "matrix_rank", _out_written_after(torch.linalg.matrix_rank)),
    (torch.nn.functional, "one_hot", _one_hot_checked(torch.nn.functional.one_hot)),
    *_tracers(),
    (torch.Tensor, "data", _data_property()),
    (torch.UntypedStorage, "resize_", _storage_resize(torch.UntypedStorage.resize_)), *_distributed_patches()])


# While a block has written a plain tensor: the methods in PLAIN_READS write its pending
# contents back before Python code reads its memory.  A block that only reads plain tensors
# (their memory is current; its results are deferred tensors, which materialize themselves)
# never installs them.  A default defer mode under eager_segments holds them too, for as long
# as it is on: every read, SCALAR_READS included, then tells it where a segment ends.
READ_PATCHES = Patches(lambda: [*((torch.Tensor, name, _reading(getattr(torch.Tensor, name), reason))
                                   for name, reason in (*PLAIN_READS.items(),
                                                        *((n, None) for n in SCALAR_READS))),
                                 (torch, "use_deterministic_algorithms",
                                  _tiers_told(torch.use_deterministic_algorithms))])


def _tiers_told(original):
    """``torch.use_deterministic_algorithms``, which also tells this thread's default mode: a
    program that asks for the same bits on every run right after it starts, while its first
    segment runs at once, must not run that segment on torch's kernels in one run and XLA's
    in another (config.shortcuts)."""
    @functools.wraps(original)
    def told(*args, **kwargs):
        result = original(*args, **kwargs)
        mode = SEGMENT_READS.mode
        if mode is not None:
            mode.tiers_changed()
        return result
    return told
