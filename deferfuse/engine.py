"""The engine: compute a group of pending nodes, from the plan to the results.

A front end (defer mode's recorder today) hands the engine the nodes to compute and the values it
wants; ``execute`` builds the placement policy from the settings, has the planner partition the
nodes into groups (``plan/partition.py``), records the plan (``plan/records.py``, read by
``explain()``), and runs each group: on torch's kernels, replayed eagerly (``exec/replay.py``), or
as one XLA computation (``exec/runner.py``, which looks the executable up in the memory and disk
caches or compiles it, ``exec/executables.py``), and returns the results.

``clear_cache``, ``compiles_pending`` and ``wait_for_compiles`` are the engine's state API;
``profile_range`` marks a front end's own work in a torch.profiler trace.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Optional

import torch

from . import config
from .errors import LoweringError
from .exec import autotune, backend, executables, replay, runner
from .exec.executables import compiles_pending, wait_for_compiles
from .exec.profiling import profile_range
from .ir.graph import Node, Value
from .plan import cost, records
from .plan import partition as partitioner
from .plan.partition import Engine, Policy, SplitReason
from .stats import STATS

__all__ = ["clear_cache", "compiles_pending", "execute", "placement_policy", "profile_range",
           "wait_for_compiles", "watching"]

log = logging.getLogger("deferfuse")

# Told, after each group runs, its nodes (their Values hold the results now) and how it ran
# (the divergence finder, debugging/compare.py, names the path that computed a value).
_WATCHERS: list[Callable[[list[Node], str], None]] = []


@contextlib.contextmanager
def watching(callback: Callable[[list[Node], str], None]):
    """While inside, ``callback(nodes, how)`` after each group runs: ``how`` is its record's
    ``ran_as`` ("torch", "eager replay", "xla", "eager (compiling)", ...), and for an XLA run
    where its executable came from ("xla, compiled", "xla, disk", "xla, memory")."""
    _WATCHERS.append(callback)
    try:
        yield
    finally:
        _WATCHERS.remove(callback)


def placement_policy() -> Policy:
    """The partitioner's policy, from the settings now in force (this thread's overrides too)."""
    shortcuts = config.shortcuts()
    return Policy(always_compile=shortcuts.always_compile,
                  compute_engine=config.get("compute_engine"),
                  fusion_fuel=config.get("fusion_fuel"),
                  lone_op_on_torch=shortcuts.lone_op_on_torch,
                  machine_balance=cost.machine_balance(config.get("peak_gflops"),
                                                       config.get("memory_bandwidth_gbs")))


def execute(nodes: list[Node], outputs: list[Value], reason: str = "sync",
            trigger: Optional[str] = None,
            on_lone: Optional[Callable[[Any, Any], None]] = None) -> list[torch.Tensor]:
    """Compute ``outputs``: plan the subgraph into groups, run each as one computation.

    ``on_lone(op, source)``: told, for each recorded op of a lone-op group that ran on torch's
    kernel, where it was recorded (the recorder may then run it at once there next time)."""
    plan = partitioner.partition(nodes, outputs, placement_policy())
    record = records.record_plan(plan, reason, trigger, len(outputs), config.get("explain_history"))
    for group in plan.groups:
        if group.engine is Engine.TORCH:
            results = replay.execute_eager(group.nodes, group.outputs, count=False)
            record.ran(group, "torch")
            if group.reason is SplitReason.LONE_OP and on_lone is not None:
                _learn_lone(group.nodes, on_lone)
        elif replay.should_replay_eagerly(group.nodes) or backend.forked_after_xla:
            # (a child forked after JAX started: its XLA may deadlock; deferfuse/processes.py)
            results = replay.execute_eager(group.nodes, group.outputs)
            record.ran(group, "eager replay")
        else:
            group_record = record.groups[_index_of(record, group)]
            results = _execute_xla_safely(group.nodes, group.outputs, group_record)
            if results is None:
                faster = autotune.eager_is_faster(group_record.signature)
                started = time.perf_counter()
                results = replay.execute_eager(group.nodes, group.outputs)
                if faster:
                    autotune.observe_chosen_eager_time(group_record.signature, time.perf_counter() - started)
                else:
                    autotune.observe_eager_time(group_record.signature, time.perf_counter() - started)
                record.ran(group, "eager (faster than xla)" if faster else "eager (compiling)")
            else:
                record.ran(group, "xla")
        for v, r in zip(group.outputs, results):
            v.result = r
        if _WATCHERS:
            ran = record.groups[_index_of(record, group)]
            how = ran.ran_as if ran.ran_as != "xla" else f"xla, {ran.executable}"
            for watcher in list(_WATCHERS):
                watcher(group.nodes, how)
    return [v.result for v in outputs]


def _learn_lone(nodes: list[Node], on_lone: Callable[[Any, Any], None]) -> None:
    """A lone op's flush ran on torch's kernel: at the place that recorded it, the recorder
    may run it at once next time (eager_lone_ops)."""
    if not config.shortcuts().lone_ops_at_once:
        return
    for node in nodes:
        # (a node the front end recorded from an aten call carries its lowering entry; the
        # recorder's own nodes, views and write-backs, carry none)
        if node.lowering is not None and node.source is not None:
            on_lone(node.op, node.source)


def _index_of(record: Any, group: Any) -> int:
    return next(i for i, g in enumerate(record.groups) if g.index == group.index)


def _execute_xla_safely(nodes: list[Node], outputs: list[Value], group_record: Any) -> list[torch.Tensor]:
    if config.get("always_compile"):
        return runner.execute_xla(nodes, outputs, group_record)
    try:
        return runner.execute_xla(nodes, outputs, group_record)
    except LoweringError as exc:
        # A lowering bug must not cost the user a correct result: replay this graph in torch.
        STATS.lowering_failures += 1
        log.warning("deferfuse: XLA lowering failed, running this graph eagerly instead: %s", exc)
        return replay.execute_eager(nodes, outputs)


def clear_cache() -> None:
    """Forget compiled executables held in memory (the disk cache stays), and what was
    measured of each signature."""
    executables.clear()
    autotune.clear()
