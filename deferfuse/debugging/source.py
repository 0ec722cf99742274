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


def user_source() -> Optional[str]:
    """file:line of the innermost frame outside deferfuse, torch and jax.  Called for every
    recorded op, so whether a code object is internal is looked up, not worked out, each time."""
    frame = sys._getframe(1)
    known = _IS_INTERNAL
    while frame is not None:
        code = frame.f_code
        internal = known.get(code)
        if internal is None:
            internal = _is_internal(code)
        if not internal:
            return f"{code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def user_site() -> Optional[tuple]:
    """(code object, bytecode offset) of the innermost frame outside deferfuse, torch and jax:
    the place in the user's code that made the current call, told apart from other calls on the
    same line."""
    frame = sys._getframe(1)
    known = _IS_INTERNAL
    while frame is not None:
        code = frame.f_code
        internal = known.get(code)
        if internal is None:
            internal = _is_internal(code)
        if not internal:
            return code, frame.f_lasti
        frame = frame.f_back
    return None
