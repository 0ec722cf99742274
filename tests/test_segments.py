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
from deferfuse.exec import blocks, segments


class FakeClock:
    """blocks.clock: stands still until the test advances it by a segment's time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    """A fake clock for the tier, and no exploration budget (explore_share 1: the default mode
    starts deferred and the tier alternates from the first segment), which tests further down
    test; compiles on the calling thread (a run at once is not timed while one is pending)."""
    fake = FakeClock()
    monkeypatch.setattr(blocks, "clock", fake)
    blocks.forget()
    with config.override(explore_share=1.0, background_compile=False):
        yield fake
    blocks.forget()
    deferfuse.set_mode("strict")


def _decoding_loop(steps: int, clock: FakeClock | None = None, deferred_s: float = 1.0, at_once_s: float = 1.0,
                   read: str = "item"):
    """A generate()-like loop: a cache that grows by a row every step (new shapes each step), a
    running sum updated in place, and one read per step, which ends a segment: ``.item()``, or
    (``read="bool"``) generate()'s own ``bool(done.max() == 0)``."""
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
        seen.append(total.item() if read == "item" else bool(total.max() == 0))
    return seen, cache


def _segment_choice(function=None) -> blocks.BlockChoice:
    """The one place of reads starting segments, or the one in ``function``'s code (a read
    elsewhere the deferred way never saw may have become a place too: Segments.discover)."""
    found = [c for c in blocks.choices() if "reads starting segments" in c.place]
    if function is not None:
        code = function.__code__
        found = [c for c in found if any(f"{code.co_filename}:{line}" in c.place for _, _, line in code.co_lines())]
    assert len(found) == 1, [c.place for c in blocks.choices()]
    return found[0]


@pytest.mark.parametrize("read", ["item", "bool"])
@pytest.mark.parametrize("deferred_s, at_once_s, chosen", [(1.0, 0.1, blocks.Phase.AT_ONCE),
                                                          (0.1, 1.0, blocks.Phase.DEFERRED)],
                         ids=["faster-at-once", "faster-deferred"])
def test_a_loop_runs_the_way_its_segments_measured_faster(clock, deferred_s, at_once_s, chosen, read):
    # (read="bool" once failed: CPython 3.11 places a specialized call to bool() at another
    # bytecode offset, so a segment running at once never met its end and was never timed)
    expected, expected_cache = _decoding_loop(40, read=read)
    deferfuse.reset_stats()
    with config.override(eager_segments=True, always_compile=False):
        deferfuse.set_mode("defer")
        seen, cache = _decoding_loop(40, clock, deferred_s=deferred_s, at_once_s=at_once_s, read=read)
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


def _deferfuse_modes_on_the_stack() -> list:
    stack = [torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())]
    return [m for m in stack if type(m).__module__.startswith("deferfuse")]


def _step(x: torch.Tensor, step: int, clock, at_once_s: float = 0.1) -> bool:
    """One step of a loop whose segments run faster at once; its read ends a segment."""
    y = (x * step).sin().sum()
    clock.now += at_once_s if modes.active_recorder().at_once_segment else 1.0
    return bool(y < 100)


def _recheck_at_next_end(choice: blocks.BlockChoice) -> None:
    """Bring the choice's recheck forward to the next segment's end (past the streak of runs a
    place settled at once counts without looking: Segments.observed)."""
    choice.runs = choice.recheck - 1
    modes.active_recorder().segments.streak = 0


def _choose_at_once(clock, steps: int = 14) -> None:
    """Under a default defer mode: the loop of ``_step``, until its segments chose."""
    x = torch.randn(6)
    for step in range(steps):
        assert _step(x, step, clock)
    assert _segment_choice().phase is blocks.Phase.AT_ONCE


def test_a_segment_at_once_runs_with_no_mode_on_the_stack(clock):
    """Under a dispatch mode torch spends microseconds an op in Python before the mode's code
    runs; a segment that runs at once takes the mode off, and a read ends it as before."""
    x = torch.randn(6)
    with config.override(eager_segments=True, always_compile=False):
        deferfuse.set_mode("defer")
        try:
            _choose_at_once(clock)
            assert _deferfuse_modes_on_the_stack() == []
            y = (x * 3).sin()
            assert type(y) is torch.Tensor
            torch.testing.assert_close(y, (x * 3).sin())
            before = deferfuse.stats()["blocks_run_at_once"]
            for step in range(5):
                assert _step(x, step, clock)       # (each read ends a segment, at once)
                assert _deferfuse_modes_on_the_stack() == []
            assert deferfuse.stats()["blocks_run_at_once"] == before + 5
            # the choice's recheck (brought forward) puts the mode back for a deferred run
            choice = _segment_choice()
            _recheck_at_next_end(choice)
            assert _step(x, 1, clock)
            assert choice.phase is blocks.Phase.MEASURE_DEFERRED
            assert len(_deferfuse_modes_on_the_stack()) == 1
            z = (x * 5).cos()
            clock.now += 1.0
            assert z.sum().item() == pytest.approx((x * 5).cos().sum().item())
        finally:
            deferfuse.set_mode("strict")
    assert _deferfuse_modes_on_the_stack() == []


@pytest.mark.parametrize("slower", [1.0, 5.0], ids=["steady", "drifting"])
def test_a_settled_segment_counts_its_runs_and_rechecks_when_it_would_have(clock, slower):
    """A place settled at once counts its segments' ends without timing each (a streak,
    Segments.observed), yet its recheck comes at the same segment's end as when each was timed,
    every run is counted, and runs at once that drift (5x slower) still make it measure again."""
    x = torch.randn(6)
    with config.override(eager_segments=True, always_compile=False):
        deferfuse.set_mode("defer")
        try:
            _choose_at_once(clock)
            choice = _segment_choice()
            segments = modes.active_recorder().segments
            left = choice.recheck - choice.runs
            before = deferfuse.stats()["blocks_run_at_once"]
            ends = 0
            streaks = []
            while choice.phase is blocks.Phase.AT_ONCE:
                assert _step(x, ends, clock, 0.1 * slower)
                ends += 1
                streaks.append(segments.streak)
                assert ends <= left
            assert max(streaks) > 0   # (the streak did the counting)
            assert deferfuse.stats()["blocks_run_at_once"] == before + ends
            if slower == 1.0:
                assert ends == left
            else:
                # (two outliers in a row, each a streak's mean at most)
                assert ends <= 2 * (blocks.STREAK_MAX + 1) + 1 and choice.last is None
        finally:
            deferfuse.set_mode("strict")


def test_a_read_known_to_be_no_boundary_is_looked_at_again_when_the_places_change(clock):
    """Reads a segment at once passes by (every step's ``loss.item()``) are remembered by their
    code and offset; a read the deferred way has not seen for ``NEW_READ_LOOK_S``, one it has
    for good, until a new place starts segments."""
    import sys
    frame = (lambda: sys._getframe(0))()   # (a frame that has returned: its offset holds still)
    tier = segments.Segments()
    assert not tier.known_quiet(frame)
    tier.quiet(frame, new=True)
    assert tier.known_quiet(frame)
    clock.now += segments.NEW_READ_LOOK_S
    assert not tier.known_quiet(frame)
    tier.quiet(frame, new=False)
    clock.now += 1e6
    assert tier.known_quiet(frame)

    class Recorder:
        at_once_segment = True

    with config.override(eager_segments=True, always_compile=False):
        tier.observed(Recorder(), deferfuse.debugging.source.user_line_from(sys._getframe(0)))
    assert not tier.known_quiet(frame)


def test_mode_changes_while_a_segment_runs_at_once(clock):
    """strict, debug and defer blocks, a user's own dispatch mode, and set_mode, entered while the
    default mode is off the stack for a segment at once: each behaves as with the mode on."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    x = torch.randn(6)
    with config.override(eager_segments=True, always_compile=False):
        deferfuse.set_mode("defer")
        try:
            _choose_at_once(clock)
            with deferfuse.strict():
                assert _deferfuse_modes_on_the_stack() == []
                torch.testing.assert_close((x * 2).sin(), torch.sin(x * 2))
            with deferfuse.debug():
                assert [type(m).__name__ for m in _deferfuse_modes_on_the_stack()] == ["DebugMode"]
                assert (x * 2).sum().item() == pytest.approx(float((x * 2).sum()))
            with deferfuse.defer():
                assert modes.get_mode() is deferfuse.EagerMode.DEFER
                assert (x + 1).sum().item() == pytest.approx(float(x.sum()) + 6, rel=1e-5)
            # (a step, so that the segment running is the step read's again: the read inside the
            # defer block above was new, and the deferred way went to see it, Segments.discover)
            assert _step(x, 1, clock)
            counting = Counting()
            choice = _segment_choice(_step)
            with counting:
                # (the segment ending inside a user's mode chooses to run deferred next: the
                # default mode stays off the stack rather than come back above the user's mode)
                _recheck_at_next_end(choice)
                assert _step(x, 2, clock)
                assert choice.phase is blocks.Phase.MEASURE_DEFERRED
                assert _deferfuse_modes_on_the_stack() == []
                assert (x * 4).sum().item() == pytest.approx(float((x * 4).sum()))
            assert counting.ops >= 2
            assert torch._C._len_torch_dispatch_stack() == 0
            assert _step(x, 3, clock)          # (and comes back at the next segment's end)
            assert len(_deferfuse_modes_on_the_stack()) == 1
            assert (x * 6).sum().item() == pytest.approx(float((x * 6).sum()))
        finally:
            deferfuse.set_mode("strict")
    assert _deferfuse_modes_on_the_stack() == []
    assert modes.get_mode() is deferfuse.EagerMode.STRICT


def test_asking_for_deterministic_algorithms_ends_a_segment_at_once():
    """Found by corpus/resume_checkpoint.py: a program that calls
    ``torch.use_deterministic_algorithms(True)`` first thing, under ``TORCHTPU_MODE=defer``,
    ran its first step at once (the default mode starts at once until its exploration budget
    allows a deferred run) and every later one compiled: training resumed from a checkpoint
    then rounded differently from the uninterrupted run.  Asking for determinism ends the
    segment running at once: from that call on, the program runs as under always_compile."""
    blocks.forget()
    with config.override(eager_segments=True, always_compile=False, explore_share=0.05, cache_dir=""):
        deferfuse.set_mode("defer")
        try:
            assert modes.active_recorder().at_once_segment
            torch.use_deterministic_algorithms(True)
            assert not modes.active_recorder().at_once_segment
            x = torch.randn(5)
            y = (x * 2).sin()
            assert type(y).__name__ == "DeferredTensor"
            torch.testing.assert_close(y.sum().item(), float(torch.sin(x.detach() * 2).sum()))
        finally:
            torch.use_deterministic_algorithms(False)
            deferfuse.set_mode("strict")
            blocks.forget()


def _assert_same_losses(actual: list, expected: list) -> None:
    """The printed losses equal strict's up to the last printed digit: a step run in an XLA
    program computes tanh and the mean with XLA's kernels (within an ulp of torch's, not
    bitwise), and whether a step ran so or was replayed on torch's kernels while its program
    compiled depends on how long the compile took, so the sixth decimal may differ."""
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want)) + 2e-6, (actual, expected)


def _train(steps: int, clock=None, deferred_s: float = 1.0, at_once_s: float = 1.0, place=None, ways=None):
    """A training loop reading its loss every step; with ``clock``, each step takes the time the
    test says for the way it ran (and ``ways`` gets whether it ran at once)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 6), torch.randn(16, 1)
    losses = []
    for _ in range(steps):
        loss = (model(x) - y).square().mean()
        loss.backward()
        if clock is not None:
            at_once = modes.active_recorder().at_once_segment
            clock.now += at_once_s if at_once else deferred_s
            if ways is not None:
                ways.append(at_once)
        opt.step()
        opt.zero_grad()
        losses.append(f"{loss:.6f}")
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("deferred_s, at_once_s, chosen", [(1.0, 0.1, blocks.Phase.AT_ONCE),
                                                          (0.1, 1.0, blocks.Phase.DEFERRED)],
                         ids=["faster-at-once", "faster-deferred"])
def test_a_with_block_around_a_training_loop_chooses_per_step(clock, deferred_s, at_once_s, chosen):
    """``with deferfuse.defer():`` around a whole training loop runs once: the block tier, which
    chooses per run of the block, ran every step deferred, 2.8x strict's time for a small Llama
    fine-tuned as a user writes it (a step 51 ms, strict's 18).  From its second step's end the
    segment tier chooses per step, as under the default mode; the next run of the block starts
    so."""
    expected = _train(40)

    def run():
        with deferfuse.defer():
            first = modes.active_recorder().segments
            return first, _train(40, clock, deferred_s, at_once_s)
    deferfuse.reset_stats()
    with config.override(eager_blocks=True, eager_segments=True, always_compile=False):
        first, actual = run()
        assert first is None   # (its first run: a block, until its second step ended)
        steps = [c for c in blocks.choices() if "steps ending" in c.place]
        assert len(steps) == 1 and steps[0].phase is chosen
        at_once = deferfuse.stats()["blocks_run_at_once"]
        assert at_once > 20 if chosen is blocks.Phase.AT_ONCE else at_once == blocks.SAMPLES
        again, actual_again = run()
        assert again is not None   # (its next run: the steps' tier from the start)
    _assert_same_losses(actual[0], expected[0])
    _assert_same_losses(actual_again[0], expected[0])
    for a, b in zip(actual[1] + actual_again[1], expected[1] * 2):
        torch.testing.assert_close(a, b)
    assert "steps ending" in str(deferfuse.explain())


@pytest.mark.parametrize("deferred_s, at_once_s, tries", [(1.0, 0.1, False), (0.1, 1.0, True)],
                         ids=["costly-first-steps", "cheap-first-steps"])
def test_a_with_block_around_a_loop_finds_it_at_once(clock, deferred_s, at_once_s, tries):
    """A ``with`` block's first run runs at once, its ops counted (BlockChoice.probes): a loop
    in it is found there, and its steps try the deferred way with a block's credit once a warm
    step at once has priced the first deferred one from its ops.  Before, the block's first two
    steps ran deferred to find the loop, first sightings included: a small Llama fine-tuned in
    one block spent 2.2 s on them, in a 10 s loop.  Steps whose deferred runs are costly (here
    on the fake clock, not by their ops) stop after one; cheap ones (a GELU chain over large
    tensors) keep the deferred way where it is faster."""
    ways: list = []
    with config.override(eager_blocks=True, eager_segments=True, always_compile=False, explore_share=0.05):
        with deferfuse.defer():
            actual = _train(30, clock, deferred_s, at_once_s, ways=ways)
    expected = _train(30)
    _assert_same_losses(actual[0], expected[0])
    for got, want in zip(actual[1], expected[1]):
        torch.testing.assert_close(got, want)
    # (the probe's two steps, the loop found at the second's end, then a warm step that prices)
    assert ways[:3] == [True, True, True]
    assert ways[3] is False   # (a few ops: a first deferred step is cheap, its credit tries it)
    if tries:
        assert not ways[-1]   # (chosen: deferred is faster)
    else:
        assert all(ways[4:])   # (its credit ended on the first deferred step's cost)
    step = next(c for c in blocks.choices() if "steps ending" in c.place)
    assert 0 < step.probed_ops < 200


def test_a_with_block_per_step_stays_a_block(clock):
    """A ``with`` inside the loop holds one step a run: the block tier times it run by run."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    with config.override(eager_blocks=True, eager_segments=True, always_compile=False):
        for _ in range(12):
            with deferfuse.defer():
                recorder = modes.active_recorder()
                assert recorder is None or recorder.segments is None
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
                clock.now += 0.1
    assert not [c for c in blocks.choices() if "steps ending" in c.place]


def _evaluate(steps: int, read: str, clock=None, deferred_s: float = 1.0, at_once_s: float = 1.0):
    """An evaluation loop with no optimizer that reads a metric every iteration."""
    torch.manual_seed(0)
    w = torch.randn(6, 3)
    seen = []
    for k in range(steps):
        x = torch.randn(8, 6)
        score = (x @ w).softmax(-1).max(-1).values.mean() * (k + 1)
        if clock is not None:
            clock.now += at_once_s if modes.active_recorder().at_once_segment else deferred_s
        seen.append(score.item() if read == "item" else f"{score:.6f}")
    return seen


@pytest.mark.parametrize("read", ["item", "format"])
@pytest.mark.parametrize("deferred_s, at_once_s, chosen", [(1.0, 0.1, blocks.Phase.AT_ONCE),
                                                          (0.1, 1.0, blocks.Phase.DEFERRED)],
                         ids=["faster-at-once", "faster-deferred"])
def test_a_with_block_around_a_loop_of_reads_chooses_per_iteration(clock, deferred_s, at_once_s, chosen, read):
    """A block around an evaluation loop that reads every iteration (no optimizer: no step
    ends): the second read at the same place that computed its value hands the iterations to
    the segment tier (an inference loop of a small Llama: 54 ms an iteration, strict's 15)."""
    expected = _evaluate(40, read)
    deferfuse.reset_stats()
    with config.override(eager_blocks=True, eager_segments=True, always_compile=False):
        with deferfuse.defer():
            actual = _evaluate(40, read, clock, deferred_s, at_once_s)
    assert actual == expected
    assert _segment_choice(_evaluate).phase is chosen
    at_once = deferfuse.stats()["blocks_run_at_once"]
    assert at_once > 20 if chosen is blocks.Phase.AT_ONCE else at_once == blocks.SAMPLES


@pytest.mark.parametrize("deferred_s, at_once_s", [(1.0, 0.1), (0.1, 1.0)], ids=["at-once", "deferred"])
def test_an_exception_in_a_block_handed_to_the_segment_tier_leaves_torch_as_it_was(clock, deferred_s, at_once_s):
    """A loop that raises after its block was handed to the segment tier (its mode changed in
    place, possibly off the dispatch stack while a step runs at once): the exception reaches
    the user, and torch's dispatch stack and methods are as before the block."""
    before = ({name: torch.Tensor.__dict__.get(name) for name in ("item", "tolist", "__format__", "__bool__")},
              _deferfuse_modes_on_the_stack())

    def failing_loop():
        with deferfuse.defer():
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            x = torch.randn(8, 4)
            for step in range(30):
                loss = model(x).square().mean()
                loss.backward()
                clock.now += at_once_s if modes.active_recorder().at_once_segment else deferred_s
                opt.step()
                opt.zero_grad()
                if step == 25:
                    assert modes.active_recorder().segments is not None
                    raise KeyError(f"{loss:.4f}")
    with config.override(eager_blocks=True, eager_segments=True, always_compile=False):
        with pytest.raises(KeyError):
            failing_loop()
    after = ({name: torch.Tensor.__dict__.get(name) for name in ("item", "tolist", "__format__", "__bool__")},
             _deferfuse_modes_on_the_stack())
    assert after == before
    assert deferfuse.get_mode() is deferfuse.EagerMode.STRICT
    assert torch.ones(2).add(1).tolist() == [2.0, 2.0]


def _writes_and_in_place_views(steps: int, clock: FakeClock | None = None, deferred_s: float = 1.0,
                               at_once_s: float = 1.0):
    """Each step writes a plain tensor in place, changes another's metadata in place (which
    clears what the recorder remembers of plain tensors) and reads the first."""
    p, q = torch.zeros(4), torch.zeros(2, 3)
    seen = []
    for step in range(steps):
        p.add_(1.0)
        q.t_()
        if clock is not None:
            clock.now += at_once_s if modes.active_recorder().at_once_segment else deferred_s
        seen.append(p.sum().item())
    return seen


@pytest.mark.parametrize("deferred_s, at_once_s", [(1.0, 0.1), (0.1, 1.0)], ids=["faster-at-once", "faster-deferred"])
def test_writes_across_segments_at_once_and_deferred_match_strict(clock, deferred_s, at_once_s):
    """Segments run at once let go of the storages the recorder held (Recorder.release_states),
    each entered afresh by the next deferred segment: a plain tensor written in every step,
    with the remembered tensors cleared in between, reads as strict's."""
    expected = _writes_and_in_place_views(30)
    deferfuse.reset_stats()
    with config.override(eager_segments=True, always_compile=False):
        deferfuse.set_mode("defer")
        try:
            seen = _writes_and_in_place_views(30, clock, deferred_s, at_once_s)
        finally:
            deferfuse.set_mode("strict")
    assert seen == expected
    assert deferfuse.stats()["blocks_run_at_once"] > 0
