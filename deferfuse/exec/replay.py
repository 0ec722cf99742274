"""Eager replay: run a subgraph op by op with torch's own kernels, without compiling.

For tiny one-off graphs, ops placed on torch's kernels, graphs whose lowering failed, and
signatures that run eagerly while they compile or because torch was measured faster.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import config
from ..errors import mark_failed
from ..ir import graph
from ..ir.graph import Node, RuntimeScalar, Value
from ..stats import STATS
from .program import source_suffix


def naming_source(exc: Exception, source: Any) -> Exception:
    """``exc``, raised by torch's kernel while a flush replays an op, naming the line that
    recorded the op as a compiled run's checks do (the error surfaces at the flush, not on that
    line).  The same type with the longer message, or where the type takes other arguments,
    ``exc`` itself with the line as a note."""
    if not source:
        return exc
    try:
        named = type(exc)(f"{exc}{source_suffix(source)}")
    except Exception:  # noqa: BLE001 - an exception type with its own constructor
        named = None
    if type(named) is not type(exc) or str(named) != f"{exc}{source_suffix(source)}":
        exc.add_note(f"recorded at {source}")
        return exc
    named.__traceback__ = exc.__traceback__
    return named


def _eager_internal(node: Node, args: tuple) -> torch.Tensor:
    op = node.op
    if op is graph.READ_VIEW:
        flat, meta = args
        # a view of the flat contents: fine for the ops that read it next (outputs are
        # cloned by execute_eager, so no result aliases memory a write-back may change)
        return torch.as_strided(flat, meta.shape, meta.stride, meta.offset)
    if op is graph.WRITE_VIEW:
        flat, value, meta = args
        out = flat.clone()
        torch.as_strided(out, meta.shape, meta.stride, meta.offset).copy_(value)
        return out
    if op is graph.FLATTEN:
        value, meta = args
        out = torch.zeros(meta.storage_numel, dtype=meta.dtype, device=value.device)
        torch.as_strided(out, meta.shape, meta.stride, meta.offset).copy_(value)
        return out
    if op is graph.CAST:
        value, dtype = args
        return value.to(dtype)
    if op is graph.AS_REAL:
        (value,) = args
        return torch.view_as_real(value.resolve_conj()).reshape(-1)
    if op is graph.VALUE_CHECK:
        condition, error, message = args
        if not bool(condition.all()):
            raise error(message)
        return condition
    if op is graph.BITS:
        value, conj, neg = args
        value = value.conj_physical() if conj else value
        return -value if neg else value
    raise AssertionError(f"no eager form for {op}")


def _replay_arg(a: Any, computed: dict[int, torch.Tensor]) -> Any:
    # (a module-level function: a recursive closure is a reference cycle, which kept ``computed``,
    # every intermediate of the replay, alive until Python's cycle collector ran)
    if isinstance(a, Value):
        return a.result if a.result is not None else computed[id(a)]
    if isinstance(a, RuntimeScalar):
        return a.value
    if type(a) in (list, tuple):
        return type(a)(_replay_arg(x, computed) for x in a)
    return a


def execute_eager(nodes: list[Node], outputs: list[Value], count: bool = True) -> list[torch.Tensor]:
    """Replay the subgraph op by op with torch (no compile): for tiny one-off graphs, ops placed
    on torch's kernels, and graphs whose lowering failed."""
    computed: dict[int, torch.Tensor] = {}
    # Each intermediate is dropped after the last op that reads it, as strict frees it: a
    # training step replayed with every intermediate kept held ~700 MB more than strict (the
    # zoo's GPT-2 at size small)
    wanted = {id(v) for v in outputs}
    last_use: dict[int, int] = {}
    for i, node in enumerate(nodes):
        for v in node.inputs:
            if type(v) is Value:
                last_use[id(v)] = i
    for i, node in enumerate(nodes):
        args = _replay_arg(node.args, computed)
        kwargs = {k: _replay_arg(v, computed) for k, v in node.kwargs.items()}
        if isinstance(node.op, graph.InternalOp):
            try:
                out = _eager_internal(node, args)
            except Exception as exc:   # (a value check that failed)
                raise mark_failed(naming_source(exc, node.source), node) from None
        else:
            try:
                out = node.op(*args, **kwargs)
            except Exception as exc:
                raise mark_failed(naming_source(exc, node.source), node) from None
        # a node's Values are its op's tensor outputs only (MetaEntry.tensor_outs): an output
        # torch leaves undefined (None: convolution_backward's grad_input with output_mask
        # False) or that is not a tensor has none, and zipping past it would shift the rest
        outs = [t for t in out if isinstance(t, torch.Tensor)] if isinstance(out, (tuple, list)) else (out,)
        for v, t in zip(node.outputs, outs):
            if v is not None and (id(v) in wanted or last_use.get(id(v), -1) > i):
                computed[id(v)] = t
        del args, kwargs, out, outs
        for v in node.inputs:
            key = id(v)
            if last_use.get(key) == i and key not in wanted:
                computed.pop(key, None)
    if count:
        STATS.eager_replays += 1
    for v in outputs:
        if v.result is None and v.node.op is graph.READ_VIEW:
            computed[id(v)] = computed[id(v)].clone()
    return [v.result if v.result is not None else computed[id(v)] for v in outputs]


def should_replay_eagerly(nodes: list[Node]) -> bool:
    """Scalar bookkeeping (graphs of tiny tensors) runs eagerly rather than paying a compile."""
    shortcuts = config.shortcuts()
    limit = shortcuts.small_flush_nodes
    if limit and len(nodes) <= limit:
        return True
    return shortcuts.tiny_graphs_replay and len(nodes) <= 64 \
        and all(m.numel <= 1 for n in nodes for m in n.out_metas)
