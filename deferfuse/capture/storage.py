"""Storage bookkeeping: which StorageState stands for which memory, across blocks.

Three stores live here, each with a small API for tests (``state_at``, ``remembered_plain``,
``plain_keys``, ``buffer_keys``): the states of real memory by data pointer, the flat buffers
over user tensors, and the plain-tensor cache (what ``Recorder._real`` worked out for a plain
tensor).  Beside them: which memory is foreign, and what a block's exit or an unknown write
drops from the states.  Nothing here imports the tensor subclass, so the flush can use it.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from ..ir.graph import StorageState
from ..ir.meta import TensorMeta

# (torch's own method: our code's reads of storages skip the wrapper of READ_PATCHES)
untyped_storage = torch._C.TensorBase.untyped_storage
raw_data_ptr = torch._C.TensorBase.data_ptr   # (not the wrapper of patches.READ_PATCHES)

# Storages with real memory, by data pointer, so every tensor over the same memory (a user
# tensor, its views, a materialized deferred tensor) shares one StorageState.
STATES_BY_PTR: "weakref.WeakValueDictionary[int, StorageState]" = weakref.WeakValueDictionary()

# The flat buffer over a user tensor's storage, by id of the tensor that owns the view (the
# tensor itself, or its base): (weak reference to it, data pointer, numel, dtype, buffer).  A
# user storage gets a new StorageState in each defer context, but the same buffer object, so
# the DLPack view of it made for one flush (interop's cache, keyed by the tensor) serves the
# next ones: an optimizer's parameters are read by every step.  The buffer is a detached view,
# which does not keep the owner alive; the entry goes when the owner does.
BUFFERS: dict[int, tuple] = {}

# id(plain tensor) -> (weak ref, StorageState, TensorMeta, data pointer, storage bytes): what
# Recorder._real worked out for a plain tensor, kept across blocks (an optimizer step touches
# the same 200 tensors in every block, ~15 us each to work out afresh) while the tensor lives.
# Checked on every use against the tensor's memory and layout, which code we do not see can
# change; changes we do see clear it (Recorder._forget_plain).  A block's exit drops what its
# states cached from the graph (drop_reads), so an entry keeps no computed values alive.
PLAIN: dict[int, tuple] = {}
PLAIN_CACHE_SIZE = 4096   # plain tensors remembered before starting over


# Weak references to the states of plain tensors' memory whose tensor (StorageState.owner) has
# gone: a recorder that still holds one (real_states) lets it go at its next flush
# (Recorder.flushed).  Appended to by the owners' weakref callbacks, whenever they run.
ORPHANS: list = []


def orphaned(state_ref: "weakref.ref[StorageState]"):
    """The callback for a state's owner: its state goes to ORPHANS."""
    return lambda _dead: ORPHANS.append(state_ref)


def forget_dead_plain(key: int, dead: Any) -> None:
    entry = PLAIN.get(key)
    if entry is not None and entry[0] is dead:
        del PLAIN[key]


def drop_reads(states: Any) -> None:
    """At a block's exit: what its storages cached from its graph (reads, graph inputs) goes,
    so that storages remembered across blocks (PLAIN) keep no computed values alive; the next
    block reads their memory afresh anyway.  Graph inputs still alive (another thread's
    pending nodes may read them) stay listed for a write to snapshot."""
    for s in states:
        if s.contents is None:
            s.reads = {}
            s.leaf = None
            if s.old_leaves:
                s.old_leaves = [ref for ref in s.old_leaves if ref() is not None]


def flat_buffer(t: torch.Tensor, ptr: int, numel: int) -> torch.Tensor:
    owner = t._base if t._base is not None else t
    key = id(owner)
    hit = BUFFERS.get(key)
    if hit is not None and hit[0]() is owner and hit[1] == ptr and hit[2] == numel and hit[3] is t.dtype \
            and hit[4].device == t.device:
        return hit[4]
    buffer = t.detach().as_strided((numel,), (1,), 0)   # (detached: no autograd record)
    if ptr:
        BUFFERS[key] = (weakref.ref(owner, lambda _ref: BUFFERS.pop(key, None)), ptr, numel, t.dtype, buffer)
    return buffer


def flat_meta(state: StorageState) -> TensorMeta:
    return TensorMeta((state.numel,), (1,), 0, state.dtype, state.device, state.numel)


def foreign(storage: torch.UntypedStorage) -> bool:
    """Whether a storage's memory is not torch's own, so that code we do not see may write it:
    memory torch allocated itself is resizable, memory it was handed is not (``from_numpy``,
    ``frombuffer``, DLPack imports, and also the storages of ``torch.load``); memory shared with
    other processes (``share_memory_``, DataLoader workers' batches, a file mapped shared) is
    resizable but theirs to write too.  Three kinds of memory that is not resizable are torch's
    own all the same: memory known to have been torch's when NumPy was shown it
    (``show_to_numpy``: ``t.numpy()`` makes it not resizable for good), foreign only while an
    array over it lives; ``torch.load``'s storages (``note_torch_memory``); and files torch
    mapped privately (``note_mapped_file``: ``torch.load(mmap=True)``, safetensors, so every
    ``from_pretrained`` model's weights).  ~0.1 us, asked once per storage state."""
    ptr = storage.data_ptr()
    if _MAPPED and _mapped_by_torch(ptr):
        return ptr in EXPOSED   # (is_shared() is true of any file torch mapped)
    if storage.is_shared():
        return True
    if storage.resizable():
        return False
    shown = _SHOWN.get(ptr)
    if shown is not None and shown() is storage:
        return ptr in EXPOSED
    return True


# Files torch mapped privately (copy-on-write), UntypedStorage.from_file(shared=False), which
# torch.load(mmap=True) and safetensors call: [start, end) and the storage (weakly), alive while
# any tensor over the file is (a slice of a storage keeps its storage).  POSIX does not promise
# that another process's writes to the file show in a private mapping, and writes into it are
# this process's own: no code we do not see writes that memory.  (A NumPy memmap in
# copy-on-write mode is mapped by NumPy, so a tensor over it stays foreign.)
_MAPPED: list[tuple[int, int, Any]] = []


def note_mapped_file(storage: Any) -> None:
    """``storage`` is a file torch mapped privately."""
    if not storage.nbytes():
        return
    _MAPPED[:] = [entry for entry in _MAPPED if entry[2]() is not None]
    ptr = storage.data_ptr()
    _MAPPED.append((ptr, ptr + storage.nbytes(), weakref.ref(storage)))


def _mapped_by_torch(ptr: int) -> bool:
    return any(start <= ptr < end and ref() is not None for start, end, ref in _MAPPED)


# -- memory a NumPy array sees -------------------------------------------------------------------
# ``t.numpy()`` and ``np.asarray(t)`` give an array over the tensor's memory, which NumPy reads
# and writes without asking torch.  While such an array is alive the memory is foreign
# (recorded writes land at once, reads copy what they read at the op), as if it were NumPy's;
# once the last one is gone it is torch's again, and costs nothing: a discarded ``x.numpy()``
# made every later read of ``x`` a copy (a GELU chain on 2^22 floats, 2x faster than strict
# before, ran at strict's speed).  Keyed by the storage's data pointer; weak references to the
# arrays (NumPy arrays take them) tell when the last one goes.
EXPOSED: dict[int, list] = {}
# data pointer -> the storage (weakly) known to be torch's own: when NumPy was first shown it, or
# as torch.load made it (note_torch_memory)
_SHOWN: dict[int, Any] = {}
_SHOWN_LIMIT = 1 << 14


def note_torch_memory(t: torch.Tensor) -> None:
    """``t``'s storage is torch's own memory although it is not resizable (torch.load's storages
    are not: treated as foreign, the optimizer state of a resumed run was read through copies,
    and its programs were not the uninterrupted run's)."""
    storage = untyped_storage(t)
    if not storage.resizable() and not storage.is_shared():
        _remember_shown(storage)


def _remember_shown(storage: Any) -> None:
    """Note ``storage`` as torch's own memory (``_SHOWN``), dropping dead entries when full."""
    if len(_SHOWN) >= _SHOWN_LIMIT:
        for ptr in [p for p, ref in _SHOWN.items() if ref() is None]:
            del _SHOWN[ptr]
    try:
        _SHOWN[storage.data_ptr()] = weakref.ref(storage)
    except TypeError:
        pass


def show_to_numpy(t: torch.Tensor, make_array: Any) -> Any:
    """``make_array()`` (``t.numpy()``, ``t.__array__()``), with its array known to share
    ``t``'s memory while it lives, and that memory known as torch's own afterwards."""
    storage = untyped_storage(t)
    if storage.resizable() and not storage.is_shared():
        _remember_shown(storage)
    array = make_array()
    expose(t, array)
    return array


def expose(t: torch.Tensor, array: Any) -> None:
    """``array`` (a NumPy array ``t.numpy()`` or ``__array__`` returned) may share ``t``'s
    memory: while it lives, that memory is foreign."""
    try:
        import numpy as np
        if not isinstance(array, np.ndarray) or array.size == 0:
            return
        ptr = untyped_storage(t).data_ptr()
        shares = array.__array_interface__["data"][0]
        if not ptr or not ptr <= shares < ptr + untyped_storage(t).nbytes():
            return   # (a copy: numpy's own memory)
        ref = weakref.ref(array, lambda dead, ptr=ptr: _array_gone(ptr, dead))
    except (TypeError, ValueError, RuntimeError):
        return
    EXPOSED.setdefault(ptr, []).append(ref)
    state = STATES_BY_PTR.get(ptr)
    if state is not None and not state.foreign:
        state.foreign = True
        state.reads = {}


def exposed(ptr: int) -> bool:
    """Whether a NumPy array over the memory at ``ptr`` is alive."""
    return ptr in EXPOSED


def _array_gone(ptr: int, dead: Any) -> None:
    refs = EXPOSED.get(ptr)
    if refs is None:
        return
    refs[:] = [r for r in refs if r is not dead and r() is not None]
    if refs:
        return
    del EXPOSED[ptr]
    state = STATES_BY_PTR.get(ptr)
    if state is not None and state.buffer is not None and not foreign(untyped_storage(state.buffer)):
        state.foreign = False
        state.changed()


def forget_all_reads() -> None:
    """Memory we cannot name was written: every storage with no pending contents reads its
    memory afresh (pending contents are the graph's, which the write did not touch)."""
    for s in list(STATES_BY_PTR.values()):
        if s.contents is None:
            s.changed()


def snapshot_old_leaves(s: StorageState) -> None:
    """Pending nodes reading ``s.buffer`` through a graph input keep its current contents."""
    for ref in s.old_leaves:
        leaf = ref()
        if leaf is not None and leaf.result is not None:
            leaf.result = leaf.result.clone()


# -- the stores' API (what tests ask of them) ----------------------------------------------------
def state_at(ptr: int) -> StorageState:
    """The state of the real memory at data pointer ``ptr`` (KeyError if there is none)."""
    return STATES_BY_PTR[ptr]


def remembered_plain(t: torch.Tensor) -> Optional[StorageState]:
    """The state the plain-tensor cache holds for ``t``, or None if it holds none for it."""
    entry = PLAIN.get(id(t))
    return entry[1] if entry is not None and entry[0]() is t else None


def plain_keys() -> frozenset:
    """The ids of the plain tensors the plain-tensor cache holds entries for, now."""
    return frozenset(PLAIN)


def buffer_keys() -> frozenset:
    """The ids of the tensors whose flat buffers are remembered, now."""
    return frozenset(BUFFERS)
