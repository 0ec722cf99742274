"""deferfuse: eager PyTorch, deferred and fused through XLA, with strict-mode semantics.

    import deferfuse
    with deferfuse.defer():
        y = model(x)          # recorded, not run
    print(y)                  # computed as fused XLA computations

or, with no code change: ``TORCHTPU_MODE=defer python script.py`` (reads the variable at import)
or ``python -m deferfuse --mode defer script.py``.
"""

from __future__ import annotations

from typing import Any

from .version import __version__  # noqa: F401

import torch

from . import config
from .capture.tensor import DeferredTensor, is_materialized
from . import errors
from .errors import DeferfuseError, FallbackReason, FlushReason, LoweringError, ModeError
from .modes import EagerMode, debug, defer, get_mode, mode, set_mode, strict
from .debugging.explain import explain, plan_dot, stablehlo
from .debugging.compare import compare
from .kernels import jax_op
from .stats import STATS as _STATS

__all__ = [
    "EagerMode", "mode", "defer", "debug", "strict", "set_mode", "get_mode", "sync",
    "is_materialized", "stats", "reset_stats", "config", "DeferredTensor", "DeferfuseError",
    "ModeError", "FlushReason", "FallbackReason", "LoweringError", "explain", "plan_dot", "stablehlo",
    "jax_op", "compare",
]


def sync(*tensors: torch.Tensor) -> None:
    """Compute now: the given tensors, or with no arguments everything pending on this thread."""
    from .capture import flush
    from .capture.dispatch_keys import no_dispatch
    from .modes import active_recorder
    if tensors:
        states = [t._storage for t in tensors if isinstance(t, DeferredTensor)]
        recorder = active_recorder()
        with no_dispatch():
            flush.materialize_states(states, FlushReason.SYNC, recorder)
        return
    recorder = active_recorder()
    if recorder is not None:
        with no_dispatch():
            recorder.flush_all(FlushReason.SYNC)


def stats() -> dict[str, Any]:
    """What deferfuse did since the last reset_stats(): ops recorded, flushes by reason,
    executions, compiles, cache hits/misses, fallbacks by op (and by reason), ..."""
    return _STATS.snapshot()


def reset_stats() -> None:
    _STATS.reset()


def _track_memory() -> None:
    # NumPy's arrays over torch's memory, torch.load's tensors and the files torch maps, known
    # from import on, not from the first block (capture/patches.install_memory_tracking)
    from .capture import patches
    patches.install_memory_tracking()


_track_memory()


def _apply_environment() -> None:
    from .modes import apply_environment
    apply_environment()


_apply_environment()


def __getattr__(name: str) -> Any:
    # deferfuse.compile (the torch.compile backend, docs/compile.md) loads on first use: importing
    # deferfuse neither imports Dynamo nor registers a backend
    if name == "compile":
        import importlib
        return importlib.import_module(".compile", __name__)
    raise AttributeError(f"module 'deferfuse' has no attribute {name!r}")
