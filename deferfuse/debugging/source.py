"""The user's line: the innermost frame outside deferfuse, torch and jax."""

from __future__ import annotations

import contextlib
import os
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


def user_source() -> Optional[str]:
    """file:line of the innermost frame outside deferfuse, torch and jax."""
    frame = _user_frame()
    return None if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


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
        for start, end, line in self.code.co_lines():
            if start <= self.lasti < end:
                return line
        return None

    def __str__(self) -> str:
        return f"{self.code.co_filename}:{self.line}"

    __repr__ = __str__


def user_line() -> Optional[SourceLine]:
    """The place in the user's code that made the current call (the frame ``user_source``
    names); its line number is worked out only when it is printed."""
    frame = _first_user_frame(sys._getframe(1))
    return None if frame is None else SourceLine(frame.f_code, frame.f_lasti)


def user_line_from(frame) -> Optional[SourceLine]:
    """``user_line()`` for a caller that knows how many of its own frames to skip: the walk
    starts at ``frame`` (the recorder's fast path passes the frame above its dispatch entry,
    saving the lookups of its own frames on every op)."""
    frame = _first_user_frame(frame)
    return None if frame is None else SourceLine(frame.f_code, frame.f_lasti)
