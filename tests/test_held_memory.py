"""A defer context that never ends (``TORCHTPU_MODE=defer``, ``set_mode("defer")``) holds no
memory the user has let go: each batch a loop reads is freed when strict would free it.  The
context's recorder holds the storages it reads (Recorder.real_states) only while something
pending may need them: a flush of everything lets them all go, a partial flush those whose
tensor has gone (Recorder.flushed).  Before, it held every storage it had ever read, so a
deferred Llama training loop grew ~13 MB a step and an evaluation loop by each batch."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

import deferfuse


def _batch(step: int) -> np.ndarray:
    # plain memory each step, as a loader's batch: a NumPy array (weakly referenced below)
    return np.random.default_rng(step).standard_normal((64, 32)).astype(np.float32)


def _evaluate(model: torch.nn.Module, steps: int) -> tuple[list[float], int]:
    """An evaluation loop reading each batch's result with .item(): what it printed, and how
    many of its batches' arrays are still alive at the end."""
    refs, printed = [], []
    with torch.no_grad():
        for step in range(steps):
            a = _batch(step)
            refs.append(weakref.ref(a))
            printed.append(model(torch.from_numpy(a)).square().mean().item())
            del a
    gc.collect()
    return printed, sum(r() is not None for r in refs)


def _train(model: torch.nn.Module, steps: int) -> tuple[list[float], int]:
    """A training loop with an optimizer (each step's end flushes everything) that prints its
    loss every 4 steps."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    refs, printed = [], []
    for step in range(steps):
        a = _batch(step)
        refs.append(weakref.ref(a))
        loss = model(torch.from_numpy(a)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        del a
        if step % 4 == 3:
            printed.append(loss.item())
    gc.collect()
    return printed, sum(r() is not None for r in refs)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))


def _in_defer_mode(loop, steps):
    model = _model()
    try:
        deferfuse.set_mode("defer")
        return loop(model, steps)
    finally:
        deferfuse.set_mode("strict")


@pytest.mark.parametrize("loop", [_evaluate, _train], ids=["evaluate", "train"])
def test_a_context_that_never_ends_frees_each_batch_as_strict_does(loop):
    strict_printed, strict_alive = loop(_model(), 24)
    printed, alive = _in_defer_mode(loop, 24)
    torch.testing.assert_close(printed, strict_printed, rtol=1e-5, atol=1e-6)
    assert alive <= strict_alive + 1, (alive, strict_alive)   # (before: all 24 alive)


@pytest.mark.parametrize("loop", [_evaluate, _train], ids=["evaluate", "train"])
def test_a_context_that_never_ends_frees_each_batch_under_the_default_settings(loop, user_defaults):
    strict_printed, strict_alive = loop(_model(), 24)
    printed, alive = _in_defer_mode(loop, 24)
    torch.testing.assert_close(printed, strict_printed, rtol=1e-5, atol=1e-6)
    assert alive <= strict_alive + 1, (alive, strict_alive)


def test_memory_let_go_while_pending_nodes_read_it_keeps_what_they_read():
    """``x`` is read by a pending op and then dropped while another tensor over its memory (a
    detached alias) lives: a partial flush keeps x's storage (its graph input is still read), so
    a later write through the alias leaves what the pending op reads as it was."""
    x = torch.arange(6.0)
    alias = x.detach()
    expected = (x * 2).tolist()
    try:
        deferfuse.set_mode("defer")
        y = x * 2                                     # pending: reads x's memory
        del x
        gc.collect()
        assert (torch.ones(3) * 3).sum().item() == 9.0   # a partial flush, of something else
        alias.add_(1)                                 # writes the memory y reads
        assert alias.sum().item() == sum(range(6)) + 6.0
        got = y.tolist()
    finally:
        deferfuse.set_mode("strict")
    assert got == expected
    assert alias.tolist() == [float(i + 1) for i in range(6)]
