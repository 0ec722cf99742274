"""The cost model: is a node memory-bound or compute-bound on this machine?

A node's arithmetic intensity (FLOPs per byte it must move) is compared with the machine's
balance point (peak FLOP rate / memory bandwidth, both settings, which the caller reads and
passes in: nothing in ``plan/`` reads a setting).  Ops whose FLOPs grow faster
than their operands (matrix products, convolutions) are the only ones that can be compute-bound;
their FLOP counts are below.  Everything else moves each byte a small constant number of times.
"""

from __future__ import annotations

import enum
import math
from typing import Callable, Optional

import torch

from ..ir import graph
from ..ir.graph import Node

aten = torch.ops.aten


class Bound(enum.Enum):
    MEMORY = "memory-bound"
    COMPUTE = "compute-bound"


def _numel(shape) -> int:
    return math.prod(shape)


def _mm_flops(node: Node) -> float:
    a, b = node.args[0].meta.shape, node.args[1].meta.shape
    return 2.0 * a[0] * a[1] * b[1]


def _bmm_flops(node: Node) -> float:
    a, b = node.args[0].meta.shape, node.args[1].meta.shape
    return 2.0 * a[0] * a[1] * a[2] * b[2]


def _addmm_flops(node: Node) -> float:
    a, b = node.args[1].meta.shape, node.args[2].meta.shape
    return 2.0 * a[0] * a[1] * b[1]


def _baddbmm_flops(node: Node) -> float:
    a, b = node.args[1].meta.shape, node.args[2].meta.shape
    return 2.0 * a[0] * a[1] * a[2] * b[2]


def _conv_flops(node: Node) -> float:
    weight = node.args[1].meta.shape
    out = node.out_metas[0].shape
    per_output = 2.0 * _numel(weight[1:])
    return per_output * _numel(out)


# FLOP counts of the ops whose work grows faster than their data.
FLOPS: dict[torch._ops.OpOverload, Callable[[Node], float]] = {
    aten.mm.default: _mm_flops,
    aten.bmm.default: _bmm_flops,
    aten.addmm.default: _addmm_flops,
    aten.baddbmm.default: _baddbmm_flops,
    aten.convolution.default: _conv_flops,
}


# The operand each of them reads row by row: the left-hand side of a product, the input of a
# convolution (see ``ordering_operand``).
_LHS = {aten.mm.default: 0, aten.bmm.default: 0, aten.addmm.default: 1, aten.baddbmm.default: 1,
        aten.convolution.default: 0}
assert _LHS.keys() == FLOPS.keys()

# A product below this many FLOPs is a few microseconds of one core: nothing to order.
ORDER_MIN_FLOPS = 1 << 22


def ordering_operand(node: Node) -> Optional[int]:
    """Where ``node`` is a matrix product or convolution big enough to spread over the cores,
    the index of the argument through which the computation orders it after the previous one
    (``order_compute``, exec/program.py); else None.  Decided by shapes alone, which the
    computation's signature holds."""
    index = _LHS.get(node.op)
    if index is None or len(node.args) <= index or not isinstance(node.args[index], graph.Value) \
            or flops(node) < ORDER_MIN_FLOPS:
        return None
    return index


def bytes_moved(node: Node) -> int:
    """Bytes a node reads and writes if it runs alone (its unfused memory traffic)."""
    total = 0
    for v in node.input_values():
        total += v.meta.numel * v.meta.dtype.itemsize
    for m in node.out_metas:
        total += m.numel * m.dtype.itemsize
    return total


# OpOverloads are singletons; keying by id avoids their slow Python __hash__ on the hot path.
_FLOPS_BY_ID = {id(op): fn for op, fn in FLOPS.items()}


def flops(node: Node) -> Optional[float]:
    estimate = _FLOPS_BY_ID.get(id(node.op))
    return estimate(node) if estimate is not None else None


def bounds(nodes: list[Node], balance: float) -> dict[int, Bound]:
    """Node id -> bound of each of ``nodes``.  Only ops with a FLOP count can be compute-bound,
    so the others (most of any graph) are not looked at one by one: this runs on every flush."""
    found = dict.fromkeys((n.id for n in nodes), Bound.MEMORY)
    counted = _FLOPS_BY_ID
    for n in nodes:
        if id(n.op) in counted:
            found[n.id] = bound(n, balance)
    return found


def machine_balance(peak_gflops: float, memory_bandwidth_gbs: float) -> float:
    """FLOPs the machine can do per byte it moves from memory."""
    return peak_gflops / memory_bandwidth_gbs


def bound(node: Node, balance: float) -> Bound:
    """Whether ``node`` is compute-bound on a machine of ``balance`` (``machine_balance``)."""
    if isinstance(node.op, graph.InternalOp):
        return Bound.MEMORY
    work = flops(node)
    if work is None:
        return Bound.MEMORY
    moved = max(bytes_moved(node), 1)
    return Bound.COMPUTE if work / moved >= balance else Bound.MEMORY


def estimated_seconds(node: Node, peak_gflops: float, memory_bandwidth_gbs: float) -> float:
    """Roofline time of a node run alone."""
    work = flops(node) or 0.0
    return max(work / (peak_gflops * 1e9), bytes_moved(node) / (memory_bandwidth_gbs * 1e9))
