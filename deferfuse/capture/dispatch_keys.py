"""Running torch with our own dispatch machinery switched off.

A leaf of capture/: it imports nothing of ours, so the tensor, the size rules, the flush and the
modules outside capture/ can all use ``no_dispatch()`` without importing the recorder.
"""

from __future__ import annotations

import contextlib

import torch

PYTHON_KEY = torch._C.DispatchKey.Python


@contextlib.contextmanager
def no_dispatch():
    """Run torch ops on real tensors with no dispatch or function mode intercepting them (our own
    machinery must not be recorded, nor trigger the plain-read write-backs).

    torch's C++ guard excludes its Python dispatch keys on this thread: the modes stay on the
    stack but are not called (``recorder_on_stack`` sees the exclusion).  Popping the modes
    and pushing them back (``_disable_current_modes``) gives the same and costs ~8 us, once per
    flush.  torch.func's transforms are excluded too: a flush inside ``jacfwd`` or ``vmap``
    computes ops recorded below them, on plain tensors (under a transform's level, even
    ``detach()`` of a plain tensor returns its wrapper, which has no memory for DLPack or a
    write-back)."""
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch(), torch._C._DisableFuncTorch():
        yield
