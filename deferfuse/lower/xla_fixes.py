"""Workarounds for miscompilations in XLA's CPU backend that lowerings would otherwise meet.

Each names what goes wrong, found by comparing with strict PyTorch; each has a test in
tests/test_regressions.py that fails without it.
"""

from __future__ import annotations

from .._lazy import lazy_import

jnp = lazy_import("jax.numpy", globals(), "jnp")


def exp(x):
    """``jnp.exp`` that keeps NaN.  XLA's CPU code for a float32 (or narrower) exp returns
    garbage (0.0, 1e+23, -3e-33: it differs from run to run) where the compiler can prove its
    argument is NaN, such as a constant NaN that XLA folded (0 / 0 of a zeroed tensor) plus a
    runtime value; a NaN that arrives as data is kept.  Selecting NaN where the argument is
    NaN costs a compare and a select in the fused loop.  float64 is not affected."""
    if x.dtype == jnp.float64 or not jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.exp(x)
    return jnp.where(jnp.isnan(x), x, jnp.exp(x))
