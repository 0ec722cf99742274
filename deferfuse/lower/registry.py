"""The lowering registry: aten OpOverload -> a rule that builds JAX code.

A lowering is small immutable data: the rule and an optional checker.  Rules are registered with
``@lowering(aten.x.y, ...)``; registering an overload twice raises ``DuplicateLoweringError``.
This module is the table only and imports no family; ``table`` loads the families and answers
lookups (``table.get_lowering``, ``table.get_shape_rule``).

A rule is called while tracing under ``jax.jit`` as ``rule(ctx, *args, **kwargs)``, where the
args mirror the aten call: tensors become JAX arrays, lists of tensors lists of arrays, and every
other argument keeps its Python value, except Python floats passed to ``Scalar`` parameters, which
arrive as 0-d float64 JAX values (they are runtime inputs, so a changing learning rate does not
recompile).  A rule returns one array, or a tuple for ops with several outputs; results are cast
to the dtypes torch inferred (``ctx.out``) by the caller, so a rule may return a wider type.

A checker is called at record time as ``check(ctx)`` (``ctx`` without arrays) and returns None
when the rule handles this call, or a short reason string when it does not; the op then goes to a
decomposition or to an eager fallback.  A reason given as ``OnTorch(reason)`` asks for neither:
the call is recorded as usual and placed on torch's kernel inside the deferred graph (no flush,
no fallback), for a call one of whose outputs only torch's kernel can make (an LSTM layer's
workspace under grad mode, which torch's backward reads: lower/rnn.py).  Checkers are cached
per (op, input metadata).  A checker may also raise torch's own exception for a call that
torch's meta kernel accepts but its CPU kernel rejects (it then runs at record time, on the
user's line, with strict's error type).

An op tagged ``nondeterministic_seeded`` (random) is recorded through its lowering only for calls
the checker accepts, so its checker must decline every call that would draw random numbers (the
tag is the schema's, for every backend: the CPU flash attention kernel draws none).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import torch

from ..errors import DuplicateLoweringError
from ..ir.graph import RuntimeScalar
from ..ir.meta import TensorMeta
from . import dtypes as _dtypes
from .._lazy import lazy_import

jnp = lazy_import("jax.numpy", globals(), "jnp")

Rule = Callable[..., Any]


class OnTorch(str):
    """A checker's reason that places the call on torch's kernel within the deferred graph,
    rather than sending it to a decomposition or an eager fallback (see the module docstring)."""


Checker = Callable[["LoweringContext"], Optional[str]]


@dataclasses.dataclass(frozen=True)
class Lowering:
    op: torch._ops.OpOverload
    rule: Rule
    check: Optional[Checker] = None
    # whether torch's kernel gives other outputs under grad mode (an LSTM layer's workspace):
    # the recorder then keys the op's metadata and check by grad mode too
    grad_mode_keyed: bool = False
    # a custom op's (deferfuse.jax_op): a fingerprint of the user's code, which enters the op's
    # structural key (and so the executable caches, on disk too), and, for an op with a
    # fingerprint, exactly the arguments whose Python floats are runtime scalars (torch's own
    # ops say that by the ``Scalar`` type)
    fingerprint: Optional[str] = None
    runtime_floats: frozenset = frozenset()


LOWERINGS: dict[torch._ops.OpOverload, Lowering] = {}


def lowering(*ops: torch._ops.OpOverload, check: Optional[Checker] = None,
             grad_mode_keyed: bool = False, fingerprint: Optional[str] = None,
             runtime_floats: frozenset = frozenset()) -> Callable[[Rule], Rule]:
    """Register ``rule`` as the lowering of each overload in ``ops`` (``grad_mode_keyed``,
    ``fingerprint``, ``runtime_floats``: see Lowering)."""
    for op in ops:
        if not isinstance(op, torch._ops.OpOverload):
            raise TypeError(f"lowering() takes aten overloads such as aten.add.Tensor, got {op!r}")

    def register(rule: Rule) -> Rule:
        for op in ops:
            if op in LOWERINGS:
                raise DuplicateLoweringError(
                    f"{op} already lowered by {LOWERINGS[op].rule.__module__}."
                    f"{LOWERINGS[op].rule.__qualname__}; remove one of the two registrations")
            LOWERINGS[op] = Lowering(op, rule, check, grad_mode_keyed, fingerprint, frozenset(runtime_floats))
        return rule

    return register


# Output metadata of ops that have no meta kernel (geqrf, histogram): called with the call's
# arguments as meta tensors, a rule returns what torch's kernel would (meta tensors of the output
# shapes and dtypes), or raises NotImplementedError where only the real kernel can say.
ShapeRule = Callable[..., Any]
SHAPE_RULES: dict[torch._ops.OpOverload, ShapeRule] = {}


def shape_rule(*ops: torch._ops.OpOverload) -> Callable[[ShapeRule], ShapeRule]:
    """Register ``rule`` as the output-metadata function of each overload in ``ops``, for ops
    without a meta kernel.  Register functional overloads only: an ``out=`` overload whose
    functional twin has a rule gets one derived from it (see ``capture.meta``)."""
    def register(rule: ShapeRule) -> ShapeRule:
        for op in ops:
            if op in SHAPE_RULES:
                raise DuplicateLoweringError(f"{op} already has a shape rule, {SHAPE_RULES[op].__qualname__}")
            SHAPE_RULES[op] = rule
        return rule

    return register


# Value-dependent checks registered by rules while a program is traced (see runtime_check).
class CheckCollector:
    __slots__ = ("op", "items")

    def __init__(self, op: Any) -> None:
        self.op = op
        self.items: list[tuple[Any, type, str, Any]] = []


# The collectors of the rules being traced, innermost last: the runner pushes one per step
# (``CheckCollector(op)``) around the call of its rule and reads its items after.
CHECK_COLLECTORS: list[CheckCollector] = []


def runtime_check(failed: Any, error: type, message: str, value: Any = None) -> None:
    """Raise ``error(message)`` when the computation runs and any element of ``failed`` is true.

    For errors that depend on values, which torch raises eagerly and XLA would silently hide
    (XLA clamps an out-of-range gather index).  The flag is an extra output of the compiled
    computation, checked before any result is written back; the error names the line that
    recorded the op.  ``{value}`` in the message is replaced by the first element of ``value``
    (same shape as ``failed``) where the check failed.
    """
    if not CHECK_COLLECTORS:
        return
    failed = jnp.asarray(failed).reshape(-1)
    if value is not None:
        first = jnp.argmax(failed) if failed.size else 0
        value = jnp.asarray(value).reshape(-1)[first].astype(jnp.int64) if failed.size else jnp.int64(0)
    CHECK_COLLECTORS[-1].items.append((jnp.any(failed), error, message, value))


# Which exception torch's CPU kernels raise for an out-of-range index, by op name.
_INDEX_ERRORS_AS_RUNTIME = frozenset({"gather", "scatter", "scatter_add", "scatter_reduce", "index_add"})
_FLAT_INDEX_OPS = frozenset({"take", "put"})
# Ops whose CPU kernels accept negative indices from -size (the others reject them).
_NEGATIVE_INDEX_OPS = frozenset({"index", "index_put", "index_fill", "take", "put"})
# Ops whose CPU kernels say only "index out of range in self".
_TERSE_INDEX_OPS = frozenset({"index_select", "embedding", "index_reduce"})


# -- which lowerings raise on values ----------------------------------------------------------
# An op whose lowering registers a runtime check (an index out of range, an integer division by
# zero) can raise on its inputs' values, which deferring moves from its line to a flush: the
# recorder runs such an op at once inside a try block (capture/handlers.py), and never leaves
# one uncomputed because its result is dead.  Whether a lowering does is read off its rule: the
# functions it calls, followed through the lower package's modules, reach runtime_check or
# bounds_check (found once per rule; a rule that only may, as a read of a view, counts: running
# at once is never wrong).  The errors such checks raise:
VALUE_ERRORS = (IndexError, RuntimeError)
_RAISES: dict[Any, bool] = {}
_CHECK_NAMES = frozenset({"runtime_check", "bounds_check"})


def raises_on_values(rule: Any) -> bool:
    """Whether the lowering rule ``rule`` registers runtime checks of values (see above)."""
    found = _RAISES.get(rule)
    if found is None:
        found = _RAISES[rule] = _reaches_checks(rule, set())
    return found


def _functions_named(fn: Any) -> list:
    """The functions of the lower package that ``fn``'s code names (in its own module, or as an
    attribute of a module of the package it names), and the functions in its closure."""
    import types
    code = fn.__code__
    names: set = set()
    stack = [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        names.update(c.co_freevars)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    found = []
    if names & _CHECK_NAMES:   # (imported inside the function, or named in its module)
        found.extend((runtime_check, bounds_check))
    scope = getattr(fn, "__globals__", {})
    for name in names:
        obj = scope.get(name)
        if isinstance(obj, types.ModuleType) and obj.__name__.startswith(__package__):
            found.extend(getattr(obj, n, None) for n in names)
        else:
            found.append(obj)
    for cell in fn.__closure__ or ():
        try:
            found.append(cell.cell_contents)
        except ValueError:   # (an empty cell)
            pass
    return [f for f in found if isinstance(f, types.FunctionType)
            and (f.__module__ or "").startswith(__package__)]


def _reaches_checks(fn: Any, seen: set) -> bool:
    stack = [fn]
    while stack:
        f = stack.pop()
        if f in seen:
            continue
        seen.add(f)
        for g in _functions_named(f):
            if g is runtime_check or g is bounds_check:
                return True
            if g not in seen:
                stack.append(g)
    return False


def bounds_check(index: Any, size: int, dim: int, rank: Optional[int] = None) -> None:
    """Register torch's out-of-range error for ``index`` into a dim of ``size`` (negative indices
    from -size are allowed), with torch's exception type for the op being lowered (``rank``:
    the indexed tensor's, where that type depends on it)."""
    if not CHECK_COLLECTORS:
        return
    op = CHECK_COLLECTORS[-1].op
    name = op._schema.name.split("::")[-1].rstrip("_") if hasattr(op, "_schema") else str(op)
    if name.startswith("_unsafe"):
        return  # torch does not check these either: callers guarantee (or mask) the range
    error = RuntimeError if name in _INDEX_ERRORS_AS_RUNTIME else IndexError
    if name == "index_add" and rank is not None and rank <= 1:
        # (torch's CPU kernel checks a vector itself, tersely; other ranks in a generic scatter)
        error = IndexError
        message = f"{op}: index out of range in self (index {{value}}, dimension 0 with size {size})"
    elif name == "index_select" and dim != 0:
        # torch's CPU kernel checks other dims in a generic gather with its own wording
        error = RuntimeError
        message = f"{op}: INDICES element is out of DATA bounds, id={{value}} axis_dim={size}"
    elif name in _FLAT_INDEX_OPS:
        message = f"{op}: out of range: tried to access index {{value}} on a tensor of {size} elements."
    elif name in _TERSE_INDEX_OPS:
        message = f"{op}: index out of range in self (index {{value}}, dimension {dim} with size {size})"
    else:
        message = f"{op}: index {{value}} is out of bounds for dimension {dim} with size {size}"
    index = jnp.asarray(index)
    lowest = -size if name in _NEGATIVE_INDEX_OPS else 0
    runtime_check((index < lowest) | (index >= size), error, message, index)


def replay_on_cpu(ctx: "LoweringContext", *, empty: bool = False) -> str:
    """Replay the call on CPU stand-ins of its tensors (zeros of the same shape, expanded so they
    cost one element; or, with ``empty``, tensors with every dim empty, for dtype-only checks) so
    that torch raises its own exception now, on the user's line.  For checkers of calls that the
    meta kernel accepts but the CPU kernel may reject.  Returns a decline reason if the CPU kernel
    accepts the call after all."""
    import warnings
    from torch.utils._python_dispatch import _disable_current_modes

    def stand_in(a: Any) -> Any:
        if isinstance(a, TensorMeta):
            if empty:
                # (a 0-dim stand-in keeps one element: False for a bool, which selects nothing
                # in a mask, and 1 otherwise, which divides without error)
                return (torch.zeros if a.dtype is torch.bool else torch.ones)((0,) * len(a.shape), dtype=a.dtype)
            return torch.zeros((), dtype=a.dtype).expand(a.shape)
        if isinstance(a, RuntimeScalar):
            return a.value
        if type(a) in (list, tuple):
            return type(a)(stand_in(x) for x in a)
        return a

    with _disable_current_modes(), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ctx.op(*stand_in(ctx.args), **{k: stand_in(v) for k, v in ctx.kwargs.items()})
    return "the meta and CPU kernels disagree on this call"


def _meta_arg(a: Any) -> Any:
    if isinstance(a, TensorMeta):
        return a.to_meta_tensor()
    if isinstance(a, RuntimeScalar):
        return a.value
    if type(a) in (list, tuple):
        return type(a)(_meta_arg(x) for x in a)
    return a


class LoweringContext:
    """What a rule or checker may know about the call besides the arrays: metadata only."""

    def __init__(self, op: torch._ops.OpOverload, args: tuple, kwargs: dict,
                 out: tuple[TensorMeta, ...]) -> None:
        self.op = op
        self.args = args        # TensorMeta for tensors, RuntimeScalar for runtime floats
        self.kwargs = kwargs
        self.out = out

    @property
    def out_dtype(self) -> jnp.dtype:
        return _dtypes.to_jax(self.out[0].dtype)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.out[0].shape

    def tensor_args(self) -> list[TensorMeta]:
        found: list[TensorMeta] = []
        stack = list(self.args) + list(self.kwargs.values())
        while stack:
            a = stack.pop()
            if isinstance(a, TensorMeta):
                found.append(a)
            elif type(a) in (list, tuple):
                stack.extend(a)
        return found

    @functools.cached_property
    def _elementwise(self) -> tuple[torch.dtype, torch.dtype]:
        from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes
        operands = [_meta_arg(a) for a in self.args
                    if isinstance(a, (TensorMeta, RuntimeScalar, bool, int, float, complex))]
        return elementwise_dtypes(*operands,
                                  type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)

    @property
    def compute_dtype(self) -> jnp.dtype:
        """torch's computation dtype for an elementwise op over the positional operands
        (float32 for float16/bfloat16 inputs, as torch's CPU kernels compute)."""
        return _dtypes.to_jax(self._elementwise[0])

    @property
    def promoted_dtype(self) -> jnp.dtype:
        """torch's result dtype of type promotion over the positional operands."""
        return _dtypes.to_jax(self._elementwise[1])

    def meta_args(self) -> tuple[tuple, dict]:
        """The call's arguments as meta tensors and plain Python values."""
        return (tuple(_meta_arg(a) for a in self.args),
                {k: _meta_arg(v) for k, v in self.kwargs.items()})
