"""What the recorder works out for a plain tensor (its storage state and metadata) is kept
across blocks while the tensor lives (storage.PLAIN): an optimizer touches the same tensors
in every step.  It must never serve stale memory or layouts, nor keep memory alive."""

from __future__ import annotations

import gc

import torch

import deferfuse
from deferfuse.capture import storage


def _cached_state(t: torch.Tensor):
    state = storage.remembered_plain(t)
    assert state is not None
    return state


def test_a_block_leaves_no_graph_values_in_a_remembered_state():
    x = torch.arange(6.0)
    with deferfuse.defer():
        x.mul_(2)
        y = x + 1
    state = _cached_state(x)
    assert state.contents is None and state.reads == {} and state.leaf is None
    assert all(ref() is None for ref in state.old_leaves)
    assert x.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0] and y.tolist() == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]


def test_the_entry_goes_with_the_tensor():
    x = torch.randn(1000)
    with deferfuse.defer():
        x.add_(1)
    key = id(x)
    assert key in storage.plain_keys()
    del x
    gc.collect()
    assert key not in storage.plain_keys()


def test_changes_between_blocks_are_seen():
    """Between blocks, code we do not see (no wrapper is installed outside a block) re-points,
    resizes and rewrites the tensor: the next block reads what it holds then."""
    x = torch.arange(4.0)
    for _ in range(2):
        with deferfuse.defer():
            a = x * 2
    assert a.tolist() == [0.0, 2.0, 4.0, 6.0]
    x.data = torch.full((4,), 5.0)              # other memory
    with deferfuse.defer():
        b = x * 2
    assert b.tolist() == [10.0] * 4
    x.resize_(2)                                # the same memory, a smaller shape
    with deferfuse.defer():
        c = x * 2
    assert c.tolist() == [10.0] * 2
    x.resize_(64).fill_(1.5)                    # a larger storage
    with deferfuse.defer():
        d = x * 2
    assert d.tolist() == [3.0] * 64
    x.numpy()[:] = 7.0                          # written behind torch's back
    with deferfuse.defer():
        e = x.sum()
    assert e.item() == 7.0 * 64


def test_a_tensor_written_in_every_block_matches_strict():
    p, g = torch.randn(5, 3), torch.randn(5, 3)
    expected = p.clone()
    for step in range(4):
        expected.mul_(0.9).add_(g, alpha=-0.1 * step)
        with deferfuse.defer():
            p.mul_(0.9).add_(g, alpha=-0.1 * step)
        torch.testing.assert_close(p, expected, rtol=0, atol=0)
