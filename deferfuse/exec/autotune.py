"""Engine autotuning: per signature, whether XLA's compiled code or torch's kernels run it faster.

The engine times a signature's eager runs and its first XLA runs here; a signature whose XLA
runs were clearly slower stays eager (``eager_is_faster``) and is measured again now and then.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import config
from ..stats import STATS

log = logging.getLogger("deferfuse")

# Engine choice per signature: XLA's fused code is usually faster, but for some graphs torch's
# hand-written kernels win (a lone softmax or layer norm on a CPU).  The eager runs of the first
# tier and the first XLA runs are timed; if eager was clearly faster, the signature stays eager.
# Timings taken while the machine was busy can mislead, so a signature kept eager is measured
# again every RECHECK_EAGER runs: its latest eager time against fresh XLA runs.
_EAGER_IS_FASTER = object()
_EAGER_SECONDS: dict[Any, float] = {}
_XLA_SECONDS: dict[Any, list[float]] = {}
_CHOICE: dict[Any, object] = {}
_EAGER_RUNS: dict[Any, int] = {}
XLA_SAMPLES = 3
RECHECK_EAGER = 128

def observe_chosen_eager_time(sig: Any, seconds: float) -> None:
    """A run of a signature kept eager: every RECHECK_EAGER runs, give XLA another hearing."""
    runs = _EAGER_RUNS.get(sig, 0) + 1
    if runs < RECHECK_EAGER:
        _EAGER_RUNS[sig] = runs
        return
    _EAGER_RUNS.pop(sig, None)
    _EAGER_SECONDS[sig] = seconds
    _CHOICE.pop(sig, None)

def observe_eager_time(sig: Any, seconds: float) -> None:
    if sig is not None:
        bounded(_EAGER_SECONDS)[sig] = min(seconds, _EAGER_SECONDS.get(sig, seconds))

def observe_xla_time(sig: Any, seconds: float) -> None:
    if sig in _CHOICE or sig not in _EAGER_SECONDS or not config.shortcuts().autotune_engine:
        return
    samples = _XLA_SECONDS.setdefault(sig, [])
    samples.append(seconds)
    if len(samples) < XLA_SAMPLES:
        return
    if min(samples) > 1.1 * _EAGER_SECONDS[sig]:
        _CHOICE[sig] = _EAGER_IS_FASTER
        STATS.eager_chosen += 1
        log.info("deferfuse: torch's kernels ran a graph faster than XLA (%.3f ms vs %.3f ms); "
                 "it will run eagerly", _EAGER_SECONDS[sig] * 1e3, min(samples) * 1e3)
    else:
        _CHOICE[sig] = None
    del _XLA_SECONDS[sig]

def eager_is_faster(sig: Any) -> bool:
    """Whether ``sig`` was measured faster on torch's kernels (it then runs eagerly)."""
    return _CHOICE.get(sig) is _EAGER_IS_FASTER

def bounded(per_signature: dict) -> dict:
    """``per_signature``, emptied once it holds many times the executable cache's size of
    entries (signatures that ran eagerly and never compiled: forgetting one costs it another
    eager run or measurement)."""
    if len(per_signature) > 8 * max(config.get("executable_cache_size"), 64):
        per_signature.clear()
    return per_signature

def forget(sig: Any) -> None:
    """Drop what was measured of ``sig`` (its executable was evicted)."""
    for per_signature in (_CHOICE, _EAGER_SECONDS, _XLA_SECONDS, _EAGER_RUNS):
        per_signature.pop(sig, None)

def clear() -> None:
    """Forget every measurement and choice."""
    _CHOICE.clear()
    _EAGER_SECONDS.clear()
    _XLA_SECONDS.clear()
    _EAGER_RUNS.clear()
