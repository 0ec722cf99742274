"""Counters that say what deferfuse did: count, don't guess."""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Any, Iterator


class Stats:
    __slots__ = ("ops_recorded", "flushes", "executions", "compiles", "cache_hits", "cache_misses",
                 "fallbacks", "fallback_reasons", "decompositions", "eager_replays",
                 "dlpack_copies", "meta_cache_hits", "meta_cache_misses", "lowering_failures",
                 "disk_cache_hits", "disk_cache_writes", "disk_cache_errors", "background_compiles",
                 "eager_chosen", "unseen_ops_run", "lone_ops_run", "host_scalar_ops_run", "executables_evicted",
                 "compiles_put_off", "raising_ops_run", "blocks_run_at_once", "compiled_graphs", "compiled_partitions",
                 "compiled_specializations", "compiled_fallbacks", "compiled_rule_calls", "collectives",
                 "host_kernel_products", "host_kernel_fallbacks")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.ops_recorded = 0
        self.flushes: collections.Counter[str] = collections.Counter()
        self.executions = 0
        self.compiles = 0
        self.cache_hits = 0
        self.cache_misses = 0
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self.fallback_reasons: collections.Counter[str] = collections.Counter()
        self.decompositions: collections.Counter[str] = collections.Counter()
        self.eager_replays = 0
        self.dlpack_copies = 0
        self.meta_cache_hits = 0
        self.meta_cache_misses = 0
        self.lowering_failures = 0
        self.disk_cache_hits = 0
        self.disk_cache_writes = 0
        self.disk_cache_errors = 0
        self.background_compiles = 0
        self.eager_chosen = 0
        self.unseen_ops_run = 0   # ops run at once on first sight (config: eager_unseen_ops)
        self.lone_ops_run = 0     # ops run at once where their flushes were lone (eager_lone_ops)
        self.host_scalar_ops_run = 0   # ops on one-element CPU tensors run at once (host_scalars_at_once)
        self.executables_evicted = 0   # least recently used executables dropped (executable_cache_size)
        # compiles not started because they did not fit the block tier's exploration budget
        # (explore_share): the graph replayed eagerly instead
        self.compiles_put_off = 0
        # ops that can raise on values (an index out of range) run at once inside a try block
        # whose handler would catch their error (capture/handlers.py)
        self.raising_ops_run = 0
        self.blocks_run_at_once = 0    # defer blocks run as strict where that was faster (eager_blocks)
        # torch.compile(backend="deferfuse") (deferfuse/compile/): fx graphs handed to it, XLA
        # partitions planned, concrete-shape specializations planned, ops run on torch between
        # partitions (by op name), and lowering rules called while tracing its programs
        self.compiled_graphs = 0
        self.compiled_partitions = 0
        self.compiled_specializations = 0
        self.compiled_fallbacks: collections.Counter[str] = collections.Counter()
        self.compiled_rule_calls = 0
        # torch.distributed collectives run (each a flush point), by op: {"c10d::allreduce_": 3}
        self.collectives: collections.Counter[str] = collections.Counter()
        # matrix products lowered to the host kernels' FFI calls (deferfuse/native/hostkernels.py),
        # and those lowered to XLA's own dot on the CPU because the host kernels were unavailable
        # (no compiler, a failed build or load; counted per product traced, by op name)
        self.host_kernel_products = 0
        self.host_kernel_fallbacks: collections.Counter[str] = collections.Counter()

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.__slots__:
            value = getattr(self, name)
            out[name] = dict(value) if isinstance(value, collections.Counter) else value
        return out


STATS = Stats()


# One-off costs of a process's first use of deferfuse's machinery (importing JAX and what torch's
# meta kernels import, loading the lowering table, the first metadata inference): the block
# tier's exploration budget (exec/blocks.py) leaves them out of what a place's deferred run
# cost, since no later run pays them again.
_STARTUP = [0.0]


_ONE_OFF = threading.local()   # (depth: one-off costs met inside one another count once)


def note_startup(seconds: float) -> None:
    _STARTUP[0] += seconds


@contextlib.contextmanager
def one_off() -> Iterator[None]:
    """Time the block as a one-off cost (note_startup), unless it runs inside another one on
    this thread (the lowering table loaded by the first metadata inference), which counts it."""
    if getattr(_ONE_OFF, "depth", 0):
        yield
        return
    _ONE_OFF.depth = 1
    started = time.perf_counter()
    try:
        yield
    finally:
        _ONE_OFF.depth = 0
        note_startup(time.perf_counter() - started)


def startup_seconds() -> float:
    return _STARTUP[0]
