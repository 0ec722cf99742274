"""DebugMode: run each aten op eagerly and synchronously, checked before and after."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import config
from ..capture.classify import OpKind, op_info
from ..errors import DebugCheckError
from . import bounds, checks
from .source import user_source

_NOTE_PREFIX = "deferfuse debug mode:"


class DebugMode(TorchDispatchMode):
    """Runs every op at once on real tensors, after checking its indices and the memory it
    writes, and (with the setting ``check_nans``) checks its outputs for new NaN/Inf.
    On an accelerator it waits for each op to finish, so an error surfaces at its own op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return _run_checked(func, args, kwargs or {})
        except Exception as exc:
            _annotate(exc, func)
            raise


def _run_checked(func, args: tuple, kwargs: dict) -> Any:
    info = op_info(func)
    rule = bounds.rule_for(func)
    checks_writes = info.kind is OpKind.MUTATING
    check_nans = config.get("check_nans") and info.kind is not OpKind.VIEW
    bound, before = None, None
    if rule is not None or checks_writes or check_nans:
        bound = checks.bind(func, args, kwargs)
        if rule is not None:
            bounds.check(func, rule, bound, args, kwargs)
        if checks_writes:
            checks.check_overlap(func, info, bound)
        if check_nans:
            before = checks.nonfinite_written(func, info, bound)
    out = func(*args, **kwargs)
    if check_nans:
        checks.check_produced_nonfinite(func, info, bound, out, before)
    _wait_for_device(out)
    return out


def _annotate(exc: Exception, func) -> None:
    """Add the op and the user's line to an error torch raised, keeping its type and message."""
    if isinstance(exc, DebugCheckError) or any(
            str(note).startswith(_NOTE_PREFIX) for note in getattr(exc, "__notes__", ())):
        return
    source = user_source()
    exc.add_note(f"{_NOTE_PREFIX} raised by {func} called at {source or 'an unknown line'}")


def _wait_for_device(out: Any) -> None:
    # "launch blocking": an asynchronous device error must surface at the op that caused it
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    if checks.has_data(first) and first.device.type != "cpu":
        torch.accelerator.synchronize(first.device)
