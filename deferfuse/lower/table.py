"""The lowering table's loader: imports every op family once, so that its rules register, and
answers the lookups that the recorder and the metadata inference make.

``registry`` holds the table (``LOWERINGS``, ``SHAPE_RULES``) and imports no family; this module
is the one place that imports them.  The families import JAX, so they load on the first lookup,
not on ``import deferfuse``.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..stats import one_off
from .registry import LOWERINGS, SHAPE_RULES, Lowering, ShapeRule


def get_lowering(op: torch._ops.OpOverload) -> Optional[Lowering]:
    """The lowering registered for ``op``, or None."""
    _load_families()
    return LOWERINGS.get(op)


def get_shape_rule(op: torch._ops.OpOverload) -> Optional[ShapeRule]:
    """The output-metadata rule registered for ``op`` (an op without a meta kernel), or None."""
    _load_families()
    return SHAPE_RULES.get(op)


@functools.cache
def _load_families() -> None:
    # (a process's one-off cost, ~0.14 s: the block tier does not charge it to the place whose
    # run paid it, stats.one_off)
    with one_off():
        _import_families()


def _import_families() -> None:
    # Importing a family module registers its rules.  prims goes after pointwise: its twins
    # reuse the aten rules registered by then.
    from . import (attention, creation, fastpath, fft, grouped_mm, histogram, linalg, movement,  # noqa: F401
                   nn, nn_backward, pointwise, activation, prims, reduction, normalization, order,
                   segment, rnn, special)
