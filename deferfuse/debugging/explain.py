"""What deferfuse did, in words and pictures: explain(), the DOT dump of a plan, StableHLO text.

They read the plan records the engine leaves at every flush (``plan/records.py``) and, for
StableHLO, the executable cache (``exec/executables.py``).
"""

from __future__ import annotations

from typing import Optional

from ..exec import blocks
from ..plan import records
from ..stats import STATS


class Explanation(str):
    """The report ``explain()`` gives: a ``str`` (``in``, ``splitlines()`` and comparisons work
    as on any string) whose ``repr`` is the report itself, so a REPL shows it as ``print`` does
    rather than as one escaped line."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str.__str__(self)


def explain(last: Optional[int] = None) -> Explanation:
    """The recent flush plans in words: which ops fused into which group, why each split and each
    flush happened, and the user line that triggered it.

    ``print(deferfuse.explain())`` prints the report, and a REPL shows it as it is; the result is
    a ``str`` (an ``Explanation``), so ``"mm" in explain()`` and ``explain().splitlines()`` work.
    ``last``: only the latest ``last`` flushes."""
    flushes = records.history()
    if last is not None:
        flushes = flushes[-last:]
    text = "\n".join(r.describe() for r in flushes) if flushes else "deferfuse: no flushes yet"
    at_once = STATS.unseen_ops_run + STATS.lone_ops_run + STATS.host_scalar_ops_run
    if at_once:
        # (ops that never reached a graph: without this line a one-off script looks unfused)
        text += (f"\n{at_once} op(s) ran at once on torch's kernels since the last reset_stats(): "
                 f"{STATS.unseen_ops_run} seen for the first time at their place in the code "
                 f"(eager_unseen_ops), {STATS.lone_ops_run} where their flushes were lone "
                 f"(eager_lone_ops), {STATS.host_scalar_ops_run} on one-element CPU tensors "
                 f"(host_scalars_at_once)")
    described = blocks.describe_all()
    if described:
        text += "\n" + described
    return Explanation(text)


def plan_dot(record_number: Optional[int] = None) -> str:
    """Graphviz DOT of a flush plan (default: the latest), one cluster per fusion group."""
    record = records.find(record_number)
    lines = [f'digraph "deferfuse_flush_{record.number}" {{', "  rankdir=TB;",
             '  node [shape=box, fontname="monospace", fontsize=10];']
    known: set[int] = set()
    for g in record.groups:
        lines.append(f"  subgraph cluster_{g.index} {{")
        lines.append(f'    label="group {g.index} ({g.ran_as}): {g.reason}";')
        lines.append('    style=rounded; color="#4477aa";')
        for node_id, op, bound in zip(g.node_ids, g.ops, g.bounds):
            fill = "#ffddaa" if bound == "compute-bound" else "#ddeeff"
            lines.append(f'    n{node_id} [label="{op}", style=filled, fillcolor="{fill}"];')
            known.add(node_id)
        lines.append("  }")
    for g in record.groups:
        for producer, consumer in g.edges:
            if producer not in known:
                lines.append(f'  n{producer} [label="input", shape=ellipse];')
                known.add(producer)
            lines.append(f"  n{producer} -> n{consumer};")
    lines.append("}")
    return "\n".join(lines)


def stablehlo(group: int = 0, record_number: Optional[int] = None) -> str:
    """The StableHLO text of one XLA group of a flush plan (default: the latest flush)."""
    record = records.find(record_number)
    g = record.groups[group]
    if g.signature is None:
        raise ValueError(f"group {group} of flush #{record.number} ran as {g.ran_as!r}, not as an XLA computation")
    # (imported here: the executable cache is not needed, nor imported, until something compiles)
    from ..exec import executables
    return executables.stablehlo_text(g.signature)
