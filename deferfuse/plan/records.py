"""Plan records: what each flush planned and how each group ran, kept in a short history.

Every flush leaves a FlushRecord: why it happened, the user line that triggered it, the groups
the planner made, why each group was split from its neighbours, and how each ran.  The engine
writes them (``record_plan``, ``FlushRecord.ran``); ``debugging/explain.py`` reads them through
``history``, ``latest`` and ``find``.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
from typing import Any, Optional

from ..ir import graph

log = logging.getLogger("deferfuse")
_flush_ids = itertools.count(1)


def _op_name_of(op: Any) -> str:
    if isinstance(op, graph.InternalOp):
        return op.name
    return str(op).replace("aten.", "").replace(".default", "")


@dataclasses.dataclass
class GroupRecord:
    index: int
    engine: str
    reason: str
    op_objects: list[Any]
    bound_objects: list[Any]
    sources: list  # SourceLine of each node (str() gives file:line), None where not recorded
    n_outputs: int
    edges: list[tuple[int, int]]           # (producer node id, consumer node id) inside or into
    node_ids: list[int]
    ran_as: str = "pending"
    signature: Any = None
    executable: Optional[str] = None   # an XLA group's: "compiled" (its first run), "disk", "memory"

    # names are made only when someone looks: recording a plan is on every flush's path
    @property
    def ops(self) -> list[str]:
        return [_op_name_of(op) for op in self.op_objects]

    @property
    def bounds(self) -> list[str]:
        return [b.value for b in self.bound_objects]


@dataclasses.dataclass
class FlushRecord:
    number: int
    reason: str
    trigger: Optional[str]
    n_nodes: int
    n_outputs: int
    groups: list[GroupRecord]

    def ran(self, group, how: str) -> None:
        self.groups[_position(self, group)].ran_as = how

    def describe(self) -> str:
        where = f" at {self.trigger}" if self.trigger else ""
        lines = [f"flush #{self.number} ({self.reason}{where}): {self.n_nodes} ops -> "
                 f"{len(self.groups)} group(s), {self.n_outputs} value(s) out"]
        for g in self.groups:
            counts = collections.Counter(g.ops)
            ops = ", ".join(f"{name} x{n}" if n > 1 else name for name, n in counts.most_common(8))
            if len(counts) > 8:
                ops += f", ... ({len(counts) - 8} more kinds)"
            compute = sum(1 for b in g.bounds if b == "compute-bound")
            kind = f"{compute} compute-bound, {len(g.bounds) - compute} memory-bound"
            sources = [str(s) for s in sorted(set(s for s in g.sources if s), key=_place_order)]
            span = ""
            if sources:
                span = f"; recorded at {sources[0]}" + (f" ... {sources[-1]}" if len(sources) > 1 else "")
            lines.append(f"  group {g.index} [{g.ran_as}, {len(g.ops)} ops, {g.n_outputs} out] "
                         f"split: {g.reason}; {kind}{span}")
            lines.append(f"    {ops}")
        return "\n".join(lines)


def _place_order(source: Any) -> tuple:
    """Sorts places by file, then line number (as text, line 10 came before line 9)."""
    line = getattr(source, "line", None)
    return (str(source).rsplit(":", 1)[0], line if line is not None else -1)


def _position(record: FlushRecord, group) -> int:
    for i, g in enumerate(record.groups):
        if g.index == group.index:
            return i
    raise KeyError(group.index)


_HISTORY: collections.deque[FlushRecord] = collections.deque(maxlen=16)


def record_plan(plan, reason: str, trigger: Optional[str], n_outputs: int, keep: int) -> FlushRecord:
    """Record a flush's plan; the history keeps the latest ``keep`` (the explain_history
    setting, read by the caller)."""
    if _HISTORY.maxlen != keep:
        globals()["_HISTORY"] = collections.deque(_HISTORY, maxlen=keep)
    groups = []
    for g in plan.groups:
        edges = [(v.node.id, n.id) for n in g.nodes for v in n.inputs if v.node.op is not graph.INPUT]
        groups.append(GroupRecord(
            g.index, g.engine.value, g.reason.value, [n.op for n in g.nodes],
            [plan.bounds[n.id] for n in g.nodes], [n.source for n in g.nodes],
            len(g.outputs), edges, [n.id for n in g.nodes]))
    record = FlushRecord(next(_flush_ids), reason, trigger, sum(len(g.nodes) for g in plan.groups),
                         n_outputs, groups)
    _HISTORY.append(record)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s", record.describe())
    return record


def history() -> list[FlushRecord]:
    """The flushes still in the history, oldest first."""
    return list(_HISTORY)


def latest() -> FlushRecord:
    """The latest flush's record (IndexError where there was none)."""
    return _HISTORY[-1]


def find(record_number: Optional[int]) -> FlushRecord:
    """The record of flush ``record_number`` (None: the latest); ValueError where it is gone."""
    if not _HISTORY:
        raise ValueError("deferfuse: no flushes yet")
    if record_number is None:
        return _HISTORY[-1]
    for r in _HISTORY:
        if r.number == record_number:
            return r
    raise ValueError(f"flush #{record_number} is no longer in the history (explain_history setting)")
