"""Lowerings of ``torch.ops.prims`` overloads, which torch._refs decompositions emit.

Prims do no type promotion: their tensor operands already share a dtype (or are 0-dim), and
the result dtype is the one the prim's meta function says.  Most elementwise prims compute
exactly what their aten namesake computes for such operands, so they reuse the aten rule and
its checker (``_TWINS``); the few that differ (``div`` truncates integers, ``convert_element_type``
also converts complex values) have rules here.

The aten checkers decline complex dtypes, so decompositions of complex calls reach the prims;
``convert_element_type``, ``clone``, ``add``, ``sub``, ``mul``, ``neg``, ``abs`` and
``conj_physical`` lower complex operands too (their XLA forms are torch's formulas).
"""

from __future__ import annotations

import torch

from . import common
from . import pointwise as _pw
from .registry import LOWERINGS, lowering
from .._lazy import late, lazy_import

jnp = lazy_import("jax.numpy", globals(), "jnp")
_jnp = late(jnp)

aten = torch.ops.aten
prims = torch.ops.prims


_supported = common.supported_dtypes


def _is_complex_call(ctx) -> bool:
    return any(m.dtype.is_complex for m in [*ctx.tensor_args(), *ctx.out])


# -- casts and copies ------------------------------------------------------------------------------
@lowering(prims.convert_element_type.default, check=_supported)
def convert_element_type(ctx, x, dtype):
    return common.convert_any(x, ctx.out_dtype)


@lowering(prims.clone.default, check=_supported)
def clone(ctx, x, **_ignored):
    return x


# -- twins of aten rules ---------------------------------------------------------------------------
# prims name -> the aten overload whose rule computes the same thing for same-dtype operands
_TWINS: dict[str, torch._ops.OpOverload] = {
    name: getattr(aten, name).default for name in (
        "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "bitwise_not",
        "ceil", "digamma", "erf", "erfc", "exp", "expm1", "exp2", "floor", "lgamma", "log", "log1p",
        "log2", "log10", "neg", "round", "sign", "signbit", "sin", "sinh", "sqrt", "tan", "tanh",
        "trunc", "atan2", "fmax", "fmin", "hypot", "maximum", "minimum", "nextafter")
}
_TWINS.update({
    name: getattr(aten, name).Tensor for name in (
        "add", "sub", "mul", "bitwise_and", "bitwise_or", "bitwise_xor", "eq", "ne", "ge", "gt", "le",
        "lt", "fmod", "remainder")
})
_TWINS.update({
    "erf_inv": aten.erfinv.default, "ndtri": aten.special_ndtri.default,
    "bessel_i0": aten.i0.default, "bessel_i0e": aten.special_i0e.default,
    "bessel_i1": aten.special_i1.default, "bessel_i1e": aten.special_i1e.default,
    "pow": aten.pow.Tensor_Tensor, "where": aten.where.self, "fill": aten.fill.Scalar,
    "shift_left": aten.bitwise_left_shift.Tensor, "shift_right_arithmetic": aten.bitwise_right_shift.Tensor,
    "gcd": aten.gcd.default, "igamma": aten.igamma.default, "igammac": aten.igammac.default,
    "zeta": aten.special_zeta.default, "polygamma": aten.polygamma.default,
    "conj_physical": aten._conj_physical.default,
})

# Complex forms: plain XLA arithmetic is torch's formula (no alpha multiply: (1+0j) * inf would
# make a NaN imaginary part).
_COMPLEX = {
    "add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y,
    "neg": _jnp.negative, "abs": _jnp.abs,
}


def _twin_rule(name, aten_lowering):
    complex_fn = _COMPLEX.get(name)

    def rule(ctx, *args, **kwargs):
        if complex_fn is not None and any(jnp.iscomplexobj(a) for a in args):
            return complex_fn(*args)
        return aten_lowering.rule(ctx, *args, **kwargs)

    def check(ctx):
        if complex_fn is not None and _is_complex_call(ctx):
            return _supported(ctx)
        return aten_lowering.check(ctx) if aten_lowering.check is not None else None

    rule.__qualname__ = f"prims_twin[{name}]"
    return rule, check


def _register_twins():
    for name, aten_op in _TWINS.items():
        prim = getattr(prims, name, None)
        found = LOWERINGS.get(aten_op)
        if prim is None or found is None or prim.default in LOWERINGS:
            continue
        rule, check = _twin_rule(name, found)
        lowering(prim.default, check=check)(rule)


_register_twins()


@lowering(prims.div.default, check=common.check)
def div(ctx, x, y):
    # true division for floats; integers truncate (C division), as prims.div says
    if jnp.issubdtype(jnp.dtype(ctx.out_dtype), jnp.floating):
        return _pw.div(ctx, x, y)
    return _pw.div_mode(ctx, x, y, rounding_mode="trunc")
