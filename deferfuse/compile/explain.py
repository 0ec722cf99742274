"""What the torch.compile backend made of each graph: ``explain()`` and ``stablehlo()``."""

from __future__ import annotations

import collections
from typing import Optional

from ..exec import executables
from .plan import Draw, OnTorch, Partition, WriteBack
from .runtime import CompiledGraph, compiled_graphs


def explain(graph: Optional[CompiledGraph] = None) -> str:
    """Each compiled graph (or ``graph``), per input shape planned: its units in order (XLA
    partitions with their op counts, random draws, ops torch runs and why, write-backs)."""
    lines = []
    graphs = [graph] if graph is not None else compiled_graphs()
    for number, g in enumerate(graphs):
        lines.append(f"graph {number} ({g.kind}): {len(g.plans)} shape(s) planned")
        for key, plan in g.plans.items():
            shapes = ", ".join(str(tuple(k[0])) if k and isinstance(k[0], tuple) else str(k[1]) for k in key)
            lines.append(f"  inputs {shapes}")
            for unit in plan.units:
                if isinstance(unit, Partition):
                    ops = collections.Counter(str(n.target).replace("aten.", "") for n in unit.nodes)
                    top = ", ".join(f"{op} x{c}" for op, c in ops.most_common(6))
                    more = f", ... {len(ops) - 6} more kinds" if len(ops) > 6 else ""
                    lines.append(f"    XLA partition {unit.index}: {len(unit.nodes)} ops, {len(unit.inputs)} inputs, "
                                 f"{len(unit.outputs)} outputs ({top}{more})")
                elif isinstance(unit, Draw):
                    lines.append(f"    draw {unit.node.target} with torch's generator")
                elif isinstance(unit, OnTorch):
                    why = f"fallback: {unit.reason}" if unit.fallback else "a view of memory torch holds"
                    lines.append(f"    torch: {unit.node.target} ({why}; the partition before it ends here)"
                                 if unit.fallback else f"    torch: {unit.node.target} ({why})")
                elif isinstance(unit, WriteBack):
                    lines.append(f"    write back into input {unit.node.args[0].name}")
    return "\n".join(lines) if lines else "no graph compiled with backend='deferfuse' is alive"


def stablehlo(graph: CompiledGraph, partition: int = 0) -> str:
    """The StableHLO text of one XLA partition of ``graph``'s most recently used plan."""
    if not graph.plans:
        raise ValueError("that graph has not run yet")
    plan = next(reversed(graph.plans.values()))
    p = plan.partitions[partition]
    if p.compiled is None:
        raise ValueError("that partition has not run yet")
    return executables.stablehlo_text(p.signature)
