"""``torch.compile(model, backend="deferfuse")``: Dynamo's graphs through deferfuse's lowerings to XLA.

A front end beside ``capture/`` (it never imports it): TorchDynamo captures a graph, AOTAutograd
(``torch._dynamo.backends.common.aot_autograd``) turns it into forward and backward aten graphs
(min-cut partitioner, ``keep_inference_input_mutations=True``, core-aten decompositions only for
ops that have no lowering), and each graph becomes a ``runtime.CompiledGraph``: per concrete
input shape a plan (``plan.py``) of XLA partitions over the lowering table, torch fallbacks
between them, random draws ahead and write-backs into mutated inputs; each partition one
executable, cached in memory and on disk (``exec/executables.get_or_compile``).

The backend is registered with Dynamo through the ``torch_dynamo_backends`` entry point in
``pyproject.toml`` (``deferfuse = "deferfuse.compile:backend"``), never by importing deferfuse, so
a process that never imports deferfuse lists it and the name is registered once.  See
docs/compile.md.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from .. import config
from .explain import explain, stablehlo  # noqa: F401
from .runtime import CompiledGraph, compiled_graphs, forget  # noqa: F401

# torch.compile's modes: no mode changes what this backend does (no CUDA graphs, no autotuning)
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def backend(gm: torch.fx.GraphModule, example_inputs: list, *, options: Optional[dict] = None,
            mode: Optional[str] = None, **settings: Any):
    """The Dynamo backend: ``torch.compile(f, backend="deferfuse", options={...})`` or
    ``torch.compile(f, backend=deferfuse.compile.backend)``.  ``options`` (and keyword
    arguments) are deferfuse settings (``deferfuse.config``) that hold while the compiled graphs
    are planned and run."""
    settings = {**(options or {}), **settings}
    known = config.settings()
    unknown = sorted(k for k in settings if k not in known)
    if unknown:
        raise ValueError(f"torch.compile(backend='deferfuse'): unknown option(s) {', '.join(unknown)}; "
                         f"options are deferfuse settings: {', '.join(sorted(known))}")
    if mode is not None and mode not in MODES:
        raise ValueError(f"torch.compile(backend='deferfuse'): unknown mode {mode!r}; one of {', '.join(MODES)}")
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def compiler(kind: str):
        def compile_graph(fx_graph: torch.fx.GraphModule, inputs: list) -> CompiledGraph:
            return CompiledGraph(fx_graph, kind, settings)
        return compile_graph

    aot = aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                       inference_compiler=compiler("inference"),
                       partition_fn=min_cut_rematerialization_partition,
                       keep_inference_input_mutations=True, decompositions=decompositions())
    return aot(gm, example_inputs)


@functools.cache
def decompositions() -> dict:
    """torch's core-aten decompositions of the ops that have no lowering (random ops and view
    ops excepted: they are drawn ahead, or lowered as their ``*_copy`` twins)."""
    from torch._decomp import core_aten_decompositions
    from ..lower.table import get_lowering
    from .plan import is_random, view_twin
    table = {}
    for op, fn in core_aten_decompositions().items():
        if not isinstance(op, torch._ops.OpOverload) or get_lowering(op) is not None or is_random(op):
            continue
        twin = view_twin(op)
        if twin is not None and get_lowering(twin) is not None:
            continue
        table[op] = fn
    return table
