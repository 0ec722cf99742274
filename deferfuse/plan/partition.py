"""The fusion planner: partition a flushed subgraph into groups, each run as one computation.

The policy is a set of pure predicates (``placement``, ``split_reason``) and the cost model in
``cost.py``, parametrized by a ``Policy`` that the caller builds from the settings and passes in
(the planner reads no setting itself); ``partition`` is generic: it walks nodes in topological order and puts each node in
the group of one of its producers when the policy allows it and the group stays convex (no path
leaves the group and comes back), otherwise opens a new group and records why.  networkx holds
the group graph, checks that it is acyclic, and gives the order to run the groups in.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

from ..ir import graph
from ..ir.graph import Node, Value
from . import cost
from .._lazy import lazy_import

nx = lazy_import("networkx", globals(), "nx")   # (80 ms to import; one-group plans never need it)


class SplitReason(enum.Enum):
    FIRST = "first group"
    ENGINE = "runs on another engine"              # a compute-bound op placed on torch
    NOT_CONVEX = "joining would make a cycle"      # producer group depends on another group
    NO_PRODUCER = "reads only graph inputs"
    LONE_OP = "one op, nothing to fuse"            # runs on torch's own kernel
    FUEL = "fusion fuel exhausted"                 # DEFERFUSE_FUSION_FUEL, to bisect a bad fusion


class Engine(enum.Enum):
    XLA = "xla"
    TORCH = "torch"


@dataclasses.dataclass
class Group:
    index: int
    engine: Engine
    nodes: list[Node]
    reason: SplitReason
    outputs: list[Value] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Plan:
    groups: list[Group]           # in the order they run
    bounds: dict[int, cost.Bound]  # node id -> memory/compute bound


@dataclasses.dataclass(frozen=True)
class Policy:
    """What the settings tell the partitioner, read once per flush where execution is decided
    (the engine) and passed in."""
    always_compile: bool       # every node on XLA, one group
    compute_engine: str        # where compute-bound ops run: "xla" or "torch"
    fusion_fuel: int           # fusions allowed before every node opens its own group; < 0: no limit
    lone_op_on_torch: bool     # a one-op subgraph runs on torch's kernel
    machine_balance: float     # FLOPs per byte moved (cost.machine_balance)


# -- policy: pure predicates --------------------------------------------------------------------
def placement(node: Node, bound: cost.Bound, policy: Policy) -> Engine:
    """Where a node runs.  A node with no lowering (recorded to run on torch's kernel: its
    checker answered OnTorch) runs there whatever the settings; compute-bound ops may run on
    torch's own kernels when the setting says torch's are faster on this machine; everything
    else is fused by XLA."""
    if needs_torch(node):
        return Engine.TORCH
    if policy.always_compile:
        return Engine.XLA
    if bound is cost.Bound.COMPUTE and policy.compute_engine == "torch":
        return Engine.TORCH
    return Engine.XLA


def needs_torch(node: Node) -> bool:
    """Whether ``node`` was recorded from an aten call without a lowering (its checker placed it
    on torch's kernel: lower/registry.OnTorch); a recorded call carries its metadata entry as
    ``lowering``, the recorder's own nodes (views, write-backs) carry None."""
    entry = node.lowering
    return entry is not None and entry.lowering is None


def is_lone_op(nodes: list[Node]) -> bool:
    """A subgraph of one op (and views of its inputs) has nothing to fuse: XLA would at best
    match torch's own kernel, and for the fused CPU kernels (softmax, layer norm) it makes
    several passes where torch makes one; torch's kernel also needs no compile."""
    ops = [n for n in nodes if n.op is not graph.READ_VIEW]
    return len(ops) == 1 and not isinstance(ops[0].op, graph.InternalOp) \
        and all(v.node.op is graph.INPUT for n in nodes if n.op is graph.READ_VIEW for v in n.input_values())


def split_reason(group: Group, engine: Engine) -> Optional[SplitReason]:
    """None if a node placed on ``engine`` may join ``group``, else why not."""
    if group.engine is not engine or engine is Engine.TORCH:
        return SplitReason.ENGINE
    return None


# -- the generic partitioner --------------------------------------------------------------------
def partition(nodes: list[Node], outputs: list[Value], policy: Policy) -> Plan:
    if not policy.always_compile and policy.lone_op_on_torch and is_lone_op(nodes):
        group = Group(0, Engine.TORCH, list(nodes), SplitReason.LONE_OP, list(outputs))
        return Plan([group], cost.bounds(nodes, policy.machine_balance))
    if (policy.always_compile or (policy.compute_engine == "xla" and policy.fusion_fuel < 0)) \
            and not any(map(needs_torch, nodes)):
        # Every node is placed on XLA and may fuse with every other: one group, which is convex
        # by construction.  This is the common case, so it skips the walk.
        group = Group(0, Engine.XLA, list(nodes), SplitReason.FIRST, list(outputs))
        return Plan([group], cost.bounds(nodes, policy.machine_balance))
    group_of: dict[int, Group] = {}
    # transitive closure of group dependencies, to keep groups convex
    depends_on: dict[int, set[int]] = {}
    groups: list[Group] = []
    bounds: dict[int, cost.Bound] = {}
    fuel = policy.fusion_fuel
    fused = 0

    def open_group(node: Node, engine: Engine, reason: SplitReason) -> Group:
        group = Group(len(groups), engine, [node], reason)
        groups.append(group)
        depends_on[group.index] = set()
        return group

    for node in nodes:
        bound = bounds[node.id] = cost.bound(node, policy.machine_balance)
        engine = placement(node, bound, policy)
        producers = []
        for v in node.input_values():
            g = group_of.get(v.node.id)
            if g is not None and g not in producers:
                producers.append(g)
        chosen: Optional[Group] = None
        reason = SplitReason.FIRST if not groups else SplitReason.NO_PRODUCER
        for candidate in reversed(producers):
            why = split_reason(candidate, engine)
            if why is None and any(candidate.index in depends_on[p.index] for p in producers if p is not candidate):
                why = SplitReason.NOT_CONVEX
            if why is None and fuel >= 0 and fused >= fuel:
                why = SplitReason.FUEL
            if why is None:
                chosen = candidate
                break
            reason = why
        if chosen is None and not producers and groups and groups[-1].engine is engine is Engine.XLA \
                and (fuel < 0 or fused < fuel):
            # a node reading only graph inputs joins the latest XLA group: no dependency to break
            chosen = groups[-1]
        if chosen is None:
            group = open_group(node, engine, reason)
        else:
            group = chosen
            group.nodes.append(node)
            fused += 1
        for p in producers:
            if p is not group:
                depends_on[group.index] |= depends_on[p.index] | {p.index}
        group_of[node.id] = group

    _assign_outputs(groups, group_of, outputs)
    order = _run_order(groups, group_of)
    return Plan(order, bounds)


def _assign_outputs(groups: list[Group], group_of: dict[int, Group], outputs: list[Value]) -> None:
    """A group writes out only what leaves it: values other groups read, and requested outputs.
    Dead intermediates stay inside the computation."""
    wanted: dict[int, list[Value]] = {g.index: [] for g in groups}
    seen: set[int] = set()

    def add(g: Group, v: Value) -> None:
        if id(v) not in seen:
            seen.add(id(v))
            wanted[g.index].append(v)

    for g in groups:
        for node in g.nodes:
            for v in node.input_values():
                producer = group_of.get(v.node.id)
                if producer is not None and producer is not g:
                    add(producer, v)
    for v in outputs:
        producer = group_of.get(v.node.id)
        if producer is not None:
            add(producer, v)
    for g in groups:
        g.outputs = wanted[g.index]


def _run_order(groups: list[Group], group_of: dict[int, Group]) -> list[Group]:
    dag = nx.DiGraph()
    dag.add_nodes_from(g.index for g in groups)
    for g in groups:
        for node in g.nodes:
            for v in node.input_values():
                producer = group_of.get(v.node.id)
                if producer is not None and producer is not g:
                    dag.add_edge(producer.index, g.index)
    if not nx.is_directed_acyclic_graph(dag):
        raise AssertionError("fusion groups form a cycle: the partitioner broke convexity")
    by_index = {g.index: g for g in groups}
    return [by_index[i] for i in nx.lexicographical_topological_sort(dag)]
