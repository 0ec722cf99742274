"""The program interpreter: a pending subgraph as a Program, and its structural Signature.

``build`` turns a subgraph into the Signature that keys the executable cache and a closure that
makes its Program (the lowering rules of its nodes, with value identities replaced by local
ids); the Program, traced by JAX, is the computation XLA compiles.

The signature holds, for each node, its structural key (op, input metadata, static arguments)
and which earlier values it reads, the metadata of the graph inputs, and which values leave the
computation.  Runtime scalars (Python floats given to ``Scalar`` parameters) are passed in, so
they never change the key.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from .. import config
from ..errors import LoweringError
from ..ir import graph
from ..ir.graph import Node, RuntimeScalar, Value
from ..lower import common
from ..lower import dtypes as dtypes_
from ..lower import host_products
from ..lower.registry import CHECK_COLLECTORS, CheckCollector
from ..lower.views import internal_rule
from ..plan import cost
from .._lazy import lazy_import

jax = lazy_import("jax", globals(), "jax")
jnp = lazy_import("jax.numpy", globals(), "jnp")
lax = lazy_import("jax.lax", globals(), "lax")


class Ref:
    """A reference, inside a program template, to a value (by local id) or a runtime scalar."""

    __slots__ = ("kind", "index")

    def __init__(self, kind: str, index: int) -> None:
        self.kind = kind
        self.index = index


class Step:
    """One node of a Program.  ``ordered_by``: the index of the argument through which the step
    runs after the previous ordered step (``order_compute``), or None."""

    __slots__ = ("rule", "ctx", "args", "kwargs", "outs", "out_metas", "source", "op", "ordered_by")

    def __init__(self, rule, ctx, args, kwargs, outs, out_metas, source, op, ordered_by=None) -> None:
        self.rule, self.ctx, self.args, self.kwargs = rule, ctx, args, kwargs
        self.outs, self.out_metas, self.source, self.op = outs, out_metas, source, op
        self.ordered_by = ordered_by


_aten = torch.ops.aten
# XLA's algebraic simplifier rewrites some compositions as if floats could not overflow:
# log(exp(a)) -> a, pow(exp(a), y) -> exp(a * y) and sqrt(a * a) -> |a| (exp(100.0) is inf in
# float32, so torch's log of it is inf, not 100; exp(inf) ** 0 is 1, exp(inf * 0) nan).  Where a consumer of these kinds reads a producer of these kinds, the value
# passes through an optimization barrier, which the simplifier cannot see through (the producer
# is then materialized instead of fused, only on such edges).
_LOG_OPS = frozenset({_aten.log.default, _aten.log2.default, _aten.log10.default})
_SQRT_OPS = frozenset({_aten.sqrt.default, _aten.rsqrt.default})
_POW_OPS = frozenset({_aten.pow.Tensor_Tensor, _aten.pow.Tensor_Scalar})


def _unsafe_rewrite(consumer: Any, producer: Optional["Step"]) -> bool:
    """Whether XLA would rewrite ``consumer(producer(...))`` unsafely (see above)."""
    if producer is None:
        return False
    if consumer in _LOG_OPS or consumer in _POW_OPS:
        return producer.op is _aten.exp.default
    if consumer in _SQRT_OPS:
        # a * a with both operands the same value (x ** 2 is computed otherwise: pow lowering)
        return producer.op is _aten.mul.Tensor and len(producer.args) == 2 \
            and isinstance(producer.args[0], Ref) and isinstance(producer.args[1], Ref) \
            and producer.args[0].kind == producer.args[1].kind == "v" \
            and producer.args[0].index == producer.args[1].index
    return False


# XLA's fusion counts sine, cosine and tangent as cheap (``InstructionFusion::IsExpensive``), so
# it fuses them into every consumer, also one that broadcasts them, where they are then computed
# once per element of the consumer: RoPE's ``cos(emb)`` and ``sin(emb)`` ([1, S, D]) were
# evaluated for every element of the [B, H, S, D] queries and keys, forward and backward (32
# fusions of the Llama step's backward; docs/performance.md, "Sines and cosines computed
# once").  A value whose computation since its last materialization holds such a function
# (``_costly``) is materialized (``_held``) where a consumer broadcasts it to at least twice its
# size.  (The other transcendental functions are expensive to XLA, which does not duplicate
# them so.)
_TRANSCENDENTAL = frozenset({"cos", "sin", "tan"})
# ops that only reshape, re-index or retype their first operand: one that reads no more elements
# than the operand has keeps a costly operand costly (an unsqueeze, a transpose, a slice).  Defer
# mode's programs read every view of a storage through ``read_view`` (ir/graph.py): RoPE's
# ``cos(emb).unsqueeze(1)`` was one, it dropped the mark, and the deferred Llama step evaluated
# its sines and cosines inside 32 fusions over the queries and keys (~13 ms a step).
_RESHAPING = frozenset({
    "view", "view_copy", "_unsafe_view", "reshape", "unsqueeze", "unsqueeze_copy", "squeeze",
    "squeeze_copy", "clone", "alias", "alias_copy", "_to_copy", "permute", "permute_copy",
    "transpose", "transpose_copy", "t", "t_copy", "contiguous", "slice", "slice_copy", "select",
    "select_copy", "narrow", "expand", "expand_copy",
    "read_view", "flatten", "cast", "bits",    # (deferfuse's own: ir/graph.py's InternalOps)
})


def _op_name(op: Any) -> str:
    if isinstance(op, graph.InternalOp):
        return op.name
    schema = getattr(op, "_schema", None)
    return schema.name.split("::")[-1] if schema is not None else ""


def _pointwise(op: Any) -> bool:
    return isinstance(op, torch._ops.OpOverload) and torch.Tag.pointwise in op.tags


def _is_costly(step: "Step", operands: list[tuple[bool, int]]) -> bool:
    """Whether ``step``'s outputs carry a transcendental computation not yet materialized;
    ``operands``: (costly, size) of each value the step reads."""
    name = _op_name(step.op)
    if name in _TRANSCENDENTAL:
        return True
    reshaping = name in _RESHAPING
    if not operands or not (reshaping or _pointwise(step.op)):
        return False
    size = step.out_metas[0].numel if step.out_metas else 0
    return any(c for c, _ in operands) and all(n >= size if reshaping else n == size for c, n in operands if c)


_BITS = {2: "uint16", 4: "uint32", 8: "uint64"}


def _held(x: Any) -> Any:
    """``x``, computed once into its own buffer: a reduction XLA does not fuse into a consumer
    that reads its elements more than once (an optimization barrier is gone before fusion).  It
    ORs the value's bits with zero, so every value, -0.0 and NaN's payload included, is kept."""
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize not in _BITS:
        return x
    bits = jnp.dtype(_BITS[x.dtype.itemsize])
    b = lax.bitcast_convert_type(x, bits)
    kept = lax.reduce(jnp.stack([b, jnp.zeros_like(b)]), bits.type(0), lax.bitwise_or, (0,))
    return lax.bitcast_convert_type(kept, x.dtype)


def _value_refs(a: Any):
    """The value references in an argument tree."""
    if isinstance(a, Ref):
        if a.kind == "v":
            yield a
    elif type(a) in (list, tuple):
        for x in a:
            yield from _value_refs(x)


def _spreads(shape: tuple, out_shape: tuple, consumer: Any) -> bool:
    """Whether a step ``consumer`` with result ``out_shape`` reads an operand of ``shape`` at least
    twice per element on average: it broadcasts the operand, or it re-indexes it (an expanding
    view: ``read_view`` gathers a flat storage into any shape)."""
    if math.prod(out_shape) < 2 * max(math.prod(shape), 1):
        return False
    return _op_name(consumer) in _RESHAPING or common.broadcastable(shape, out_shape)


class Program:
    """A subgraph with value identities replaced by local ids: what gets compiled."""

    def __init__(self, n_inputs: int, steps: list[Step], outputs: tuple[int, ...]) -> None:
        self.n_inputs = n_inputs
        self.steps = steps
        self.outputs = outputs
        # (step index, error type, message) of each runtime check, filled while tracing
        self.checks: list[tuple[int, type, str]] = []

    def __call__(self, inputs: Sequence[jax.Array], scalars: jax.Array) -> tuple[list[jax.Array], jax.Array, jax.Array]:
        env: list[Any] = list(inputs)
        producers: list[Optional[Step]] = [None] * len(env)   # the step that made each value
        flags: list[Any] = []
        values: list[Any] = []
        self.checks = []
        costly: list[bool] = [False] * len(env)   # see _TRANSCENDENTAL
        materialized: dict[int, Any] = {}          # a costly value, computed once (_held)
        consumer: Any = None
        out_shape: tuple = ()
        last_ordered: Any = None   # the result of the latest ordered step

        def resolve(a: Any) -> Any:
            if isinstance(a, Ref):
                if a.kind != "v":
                    return scalars[a.index]
                if _unsafe_rewrite(consumer, producers[a.index]):
                    return lax.optimization_barrier(env[a.index])
                if costly[a.index] and _spreads(tuple(env[a.index].shape), out_shape, consumer):
                    if a.index not in materialized:
                        materialized[a.index] = _held(env[a.index])
                    return materialized[a.index]
                return env[a.index]
            if type(a) in (list, tuple):
                return type(a)(resolve(x) for x in a)
            return a

        for position, step in enumerate(self.steps):
            consumer = step.op
            out_shape = tuple(step.out_metas[0].shape) if step.out_metas else ()
            collector = CheckCollector(step.op)
            CHECK_COLLECTORS.append(collector)
            try:
                args = resolve(step.args)
                if step.ordered_by is not None and last_ordered is not None:
                    args = _ordered_after(args, step.ordered_by, last_ordered)
                out = step.rule(step.ctx, *args, **{k: resolve(v) for k, v in step.kwargs.items()})
            except Exception as exc:
                raise LoweringError(f"lowering {step.op} failed{source_suffix(step.source)}: {type(exc).__name__}: {exc}") from exc
            finally:
                CHECK_COLLECTORS.pop()
            for flag, error, message, value in collector.items:
                flags.append(flag)
                values.append(jnp.int64(0) if value is None else value)
                self.checks.append((position, error, message))
            outs = out if isinstance(out, (tuple, list)) else (out,)
            if step.ordered_by is not None:
                last_ordered = outs[0]
            read = [(costly[r.index], env[r.index].size) for r in _value_refs(step.args)]
            carried = _is_costly(step, read)
            for local_id, meta, arr in zip(step.outs, step.out_metas, outs):
                arr = jnp.asarray(arr)
                want = dtypes_.to_jax(meta.dtype)
                if arr.dtype != want:
                    arr = dtypes_.cast(arr, want)
                if tuple(arr.shape) != meta.shape:
                    raise LoweringError(f"lowering {step.op} gave shape {tuple(arr.shape)}, torch gives "
                                        f"{meta.shape}{source_suffix(step.source)}")
                env.append(arr)
                producers.append(step)
                costly.append(carried)
                assert len(env) - 1 == local_id
        outputs = [env[i] for i in self.outputs]
        if not flags:
            # (no check: no empty flag arrays either, each an output buffer on every call)
            return outputs, None, None
        return outputs, jnp.stack(flags), jnp.stack(values)


# XLA's CPU dot (YNNPACK) reads its left-hand side row by row: a transposed one (x.t() @ g, every
# weight gradient) went to a slower Eigen kernel, at about half the speed (python -m bench.dots,
# transposed lhs), and XLA's runtime started independent products (a layer's weight and input
# gradients) together, each spread over every core already.  An optimization barrier grouping a
# product's left-hand operand with the previous product's result makes XLA materialize the
# operand row-major and ties the products in record order.  XLA drops the barrier once it has
# optimized, so its runtime may still overlap two products; measured on the GPT step, the tie
# beat materializing the operand alone (docs/performance.md, training).
def _ordered_after(args: tuple, index: int, previous: Any) -> tuple:
    """``args`` with ``args[index]`` available only once ``previous`` is computed."""
    operand, _ = lax.optimization_barrier((args[index], previous))
    return args[:index] + (operand,) + args[index + 1:]


def source_suffix(source: Any) -> str:
    """The text naming the line that recorded an op, for error messages ("" where unknown)."""
    return f" (recorded at {source})" if source else ""



def _template(a: Any, index: dict[int, int], leaves: list[Value], scalars: list[float]) -> tuple[Any, Any]:
    """(template for the program, structural key) of one argument."""
    if isinstance(a, Value):
        local = index.get(id(a))
        if local is None:
            # a value computed earlier (or a graph input): it enters as an input
            local = len(leaves)
            index[id(a)] = local
            leaves.append(a)
        return Ref("v", local), ("v", local)
    if isinstance(a, RuntimeScalar):
        scalars.append(a.value)
        return Ref("s", len(scalars) - 1), "s"
    if type(a) in (list, tuple):
        parts = [_template(x, index, leaves, scalars) for x in a]
        return type(a)(p[0] for p in parts), tuple(p[1] for p in parts)
    return a, a


class Signature:
    """A subgraph's structural signature, hashed once: it keys several caches per flush, and
    hashing the tuple again would hash every op in it each time (OpOverload's hash is Python)."""

    __slots__ = ("key", "_hash")

    def __init__(self, key: tuple) -> None:
        self.key = key
        self._hash = hash(key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, Signature) and self._hash == other._hash
                                 and self.key == other.key)

    def __repr__(self) -> str:
        # (the disk cache keys by this text)
        return repr(self.key)


def build(nodes: list[Node], outputs: list[Value]):
    """Signature, program-building closure, graph inputs and runtime scalars of a subgraph.

    This is the hot path of a cache hit, so it reads only each node's precomputed key, inputs
    and scalars; the argument templates of the program are built only when it is compiled.
    Graph inputs are numbered first (in order of first use) so the program sees them as
    env[0..n); node outputs follow.
    """
    leaves: list[Value] = []
    scalars: list[float] = []
    index: dict[int, int] = {}
    in_set = {n.id for n in nodes}
    for node in nodes:
        for v in node.inputs:
            if v.node.id not in in_set and id(v) not in index:
                index[id(v)] = len(leaves)
                leaves.append(v)
    n_inputs = next_id = len(leaves)
    entries: list[Any] = []
    first_out: list[int] = []   # per node, the env slot of its first output
    slot_of = index.__getitem__
    for node in nodes:
        entries.append((node.key, tuple(map(slot_of, map(id, node.inputs)))))
        if node.scalars:
            scalars.extend(node.scalars)
        first_out.append(next_id)
        for ref in node.out_refs:
            v = ref()
            if v is not None:
                index[id(v)] = next_id
            next_id += 1
    out_ids = tuple(index[id(v)] for v in outputs)
    sig = Signature((tuple((v.meta.shape, v.meta.dtype) for v in leaves), tuple(entries), out_ids, config.compile_key()))

    def make_program() -> Program:
        steps = []
        scalar_list: list[float] = []
        ordering = config.get("order_compute") and jax.default_backend() == "cpu"
        for node, first in zip(nodes, first_out):
            args_t, _ = _template(node.args, index, leaves, scalar_list)
            kwargs_t = {k: _template(v, index, leaves, scalar_list)[0] for k, v in node.kwargs.items()}
            if isinstance(node.op, graph.InternalOp):
                rule, ctx = internal_rule(node.op), None
            else:
                rule, ctx = node.lowering.lowering.rule, node.lowering.ctx
            outs = tuple(range(first, first + len(node.out_metas)))
            ordered_by = cost.ordering_operand(node) if ordering and not host_products.hosted(ctx) else None
            steps.append(Step(rule, ctx, args_t, kwargs_t, outs, node.out_metas, node.source, node.op,
                              ordered_by))
        assert len(leaves) == n_inputs and scalar_list == scalars, "argument templates disagree with the signature"
        return Program(n_inputs, steps, out_ids)

    return sig, make_program, leaves, scalars



def leaf_avals(leaves: list[Value]) -> tuple:
    """(shape, dtype) of each graph input: what a program is compiled for."""
    return tuple((v.meta.shape, v.meta.dtype) for v in leaves)

