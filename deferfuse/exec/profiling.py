"""Profiler ranges around deferfuse's own work (flush, compile, execute), only while a
torch.profiler runs."""

from __future__ import annotations

import contextlib

import torch


_NO_RANGE = contextlib.nullcontext()


def profile_range(name: str):
    """A torch.profiler range named ``name`` while a profiler runs; otherwise nothing (a
    record_function costs ~11 us even with no profiler, twice per flush)."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return _NO_RANGE

