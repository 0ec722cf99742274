"""A ``jax_op``'s arguments, read from its schema: which are tensors, which are runtime floats,
which are static (part of the compiled code), and how a call splits into those parts.

Every path that runs a kernel (strict through ``jax.jit``, the fake kernel through
``jax.eval_shape``, defer mode's lowering inlined in a fused computation) splits a call the same
way: the *dynamic* part (tensors as arrays, floats as weakly typed scalars) and the *static* part
(everything else, hashable: ints, bools, strings, lists as tuples, and the floats named in
``static_argnames``), which keys the compiled code.  ``join`` puts them back in the order of the
user's function.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Sequence

import torch


class Kind(enum.Enum):
    TENSOR = "Tensor"               # a jax.Array; differentiable when it is a float or complex
    OPTIONAL_TENSOR = "Tensor?"     # a jax.Array or None
    TENSOR_LIST = "Tensor[]"        # a list of jax.Arrays
    FLOAT = "float"                 # a runtime scalar: a changing value does not recompile
    STATIC = "static"               # part of the compiled code (a new value compiles anew)


def _kind(argument: Any, static_names: frozenset[str]) -> Kind:
    text = str(argument.type)
    if argument.name in static_names:
        if "Tensor" in text:
            raise ValueError(f"static_argnames names the tensor argument {argument.name!r}; "
                             "only non-tensor arguments can be static")
        return Kind.STATIC
    if text == "Tensor":
        return Kind.TENSOR
    if text == "Optional[Tensor]":
        return Kind.OPTIONAL_TENSOR
    if text == "List[Tensor]":
        return Kind.TENSOR_LIST
    if "Tensor" in text:
        raise TypeError(f"argument {argument.name!r} of type {text}: jax_op takes Tensor, Tensor?, "
                        "Tensor[] and non-tensor arguments")
    if text in ("float", "Optional[float]"):
        return Kind.FLOAT       # (a ``Scalar``, which may be an int, is static)
    return Kind.STATIC


def hashable(value: Any) -> Any:
    """``value`` as a static key part: lists become tuples; floats keyed by their bits."""
    if isinstance(value, (list, tuple)):
        return tuple(hashable(v) for v in value)
    if isinstance(value, float):
        return (float, value.hex())
    if isinstance(value, bool):
        return (bool, value)
    return value


def as_static(value: Any) -> Any:
    """``value`` as the user's function receives a static argument (lists as tuples)."""
    if isinstance(value, list):
        return tuple(as_static(v) for v in value)
    return value


class CallSpec:
    """The arguments of one op's schema, sorted by kind."""

    def __init__(self, schema: torch._C.FunctionSchema, static_argnames: Sequence[str] = ()) -> None:
        static = frozenset(static_argnames)
        names = [a.name for a in schema.arguments]
        unknown = static - set(names)
        if unknown:
            raise ValueError(f"static_argnames {sorted(unknown)} are not arguments of {schema.name}")
        self.names = tuple(names)
        self.kinds = tuple(_kind(a, static) for a in schema.arguments)
        self.kwarg_only = tuple(a.kwarg_only for a in schema.arguments)
        self.defaults = tuple(a.default_value if a.has_default_value() else _REQUIRED for a in schema.arguments)
        returns = [str(r.type) for r in schema.returns]
        if returns == ["List[Tensor]"]:
            self.returns = "list"
        elif returns and all(r == "Tensor" for r in returns):
            self.returns = "tuple" if len(returns) > 1 else "one"
        else:
            raise TypeError(f"{schema.name} returns {returns or 'nothing'}: a jax_op returns a Tensor, "
                            "a tuple of Tensors (annotate it tuple[torch.Tensor, ...]) or a list of them")
        self.n_outputs = None if self.returns == "list" else len(returns)
        self.runtime_floats = frozenset(n for n, k in zip(names, self.kinds) if k is Kind.FLOAT)
        # the arguments that may have gradients: tensors, optional tensors, lists of tensors
        self.grad_slots = tuple(i for i, k in enumerate(self.kinds)
                                if k in (Kind.TENSOR, Kind.OPTIONAL_TENSOR, Kind.TENSOR_LIST))
        self.n_positional = sum(1 for k in self.kwarg_only if not k)

    def bind(self, args: Sequence[Any], kwargs: dict) -> list:
        """The call's values in schema order, defaults filled in."""
        values = list(args) + [_REQUIRED] * (len(self.names) - len(args))
        for name, value in kwargs.items():
            values[self.names.index(name)] = value
        for i, value in enumerate(values):
            if value is _REQUIRED:
                if self.defaults[i] is _REQUIRED:
                    raise TypeError(f"missing argument {self.names[i]!r}")
                values[i] = self.defaults[i]
        return values

    def split(self, values: Sequence[Any], tensor: Callable[[Any], Any],
              scalar: Callable[[Any], Any] = float) -> tuple[tuple, tuple]:
        """(dynamic parts, static key) of ``values``: ``tensor`` converts each tensor (to an
        array, or to its shape and dtype), ``scalar`` each runtime float."""
        dynamic: list = []
        static: list = []
        for kind, value in zip(self.kinds, values):
            if kind is Kind.STATIC or value is None:
                static.append(("s", hashable(value)))
            elif kind is Kind.TENSOR or kind is Kind.OPTIONAL_TENSOR:
                dynamic.append(tensor(value))
                static.append("t")
            elif kind is Kind.TENSOR_LIST:
                dynamic.append([tensor(v) for v in value])
                static.append(("l", len(value)))
            else:
                dynamic.append(scalar(value))
                static.append("f")
        return tuple(dynamic), tuple(static)

    def join(self, dynamic: Sequence[Any], static: tuple, static_values: Sequence[Any]) -> list:
        """The values in the order of the user's function, from ``split``'s parts (the static
        values themselves, not their key, in ``static_values``)."""
        parts = iter(dynamic)
        values = []
        for key, value in zip(static, static_values):
            values.append(as_static(value) if type(key) is tuple and key[0] == "s" else next(parts))
        return values

    def call(self, fn: Callable, values: Sequence[Any]) -> Any:
        """``fn`` called with ``values`` (schema order), kwarg-only ones by name."""
        positional = [v for v, k in zip(values, self.kwarg_only) if not k]
        keywords = {n: v for n, v, k in zip(self.names, values, self.kwarg_only) if k}
        return fn(*positional, **keywords)

    def outputs(self, result: Any, name: str) -> tuple:
        """The user function's result as a tuple of arrays, checked against the schema."""
        outs = tuple(result) if isinstance(result, (tuple, list)) else (result,)
        if self.n_outputs is not None and len(outs) != self.n_outputs \
                or not all(hasattr(o, "shape") and hasattr(o, "dtype") for o in outs):
            wanted = "a list of tensors" if self.n_outputs is None else \
                f"{self.n_outputs} tensor{'s' if self.n_outputs > 1 else ''}"
            raise TypeError(f"{name}: the function returned {_describe(result)}; its schema says {wanted}")
        return outs

    def pack(self, results: Sequence[Any]) -> Any:
        """``results`` in the structure the schema returns: one, a tuple or a list."""
        if self.returns == "one":
            return results[0]
        return tuple(results) if self.returns == "tuple" else list(results)


class _Required:
    def __repr__(self) -> str:
        return "<required>"


_REQUIRED = _Required()


def _describe(result: Any) -> str:
    if isinstance(result, (tuple, list)):
        return f"a {type(result).__name__} of {len(result)}"
    return type(result).__name__
