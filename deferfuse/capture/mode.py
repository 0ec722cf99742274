"""DeferMode: the TorchDispatchMode of a defer block, which hands each op to its Recorder.

``_defer_dispatch`` is its ``__torch_dispatch__``: host scalars, lone ops and the fast path
first, then the Recorder's general dispatch.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_mode

from .. import config
from ..debugging.source import forget_frames, is_internal, user_line_from
from ..errors import FlushReason
from ..stats import STATS
from . import meta as meta_
from . import patches
from .fastpath import FAST, UNSEEN, fast_form
from .opfacts import LOCAL_SCALAR_DENSE
from .patches import BLOCK_PATCHES, READ_PATCHES, SEGMENT_READS
from .recorder import Recorder

_CLONE = torch.ops.aten.clone.default


def _defer_dispatch(self, func, types, args=(), kwargs=None):
    """DeferMode.__torch_dispatch__: the op recorded, and a write it made into foreign memory
    landed at once (Recorder.land_foreign_writes)."""
    result = _record(self, func, types, args, kwargs)
    if self.recorder.foreign_written:
        self.recorder.land_foreign_writes()
    return result


def _record(self, func, types, args=(), kwargs=None):
    """The fast path where the op has one, else the general one."""
    recorder = self.recorder
    kwargs = kwargs or {}
    if args and type(args[0]) is torch.Tensor and args[0].numel() <= 1:
        if func is LOCAL_SCALAR_DENSE:
            # (an optimizer's step counter read with .item() every step)
            result = recorder.item_if_computed(args[0])
        elif recorder.host_scalars:
            result = recorder.at_once_if_host_scalar(func, args, kwargs)
        else:
            result = NotImplemented
        if result is not NotImplemented:
            return result
    if func is _CLONE and args and type(args[0]) is torch.Tensor and (args[0].is_conj() or args[0].is_neg()):
        result = recorder.resolved_at_once(func, args, kwargs)
        if result is not NotImplemented:
            return result
    if id(func) in meta_.LONE_OPS and recorder.eager_lone:
        result = recorder.at_once_if_lone(func, args, kwargs)
        if result is not NotImplemented:
            return result
    form = FAST.get(id(func), UNSEEN)
    if form is UNSEEN:
        form = fast_form(func)
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
        BLOCK_PATCHES.hold()
        return result

    def segment(self, segments, place, reason: FlushReason) -> None:
        """A ``with`` block whose work turned out to be a loop (a block around a whole training
        or evaluation loop): from this boundary on (a step's end, ``reason`` STEP, or a read),
        the segment tier (``segments``, exec/segments.Segments) chooses per iteration whether it
        runs deferred or at once, as under the default mode.  The block tier, which chooses per
        run of the whole block, cannot: the block runs once."""
        self.__class__ = SegmentedDeferMode
        self._start_segments(segments)
        READ_PATCHES.hold()   # (released by SegmentedDeferMode.__exit__)
        SEGMENT_READS.mode = self
        segments.observed(self.recorder, place, reason)
        self.settle()

    def __exit__(self, exc_type, exc_value, traceback):
        try:
            BLOCK_PATCHES.release()
            # (a block leaves nothing pending in plain tensors: suspending one flushes it)
            if self.recorder.guarding_reads:
                self.recorder.guarding_reads = False
                READ_PATCHES.release()
        finally:
            forget_frames()
            super().__exit__(exc_type, exc_value, traceback)


def _segment_dispatch(self, func, types, args=(), kwargs=None):
    """SegmentedDeferMode.__torch_dispatch__ (exec/segments.Segments): a read of a value that had
    to be computed ends a segment, and the next runs deferred or at once, as its place chose."""
    recorder = self.recorder
    if func is not LOCAL_SCALAR_DENSE:
        if recorder.at_once_segment:
            recorder.ops_at_once += 1
            return recorder.run_at_once(func, args, kwargs or {})
        return _defer_dispatch(self, func, types, args, kwargs)
    segments = recorder.segments
    place = user_line_from(sys._getframe(1))
    if recorder.at_once_segment:
        recorder.ops_at_once += 1
        result = recorder.run_at_once(func, args, kwargs or {})
        if segments.probe is None and segments.starts_segments(place):
            # (a block's first run finds its loop from Python-level reads: after_read)
            segments.observed(recorder, place)
        return result
    flushed = STATS.flushes["item"]
    result = _defer_dispatch(self, func, types, args, kwargs)
    if STATS.flushes["item"] != flushed:
        segments.observed(recorder, place)
    else:   # (a read of a value already computed is no boundary)
        segments.note_read(place)
    return result


class SegmentedDeferMode(DeferMode):
    """The DeferMode of a default defer mode under eager_segments: ``segments`` (the tier's
    state, exec/segments.Segments) decides per segment whether its ops are recorded or run at
    once.  A mode of its own, so that a ``with`` block's ops pay nothing for the tier.

    A segment that runs at once runs with this mode off torch's dispatch stack (*suspended*),
    so that its ops pay nothing at all: under any Python dispatch mode torch spends ~3.5 µs an
    op in its own Python before the mode's code runs (generate() of the zoo's Llama: 11,000
    ops a call, strict 61 ms, at once under the mode 121 ms).  Its end is then seen by the
    wrappers of Python-level reads (capture/patches.READ_PATCHES, held while this mode is on:
    ``item()``, ``bool()``, ``format`` ...), which call ``after_read``.  Reads that only aten
    sees (``int(t)`` in C++) do not end a segment while suspended; the segment then runs at
    once a little longer, which is strict all the same.  The mode suspends only from the top
    of torch's dispatch stack and outside its own dispatch, and comes back only onto the
    stack it left (a mode entered meanwhile and still on stays above nothing of ours)."""

    def __init__(self, segments) -> None:
        super().__init__()
        self._start_segments(segments)

    def _start_segments(self, segments) -> None:
        self.recorder.segments = segments
        # a program starts at once, as strict, until its first boundary, or until it may run
        # deferred to find one (Segments.may_discover); a block's first run runs at once
        self.recorder.at_once_segment = segments.probe is not None or not segments.may_discover()
        self.suspended = False
        self._left: tuple = (0, None)   # the dispatch stack when suspended: (depth, top)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _segment_dispatch(self, func, types, args, kwargs)

    def __enter__(self):
        result = super().__enter__()
        READ_PATCHES.hold()
        SEGMENT_READS.mode = self
        self.settle()   # (off the stack again at once when it comes back inside a segment at once)
        return result

    def __exit__(self, exc_type, exc_value, traceback):
        if SEGMENT_READS.mode is self:
            SEGMENT_READS.mode = None
        READ_PATCHES.release()
        if self.suspended:
            # (back on the stack for DeferMode.__exit__ to take off: a push and a pop, whatever
            # was entered meanwhile)
            self.suspended = False
            TorchDispatchMode.__enter__(self)
        return super().__exit__(exc_type, exc_value, traceback)

    def after_read(self, frame) -> None:
        """Python code read a tensor's value (a wrapper of READ_PATCHES, after the read).  Only
        a read made by the user's code can end a segment running at once: one inside torch (an
        optimizer reading its step counter) is never a boundary."""
        recorder = self.recorder
        if not recorder.active:
            return
        if is_internal(frame.f_code):
            self.settle()
            return
        segments = recorder.segments
        if segments.probe is not None:
            # (a block's first run, at once: a read that comes round is a loop's; Segments.observed)
            if not recorder.whole_blocks:
                segments.observed(recorder, user_line_from(frame))
            self.settle()
            return
        if not self.suspended:
            # (a read that flushed ended its segment in _segment_dispatch; one of memory already
            # computed is no boundary)
            place = user_line_from(frame)
            if not segments.starts_segments(place):
                segments.note_read(place)
            self.settle()
            return
        if segments.known_quiet(frame):   # (every step's loss.item())
            self.settle()
            return
        place = user_line_from(frame)
        if segments.starts_segments(place):
            segments.observed(recorder, place)
        elif segments.is_new_read(place):
            if segments.may_discover():
                # a read the deferred way has never seen (the program moved on: generate() after
                # training, say): run deferred until the next read that flushes, to learn
                # whether it is a boundary (Segments.discover)
                segments.discover(recorder)
            else:
                segments.quiet(frame, new=True)
        else:
            segments.quiet(frame, new=False)
        self.settle()

    def tiers_changed(self) -> None:
        """The shortcuts may have changed (``torch.use_deterministic_algorithms``): a segment
        running at once while the segment tier is now off goes deferred from here."""
        recorder = self.recorder
        if recorder.active and recorder.at_once_segment and not config.shortcuts().segments_timed:
            recorder.segments.discover(recorder)
            self.settle()

    def settle(self) -> None:
        """Off torch's dispatch stack while the segment runs at once, on it while deferred."""
        recorder = self.recorder
        if recorder.at_once_segment:
            if not self.suspended and _current_mode() is self and recorder.active \
                    and recorder.segments.probe is None:   # (a block's first run counts its ops)
                TorchDispatchMode.__exit__(self, None, None, None)
                self.suspended = True
                self._left = (torch._C._len_torch_dispatch_stack(), _current_mode())
                # (as at a block's exit: what the storages cached from graphs goes; the
                # segment's writes go to memory that the next deferred segment reads afresh)
                recorder.release_states()
                forget_frames()   # (the frames the last walk kept: their locals stay alive)
        elif self.suspended:
            if self._left == (torch._C._len_torch_dispatch_stack(), _current_mode()):
                self.suspended = False
                TorchDispatchMode.__enter__(self)
            else:   # (a mode entered since is still on: this segment runs at once too)
                recorder.at_once_segment = True


patches.register_mode(DeferMode)


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

    for dispatch in (_defer_dispatch, _segment_dispatch):
        set_code_exec_strategy(dispatch.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    # (__init_subclass__ has run already)
    DeferMode.__torch_dispatch__ = _defer_dispatch
    SegmentedDeferMode.__torch_dispatch__ = _segment_dispatch


_skip_dynamo_without_wrapper()
