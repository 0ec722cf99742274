"""Real client models (bench/zoo_models.py) under defer mode, against strict.

The tiny zoo: every model of the zoo, built from its config at random init, trains a few AdamW
steps (dropout on where the model has it) and, for the language models, decodes greedily with
its KV cache.  Under defer each step is one ``with deferfuse.defer():`` block; its losses must be
strict's, step by step, the generated ids identical, and no op may fall back to eager torch.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import deferfuse
from deferfuse import config


from bench import zoo_models as zoo  # noqa: E402  (the repository root is on sys.path under pytest)

STEPS = 3
GENERATED = 6   # new tokens (each a new KV-cache length: a new graph)


def run(model: zoo.ZooModel, block, steps: int = STEPS, calls=None) -> tuple[list[float], list | None]:
    """Losses of ``steps`` training steps, each inside ``block()``, and the ids ``generate()``
    gives (the LMs; None for the others).  ``calls``: the user_defaults fixture's calls."""
    m = model.make("tiny")
    optimizer = zoo.optimizer_for(m, model)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in (calls(steps) if calls else range(steps)):
        batch = model.batch("tiny", g)
        with block():
            loss = zoo.train_step(m, model, optimizer, batch)
        losses.append(loss.item())
    ids = None
    if model.generates:
        m.eval()
        with block():
            ids = zoo.generate(m, model.prompt("tiny", torch.Generator().manual_seed(2)), tokens=GENERATED).tolist()
    return losses, ids


def assert_same_run(expected, actual) -> None:
    (losses, ids), (got_losses, got_ids) = expected, actual
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(losses), rtol=1e-4, atol=1e-5)
    assert got_ids == ids


@pytest.mark.parametrize("name", list(zoo.MODELS))
def test_zoo_model_trains_and_generates_as_strict_with_no_fallback(name):
    """Every op recorded (the suite's settings turn the eager shortcuts off), lowered and run
    compiled (always_compile: no eager replay of a new graph, so every lowering is checked)."""
    model = zoo.MODELS[name]
    expected = run(model, contextlib.nullcontext)
    deferfuse.reset_stats()
    with config.override(always_compile=True):
        actual = run(model, deferfuse.defer)
    stats = deferfuse.stats()
    assert_same_run(expected, actual)
    assert not stats["fallbacks"], stats["fallback_reasons"]
    assert stats["ops_recorded"] > 0 and stats["executions"] > 0 and stats["eager_replays"] == 0


@pytest.mark.parametrize("name", ["llama", "resnet"])
def test_zoo_model_with_the_default_settings(name, user_defaults):
    """As a user runs it: first sightings at once, replays while compiling, then compiled."""
    model = zoo.MODELS[name]
    expected = run(model, contextlib.nullcontext, steps=5)
    actual = run(model, deferfuse.defer, steps=5, calls=user_defaults.calls)
    assert_same_run(expected, actual)


@pytest.mark.parametrize("user_defaults", ["measuring"], indirect=True)
def test_llama_under_the_default_mode_with_the_default_settings(user_defaults):
    """As ``TORCHTPU_MODE=defer python train.py`` runs it: no ``with`` block, the segment tier
    (eager_segments) choosing per place of each ``.item()``, training then generate()."""
    from deferfuse.exec import blocks
    model = zoo.MODELS["llama"]
    expected = run(model, contextlib.nullcontext, steps=5)
    deferfuse.set_mode("defer")
    try:
        actual = run(model, contextlib.nullcontext, steps=5, calls=user_defaults.calls)
    finally:
        deferfuse.set_mode("strict")
    assert_same_run(expected, actual)
    assert [c for c in blocks.choices() if "reads starting segments" in c.place]


def test_medium_is_larger_than_small_and_every_bench_accepts_it():
    """``medium`` (activations past the CPU caches) is wider and longer than ``small`` and is
    a choice of every bench that takes a size; its models build (on the meta device: nothing is
    trained at medium here) and its batches fit their position tables."""
    from bench import compile as compile_bench
    from bench import loops
    from bench import zoo as zoo_bench
    from corpus import train_logging
    assert zoo.SIZES.index("medium") > zoo.SIZES.index("small")
    small, medium = zoo.DIMS["small"], zoo.DIMS["medium"]
    assert medium.hidden > small.hidden and medium.tokens > small.tokens and medium.image > small.image
    assert medium.batch * medium.tokens * medium.hidden > 4 * small.batch * small.tokens * small.hidden
    assert zoo_bench.parse_args(["--size", "medium"]).size == "medium"
    assert compile_bench.parse_args(["--size", "medium"]).size == "medium"
    assert loops.parse_args(["--size", "medium"]).size == "medium"
    assert train_logging.parse_args(["--size", "medium"]).size == "medium"
    with pytest.raises(SystemExit):
        zoo_bench.parse_args(["--size", "huge"])
    for model in zoo.MODELS.values():
        with torch.device("meta"):
            network = model.make("medium")
        batch = model.batch("medium", torch.Generator().manual_seed(1))
        if "input_ids" in batch:
            assert batch["input_ids"].shape == (medium.batch, medium.tokens)
            assert medium.positions >= medium.tokens + 2
        assert sum(p.numel() for p in network.parameters()) > 0, model.name
