"""A tiny zoo Llama's first training steps, with a chosen attention implementation, for the tests
that compare an attention kernel against torch's SDPA (test_kernels.py, test_tokamax.py)."""

from __future__ import annotations

import contextlib

import torch

import deferfuse


def train_tiny_llama(block, implementation, steps: int = 2):
    """The losses of ``steps`` training steps (each run inside ``block()``) and the parameters
    after them, for the tiny Llama with ``implementation`` as its attention (None: its default)."""
    from bench import zoo_models as zoo
    model = zoo.MODELS["llama"]
    m = model.make("tiny")
    if implementation:
        m.set_attn_implementation(implementation)
    optimizer = zoo.optimizer_for(m, model)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        with block():
            losses.append(zoo.train_step(m, model, optimizer, model.batch("tiny", g)))
    return torch.stack([loss.detach() for loss in losses]), list(m.parameters())


def assert_trains_as(implementation, reference, blocks=(contextlib.nullcontext, deferfuse.defer)) -> None:
    """The tiny Llama trains with ``implementation`` under each of ``blocks`` as it does with
    ``reference`` in strict mode, with no fallback."""
    expected, expected_params = train_tiny_llama(contextlib.nullcontext, reference)
    for block in blocks:
        deferfuse.reset_stats()
        losses, params = train_tiny_llama(block, implementation)
        assert deferfuse.stats()["fallbacks"] == {}
        torch.testing.assert_close(losses, expected, rtol=1e-4, atol=1e-5)
        for got, want in zip(params, expected_params):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
