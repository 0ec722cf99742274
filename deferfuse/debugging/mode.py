"""DebugMode: run each aten op eagerly and synchronously, checked before and after."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import config
from ..capture.classify import OpKind, op_info
from ..errors import DebugCheckError
from . import backward, bounds, checks, scopes, uninit
from .source import user_line

_NOTE_PREFIX = "deferfuse debug mode:"


class DebugMode(TorchDispatchMode):
    """Runs every op at once on real tensors, after checking its indices, the memory it writes
    and (setting ``check_uninitialized``) that what it reads was written, and (setting
    ``check_nans``) checks its outputs for new NaN/Inf.  Errors name the user's line and the
    running module; in backward, also the forward line that recorded the autograd node.
    On an accelerator it waits for each op to finish, so an error surfaces at its own op."""

    def __enter__(self):
        scopes.hold()
        return super().__enter__()

    def __exit__(self, exc_type, exc_value, traceback):
        try:
            return super().__exit__(exc_type, exc_value, traceback)
        finally:
            # (leaving, or suspended by a strict block: writes made meanwhile are not seen)
            scopes.release()
            backward.forget()
            uninit.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return _run_checked(func, args, kwargs or {})
        except Exception as exc:
            _annotate(exc, func)
            raise


def _run_checked(func, args: tuple, kwargs: dict) -> Any:
    backward.label_pending()
    info = op_info(func)
    rule = bounds.rule_for(func)
    kind = info.kind
    checks_writes = kind is OpKind.MUTATING
    check_nans = config.get("check_nans") and kind is not OpKind.VIEW
    uninitialized = config.get("check_uninitialized") and uninit.active()
    check_reads = uninitialized and uninit.tracking()
    # (written arguments, whatever the kind: uniform_ is a random op, resize_ an in-place view)
    tracks_writes = uninitialized and bool(info.written)
    bound, before, sizes = None, None, None
    if rule is not None or checks_writes or check_nans or check_reads or tracks_writes:
        bound = checks.bind(func, args, kwargs)
        if rule is not None:
            bounds.check(func, rule, bound, args, kwargs)
        if checks_writes:
            checks.check_overlap(func, info, bound)
        if check_reads:
            uninit.check_reads(func, info, bound)
        if tracks_writes:
            sizes = uninit.sizes_before(info, bound)
        if check_nans:
            before = checks.nonfinite_written(func, info, bound)
    out = func(*args, **kwargs)
    if tracks_writes:
        uninit.after(func, info, bound, sizes, user_line)
    elif kind is OpKind.ALLOCATION and uninitialized:
        uninit.allocated(func, out, user_line())
    if check_nans:
        checks.check_produced_nonfinite(func, info, bound, out, before)
    if not backward.in_backward():
        # (under no_grad too: a custom autograd Function's forward runs there, and its node is
        # attached to the last op's output when it returns)
        backward.remember(out, user_line(), scopes.current())
    _wait_for_device(out)
    return out


def _annotate(exc: Exception, func) -> None:
    """Add the op, the user's line and the running module (in backward: the forward line that
    recorded the autograd node) to an error torch raised, keeping its type and message."""
    if isinstance(exc, DebugCheckError) or any(
            str(note).startswith(_NOTE_PREFIX) for note in getattr(exc, "__notes__", ())):
        return
    exc.add_note(f"{_NOTE_PREFIX} raised by {func} called at {checks.place()}")


def _wait_for_device(out: Any) -> None:
    # "launch blocking": an asynchronous device error must surface at the op that caused it
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    if checks.has_data(first) and first.device.type != "cpu":
        torch.accelerator.synchronize(first.device)
