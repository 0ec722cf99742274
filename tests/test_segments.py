"""The segment tier (eager_segments): under a default defer mode, the work between two reads of a
value runs deferred or at once, as the place of the read that starts it measured faster.

The tier is timed on a fake clock (``blocks.clock``) that the test advances: each segment takes
the time the test says for the way it ran, so its choice never depends on this machine's load.
Strict PyTorch is the oracle: every value read equals strict's, whichever way each segment ran.
"""

from __future__ import annotations

import pytest
import torch

import deferfuse
from deferfuse import config, modes
from deferfuse.exec import blocks


class FakeClock:
    """blocks.clock: stands still until the test advances it by a segment's time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(blocks, "clock", fake)
    blocks.forget()
    yield fake
    blocks.forget()
    deferfuse.set_mode("strict")


def _decoding_loop(steps: int, clock: FakeClock | None = None, deferred_s: float = 1.0, at_once_s: float = 1.0):
    """A generate()-like loop: a cache that grows by a row every step (new shapes each step), a
    running sum updated in place, and one ``.item()`` per step, the read that ends a segment."""
    torch.manual_seed(0)
    x = torch.randn(6)
    cache = torch.zeros(1, 6)
    total = torch.zeros(())
    seen = []
    for step in range(steps):
        cache = torch.cat([cache, (x * step).sin()[None]])
        total.add_(cache.square().mean())
        if clock is not None:
            recorder = modes.active_recorder()
            clock.now += at_once_s if recorder.at_once_segment else deferred_s
        seen.append(total.item())
    return seen, cache


def _segment_choice() -> blocks.BlockChoice:
    found = [c for c in blocks.choices() if "reads starting segments" in c.place]
    assert len(found) == 1, [c.place for c in blocks.choices()]
    return found[0]


@pytest.mark.parametrize("deferred_s, at_once_s, chosen", [(1.0, 0.1, blocks.Phase.AT_ONCE),
                                                          (0.1, 1.0, blocks.Phase.DEFERRED)],
                         ids=["faster-at-once", "faster-deferred"])
def test_a_loop_runs_the_way_its_segments_measured_faster(clock, deferred_s, at_once_s, chosen):
    expected, expected_cache = _decoding_loop(40)
    deferfuse.reset_stats()
    with config.override(eager_segments=True, always_compile=False):
        deferfuse.set_mode("defer")
        seen, cache = _decoding_loop(40, clock, deferred_s=deferred_s, at_once_s=at_once_s)
        deferfuse.set_mode("strict")
    assert seen == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(cache, expected_cache)
    assert _segment_choice().phase is chosen
    at_once = deferfuse.stats()["blocks_run_at_once"]
    # the runs measured at once, then (at once) every segment after the choice
    assert at_once > 20 if chosen is blocks.Phase.AT_ONCE else at_once == blocks.SAMPLES
    assert "reads starting segments" in str(deferfuse.explain())


@pytest.mark.parametrize("settings", [dict(eager_segments=False), dict(eager_segments=True, always_compile=True)],
                         ids=["off", "always_compile"])
def test_no_segments_without_the_setting_or_under_always_compile(clock, settings):
    with config.override(**settings):
        deferfuse.set_mode("defer")
        assert modes.active_recorder().segments is None
        _decoding_loop(12, clock, deferred_s=1.0, at_once_s=0.1)
        deferfuse.set_mode("strict")
    assert not [c for c in blocks.choices() if "reads starting segments" in c.place]


def test_a_with_block_inside_the_default_mode_runs_in_its_segments(clock):
    # (a defer block inside the default defer mode adds no mode: its ops are the default's, and
    # they run the way the segment they fall in chose)
    x = torch.randn(4)
    expected = [(x * k).sin().sum().item() for k in range(30)]
    with config.override(eager_segments=True, always_compile=False):
        deferfuse.set_mode("defer")
        seen = []
        for k in range(30):
            with deferfuse.defer():
                assert modes.active_recorder().segments is not None
                y = (x * k).sin().sum()
                clock.now += 0.1 if modes.active_recorder().at_once_segment else 1.0
                seen.append(y.item())
        deferfuse.set_mode("strict")
    assert seen == pytest.approx(expected, rel=1e-6)
    assert _segment_choice().phase is blocks.Phase.AT_ONCE


def test_printing_a_loss_ends_a_segment(clock):
    """A training loop's read is often a format, not .item(): f"{loss:.4f}"."""
    torch.manual_seed(0)
    w, x = torch.randn(8, 8), torch.randn(4, 8)

    def losses(clock=None):
        out = []
        for step in range(30):
            loss = ((x @ w) * step).tanh().square().mean()
            if clock is not None:
                clock.now += 0.1 if modes.active_recorder().at_once_segment else 1.0
            out.append(f"{loss:.4f}")
        return out
    expected = losses()
    with config.override(eager_segments=True, always_compile=False):
        deferfuse.set_mode("defer")
        seen = losses(clock)
        deferfuse.set_mode("strict")
    assert seen == expected
    assert _segment_choice().phase is blocks.Phase.AT_ONCE
