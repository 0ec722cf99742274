"""How a ``_foreach_*`` overload unrolls into one per-element aten call per list element: which
per-element overload, and how the foreach op's arguments map onto it.  Read from the schemas, not
a table.  Used by defer mode's unrolling (``capture/unroll.py``) and by the torch.compile front
end (``compile/plan.py``), which rewrites a graph's foreach nodes into per-element nodes.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

aten = torch.ops.aten

# The per-element op of a foreach op has the same name without the prefix, except these.
_PER_ELEMENT_NAME = {"norm": "linalg_vector_norm"}


def _element_type(jit_type: Any) -> str:
    """The type one element of a foreach argument has: "T" (tensor), "N" (number) or other."""
    text = str(jit_type)
    if text in ("List[Tensor]", "Tensor"):
        return "T"
    if text in ("List[number]", "number"):
        return "N"
    return text


class _Binding:
    """How to call the per-element overload from the foreach op's arguments."""

    __slots__ = ("op", "names", "kwarg_only", "listed", "copy_back")

    def __init__(self, op, names: tuple, kwarg_only: tuple, listed: tuple) -> None:
        self.op = op                    # the per-element OpOverload
        self.names = names              # its parameter name for each foreach argument
        self.kwarg_only = kwarg_only    # whether that parameter is keyword-only there
        self.listed = listed            # whether the foreach argument is a per-element list
        self.copy_back = False          # an out-of-place element op whose result goes into self

    def element_arguments(self, values, i: int) -> tuple[list, dict]:
        """The positional and keyword arguments of the per-element call for element ``i``,
        from the foreach call's ``values`` (one per foreach argument, in order)."""
        pos, kw = [], {}
        for value, name, kwarg_only, listed in zip(values, self.names, self.kwarg_only, self.listed):
            element = value[i] if listed else value
            if kwarg_only:
                kw[name] = element
            else:
                pos.append(element)
        return pos, kw


def _candidate_binding(foreach_args, candidate) -> Optional[_Binding]:
    params = candidate._schema.arguments
    by_name = {p.name: p for p in params}
    wanted = [(a.name, _element_type(a.type)) for a in foreach_args]
    # by name (norm's dtype), else by position (add.Scalar's "scalar" is add's "other")
    if all(n in by_name and _element_type(by_name[n].type) == t for n, t in wanted):
        chosen = [by_name[n] for n, _ in wanted]
    elif len(wanted) <= len(params) and all(_element_type(p.type) == t for p, (_, t) in zip(params, wanted)):
        chosen = list(params[:len(wanted)])
    else:
        return None
    bound = {p.name for p in chosen}
    if any(p.name not in bound and not p.has_default_value() for p in params):
        return None
    listed = tuple(str(a.type).startswith("List[") and _element_type(by.type) in ("T", "N")
                   and not str(by.type).startswith("List[") for a, by in zip(foreach_args, chosen))
    return _Binding(candidate, tuple(p.name for p in chosen), tuple(p.kwarg_only for p in chosen), listed)


@functools.cache
def foreach_binding(op: torch._ops.OpOverload) -> Optional[_Binding]:
    """The per-element overload of a ``_foreach_*`` overload and how its arguments map, or None."""
    name = op._schema.name.split("::")[-1]
    if not name.startswith("_foreach_"):
        return None
    base = name[len("_foreach_"):]
    inplace = base.endswith("_")
    stem = base[:-1] if inplace else base
    stem = _PER_ELEMENT_NAME.get(stem, stem)
    # an in-place foreach op whose element op has no in-place form (maximum) writes the result
    packets = [getattr(aten, stem + "_", None), getattr(aten, stem, None)] if inplace else [getattr(aten, stem, None)]
    for packet in packets:
        if packet is None:
            continue
        for overload in packet.overloads():
            candidate = getattr(packet, overload)
            binding = _candidate_binding(op._schema.arguments, candidate)
            if binding is not None and any(binding.listed):
                binding.copy_back = inplace and packet is packets[-1] and len(packets) == 2
                return binding
    return None


