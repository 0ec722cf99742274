"""Errors of a compiled graph, named by the user's line: the fx node's ``meta["stack_trace"]``
(Dynamo records the user's frames for every node it traces, and AOTAutograd gives a backward
node the stack of the forward op it differentiates).

- a value check of an XLA partition (an index out of range) names the node whose check failed;
- an error torch raises in an op it runs between partitions gets a note naming the op and line;
- with the setting ``check_nans``, a partition whose outputs hold NaN/Inf that its inputs did
  not is run again op by op on torch to find the first node that made them (one pass over the
  partition's inputs and outputs when nothing is found; the rerun only once one is).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch
import torch.fx

from ..debugging.source import line_in_stack_trace
from ..errors import NonFiniteError
from .._lazy import lazy_import

jnp = lazy_import("jax.numpy", globals(), "jnp")

NOTE_PREFIX = "deferfuse compiled graph:"


def line_of(node: torch.fx.Node) -> Optional[str]:
    """The user's file:line that made ``node`` (None where its stack was not recorded)."""
    return line_in_stack_trace(node.meta.get("stack_trace"))


def suffix(node: torch.fx.Node) -> str:
    """" (at file:line)" for a message about ``node``; "" where the line is unknown."""
    line = line_of(node)
    return f" (at {line})" if line else ""


def annotate(exc: BaseException, node: torch.fx.Node) -> None:
    """Add the op and the user's line to an error torch raised running ``node``."""
    if any(str(note).startswith(NOTE_PREFIX) for note in getattr(exc, "__notes__", ())):
        return
    exc.add_note(f"{NOTE_PREFIX} raised by {node.target} called at {line_of(node) or 'an unknown line'}")


def _floating(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return (x.is_floating_point() or x.is_complex()) and x.numel() > 0
    dtype = getattr(x, "dtype", None)
    return dtype is not None and getattr(x, "size", 0) > 0 and (
        jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating))


def has_nonfinite(values: Iterable[Any]) -> bool:
    """Whether any of ``values`` (torch tensors, JAX arrays, Python numbers) holds NaN or Inf."""
    for x in values:
        if isinstance(x, float) and not math.isfinite(x):
            return True
        if isinstance(x, (list, tuple)):
            if has_nonfinite(x):
                return True
        elif _floating(x):
            # (a finite sum means every element is finite: one pass; see debugging/checks.py)
            if isinstance(x, torch.Tensor):
                nonfinite = not bool(torch.isfinite(x.sum())) and not bool(torch.isfinite(x).all())
            else:
                nonfinite = not bool(jnp.isfinite(x.sum())) and not bool(jnp.isfinite(x).all())
            if nonfinite:
                return True
    return False


def nonfinite_error(node: Optional[torch.fx.Node], ops: str = "") -> NonFiniteError:
    if node is None:
        return NonFiniteError(
            f"a compiled graph's XLA partition ({ops}) produced NaN or Inf from finite inputs, "
            f"which none of its ops makes when run on torch")
    return NonFiniteError(
        f"{node.target}: produced NaN or Inf from finite inputs in a compiled graph\n"
        f"  at {line_of(node) or 'an unknown line'}\n"
        f"  Check the inputs' range for this op (log/sqrt of negatives, division by zero, overflow "
        f"in low precision); the setting check_nans (DEFERFUSE_CHECK_NANS) turns this check off.")
