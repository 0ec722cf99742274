"""The user's line: the innermost frame outside deferfuse, torch and jax."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import Optional

import torch

_INTERNAL_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["deferfuse"]))
# (leaving a ``with deferfuse.defer():`` block passes through contextlib's __exit__: the line
# that matters is the user's ``with``)
_INTERNAL_FILES = (contextlib.__file__,)

_IS_INTERNAL: dict = {}   # code object -> whether it is ours, torch's, jax's or contextlib's


def _is_internal(code) -> bool:
    filename = code.co_filename
    internal = _IS_INTERNAL[code] = filename.startswith(_INTERNAL_DIRS) or "/jax/" in filename \
        or filename.startswith("<frozen") or filename in _INTERNAL_FILES
    return internal


def is_internal(code) -> bool:
    """Whether ``code`` is deferfuse's, torch's, JAX's or contextlib's (not the user's)."""
    internal = _IS_INTERNAL.get(code)
    return _is_internal(code) if internal is None else internal


def _user_frame():
    """The innermost frame outside deferfuse, torch and jax (None if there is none)."""
    return _first_user_frame(sys._getframe(2))


def _first_user_frame(frame):
    """``frame`` or the nearest of its callers outside deferfuse, torch and jax.  Called for
    every recorded op, so whether a code object is internal is looked up, not worked out, each
    time."""
    known = _IS_INTERNAL
    while frame is not None:
        code = frame.f_code
        internal = known.get(code)
        if internal is None:
            internal = _is_internal(code)
        if not internal:
            return frame
        frame = frame.f_back
    return None


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)', re.MULTILINE)


def line_in_stack_trace(stack_trace: Optional[str]) -> Optional[str]:
    """file:line of the innermost frame outside deferfuse, torch and jax in a formatted stack
    (``traceback.format_stack``'s text, as an fx node's ``meta["stack_trace"]`` holds it); the
    innermost frame where all are internal; None where there is none."""
    if not stack_trace:
        return None
    frames = [(m["file"], m["line"]) for m in _FRAME.finditer(stack_trace)]
    for filename, line in reversed(frames):
        if not (filename.startswith(_INTERNAL_DIRS) or "/jax/" in filename or filename.startswith("<frozen")
                or filename in _INTERNAL_FILES):
            return f"{filename}:{line}"
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else None


def user_source() -> Optional[str]:
    """file:line of the innermost frame outside deferfuse, torch and jax."""
    frame = _user_frame()
    return None if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


# (code, bytecode offset) -> line number.  co_lines() is a scan of the whole code object: ~40 µs
# for a script's module-level code, and the segment tier asks for the line of every read
# (segments._segment_key), an optimizer's step.item() among them.
_LINES: dict = {}
_LINES_LIMIT = 1 << 14
_UNKNOWN = object()


class SourceLine:
    """A place in the user's code: a code object and a bytecode offset (two calls on one line
    are two places).  Cheap to take on every recorded op; ``str()`` gives "file:line".

    Places compare by file, function and offset, not by code object: code compiled again from
    the same source (a notebook cell run again, ``exec`` of the same text) is the same place."""

    __slots__ = ("code", "lasti")

    def __init__(self, code, lasti: int) -> None:
        self.code = code
        self.lasti = lasti

    def __eq__(self, other: object) -> bool:
        if type(other) is not SourceLine or other.lasti != self.lasti:
            return False
        a, b = self.code, other.code
        return a is b or (a.co_filename == b.co_filename and a.co_firstlineno == b.co_firstlineno
                          and a.co_qualname == b.co_qualname and a.co_code == b.co_code)

    def __hash__(self) -> int:
        code = self.code
        return hash((code.co_filename, code.co_firstlineno, self.lasti))

    @property
    def line(self) -> Optional[int]:
        key = (self.code, self.lasti)
        line = _LINES.get(key, _UNKNOWN)
        if line is _UNKNOWN:
            line = None
            for start, end, number in self.code.co_lines():
                if start <= self.lasti < end:
                    line = number
                    break
            if len(_LINES) >= _LINES_LIMIT:
                _LINES.clear()
            _LINES[key] = line
        return line

    def __str__(self) -> str:
        return f"{self.code.co_filename}:{self.line}"

    __repr__ = __str__


def user_line() -> Optional[SourceLine]:
    """The place in the user's code that made the current call (the frame ``user_source``
    names); its line number is worked out only when it is printed."""
    return _place(sys._getframe(1))


def user_line_from(frame) -> Optional[SourceLine]:
    """``user_line()`` for a caller that knows how many of its own frames to skip: the walk
    starts at ``frame`` (the recorder's fast path passes the frame above its dispatch entry,
    saving the lookups of its own frames on every op)."""
    return _place(frame)


# The place is taken for every recorded op, and walking up the stack makes a frame object for
# each of torch's frames on the way (a backward op: four of autograd's; an optimizer's: its
# step wrappers), ~3 µs an op.  Consecutive ops usually leave deferfuse's own frames at the
# same running frame of torch's (the autograd engine's call, an optimizer's loop), and while
# that frame runs, the frames above it are suspended in the same calls: the same caller, at
# the same instruction.  So the last answer is kept with that frame and its caller, and holds
# while both are the same objects and the caller is at the same instruction.  The frames are
# held until the next walk, or until the defer block ends (``forget_frames``).
_OWN_DIR = os.path.dirname(sys.modules["deferfuse"].__file__) + os.sep
_IS_OWN: dict = {}   # code object -> whether it is deferfuse's
_NO_WALK = (None, None, -1, None)
_last_walk: tuple = _NO_WALK   # (frame, its f_back, that one's f_lasti, place)


def _place(frame) -> Optional[SourceLine]:
    own = _IS_OWN
    while frame is not None:
        code = frame.f_code
        is_own = own.get(code)
        if is_own is None:
            is_own = own[code] = code.co_filename.startswith(_OWN_DIR)
        if not is_own:
            break
        frame = frame.f_back
    if frame is None:
        return None
    internal = _IS_INTERNAL.get(code)
    if internal is None:
        internal = _is_internal(code)
    if not internal:
        return SourceLine(code, frame.f_lasti)
    global _last_walk
    start, back, back_lasti, place = _last_walk
    caller = frame.f_back
    if frame is start and caller is back and (caller is None or caller.f_lasti == back_lasti):
        return place
    user = _first_user_frame(caller)
    place = None if user is None else SourceLine(user.f_code, user.f_lasti)
    _last_walk = (frame, caller, -1 if caller is None else caller.f_lasti, place)
    return place


def forget_frames() -> None:
    """Drop the frames the last walk keeps (their locals stay alive while they are held)."""
    global _last_walk
    _last_walk = _NO_WALK
