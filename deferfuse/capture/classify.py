"""What an aten op does, read from its schema and tags (never from lists of names)."""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Optional

import torch

aten = torch.ops.aten


class OpKind(enum.Enum):
    PURE = "pure"                  # fresh tensor outputs, no aliasing, no mutation
    VIEW = "view"                  # outputs alias an input's storage
    MUTATING = "mutating"          # in-place or out=: writes some tensor arguments
    INPLACE_VIEW = "inplace_view"  # changes a tensor's metadata in place (t_, unsqueeze_, ...)
    RANDOM = "random"              # consumes the torch RNG
    DYNAMIC = "dynamic"            # output shape depends on input values
    OBSERVING = "observing"        # returns Python values computed from tensor data
    ALLOCATION = "allocation"      # returns uninitialized memory (empty*)


# Kinds of ops whose results never alias their arguments' memory: running one on a deferred
# tensor's data does not hand that memory out (see StorageState.owned).
FRESH_RESULT_KINDS = frozenset({OpKind.PURE, OpKind.OBSERVING, OpKind.DYNAMIC})


@dataclasses.dataclass(frozen=True)
class OpInfo:
    kind: OpKind
    written: tuple[str, ...]        # names of arguments the op writes
    scalar_args: frozenset[str]     # arguments where a Python float is a runtime input
    arg_names: tuple[str, ...]      # positional order
    pointwise: bool
    random: bool
    dynamic: bool
    is_factory: bool                # takes no tensor arguments
    returns: str                    # "one", "list" (Tensor[]) or "tuple"
    composite_implicit: bool        # has a CompositeImplicitAutograd kernel (decomposes itself)


def _is_tensor_type(t: torch._C.JitType) -> bool:
    text = str(t)
    return "Tensor" in text


def _is_number_type(t: torch._C.JitType) -> bool:
    text = str(t)
    return text in ("number", "Optional[number]", "List[number]")


# Ops whose output is uninitialized memory.  torch has no tag for this; they run eagerly (an
# allocation costs nothing to do now) so their results are real tensors that code such as
# torch.load can re-point with set_().
_ALLOCATIONS = frozenset({"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like",
                          "empty_permuted"})


# ``_unsafe_view`` returns a view of its input (kron's out= variant writes through it), but its
# schema declares no alias so that autograd does not track it as one.  It is the only aten op
# whose schema says so while its kernel aliases.
_UNANNOTATED_VIEWS = frozenset({"_unsafe_view"})


@functools.cache
def op_info(op: torch._ops.OpOverload) -> OpInfo:
    schema = op._schema
    tags = set(op.tags)
    written = tuple(a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write)
    returns_tensors = all(_is_tensor_type(r.type) for r in schema.returns)
    is_factory = not any(_is_tensor_type(a.type) for a in schema.arguments)
    # A Python float given where a number or a tensor is expected is data (x * lr), not structure:
    # it becomes a runtime input of the compiled computation.  Factories' numbers shape their
    # output (arange's end), so theirs stay static.
    scalar_args = frozenset() if is_factory else frozenset(
        a.name for a in schema.arguments if _is_number_type(a.type) or str(a.type) in ("Tensor", "Optional[Tensor]"))
    if schema.name == "aten::pow":
        # ...except a power's exponent, which is structure: torch computes x ** 2 as x * x and
        # x ** 1 as a copy, and autograd's pow_backward passes its exponent as a float (x ** 1.0,
        # times 2.0), which as a runtime input compiled the general float64 pow with its NaN
        # rules (a Llama step's RMSNorm backward: ~7 ms a layer against strict's ~0.3)
        scalar_args -= {a.name for a in schema.arguments if a.name == "exponent" and _is_number_type(a.type)}
    random = torch.Tag.nondeterministic_seeded in tags
    dynamic = torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags

    if torch.Tag.inplace_view in tags:
        kind = OpKind.INPLACE_VIEW
    elif schema.name.split("::")[-1] in _ALLOCATIONS and not written:
        kind = OpKind.ALLOCATION
    elif random:
        kind = OpKind.RANDOM
    elif not returns_tensors or not schema.returns and not written:
        kind = OpKind.OBSERVING
    elif written:
        kind = OpKind.MUTATING
    elif any(r.alias_info is not None for r in schema.returns) or schema.name.split("::")[-1] in _UNANNOTATED_VIEWS:
        kind = OpKind.VIEW
    elif dynamic:
        kind = OpKind.DYNAMIC
    else:
        kind = OpKind.PURE
    if len(schema.returns) == 1:
        returns = "list" if str(schema.returns[0].type).startswith("List") else "one"
    else:
        returns = "tuple"
    # Ops that are only CompositeImplicit (reshape) decompose themselves; ops that also have a
    # backend kernel (silu_backward) are called directly by autograd and keep their own lowering.
    composite_implicit = torch._C._dispatch_has_kernel_for_dispatch_key(
        op.name(), torch._C.DispatchKey.CompositeImplicitAutograd) and not \
        torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), torch._C.DispatchKey.CPU)
    return OpInfo(kind, written, scalar_args, tuple(a.name for a in schema.arguments),
                  torch.Tag.pointwise in tags, random, dynamic, is_factory, returns, composite_implicit)


def _argument_signature(op: torch._ops.OpOverload, skip: frozenset[str]) -> tuple:
    return tuple((a.name, str(a.type).replace("Optional[", "").rstrip("]"))
                 for a in op._schema.arguments if a.name not in skip)


@functools.cache
def functional_variant(op: torch._ops.OpOverload) -> Optional[torch._ops.OpOverload]:
    """The out-of-place overload computing what a mutating op writes: add_.Tensor -> add.Tensor,
    add.out -> add.Tensor, copy_ -> copy.  None if torch has no such overload."""
    info = op_info(op)
    name = op._schema.name.split("::")[-1]
    if torch.Tag.inplace in op.tags or (name.endswith("_") and not name.startswith("_")):
        base_name = name[:-1]
        skip: frozenset[str] = frozenset()
        # in-place: the same arguments, with self no longer written
        wanted = _argument_signature(op, skip)
    else:
        # out= variants: the written arguments are keyword-only outputs, absent from the
        # functional form.  An op that writes a positional input (running stats of batch norm)
        # has no plain functional twin under the same name: leave it to eager execution.
        kwarg_only = {a.name for a in op._schema.arguments if a.kwarg_only}
        if not set(info.written) <= kwarg_only:
            return None
        base_name = name
        skip = frozenset(info.written)
        wanted = _argument_signature(op, skip)
    packet = getattr(aten, base_name, None)
    if packet is None:
        return None
    for overload_name in packet.overloads():
        candidate = getattr(packet, overload_name)
        if candidate is op:
            continue
        if op_info(candidate).written:
            continue
        # (same arguments, possibly in another order: polygamma_(self, n) and polygamma(n, self));
        # a factory's out= variant lacks the options its functional form takes (zeros.out and
        # zeros(size, *, dtype, layout, device, pin_memory)): the recorder passes out's
        candidate_args = _argument_signature(candidate, factory_options(op, candidate))
        if sorted(candidate_args) == sorted(wanted):
            return candidate
    return None


_TENSOR_OPTIONS = frozenset({"dtype", "layout", "device", "pin_memory"})


def factory_options(op: torch._ops.OpOverload, functional: torch._ops.OpOverload) -> frozenset[str]:
    """The tensor options (dtype, device, ...) that ``functional`` takes and ``op`` does not."""
    own = {a.name for a in op._schema.arguments}
    return frozenset(a.name for a in functional._schema.arguments
                     if a.name in _TENSOR_OPTIONS and a.kwarg_only and a.name not in own)
