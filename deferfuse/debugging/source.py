"""The user's line: the innermost frame outside deferfuse, torch and jax."""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch

_INTERNAL_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["deferfuse"]))


def user_source() -> Optional[str]:
    """file:line of the innermost frame outside deferfuse, torch and jax."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith(_INTERNAL_DIRS) or "/jax/" in filename or filename.startswith("<frozen")):
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None
