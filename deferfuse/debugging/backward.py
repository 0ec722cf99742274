"""The forward line behind a backward op: which user line and module recorded the autograd node
that is running now.

In forward, each op's outputs get their ``grad_fn`` from autograd only after the dispatch mode
returned them, so debug mode keeps the last op's outputs with its place (``remember``) and, at
the next op, writes that place into each output's ``grad_fn.metadata`` (a dict torch keeps per
autograd node) unless the node has one already (``label_pending``).  In backward, torch names the
node it is running (``torch._C._current_autograd_node()``), and ``describe_current`` reads the
place back.  Costs: per forward op, one attribute read per output; no stack capture (autograd's
anomaly mode formats the whole Python stack for every node).
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch

KEY = "deferfuse_forward"   # the key of our entry in a node's metadata


class ForwardPlace:
    """Where an autograd node was recorded: the user's line and the running module."""

    __slots__ = ("line", "scope")

    def __init__(self, line: Any, scope: Any) -> None:
        self.line = line
        self.scope = scope

    def __str__(self) -> str:
        text = f"{self.line or 'an unknown line'}"
        if self.scope is not None:
            text += f" in module {self.scope}"
        return text


class _Pending(threading.local):
    def __init__(self) -> None:
        self.outputs: tuple = ()
        self.place: Optional[ForwardPlace] = None


_pending = _Pending()


def remember(out: Any, line: Any, scope: Any) -> None:
    """Keep a forward op's outputs and its place, to label their autograd nodes at the next op."""
    if isinstance(out, torch.Tensor):
        outputs: tuple = (out,)
    elif isinstance(out, (tuple, list)):
        outputs = tuple(t for t in out if isinstance(t, torch.Tensor))
    else:
        return
    _pending.outputs = outputs
    _pending.place = ForwardPlace(line, scope)


def label_pending() -> None:
    """Write the place of the last forward op into its outputs' autograd nodes."""
    outputs = _pending.outputs
    if not outputs:
        return
    place = _pending.place
    _pending.outputs, _pending.place = (), None
    for t in outputs:
        if not t.requires_grad:
            continue
        try:
            node = t.grad_fn
        except RuntimeError:
            # (a view made under no_grad whose base was since modified in place under grad
            # mode: torch refuses to give its grad_fn, and raises when it is used, not here)
            continue
        if node is not None:
            metadata = node.metadata
            if KEY not in metadata:
                metadata[KEY] = place


def forget() -> None:
    """Drop what ``remember`` holds (debug mode left)."""
    _pending.outputs, _pending.place = (), None


def in_backward() -> bool:
    return torch._C._current_autograd_node() is not None


def describe_current() -> Optional[str]:
    """In backward: the running autograd node and the forward place that recorded it, in words
    (None outside backward)."""
    node = torch._C._current_autograd_node()
    if node is None:
        return None
    place = node.metadata.get(KEY)
    name = type(node).__name__
    if place is None:
        return (f"in backward, autograd node {name}, whose forward op ran outside debug mode "
                f"(or is not an op's output: a leaf's gradient accumulation)")
    return f"in backward, autograd node {name}, recorded in forward at {place}"
