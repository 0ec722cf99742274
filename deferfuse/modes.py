"""The three eager modes, the mode stack, and TORCHTPU_MODE.

strict  (TorchTPU: DEFER_NEVER)                       plain PyTorch, nothing intercepted
debug   (TorchTPU: DEFER_NEVER_AND_LAUNCH_BLOCKING)   ops run one by one, synchronously, checked
defer   (TorchTPU: DEFER_AND_FUSE)                    ops are recorded, fused and run when observed

The stack is per thread, like torch's dispatch-mode stack.  Entering defer pushes a DeferMode
onto torch's dispatch stack and entering debug pushes a DebugMode; the innermost block wins.
Entering strict or debug inside defer flushes and takes the DeferMode off until the inner block
ends (strict also steps out of debug); defer inside debug records on top of the DebugMode.
Leaving a defer block flushes everything still alive in it.  A forked child starts in strict
mode, outside every block of its parent (``reset_after_fork``, deferfuse/processes.py).
"""

from __future__ import annotations

import contextlib
import enum
import gc
import logging
import sys
import threading
from typing import Iterator, Optional, Union

from . import config, processes
from .capture import handlers, modules, steps
from .errors import FlushReason, ModeError
from .exec import blocks
from .exec.segments import Segments
from .stats import STATS, one_off


class EagerMode(enum.Enum):
    STRICT = "strict"
    DEBUG = "debug"
    DEFER = "defer"

    # TorchTPU's names
    DEFER_NEVER = "strict"
    DEFER_NEVER_AND_LAUNCH_BLOCKING = "debug"
    DEFER_AND_FUSE = "defer"


_ALIASES = {
    "strict": EagerMode.STRICT, "debug": EagerMode.DEBUG, "defer": EagerMode.DEFER,
    "defer_never": EagerMode.STRICT, "defer_never_and_launch_blocking": EagerMode.DEBUG,
    "defer_and_fuse": EagerMode.DEFER,
}
ALLOWED_NAMES = ("strict", "debug", "defer", "DEFER_NEVER", "DEFER_NEVER_AND_LAUNCH_BLOCKING", "DEFER_AND_FUSE")

ModeLike = Union[EagerMode, str]


def parse_mode(value: ModeLike, *, source: str = "mode") -> EagerMode:
    if isinstance(value, EagerMode):
        return value
    if isinstance(value, str):
        found = _ALIASES.get(value.strip().lower())
        if found is not None:
            return found
    raise ModeError(f"{source}={value!r} is not an eager mode; use one of: {', '.join(ALLOWED_NAMES)} "
                    f"(case-insensitive), or deferfuse.EagerMode")


class _ModeStack(threading.local):
    def __init__(self) -> None:
        # each entry: (mode, the handle this block pushed or None, the handles it suspended)
        self.entries: list[tuple[EagerMode, object, list]] = []
        # deferfuse's modes on torch's dispatch stack now, innermost last: (kind, handle), with
        # a DebugMode or a DeferMode as handle.  At most [debug, defer]: debug inside defer
        # suspends the defer, so a DeferMode is never below a DebugMode.
        self.live: list[tuple[EagerMode, object]] = []
        self.default: EagerMode = EagerMode.STRICT
        self.default_handle: object = None


_stack = _ModeStack()


def get_mode() -> EagerMode:
    """The mode in force on this thread now."""
    return _stack.entries[-1][0] if _stack.entries else _stack.default


def _active_defer() -> Optional[object]:
    live = _stack.live
    return live[-1][1] if live and live[-1][0] is EagerMode.DEFER else None


class _GcFreeze:
    """While any defer block runs on any thread: gc.freeze() (the ``gc_freeze`` setting) and a
    higher threshold for young collections (``gc_young_threshold``).

    Only what existed before the outermost block is frozen, and it is unfrozen when that block
    ends, so garbage from before the block is collected late, never leaked.  A process that froze
    objects itself is left alone, and so is one that turned automatic collection off.  The
    threshold is restored when the outermost block ends, unless something changed it meanwhile.
    The lock is reentrant: a collection can run finalizers on this thread while it is held, and a
    finalizer may close an abandoned defer block (a generator)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.depth = 0
        self.froze = False
        self.thresholds: Optional[tuple[tuple, tuple]] = None   # (the process's, ours)

    def enter(self) -> None:
        with self.lock:
            self.depth += 1
            if self.depth != 1 or not gc.isenabled():
                return
            if config.get("gc_freeze") and gc.get_freeze_count() == 0:
                gc.freeze()
                self.froze = True
            young = config.get("gc_young_threshold")
            before = gc.get_threshold()
            if young > before[0] > 0:
                ours = (young, *before[1:])
                gc.set_threshold(*ours)
                self.thresholds = (before, ours)

    def exit(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth != 0:
                return
            if self.froze:
                gc.unfreeze()
                self.froze = False
            self._restore_threshold()

    def _restore_threshold(self) -> None:
        """The process's young-collection threshold again, unless something changed ours."""
        if self.thresholds is not None:
            before, ours = self.thresholds
            if gc.get_threshold() == ours:
                gc.set_threshold(*before)
            self.thresholds = None

    def after_fork(self) -> None:
        """In a forked child, where no block of the parent's will end: none is open, the
        threshold is the process's again, and what the parent froze stays frozen (Python's advice
        for forked children: their pages stay shared with the parent's).  The lock is new:
        another thread of the parent may have held it."""
        self.lock = threading.RLock()
        self.depth = 0
        self.froze = False
        self._restore_threshold()


_GC_FREEZE = _GcFreeze()


def _start_defer(segments: Optional[Segments] = None):
    if "deferfuse.capture.mode" not in sys.modules:
        with one_off():   # (the recorder's modules, loaded by a process's first defer mode)
            from .capture import mode  # noqa: F401
    from .capture.mode import DeferMode, SegmentedDeferMode
    handle = SegmentedDeferMode(segments) if segments is not None else DeferMode()
    handle.__enter__()
    _GC_FREEZE.enter()
    return handle


def _stop_defer(handle, reason: FlushReason, *, flush: bool = True) -> None:
    recorder = handle.recorder
    try:
        if flush:
            recorder.flush_all(reason)
    finally:
        recorder.active = False
        recorder.release_states()
        recorder.real_states.clear()   # (a context left without its flush lets go of everything)
        try:
            handle.__exit__(None, None, None)
        finally:
            recorder.mode = None   # (the mode refers to its recorder: no cycle left behind)
            _GC_FREEZE.exit()


def _discard_defer(handle) -> None:
    """After an exception: flush what user storages need, drop the rest, pop the mode."""
    try:
        _stop_defer(handle, FlushReason.CONTEXT_EXIT)
    except Exception:  # noqa: BLE001 - the user's exception is the one to report
        logging.getLogger("deferfuse").warning(
            "flushing at the end of a defer block that raised also failed", exc_info=True)


def _push(kind: EagerMode, segments: Optional[Segments] = None) -> object:
    """Put a new DeferMode or DebugMode on top of torch's dispatch stack (``segments``: the
    segment tier's state, for a mode whose work it times: a default defer mode's, a block's
    around a loop, a block's first run)."""
    processes.install(active_recorder, reset_after_fork)
    modules.install(active_recorder)
    steps.install(active_recorder)   # (after modules': see capture/steps.py)
    if kind is EagerMode.DEFER:
        if any(k is EagerMode.DEBUG for k, _ in _stack.live):
            from .debugging import uninit
            uninit.pause()   # (its flushes write memory the debug mode below does not see)
        handle = _start_defer(segments)
    else:
        from .debugging import DebugMode
        handle = DebugMode()
        handle.__enter__()
    _stack.live.append((kind, handle))
    return handle


def _pop(handle: object, *, ok: bool) -> None:
    """Take ``handle`` (the innermost of ours) off torch's dispatch stack; a defer flushes."""
    kind, top = _stack.live.pop()
    assert top is handle, "deferfuse modes left torch's dispatch stack out of order"
    if kind is EagerMode.DEBUG:
        handle.__exit__(None, None, None)
        return
    try:
        if ok:
            _stop_defer(handle, FlushReason.CONTEXT_EXIT)
        else:
            _discard_defer(handle)
    finally:
        if any(k is EagerMode.DEBUG for k, _ in _stack.live):
            from .debugging import uninit
            uninit.resume()


def _suspend(kinds: tuple[EagerMode, ...]) -> list[tuple[EagerMode, object]]:
    """Step out of our innermost modes while they are of ``kinds``; a defer flushes first, so
    the block inside sees computed data.  Returns what was suspended, innermost first."""
    suspended: list[tuple[EagerMode, object]] = []
    try:
        while _stack.live and _stack.live[-1][0] in kinds:
            kind, handle = _stack.live[-1]
            _require_on_top(handle)
            if kind is EagerMode.DEFER:
                handle.recorder.flush_all(FlushReason.CONTEXT_EXIT)
            handle.__exit__(None, None, None)
            suspended.append(_stack.live.pop())
    except BaseException:
        _resume(suspended)
        raise
    return suspended


def _require_on_top(handle: object) -> None:
    # torch pops the top of its dispatch stack, whichever mode that is
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    if getattr(handle, "suspended", False):
        return   # (a default defer mode's segment running at once: off the stack, nothing above it)
    top = _get_current_dispatch_mode()
    if top is not handle:
        raise ModeError(
            f"cannot leave deferfuse's {type(handle).__name__} while {type(top).__name__}, entered "
            f"inside that deferfuse block, is above it on torch's dispatch stack; enter "
            f"{type(top).__name__} outside the deferfuse block, or switch modes outside it")


def _resume(suspended: list[tuple[EagerMode, object]]) -> None:
    for kind, handle in reversed(suspended):
        handle.__enter__()
        _stack.live.append((kind, handle))


SPANS = ("step", "block")


@contextlib.contextmanager
def mode(m: ModeLike, *, span: str = "step") -> Iterator[EagerMode]:
    """Run the block under eager mode ``m``; nestable and exception-safe.

    The innermost block wins, as on torch's dispatch stack: defer inside debug records (the
    DebugMode stays below it and checks what defer runs eagerly); debug inside defer flushes
    and steps out of the defer; strict steps out of both.

    ``span`` (defer only): "step" (the default) ends a deferred program where the user's step
    ends (an optimizer's step(), a loop coming round: capture/steps.py); "block" makes the
    block one program however many steps it holds, for a longer program on purpose.
    """
    target = parse_mode(m)
    if span not in SPANS:
        raise ModeError(f"span={span!r}: use 'step' (a program ends with each step) or 'block' "
                        f"(the whole block is one program)")
    live = _stack.live
    pushed = None
    suspended: list[tuple[EagerMode, object]] = []
    block = None
    probing = False
    if target is EagerMode.DEFER:
        if processes.forked_after_xla():
            processes.note_defer_at_once()
        elif not live and config.shortcuts().blocks_timed:
            block = blocks.choice_at(_with_statement_frame())
            if block.holds_loop and config.shortcuts().segments_timed:
                # (a block around a loop: the segment tier chooses per iteration)
                block = None
                pushed = _push(EagerMode.DEFER, Segments())
            else:
                probing = block.probes()
                at_once = probing or block.runs_at_once
                block.starting(at_once)
                started = blocks.clock()
                if at_once:
                    STATS.blocks_run_at_once += 1
                if probing:
                    # (a new place's first run: at once, its ops counted, a loop in it found;
                    # exec/blocks.BlockChoice.probes)
                    pushed = _push(EagerMode.DEFER, Segments.probing(block))
                elif not at_once:
                    unsteady = blocks.unsteady_count()
                    pushed = _push(EagerMode.DEFER)
                    pushed.recorder.block = block
        elif not (live and live[-1][0] is EagerMode.DEFER):
            pushed = _push(EagerMode.DEFER)
        if pushed is not None:
            # (handlers around the with statement enclose every flush of the block)
            pushed.recorder.scope = handlers.scope_of(_with_statement_frame())
    elif target is EagerMode.DEBUG:
        suspended = _suspend((EagerMode.DEFER,))
        if not (live and live[-1][0] is EagerMode.DEBUG):
            pushed = _push(EagerMode.DEBUG)
    else:
        suspended = _suspend((EagerMode.DEFER, EagerMode.DEBUG))
    entry = (target, pushed, suspended)
    _stack.entries.append(entry)
    whole = active_recorder() if span == "block" and target is EagerMode.DEFER else None
    if whole is not None:
        whole.hold_whole_block(+1)
    ok = False
    try:
        yield target
        ok = True
    finally:
        if whole is not None:
            whole.hold_whole_block(-1)
        if _stack.entries.pop() is not entry:
            # a forked child leaving a block its parent entered: reset_after_fork took its
            # modes off already (the parent owns them and their pending work)
            pushed, suspended, block = None, [], None
        try:
            if pushed is not None:
                _pop(pushed, ok=ok)
        finally:
            _resume(suspended)
    if block is not None and block.holds_loop:
        blocks.executables.allow_compiles(None)   # (its iterations were timed, not the block)
    elif probing:
        if pushed.recorder.segments.probe is block:   # (else the tiers went off in it: untimed)
            block.finished(blocks.clock() - started, True, True)
            block.probed(pushed.recorder.ops_at_once)
    elif block is not None:   # (the block and its flush ended without an exception)
        block.finished(blocks.clock() - started, at_once or blocks.unsteady_count() == unsteady, at_once)


_CONTEXTLIB = contextlib.__file__


def _with_statement_frame():
    """The frame of the ``with`` statement entering this block (contextlib's frames skipped:
    it calls us from ``__enter__``, and from its wrapper when the block decorates a function)."""
    frame = sys._getframe(2)
    while frame.f_back is not None and frame.f_code.co_filename == _CONTEXTLIB:
        frame = frame.f_back
    return frame


def defer(*, span: str = "step"):
    """``with deferfuse.defer():`` — record, fuse, and run when observed.  A program ends at
    the latest where the user's step ends; ``span="block"`` makes the block one program
    however many steps it holds (see ``mode``)."""
    return mode(EagerMode.DEFER, span=span)


def debug():
    """``with deferfuse.debug():`` — run op by op with checks (index bounds, overlapping
    writes, and NaN/Inf producers when the setting check_nans is on)."""
    return mode(EagerMode.DEBUG)


def strict():
    return mode(EagerMode.STRICT)


def set_mode(m: ModeLike) -> None:
    """Set this thread's default mode (outside any ``with mode(...)`` block)."""
    target = parse_mode(m)
    if _stack.entries:
        raise ModeError("set_mode() cannot change the default inside a `with deferfuse.mode(...)` block")
    if _stack.default_handle is not None:
        handle, _stack.default_handle = _stack.default_handle, None
        _stack.default = EagerMode.STRICT
        _pop(handle, ok=True)
    _stack.default = target
    if target is EagerMode.DEFER and processes.forked_after_xla():
        processes.note_defer_at_once()
    elif target is not EagerMode.STRICT:
        _stack.default_handle = _push(target, Segments() if config.shortcuts().segments_timed else None)
        if target is EagerMode.DEFER:
            # (handlers around the call that set the mode enclose the program it defers)
            _stack.default_handle.recorder.scope = handlers.scope_of(sys._getframe(1))


def reset_after_fork() -> None:
    """In a forked child, on the thread that forked (the only one left): take deferfuse's modes
    off torch's dispatch stack without flushing (they and their pending work are the parent's),
    so that the child runs in strict mode.  The ``with`` blocks it is inside of end as strict
    blocks; its default mode is strict."""
    stack = _stack
    handles = [handle for _, handle in stack.live]
    handles += [handle for _, _, suspended in stack.entries for _, handle in suspended]
    if stack.default_handle is not None and stack.default_handle not in handles:
        handles.append(stack.default_handle)
    _off_dispatch_stack([handle for _, handle in stack.live])
    for handle in handles:
        recorder = getattr(handle, "recorder", None)
        if recorder is not None:
            # (ops on tensors it left pending then run as outside any block, on their data)
            recorder.active = False
    stack.live = []
    stack.entries = [(EagerMode.STRICT, None, []) for _ in stack.entries]
    stack.default = EagerMode.STRICT
    stack.default_handle = None
    _GC_FREEZE.after_fork()


def _off_dispatch_stack(handles: list) -> None:
    """Take ``handles`` off this thread's dispatch stack, leaving other modes in their order.
    torch's bookkeeping only (TorchDispatchMode.__exit__): DeferMode.__exit__ would release
    patches under a lock another thread of the parent may have held at the fork, and left
    installed they call through to torch's methods once no DeferMode is on the stack."""
    from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode, _push_mode
    ours = {id(h) for h in handles}
    others = []
    while ours:
        top = _get_current_dispatch_mode()
        if top is None:
            break
        if id(top) in ours:
            TorchDispatchMode.__exit__(top, None, None, None)
            ours.discard(id(top))
        else:
            others.append(_pop_mode())
    for other in reversed(others):
        _push_mode(other)


def active_recorder():
    handle = _active_defer()
    return handle.recorder if handle is not None else None


def apply_environment() -> None:
    value = config.requested_mode()
    if value is None:
        return
    set_mode(parse_mode(value, source="TORCHTPU_MODE"))
