"""One fx graph at one concrete input shape: which node runs where, as an ordered list of units.

A post-AOT aten graph is read node by node in graph order (its order is a topological one):

- a node whose op has a lowering that accepts the call (``lower/table.get_lowering``, its
  checker) joins the current **XLA partition**; a view op (``t``, ``view``, ``expand``, ...)
  joins it as its ``*_copy`` twin, a pure function of its input's values;
- a node with no lowering (or one whose checker declines) runs **on torch** where it stands,
  between partitions: the current partition closes before it (a counted fallback);
- a **random** op whose draws do not depend on its inputs' values (``rand``, ``*_like``,
  ``bernoulli.p``, ``native_dropout``'s mask) is **drawn** with torch's generator, before the
  partition that reads it runs and in graph order, and enters that partition as an input;
  ``native_dropout``'s output is then ``x * mask * scale`` inside the partition; other random
  ops run on torch where they stand.  torch's generator therefore sees eager's calls in eager's
  order, and ``torch.manual_seed`` gives eager's masks;
- ``copy_(graph input, value)`` (AOTAutograd's input mutations, ``keep_inference_input_mutations``:
  BatchNorm's running statistics) is a **write-back** into the input's memory once every
  partition has run;
- Python arithmetic on sizes (dynamic shapes) is evaluated when the plan is made.

Each partition becomes one ``exec/program.Program`` over the lowering rules, keyed by a
``Signature`` that names the graph's code, the partition, the input metadata and the settings
that change code; ``exec/executables.get_or_compile`` finds it in memory, on disk or compiles it.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional

import torch
import torch.fx

from .. import config
from ..exec.program import Program, Ref, Signature, Step
from ..ir.foreach import foreach_binding
from ..ir.graph import Value
from ..ir.meta import TensorMeta
from ..lower import host_products
from ..lower.registry import LoweringContext, OnTorch
from ..lower.table import get_lowering
from ..plan import cost
from ..stats import STATS
from .._lazy import lazy_import

jax = lazy_import("jax", globals(), "jax")
jnp = lazy_import("jax.numpy", globals(), "jnp")

aten = torch.ops.aten

# Random ops whose draws depend only on their tensor arguments' metadata: drawn with torch on
# placeholders of the right shape (the values are never read), in graph order.
_SHAPE_ONLY_RANDOM = frozenset({
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm",
    "bernoulli.p", "uniform", "normal_functional", "exponential", "geometric", "cauchy",
    "log_normal", "native_dropout",
})


def _random_name(op: torch._ops.OpOverload) -> str:
    name = op._schema.name.split("::")[-1]
    return f"{name}.{op._overloadname}" if name == "bernoulli" else name


def is_random(op: Any) -> bool:
    return isinstance(op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags


def drawn_ahead(op: Any) -> bool:
    """Whether a random op's draws can be made before the computation, on placeholders."""
    return is_random(op) and _random_name(op) in _SHAPE_ONLY_RANDOM


def view_twin(op: torch._ops.OpOverload) -> Optional[torch._ops.OpOverload]:
    """The ``*_copy`` twin of a view op (``aten.t.default`` -> ``aten.t_copy.default``)."""
    schema = op._schema
    if not any(r.alias_info is not None for r in schema.returns) or \
            any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return None
    namespace, name = schema.name.split("::")
    if namespace != "aten":
        return None
    packet = getattr(aten, name + "_copy", None)
    return None if packet is None else getattr(packet, op._overloadname, None)


def meta_of(value: Any) -> TensorMeta:
    """TensorMeta of a (fake or real) tensor, on the CPU."""
    try:
        return TensorMeta.of(value, torch.device("cpu"))
    except Exception:  # noqa: BLE001 - a fake tensor without storage: its own extent
        extent = 1 + sum((s - 1) * st for s, st in zip(value.shape, value.stride()) if s > 0)
        return TensorMeta(tuple(value.shape), tuple(value.stride()), value.storage_offset(), value.dtype,
                          torch.device("cpu"), extent)


def unroll_foreach_nodes(gm: torch.fx.GraphModule) -> int:
    """Rewrite ``gm``'s foreach nodes that have no lowering into one per-element node per list
    element (as defer mode unrolls them, ``ir/foreach.py``), so each element joins a partition;
    returns how many were rewritten.  A node whose results are used other than by index stays."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) \
                or not op._schema.name.startswith("aten::_foreach_") or get_lowering(op) is not None:
            continue
        binding = foreach_binding(op)
        if binding is None or binding.copy_back or not op._schema.returns or not all(
                u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)
                for u in node.users):
            continue
        schema_args = op._schema.arguments
        args = list(node.args) + [node.kwargs.get(a.name, a.default_value)
                                  if a.name in node.kwargs or a.has_default_value() else None
                                  for a in schema_args[len(node.args):]]
        lists = [v for v, listed in zip(args, binding.listed) if listed]
        if not lists or not all(isinstance(v, (list, tuple)) for v in lists):
            continue
        val = node.meta.get("val")
        elements = []
        with gm.graph.inserting_before(node):
            for i in range(len(lists[0])):
                pos, kw = binding.element_arguments(args, i)
                element_node = gm.graph.call_function(binding.op, tuple(pos), kw)
                if val is not None:
                    element_node.meta["val"] = val[i]
                elements.append(element_node)
        for user in list(node.users):
            user.replace_all_uses_with(elements[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten


# -- units ---------------------------------------------------------------------------------------
# A slot is where a tensor value lives: (node name, output index or None).

@dataclasses.dataclass
class Draw:
    """A random op drawn with torch ahead of the partition that reads it."""
    node: torch.fx.Node
    outs: list          # slots it fills (for native_dropout: the mask only)


@dataclasses.dataclass
class OnTorch:
    """A node run with torch where it stands (``fallback``: a counted fallback; otherwise a view
    of a value torch holds, taken so aliasing and strides are torch's)."""
    node: torch.fx.Node
    fallback: bool
    reason: str = ""


@dataclasses.dataclass
class Partition:
    """One XLA computation: its steps' nodes, its input and output slots, and once compiled
    its executable."""
    index: int
    nodes: list = dataclasses.field(default_factory=list)
    inputs: list = dataclasses.field(default_factory=list)
    outputs: list = dataclasses.field(default_factory=list)
    signature: Any = None
    make_program: Any = None
    avals: tuple = ()
    compiled: Any = None
    failed: Any = None       # why it could not be lowered or compiled (torch then runs its ops)
    # per input slot that is a graph input: (weak reference to the tensor, its data pointer,
    # the JAX view of it) from the last call (compile/runtime.py, _imported)
    imports: Optional[list] = None


@dataclasses.dataclass
class WriteBack:
    """``copy_(graph input, value)``: written into the input once everything has run."""
    node: torch.fx.Node


@dataclasses.dataclass
class Plan:
    units: list
    partitions: list
    values: dict              # node -> its value at this shape (fake tensors, ints)
    slot_meta: dict           # slot -> TensorMeta
    where: dict               # node name -> "xla" / "torch" / "host" / "alias"
    reasons: list             # (op name, why it runs on torch)
    schedule: Any = None      # (steps, write-backs) as a call runs them (compile/runtime.py)
    spec: Any = None          # the check that sees a call of this plan (compile/runtime._LastSpec)


# -- the plan ------------------------------------------------------------------------------------

def _lowering_for(node: torch.fx.Node, op: torch._ops.OpOverload, values: dict) -> tuple[Any, Any, str]:
    """(lowering, the op it lowers, reason) for an op node; lowering None when it cannot lower."""
    lowering, lowered_op = get_lowering(op), op
    if lowering is None:
        twin = view_twin(op)
        if twin is not None:
            lowering, lowered_op = get_lowering(twin), twin
    if lowering is None:
        return None, op, "no lowering"
    if lowering.check is not None:
        ctx = _context(node, lowered_op, values)
        try:
            reason = lowering.check(ctx)
        except Exception as exc:  # noqa: BLE001 - torch raises it when the op runs on torch
            reason = f"its checker raised {type(exc).__name__}"
        if reason is not None:
            return None, op, reason
    return lowering, lowered_op, ""


def map_nodes(a: Any, leaf) -> Any:
    """``a`` (an fx argument tree) with each Node replaced by ``leaf(node)``."""
    if isinstance(a, torch.fx.Node):
        return leaf(a)
    if isinstance(a, tuple):
        return tuple(map_nodes(x, leaf) for x in a)
    if isinstance(a, list):     # (fx's immutable_list too)
        return [map_nodes(x, leaf) for x in a]
    if isinstance(a, dict):
        return {k: map_nodes(v, leaf) for k, v in a.items()}
    return a


def concrete(v: Any) -> Any:
    """A size as a Python number (values propagated at a concrete shape hold no symbols)."""
    if isinstance(v, torch.SymInt):
        return int(v)
    if isinstance(v, torch.SymFloat):
        return float(v)
    if isinstance(v, torch.SymBool):
        return bool(v)
    return v


def _context(node: torch.fx.Node, op: Any, values: dict) -> LoweringContext:
    def leaf(n: torch.fx.Node) -> Any:
        v = values[n]
        return meta_of(v) if isinstance(v, torch.Tensor) else v
    args = map_nodes(node.args, leaf)
    kwargs = map_nodes(dict(node.kwargs), leaf)
    out = values[node]
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return LoweringContext(op, tuple(args), kwargs, tuple(meta_of(o) for o in outs if isinstance(o, torch.Tensor)))


def _getitem_parent(node: torch.fx.Node) -> Optional[tuple[torch.fx.Node, int]]:
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) \
            and isinstance(node.args[1], int):
        return node.args[0], node.args[1]
    return None


def make_plan(gm: torch.fx.GraphModule, values: dict, graph_key: str, spec_key: tuple) -> Plan:
    """The plan of ``gm`` at one concrete shape; ``values`` holds each node's fake value."""
    graph = gm.graph
    nodes = list(graph.nodes)
    where: dict[str, str] = {}
    slot_of: dict[str, Any] = {}       # node name -> slot (or tuple parent marker)
    slot_meta: dict[Any, TensorMeta] = {}
    units: list = []
    partitions: list[Partition] = []
    reasons: list[tuple[str, str]] = []
    current: Optional[Partition] = None
    steps_of: dict[int, list] = {}     # partition index -> [(node, lowering, lowered op, out slots)]
    torch_products = config.get("compute_engine") == "torch"

    def close() -> None:
        nonlocal current
        if current is not None and current.nodes:
            units.append(current)
            partitions.append(current)
        current = None

    def on_torch(node: torch.fx.Node, counted: bool, reason: str = "") -> None:
        """``node`` runs on torch where it stands, ending the current partition (``counted``: a
        fallback, with its reason)."""
        close()
        units.append(OnTorch(node, counted, reason))
        if counted:
            reasons.append((str(node.target), reason))
        where[node.name] = "torch"
        tensor_slots(node)

    def tensor_slots(node: torch.fx.Node) -> list:
        v = values[node]
        if isinstance(v, (tuple, list)):
            slots = []
            for i, o in enumerate(v):
                if isinstance(o, torch.Tensor):
                    slots.append((node.name, i))
                    slot_meta[(node.name, i)] = meta_of(o)
            return slots
        if isinstance(v, torch.Tensor):
            slot_meta[(node.name, None)] = meta_of(v)
            return [(node.name, None)]
        return []

    for node in nodes:
        if node.op in ("placeholder", "get_attr"):
            where[node.name] = "torch"
            tensor_slots(node)
            continue
        if node.op == "output":
            continue
        parent = _getitem_parent(node)
        if parent is not None:
            where[node.name] = "alias"
            continue
        value = values[node]
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            if not _holds_tensor(value):
                where[node.name] = "host"     # size arithmetic: evaluated now
                continue
            on_torch(node, True, "not an aten op")
            continue
        if target is aten.copy_.default and node.args[0].op == "placeholder":
            units.append(WriteBack(node))
            where[node.name] = "writeback"
            continue
        lowering, lowered_op, reason = (None, target, "") if not isinstance(target, torch._ops.OpOverload) \
            else _lowering_for(node, target, values)
        if is_random(target) and lowering is None:
            if drawn_ahead(target) and not (target is aten.native_dropout.default and not _dropout_trains(node)):
                slots = tensor_slots(node)
                if target is aten.native_dropout.default:
                    # the mask is drawn; the output is computed in the partition from it
                    units.append(Draw(node, [slots[1]]))
                    if current is None:
                        current = Partition(len(partitions))
                    current.nodes.append(node)
                    steps_of.setdefault(current.index, []).append((node, None, target, [slots[0]]))
                    where[node.name] = "xla"
                else:
                    units.append(Draw(node, slots))
                    where[node.name] = "torch"
                continue
            on_torch(node, True, "random, reads its inputs' values")
            continue
        if lowering is not None and torch_products and target in cost.FLOPS:
            # compute_engine="torch": products on torch's kernels, between partitions
            on_torch(node, False, "compute_engine=torch")
            continue
        if lowering is None:
            # (a checker's OnTorch places the call on torch by design: not a fallback)
            on_torch(node, not isinstance(reason, OnTorch), reason)
            continue
        if lowered_op is not target and _torch_side(node.args[0], where) and _needed_by_torch(node):
            # a view of memory torch holds that leaves the graph or feeds torch: torch takes it,
            # so that the output aliases what eager's would (XLA's consumers read it as an input)
            units.append(OnTorch(node, False))
            where[node.name] = "torch"
            tensor_slots(node)
            continue
        if current is None:
            current = Partition(len(partitions))
        current.nodes.append(node)
        steps_of.setdefault(current.index, []).append((node, lowering, lowered_op, tensor_slots(node)))
        where[node.name] = "xla"
    close()

    _connect(graph, partitions, steps_of, slot_meta)
    for p in partitions:
        _build_program(p, steps_of[p.index], values, slot_meta, graph_key, spec_key)
    STATS.compiled_partitions += len(partitions)
    return Plan(units, partitions, values, slot_meta, where, reasons)


def _dropout_trains(node: torch.fx.Node) -> bool:
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p")
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
    return train is not False and isinstance(p, (int, float)) and 0 < p < 1


def _holds_tensor(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    return isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v)


def _torch_side(n: Any, where: dict) -> bool:
    return isinstance(n, torch.fx.Node) and where.get(n.name) == "torch"


def _lowerable(op: Any) -> bool:
    if not isinstance(op, torch._ops.OpOverload):
        return False
    if get_lowering(op) is not None:
        return True
    twin = view_twin(op)
    return twin is not None and get_lowering(twin) is not None


def _needed_by_torch(node: torch.fx.Node) -> bool:
    """Whether a node's value leaves the graph or may feed an op torch runs."""
    return any(u.op == "output" or (u.op == "call_function" and u.target is not operator.getitem
                                    and not _lowerable(u.target)) for u in node.users)


def slot_of_arg(n: torch.fx.Node) -> tuple:
    """The slot an fx argument names (a getitem names its parent's output)."""
    parent = _getitem_parent(n)
    if parent is not None:
        return (parent[0].name, parent[1])
    return (n.name, None)


def _connect(graph: torch.fx.Graph, partitions: list[Partition], steps_of: dict, slot_meta: dict) -> None:
    """Each partition's input slots (read, not made inside) and output slots (read outside)."""
    made_in: dict[Any, int] = {}
    partition_of: dict[str, int] = {}
    for p in partitions:
        for node, _, _, outs in steps_of[p.index]:
            partition_of[node.name] = p.index
            for s in outs:
                made_in[s] = p.index
    read_outside: set = set()
    for node in graph.nodes:
        reader = partition_of.get(node.name)
        for arg in node.all_input_nodes:
            s = slot_of_arg(arg)
            if s in made_in and reader != made_in[s]:
                read_outside.add(s)
    for p in partitions:
        inside = {s for _, _, _, outs in steps_of[p.index] for s in outs}
        seen: set = set()
        for node, _, _, outs in steps_of[p.index]:
            reads = [slot_of_arg(arg) for arg in node.all_input_nodes]
            if node.target is aten.native_dropout.default:
                reads.append((node.name, 1))
            for s in reads:
                if s not in inside and s not in seen and s in slot_meta:
                    seen.add(s)
                    p.inputs.append(s)
        p.outputs = [s for _, _, _, outs in steps_of[p.index] for s in outs if s in read_outside]


class _CountedRule:
    """A lowering rule that counts its calls (stats()['compiled_rule_calls']): a program loaded
    from the disk cache calls none."""

    __slots__ = ("rule", "positions")

    def __init__(self, rule, positions: Optional[int] = None) -> None:
        self.rule = rule
        self.positions = positions    # of a multi-output op: how many tensors it returns

    def __call__(self, ctx, *args, **kwargs):
        STATS.compiled_rule_calls += 1
        out = self.rule(ctx, *args, **kwargs)
        if self.positions is not None and isinstance(out, (tuple, list)) and len(out) > self.positions:
            # (rules return the tensor outputs only, as ctx.out lists them; a None is dropped)
            out = tuple(o for o in out if o is not None)
        return out


def _dropout_rule(ctx, x, p, train, *, mask):
    p1m = 1.0 - p
    scale = 0.0 if p1m == 0 else 1.0 / p1m
    return x * mask.astype(x.dtype) * jnp.asarray(scale, x.dtype)


def _structure(a: Any) -> Any:
    """The cache-key form of a step's argument template."""
    if isinstance(a, Ref):
        return ("v", a.index)
    if isinstance(a, (tuple, list)):
        return tuple(_structure(x) for x in a)
    if isinstance(a, dict):
        return tuple(sorted((k, _structure(v)) for k, v in a.items()))
    return a


def _layout(meta: TensorMeta) -> tuple:
    return (meta.shape, meta.stride, meta.dtype)


def _ordering_operand(op: Any, node: torch.fx.Node, values: dict, slot_meta: dict, outs: list) -> Optional[int]:
    """Defer mode's ``order_compute`` for a product of this program (``plan/cost.py``): the
    operand through which it runs after the previous product, or None."""
    def arg(n: torch.fx.Node) -> Any:
        v = values[n]
        return Value(None, 0, meta_of(v)) if isinstance(v, torch.Tensor) else v
    standin = _CostView(op, tuple(map_nodes(node.args, arg)), tuple(slot_meta[s] for s in outs))
    return cost.ordering_operand(standin)


class _CostView:
    """What the cost model reads of a node: its op, arguments (tensors as Values) and outputs."""

    __slots__ = ("op", "args", "out_metas")

    def __init__(self, op: Any, args: tuple, out_metas: tuple) -> None:
        self.op, self.args, self.out_metas = op, args, out_metas


def _build_program(p: Partition, steps: list, values: dict, slot_meta: dict, graph_key: str,
                   spec_key: tuple) -> None:
    """The partition's Signature and program.  The key is the program's own structure (each
    step's op, argument template, constants and output layouts; the inputs' layouts; the
    settings that change code), not the fx graph's text: two graphs that plan the same
    computation (Dynamo's static graph and its dynamic recompilation at one shape) share one
    executable."""
    local = {s: i for i, s in enumerate(p.inputs)}
    n_inputs = len(p.inputs)
    templates = []
    entries = []
    next_id = n_inputs
    for node, lowering, op, outs in steps:
        def arg(n: torch.fx.Node) -> Any:
            v = values[n]
            if isinstance(v, torch.Tensor):
                return Ref("v", local[slot_of_arg(n)])
            return concrete(v)
        args = tuple(map_nodes(node.args, arg))
        kwargs = map_nodes(dict(node.kwargs), arg)
        if node.target is aten.native_dropout.default:
            kwargs = {"mask": Ref("v", local[(node.name, 1)])}
            args = args + (True,) * (3 - len(args))
        out_ids = tuple(range(next_id, next_id + len(outs)))
        for s, i in zip(outs, out_ids):
            local[s] = i
        next_id += len(outs)
        templates.append((node, lowering, op, outs, out_ids, args, kwargs))
        entries.append((str(op), _structure(args), _structure(kwargs), tuple(_layout(slot_meta[s]) for s in outs)))
    out_ids = tuple(local[s] for s in p.outputs)
    p.avals = tuple((slot_meta[s].shape, slot_meta[s].dtype) for s in p.inputs)
    p.signature = Signature(("deferfuse.compile", tuple(_layout(slot_meta[s]) for s in p.inputs),
                             tuple(entries), out_ids, config.compile_key()))

    ordering = config.get("order_compute") and jax.default_backend() == "cpu"

    def make_program() -> Program:
        program_steps = []
        for node, lowering, op, outs, ids, args, kwargs in templates:
            metas = [slot_meta[s] for s in outs]
            if node.target is aten.native_dropout.default:
                rule, ctx = _CountedRule(_dropout_rule), None
            else:
                multi = isinstance(values[node], (tuple, list))
                rule = _CountedRule(lowering.rule, len(outs) if multi else None)
                ctx = _context(node, op, values)
            ordered_by = _ordering_operand(op, node, values, slot_meta, outs) \
                if ordering and not host_products.hosted(ctx) else None
            program_steps.append(Step(rule, ctx, args, kwargs, ids, metas, None, op, ordered_by))
        return Program(n_inputs, program_steps, out_ids)

    p.make_program = make_program
