"""The XLA run: a subgraph as one compiled computation, its inputs and outputs crossing by DLPack.

``execute_xla`` builds the subgraph's signature (``program.build``), asks the executable cache for
its executable (``executables.lookup``), runs it, raises what its runtime checks found (naming
the user's line), and times the run for the engine's autotuning.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np
import torch

from ..errors import mark_failed
from ..ir.graph import Node, Value
from ..stats import STATS
from . import autotune, executables, interop, program
from .profiling import profile_range
from .program import source_suffix


def execute_xla(nodes: list[Node], outputs: list[Value], group_record: Any = None) -> Optional[list[torch.Tensor]]:
    """Run the subgraph as one XLA computation; None if it should run eagerly this time."""
    sig, make_program, leaves, scalars = program.build(nodes, outputs)
    if group_record is not None:
        group_record.signature = sig
    compiled = executables.lookup(sig, make_program, leaves, len(scalars), len(nodes))
    if compiled is None:
        return None
    sig = compiled.signature
    if group_record is not None:
        group_record.signature = sig
        # (how this run got its executable: compiled for it, loaded from disk, or held in memory)
        group_record.executable = compiled.origin if compiled.runs == 0 else "memory"
    if autotune.eager_is_faster(sig):
        return None
    # (a run beside a background compile, which takes a core, is not a fair sample for the
    # engine's choice: the OpenMP team of a product inside it loses its core and waits)
    fair = not executables.compiles_pending()
    started = time.perf_counter()
    with executables.x64(), profile_range("deferfuse.execute"):
        inputs = [interop.to_jax(v.result) for v in leaves]
        results, failed, details = executables.run(compiled, inputs, np.asarray(scalars, dtype=np.float64))
    STATS.executions += 1
    compiled.runs += 1
    if compiled.checks:
        _raise_failed_checks(np.asarray(failed), np.asarray(details), compiled.checks, nodes)
    out = [interop.to_torch(r) for r in results]
    if fair and not executables.compiles_pending():
        autotune.observe_xla_time(sig, time.perf_counter() - started)
    return out


def _raise_failed_checks(failed: np.ndarray, details: np.ndarray, checks: list[tuple[int, type, str]],
                         nodes: list[Node]) -> None:
    for flag, value, (position, error, message) in zip(failed, details, checks):
        if flag:
            raise mark_failed(error(f"{message.replace('{value}', str(int(value)))}"
                                    f"{source_suffix(nodes[position].source)}"), nodes[position])
