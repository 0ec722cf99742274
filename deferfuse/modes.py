"""The three eager modes, the mode stack, and TORCHTPU_MODE.

strict  (TorchTPU: DEFER_NEVER)                       plain PyTorch, nothing intercepted
debug   (TorchTPU: DEFER_NEVER_AND_LAUNCH_BLOCKING)   ops run one by one, synchronously, checked
defer   (TorchTPU: DEFER_AND_FUSE)                    ops are recorded, fused and run when observed

The stack is per thread, like torch's dispatch-mode stack.  Entering defer pushes a DeferMode
onto torch's dispatch stack; entering strict or debug inside defer flushes and takes it off
until the inner block ends.  Leaving a defer block flushes everything still alive in it.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import threading
from typing import Iterator, Optional, Union

from .errors import FlushReason, ModeError


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
        # each entry: (mode, DeferMode or None) — the DeferMode this entry pushed, if any
        self.entries: list[tuple[EagerMode, object]] = []
        self.default: EagerMode = EagerMode.STRICT
        self.default_handle: object = None


_stack = _ModeStack()


def get_mode() -> EagerMode:
    """The mode in force on this thread now."""
    return _stack.entries[-1][0] if _stack.entries else _stack.default


def _active_defer() -> Optional[object]:
    for mode, handle in reversed(_stack.entries):
        if handle is not None:
            return handle
        if mode is not EagerMode.DEFER:
            return None
    return _stack.default_handle if _stack.default is EagerMode.DEFER else None


def _start_defer():
    from .capture.recorder import DeferMode
    handle = DeferMode()
    handle.__enter__()
    return handle


def _stop_defer(handle, reason: FlushReason, *, flush: bool = True) -> None:
    recorder = handle.recorder
    try:
        if flush:
            recorder.flush_all(reason)
    finally:
        recorder.active = False
        recorder.real_states.clear()
        handle.__exit__(None, None, None)


def _discard_defer(handle) -> None:
    """After an exception: flush what user storages need, drop the rest, pop the mode."""
    try:
        _stop_defer(handle, FlushReason.CONTEXT_EXIT)
    except Exception:  # noqa: BLE001 - the user's exception is the one to report
        logging.getLogger("deferfuse").warning(
            "flushing at the end of a defer block that raised also failed", exc_info=True)


@contextlib.contextmanager
def mode(m: ModeLike) -> Iterator[EagerMode]:
    """Run the block under eager mode ``m``; nestable and exception-safe."""
    target = parse_mode(m)
    outer = _active_defer()
    handle = None
    suspended = None
    if target is EagerMode.DEFER:
        if outer is None:
            handle = _start_defer()
    elif outer is not None:
        # strict/debug inside defer: compute what is pending and step out of the dispatch mode
        suspended = outer
        outer.recorder.flush_all(FlushReason.CONTEXT_EXIT)
        outer.__exit__(None, None, None)
    _stack.entries.append((target, handle))
    ok = False
    try:
        yield target
        ok = True
    finally:
        _stack.entries.pop()
        if handle is not None:
            if ok:
                _stop_defer(handle, FlushReason.CONTEXT_EXIT)
            else:
                _discard_defer(handle)
        if suspended is not None:
            suspended.__enter__()


def defer():
    """``with deferfuse.defer():`` — record, fuse, and run when observed."""
    return mode(EagerMode.DEFER)


def debug():
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
        _stop_defer(handle, FlushReason.CONTEXT_EXIT)
    _stack.default = target
    if target is EagerMode.DEFER:
        _stack.default_handle = _start_defer()


def active_recorder():
    handle = _active_defer()
    return handle.recorder if handle is not None else None


def apply_environment() -> None:
    value = os.environ.get("TORCHTPU_MODE")
    if value is None or value.strip() == "":
        return
    set_mode(parse_mode(value, source="TORCHTPU_MODE"))
