"""What the recorder learns once per op: its facts for dispatch, its decomposition, whether its
calls are keyed by grad mode, and for an in-place op its functional twin (one node for both).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..lower.registry import LOWERINGS
from ..lower.table import get_lowering
from .classify import OpKind, functional_variant, op_info
from .collectives import COLLECTIVE, is_collective
from .unroll import DECOMPOSITIONS, unroll_foreach

aten = torch.ops.aten
LOCAL_SCALAR_DENSE = aten._local_scalar_dense.default

# Views that set a lazy bit (x.conj() of a complex tensor, the negation view autograd makes):
# torch's schemas and tags do not mark them.
LAZY_BIT_VIEWS = frozenset({aten._conj.default, aten._neg_view.default})
LAZY_BIT_VIEW_IDS = frozenset(id(op) for op in LAZY_BIT_VIEWS)

# Per op, what dispatch needs on every call: (OpInfo, our special form or None, the op's name
# for cache keys).  Keyed by id: OpOverloads are immortal singletons whose __hash__ is Python.
FACTS: dict[int, tuple] = {}


def learn_facts(func: torch._ops.OpOverload) -> tuple:
    info, name = op_info(func), str(func)
    if func.namespace not in _TORCH_NAMESPACES:
        # a custom op with a lowering (deferfuse.jax_op): its ``float`` arguments are runtime
        # scalars, and the fingerprint of its code enters its key (an edited kernel never
        # meets an executable compiled from the old code, in memory or on disk)
        lowered = LOWERINGS.get(func)
        if lowered is not None and lowered.fingerprint is not None:
            info = dataclasses.replace(info, scalar_args=lowered.runtime_floats)
            name = f"{name}@{lowered.fingerprint}"
    facts = FACTS[id(func)] = (info, _special_form(func), name)
    return facts


_TORCH_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "c10d", "quantized", "rngprims"})


# id(op) -> whether its calls are keyed by grad mode too (Lowering.grad_mode_keyed), asked only
# for calls that are recorded: the lowering table is not loaded for ops run at first sight
_GRAD_KEYED: dict[int, bool] = {}


def grad_mode_keyed(func: torch._ops.OpOverload) -> bool:
    keyed = _GRAD_KEYED.get(id(func))
    if keyed is None:
        lowered = get_lowering(func)
        keyed = _GRAD_KEYED[id(func)] = lowered is not None and lowered.grad_mode_keyed
    return keyed


def _special_form(op: torch._ops.OpOverload):
    """Our own decomposition of ``op`` (capture/unroll.py), COLLECTIVE for a communication op
    (capture/collectives.py), or None."""
    if is_collective(op):
        return COLLECTIVE
    if op in DECOMPOSITIONS:
        return DECOMPOSITIONS[op]
    if op._schema.name.startswith("aten::_foreach_"):
        return lambda *args, **kwargs: unroll_foreach(op, args, kwargs)
    return None


def decomposition_of(op: torch._ops.OpOverload):
    from torch._decomp import decomposition_table
    return decomposition_table.get(op)


# Kinds of ops that act on their tensor arguments before converting them (a random op draws
# from the generator; an in-place view op runs on a plain target at once; a size rule runs ops
# of its own): an opaque argument must be found first.
ACTS_BEFORE_CONVERTING = frozenset({OpKind.RANDOM, OpKind.INPLACE_VIEW, OpKind.DYNAMIC})


# In-place ops recorded as one node of their functional twin (Recorder._record_inplace), by
# id(op): (twin, its OpInfo, its name, the op's name, whether to check for partial overlap), or
# None where the general path applies.
INPLACE_TWINS: dict[int, Optional[tuple]] = {}
UNKNOWN = object()


def inplace_twin(op: torch._ops.OpOverload, info) -> Optional[tuple]:
    """Whether ``op`` writes only ``self`` and its functional twin takes the same arguments the
    same way, so one conversion serves both: a pure, single-result, lowerable kind of op."""
    twin = None
    functional = functional_variant(op)
    if functional is not None and info.written == ("self",) and op._schema.returns \
            and torch.Tag.nondeterministic_seeded not in op.tags:
        f_info = op_info(functional)
        f_facts = FACTS.get(id(functional)) or learn_facts(functional)
        same_arguments = (f_info.arg_names == info.arg_names and f_info.scalar_args == info.scalar_args
                          and _same_order(op, functional))
        if same_arguments and f_info.kind is OpKind.PURE and f_facts[1] is None \
                and not f_info.composite_implicit and f_info.returns == "one":
            twin = (functional, f_info, f_facts[2], str(op), overlap_rule(info, functional))
    INPLACE_TWINS[id(op)] = twin
    return twin


def _same_order(op, functional) -> bool:
    names = [a.name for a in op._schema.arguments]
    f_names = [a.name for a in functional._schema.arguments if not a.kwarg_only]
    return names[:len(f_names)] == f_names


def rebind(op, functional, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments of ``op`` in the order of its functional variant, which may differ
    (polygamma_(self, n) is polygamma(n, self))."""
    if _same_order(op, functional):
        return args, kwargs
    names = [a.name for a in op._schema.arguments]
    f_names = [a.name for a in functional._schema.arguments if not a.kwarg_only]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    positional = tuple(bound.pop(n) for n in f_names if n in bound)
    return positional, bound


def overlap_rule(info, functional) -> Optional[str]:
    """Which inputs of a write must not partially overlap the written tensor, as torch's kernels
    check it: every input for pointwise ops (TensorIterator) and copy_, the mask for masked_fill_
    (its value may be a view of the target; torch's index_put_ checks nothing, see
    test_regressions); None where nothing is checked."""
    if info.pointwise or functional is aten.copy.default:
        return "all"
    if functional is aten.masked_fill.Scalar or functional is aten.masked_fill.Tensor:
        return "mask"
    return None
