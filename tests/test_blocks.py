"""The block tier (eager_blocks, on by default): a place in the code whose defer blocks run faster
at once (as strict) runs them at once.

tests/conftest.py turns the setting off for the rest of the suite (a test's loop would otherwise
stop recording after a few runs), so these tests turn it on.  Times come from a fake clock that the
block's body advances, by one amount when it runs deferred and another when it runs at once, so
that every choice here is decided by the test and not by this machine's load.
"""

import pytest
import torch

import deferfuse
from deferfuse import config
from deferfuse.capture.tensor import DeferredTensor
from deferfuse.exec import blocks, segments
from deferfuse.exec.blocks import Phase
from deferfuse.modes import active_recorder


class FakeClock:
    """blocks.clock, moved on by the blocks themselves: ``spend()`` adds ``deferred`` seconds when
    called inside a recording defer block and ``at_once`` seconds otherwise (a block's first
    run, which runs at once under a mode counting its ops, included)."""

    def __init__(self, deferred: float, at_once: float) -> None:
        self.now = 0.0
        self.deferred = deferred
        self.at_once = at_once

    def __call__(self) -> float:
        return self.now

    def spend(self) -> None:
        recorder = active_recorder()
        deferred = recorder is not None and not recorder.at_once_segment
        self.now += self.deferred if deferred else self.at_once


@pytest.fixture
def tier(monkeypatch):
    """eager_blocks on, a fresh table of places; returns a function making a fake clock."""
    blocks.forget()

    def make(deferred: float, at_once: float) -> FakeClock:
        clock = FakeClock(deferred, at_once)
        monkeypatch.setattr(blocks, "clock", clock)
        return clock

    # (autotune_engine off: its engine choice, made on this machine's timings, would make one
    # more run unsteady, sometimes; explore_share 1: the alternation from the first run, with
    # no exploration budget, which tests further down test)
    with config.override(eager_blocks=True, always_compile=False, eager_first_runs=1,
                         background_compile=False, autotune_engine=False, explore_share=1.0):
        yield make
    blocks.forget()


def _block(x: torch.Tensor, clock: FakeClock) -> torch.Tensor:
    with deferfuse.defer():
        clock.spend()
        y = torch.tanh(x * 0.75 + 0.5) * x
    return y


def _only_place() -> blocks.BlockChoice:
    [choice] = blocks.choices()
    return choice


def _strict(x):
    return torch.tanh(x * 0.75 + 0.5) * x


def _alternates(types: list, start: int) -> None:
    """Five timed runs each way, alternating from ``start``: deferred, at once, deferred, ..."""
    assert types[start:start + 10] == [DeferredTensor, torch.Tensor] * 5, types


def test_a_place_faster_at_once_runs_its_blocks_at_once(tier):
    clock = tier(deferred=1.0, at_once=0.25)
    x = torch.randn(31, 17)   # (a shape no other test runs: the first runs compile)
    deferfuse.reset_stats()
    phases, types = [], []
    for _ in range(16):
        y = _block(x, clock)
        phases.append(_only_place().phase)
        types.append(type(y))
        torch.testing.assert_close(y, _strict(x))
    # the first run runs a new graph eagerly, the second compiles (neither timed); then the
    # timed runs alternate, and from the last of them on it runs at once
    assert types[:2] == [DeferredTensor] * 2
    _alternates(types, 2)
    assert set(types[12:]) == {torch.Tensor}
    assert phases[10] is Phase.MEASURE_AT_ONCE and set(phases[11:]) == {Phase.AT_ONCE}
    assert deferfuse.stats()["blocks_run_at_once"] == 5 + 4
    # a block at once is strict itself: bit for bit
    assert torch.equal(y, _strict(x))
    text = deferfuse.explain()
    assert f"{__file__}:" in text and "at once: deferred 1e+03 ms, at once 250 ms" in text


def test_a_place_faster_deferred_keeps_deferring(tier):
    clock = tier(deferred=0.25, at_once=1.0)
    x = torch.randn(37, 11)
    types = []
    for _ in range(16):
        y = _block(x, clock)
        types.append(type(y))
        torch.testing.assert_close(y, _strict(x))
    assert _only_place().phase is Phase.DEFERRED
    k = types.index(torch.Tensor) - 1
    _alternates(types, k)
    assert len(types[k + 10:]) >= 2 and set(types[k + 10:]) == {DeferredTensor}
    assert "deferred: deferred 250 ms, at once 1e+03 ms" in deferfuse.explain()


def _decided(tier, deferred: float, at_once: float, x: torch.Tensor):
    clock = tier(deferred, at_once)
    for _ in range(30):
        _block(x, clock)
        if _only_place().phase in (Phase.AT_ONCE, Phase.DEFERRED):
            break
    choice = _only_place()
    assert choice.phase is (Phase.AT_ONCE if at_once < deferred else Phase.DEFERRED)
    return clock, choice


def test_two_runs_far_off_the_chosen_median_measure_again(tier):
    x = torch.randn(37, 11)
    clock, choice = _decided(tier, 1.0, 0.25, x)
    clock.at_once = 5.0          # one slow run is noise ...
    _block(x, clock)
    clock.at_once = 0.25
    _block(x, clock)
    assert choice.phase is Phase.AT_ONCE
    clock.at_once = 5.0          # ... two in a row mean the block changed
    _block(x, clock)
    _block(x, clock)
    assert choice.phase is Phase.MEASURE_DEFERRED
    for _ in range(10):
        _block(x, clock)
    assert choice.phase is Phase.DEFERRED and type(_block(x, clock)) is DeferredTensor


def test_a_tiny_block_jittering_by_more_than_twice_is_not_measured_again(tier):
    x = torch.randn(37, 11)
    clock, choice = _decided(tier, 4e-4, 1e-4, x)
    clock.at_once = 2.5e-4      # 2.5x the median, but only 0.15 ms off it
    for _ in range(3):
        _block(x, clock)
    assert choice.phase is Phase.AT_ONCE
    clock.at_once = 4e-4        # 0.3 ms off: the block changed
    for _ in range(2):
        _block(x, clock)
    assert choice.phase is Phase.MEASURE_DEFERRED


def test_a_choice_is_checked_again_and_less_often_while_it_holds(tier, monkeypatch):
    monkeypatch.setattr(blocks, "FIRST_RECHECK", 4)
    x = torch.randn(37, 11)
    clock, choice = _decided(tier, 1.0, 0.25, x)
    assert choice.recheck == 4
    for _ in range(4 - choice.runs):
        _block(x, clock)
    assert choice.phase is Phase.MEASURE_DEFERRED
    types = []
    for _ in range(10 + 7):
        types.append(type(_block(x, clock)))
    # measured again (alternating, the graph compiled already), then 7 of the 8 runs at once
    # before the next check
    _alternates(types, 0)
    assert choice.phase is Phase.AT_ONCE and choice.recheck == 8 and choice.runs == 7
    assert set(types[10:]) == {torch.Tensor}


def test_a_raising_block_is_not_timed_and_its_error_is_the_users(tier):
    run = _at_once_block(tier)
    [choice] = blocks.choices()
    runs = choice.runs
    with pytest.raises(RuntimeError, match="size of tensor a"):
        run(lambda: torch.randn(3) + torch.randn(4))
    for _ in range(2):
        with pytest.raises(ZeroDivisionError):
            run(lambda: 1 / 0)
    assert choice.phase is Phase.AT_ONCE and choice.runs == runs
    blocks.forget()
    clock = tier(1.0, 0.25)
    with pytest.raises(RuntimeError, match="size of tensor a"):   # (strict's own message)
        with deferfuse.defer():
            clock.spend()
            (torch.randn(3) * 2) + torch.randn(4)
    [choice] = blocks.choices()
    assert choice.phase is Phase.MEASURE_DEFERRED and not choice.deferred and not choice.unsteady


@pytest.mark.parametrize("deferred, at_once, chosen", [(1.0, 0.25, Phase.AT_ONCE), (0.25, 1.0, Phase.DEFERRED)])
def test_runs_that_keep_compiling_are_timed_as_they_run(tier, deferred, at_once, chosen):
    """A block that meets new shapes at every run (generate() with a growing KV cache) is timed
    from its fourth unsteady run on, and chooses on those times (it was never timed before, and
    stayed deferred however slow)."""
    clock = tier(deferred, at_once)
    for n in range(blocks.UNSTEADY_UNTIMED + 2 * blocks.SAMPLES):
        x = torch.randn(n + 2, 3)
        y = _block(x, clock)      # a new shape every run: each runs a new graph
        torch.testing.assert_close(y, _strict(x))
    choice = _only_place()
    assert choice.phase is chosen
    assert len(choice.deferred) == len(choice.at_once) == blocks.SAMPLES
    assert "compiled or met new graphs" in choice.describe()


def _at_once_block(tier):
    """A place decided at once, and its clock: the block ``body`` runs there when called."""
    clock = tier(1.0, 0.25)

    def run(body):
        with deferfuse.defer():
            clock.spend()
            return body()

    x = torch.randn(4)
    for _ in range(30):   # (new graphs, compiles and engine choices are not timed)
        run(lambda: x * 2 + 1)
        if blocks.choices()[0].phase is Phase.AT_ONCE:
            break
    assert [c.phase for c in blocks.choices()] == [Phase.AT_ONCE]
    return run


def test_blocks_at_once_keep_training_semantics(tier):
    run = _at_once_block(tier)
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    reference = torch.nn.Linear(5, 3)
    reference.load_state_dict(model.state_dict())
    weight, view = model.weight, model.weight[0]
    x = torch.randn(7, 5)

    def step(m):
        loss = m(x).square().mean()
        loss.backward()
        with torch.no_grad():
            for p in m.parameters():
                p.sub_(0.1 * p.grad)
                p.grad = None
        return loss

    for _ in range(3):
        loss = run(lambda: step(model))
        expected = step(reference)
        assert type(loss) is torch.Tensor and loss.item() == expected.item()
    assert model.weight is weight and torch.equal(view, model.weight[0])
    assert torch.equal(model.weight, reference.weight) and torch.equal(model.bias, reference.bias)


def test_blocks_at_once_take_deferred_results_and_see_defer_mode(tier):
    run = _at_once_block(tier)
    x = torch.randn(6, 4)
    with deferfuse.defer():
        pending = (x + 1).cos()             # another place: deferred, computed at its exit
    assert type(pending) is DeferredTensor

    def body():
        assert deferfuse.get_mode() is deferfuse.EagerMode.DEFER and active_recorder() is None
        deferfuse.sync()
        out = pending.sum(0) * 2
        with deferfuse.defer():             # a nested block is chosen for at its own place
            inner = out + 1
        return inner

    out = run(body)
    torch.testing.assert_close(out, (x + 1).cos().sum(0) * 2 + 1)


def test_blocks_inside_other_blocks_and_under_settings_are_not_chosen_for(tier):
    clock = tier(1.0, 0.25)
    x = torch.randn(5)
    with deferfuse.debug():
        for _ in range(10):
            _block(x, clock)
    with config.override(always_compile=True):
        for _ in range(10):
            _block(x, clock)
    with config.override(eager_blocks=False):
        for _ in range(10):
            _block(x, clock)
    assert blocks.choices() == []
    with deferfuse.defer():
        for _ in range(10):
            y = _block(x, clock)
            assert type(y) is DeferredTensor
    [outer] = blocks.choices()   # (the outer block is chosen for; the inner ones are not)
    assert not outer.place.endswith(f":{_block.__code__.co_firstlineno + 1}")


def test_a_decorated_function_is_chosen_for_at_each_call_site(tier):
    clock = tier(1.0, 0.25)

    @deferfuse.defer()
    def f(x):
        clock.spend()
        return x * 3

    x = torch.randn(5)
    for _ in range(16):
        f(x)
    for _ in range(2):
        f(x)
    places = sorted(c.place for c in blocks.choices())
    assert len(places) == 2 and all(p.startswith(__file__ + ":") for p in places)
    assert {c.phase for c in blocks.choices()} == {Phase.AT_ONCE, Phase.MEASURE_DEFERRED}


def test_the_table_of_places_is_bounded(tier, monkeypatch):
    monkeypatch.setattr(blocks, "MAX_PLACES", 3)
    tier(1.0, 0.25)
    for line in range(5):
        source = "\n" * line + "with deferfuse.defer():\n    y = x + 1"
        exec(compile(source, "<places>", "exec"), {"deferfuse": deferfuse, "x": torch.randn(5)})
    assert 1 <= len(blocks.choices()) <= 3


def _feed(choice: blocks.BlockChoice, deferred: list, at_once: list) -> int:
    """Steady runs of the given times, each way in turn as the place asks; how many it took."""
    times = {Phase.MEASURE_DEFERRED: iter(deferred), Phase.MEASURE_AT_ONCE: iter(at_once)}
    runs = 0
    while choice.phase in times:
        choice.finished(next(times[choice.phase]), True)
        runs += 1
    return runs


def test_clearly_separated_ways_are_chosen_after_five_runs_each():
    choice = blocks.BlockChoice("here:1")
    assert _feed(choice, [2.0] * 5, [1.0] * 5) == 10
    assert choice.phase is Phase.AT_ONCE
    # one slow deferred run does not hide that deferred won 20 of the 25 pairs
    choice = blocks.BlockChoice("here:2")
    assert _feed(choice, [1.0, 1.0, 1.0, 1.0, 5.0], [2.0] * 5) == 10
    assert choice.phase is Phase.DEFERRED


def test_overlapping_ways_are_measured_longer_before_choosing():
    # deferred runs alternate 1.0 / 1.3, runs at once 1.1 / 1.2: either way wins half the pairs
    choice = blocks.BlockChoice("here:3")
    runs = _feed(choice, [1.0, 1.3] * 8, [1.1, 1.2] * 8)
    assert runs == 2 * blocks.MAX_SAMPLES
    assert choice.phase is Phase.DEFERRED   # medians 1.0 against 1.1
    # a first five runs at once that look faster, then clearly slower ones: measured on
    choice = blocks.BlockChoice("here:4")
    runs = _feed(choice, [1.0, 1.3, 1.0, 1.3, 1.2] + [1.0] * 10, [1.1, 1.1, 1.1, 1.4, 1.4] + [1.5] * 10)
    assert 2 * blocks.SAMPLES < runs <= 2 * blocks.MAX_SAMPLES
    assert choice.phase is Phase.DEFERRED


def test_a_recheck_of_a_choice_made_on_unsettled_runs_holds_while_they_stay_unsettled():
    """generate() under the default mode: each decoding step meets new shapes, so its deferred
    runs never settle and it chose at once; measuring again would compile again at every
    recheck (seconds of background compiles on a 2-core machine).  A recheck's first unsteady
    deferred run keeps the choice, checked half as often; a steady one measures again."""
    choice = blocks.BlockChoice("here:4")
    for _ in range(blocks.UNSTEADY_UNTIMED):
        choice.finished(2.0, False)
    while choice.phase in (Phase.MEASURE_DEFERRED, Phase.MEASURE_AT_ONCE):
        choice.finished(2.0 if choice.phase is Phase.MEASURE_DEFERRED else 1.0, choice.phase is Phase.MEASURE_AT_ONCE)
    assert choice.phase is Phase.AT_ONCE and choice.unsettled and choice.recheck == blocks.FIRST_RECHECK
    median = choice.median
    for _ in range(blocks.FIRST_RECHECK):
        choice.finished(1.0, True)
    assert choice.phase is Phase.MEASURE_DEFERRED
    choice.finished(2.0, False)          # still meets new graphs
    assert choice.phase is Phase.AT_ONCE and choice.recheck == 2 * blocks.FIRST_RECHECK
    assert choice.median == median and len(choice.at_once) == blocks.SAMPLES
    for _ in range(2 * blocks.FIRST_RECHECK):
        choice.finished(1.0, True)
    choice.finished(0.5, True)           # settled now (compiled): measured again
    assert choice.phase is Phase.MEASURE_AT_ONCE and choice.deferred == [0.5]


# -- remembered choices (remember_blocks): a later process starts a place from its choice ------
_REMEMBERING = '''
import json, sys
import torch
import deferfuse
from deferfuse.exec import blocks
from deferfuse.modes import active_recorder

class Clock:                      # deferred runs take 1 s, runs at once 0.25 s
    now = 0.0
    def __call__(self):
        return self.now
    def spend(self):
        self.now += 1.0 if active_recorder() is not None else 0.25

clock = blocks.clock = Clock()
x = torch.linspace(-3.0, 3.0, 257)
results = []
for _ in range(int(sys.argv[1])):
    with deferfuse.defer():
        clock.spend()
        y = torch.tanh(x * 0.75 + 0.5) * x
    expected = torch.tanh(x * 0.75 + 0.5) * x
    results.append((type(y) is torch.Tensor, torch.equal(y, expected), torch.allclose(y, expected)))
[choice] = blocks.choices()
print(json.dumps({"plain_equal_close": results, "phase": choice.phase.value,
                  "jax_imported": "jax" in sys.modules, "stats": deferfuse.stats(),
                  "explain": str(deferfuse.explain())}))
'''


def _remembering(tmp_path, calls: int, **env) -> dict:
    import json
    import os
    import subprocess
    import sys
    script = tmp_path / "remembering.py"
    script.write_text(_REMEMBERING)
    env = dict(os.environ, **{"DEFERFUSE_CACHE_DIR": str(tmp_path / "cache"),
                              "DEFERFUSE_EAGER_BLOCKS": "1", "DEFERFUSE_REMEMBER_BLOCKS": "1",
                              "DEFERFUSE_AUTOTUNE_ENGINE": "0", "DEFERFUSE_EAGER_UNSEEN_OPS": "1",
                              "DEFERFUSE_EXPLORE_SHARE": "1", "DEFERFUSE_BACKGROUND_COMPILE": "0", **env})
    out = subprocess.run([sys.executable, str(script), str(calls)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_later_process_starts_a_place_from_its_remembered_choice(tmp_path):
    first = _remembering(tmp_path, 16)
    assert first["phase"] == "at once" and first["jax_imported"]
    assert all(close for _, _, close in first["plain_equal_close"])
    # a warm start: every call at once from the first, strict's results, JAX never imported
    second = _remembering(tmp_path, 12)
    assert second["plain_equal_close"] == [[True, True, True]] * 12
    assert second["phase"] == "at once" and not second["jax_imported"]
    assert second["stats"]["blocks_run_at_once"] == 12 and second["stats"]["ops_recorded"] == 0
    assert "remembered from an earlier process" in second["explain"]
    # other settings: not the same choice; the place measures (its first call is deferred)
    other = _remembering(tmp_path, 2, DEFERFUSE_EAGER_FIRST_RUNS="2")
    assert other["phase"] == "measuring deferred" and other["stats"]["blocks_run_at_once"] == 0
    assert "remembered" not in other["explain"]
    # off: measured again
    off = _remembering(tmp_path, 2, DEFERFUSE_REMEMBER_BLOCKS="0")
    assert off["phase"] == "measuring deferred" and off["stats"]["blocks_run_at_once"] == 0


def test_a_process_too_short_to_choose_leaves_its_runs_to_the_next(tmp_path):
    first = _remembering(tmp_path, 8)   # (too few runs to time five each way)
    assert first["phase"].startswith("measuring")
    second = _remembering(tmp_path, 8)
    assert second["phase"] == "at once" and "medians of 5 and 5 runs" in second["explain"]
    assert all(close for _, _, close in second["plain_equal_close"])


def test_a_later_process_starts_a_place_whose_credit_ended_at_once(tier, tmp_path, monkeypatch):
    """A script run twice on one cache folder: a ``with`` place whose first deferred run ended
    its credit (a Llama step per block: 0.75 s over strict's) paid that run again in every
    process, since it had made no choice to keep.  Its priced first run is kept: a later
    process runs it at once from its first run, waiting for the budget."""
    clock = tier(0.3, 0.01)
    monkeypatch.setattr(blocks, "startup_seconds", lambda: 0.0)
    x = torch.randn(7, 11)

    def run():
        with deferfuse.defer():
            clock.spend()
            return torch.tanh(x * 0.75 + 0.5) * x
    with config.override(remember_blocks=True, cache_dir=str(tmp_path), explore_share=0.05):
        first = [type(run()) for _ in range(5)]
        assert first == [DeferredTensor] + [torch.Tensor] * 4
        blocks.forget()
        blocks._LOOKED_UP.clear()   # (a later process)
        again = [run() for _ in range(5)]
        assert [type(y) for y in again] == [torch.Tensor] * 5
        assert _only_place().credit == 0.0 and _only_place().trial == pytest.approx(0.29)
    for y in again:
        torch.testing.assert_close(y, _strict(x))


def test_a_damaged_remembered_choice_is_ignored(tmp_path):
    _remembering(tmp_path, 16)
    [record] = (tmp_path / "cache" / "blocks").iterdir()
    record.write_text('{"phase": "at once", "deferred": "no"')
    damaged = _remembering(tmp_path, 2)
    assert damaged["phase"] == "measuring deferred" and damaged["stats"]["blocks_run_at_once"] == 0
    assert damaged["stats"]["disk_cache_errors"] == 1


def test_forget_measures_a_remembered_place_again_in_the_same_process(tier, tmp_path):
    clock = tier(1.0, 0.25)
    x = torch.randn(9, 5)

    def run():
        with deferfuse.defer():
            clock.spend()
            return torch.tanh(x * 0.75 + 0.5) * x

    with config.override(remember_blocks=True, cache_dir=str(tmp_path)):
        for _ in range(30):
            run()
        assert _only_place().phase is Phase.AT_ONCE and not _only_place().remembered
        assert len(list((tmp_path / "blocks").iterdir())) == 1
        blocks.forget()
        assert type(run()) is DeferredTensor and _only_place().phase is not Phase.AT_ONCE


def test_a_remembered_choice_is_rechecked_as_seldom_and_watched_against_its_own_runs():
    choice = blocks.BlockChoice("here:5")
    assert not choice.remember({"phase": "at once", "deferred": [1.0], "at_once": "x", "unsteady": 0})
    assert choice.phase is Phase.MEASURE_DEFERRED
    assert choice.remember({"phase": "at once", "deferred": [1.0] * 5, "at_once": [0.25] * 5,
                            "unsteady": 0, "recheck": 4 * blocks.FIRST_RECHECK})
    assert choice.phase is Phase.AT_ONCE and choice.remembered and choice.runs_at_once
    assert choice.recheck == 4 * blocks.FIRST_RECHECK and choice.median is None
    # this process's first runs, slower than the earlier process's 0.25 s, set its median ...
    for _ in range(blocks.UNSTEADY_UNTIMED + blocks.SAMPLES):
        choice.finished(2.0, True)
    assert choice.phase is Phase.AT_ONCE and choice.median == 2.0
    # ... and runs far off it twice in a row measure again
    choice.finished(9.0, True)
    choice.finished(9.0, True)
    assert choice.phase is Phase.MEASURE_DEFERRED and not choice.remembered


# -- the exploration budget (explore_share): trying the deferred way costs a bounded share ----
@pytest.mark.parametrize("deferred, at_once", [(2.0, 1.0), (1.3, 1.0), (50.0, 1.0)])
def test_trying_deferred_runs_costs_at_most_the_budget_over_strict(tier, deferred, at_once):
    """A place where deferring never pays: the deferred runs it tries, first recordings and
    compiles included, cost at most explore_share of its time over running everything at once,
    plus a ``with`` block's credit (it asked to defer: blocks.BLOCK_CREDIT_S) and the one run
    that found out."""
    clock = tier(deferred, at_once)
    x = torch.randn(13, 7)
    share = 0.05
    types = []
    with config.override(explore_share=share):
        for _ in range(400):
            y = _block(x, clock)
            types.append(type(y))
            torch.testing.assert_close(y, _strict(x))
    strict_time = 400 * at_once
    assert clock.now <= strict_time * (1 + share) + blocks.BLOCK_CREDIT_S + (deferred - at_once), \
        (clock.now, strict_time)
    assert DeferredTensor in types   # (and it did try)


def test_where_deferring_pays_the_budget_is_not_spent_and_the_place_defers(tier):
    clock = tier(deferred=0.25, at_once=1.0)
    x = torch.randn(19, 3)
    with config.override(explore_share=0.05):
        types = [type(_block(x, clock)) for _ in range(60)]
    assert _only_place().phase is Phase.DEFERRED
    # deferred runs cost nothing over at once, so the tier alternates as with no budget
    first = types.index(DeferredTensor)
    assert first <= 10 and set(types[-10:]) == {DeferredTensor}


@pytest.mark.parametrize("deferred, at_once, compile_s, explores", [
    (0.3, 0.01, 0.0, False),     # its first deferred run cost 29 runs at once over one
    (0.03, 0.01, 10.0, False),   # cheap to run, but its ops would take 10 s to compile
    (0.03, 0.01, 0.0, True),     # cheap: a GELU chain over large tensors
], ids=["costly-first-run", "costly-compiles", "cheap"])
def test_a_with_places_credit_goes_on_only_where_its_first_run_shows_exploring_cheap(
        tier, monkeypatch, deferred, at_once, compile_s, explores):
    """A ``with`` place's credit (BLOCK_CREDIT_S) paid for deferred runs until it was spent,
    whatever the first one showed: a ResNet step per block spent 0.4 s on its first deferred run
    (18 runs at once), then 2 s more on three deferred runs and a compile, 1.83x strict's time
    over 100 steps.  Once the first deferred run is priced, the credit goes on only if that run
    cost at most CHEAP_FIRST_RUNS runs at once over one and compiling what it recorded fits the
    credit; the first deferred run itself compiles nothing."""
    from deferfuse.exec import executables
    clock = tier(deferred, at_once)
    monkeypatch.setattr(blocks, "startup_seconds", lambda: 0.0)   # (no one-off cost of this process's)
    monkeypatch.setattr(executables, "compile_estimate", lambda n_nodes: compile_s)
    x = torch.randn(11, 9)
    allowances = []

    def block():
        with deferfuse.defer():
            clock.spend()
            if active_recorder() is not None:
                allowances.append(executables._ALLOWANCE.seconds)
            y = torch.tanh(x * 0.75 + 0.5) * x
        return y
    with config.override(explore_share=0.05):
        types = [type(block()) for _ in range(40)]
        described = _only_place().describe()
    assert types[:2] == [DeferredTensor, torch.Tensor]   # (the first run, then its price)
    assert allowances[0] == 0.0
    if explores:
        assert types.count(DeferredTensor) > 3 and any(a for a in allowances[1:])
    else:
        assert types.count(DeferredTensor) == 1, types
        assert "waits for the exploration budget" in described


def test_a_places_next_trial_expects_to_compile_what_its_first_deferred_run_recorded(monkeypatch):
    """Found by bench.loops --way step-block: GPT-2's step per block, its credit ended, was
    tried again at its 55th step, its trial priced at its first deferred run's 0.3 s (which
    compiled nothing); that run and the compile it started cost ~3 s, 1.2x strict's 100 steps.
    Until a deferred run has been timed, the next one is expected to compile what the first
    recorded too (its ops at this process's compile rate, a core's share)."""
    from deferfuse.exec import executables
    from deferfuse.stats import STATS
    monkeypatch.setattr(executables, "compile_estimate", lambda n_nodes: 0.01 * n_nodes)
    monkeypatch.setattr(blocks, "clock", lambda: 0.0)
    monkeypatch.setattr(blocks, "startup_seconds", lambda: 0.0)
    choice = blocks.BlockChoice("here:9", credit=blocks.BLOCK_CREDIT_S)
    with config.override(explore_share=0.05):
        choice.starting(False)
        monkeypatch.setattr(STATS, "ops_recorded", STATS.ops_recorded + 1000)   # (what it recorded)
        choice.finished(0.2, False)
        choice.starting(True)
        choice.finished(0.1, True, at_once=True)
        assert choice.first_ops == 1000
        assert choice._trial_cost() == pytest.approx(0.1 + 10.0 * blocks.COMPILE_SHARE)
        assert choice.credit == 0.0 and choice.runs_at_once


def test_one_off_costs_met_inside_one_another_count_once(monkeypatch):
    """A process's one-off costs (JAX's start, the lowering table, the recorder's modules, the
    first metadata inference) are left out of what a place's run cost (stats.one_off); one met
    inside another (the lowering table loaded by the first inference) counts once."""
    import sys
    import types
    stats = sys.modules["deferfuse.stats"]   # (deferfuse.stats is the function stats())
    now = [0.0]
    monkeypatch.setattr(stats, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    before = stats.startup_seconds()
    with stats.one_off():
        now[0] += 1.0
        with stats.one_off():
            now[0] += 2.0
    with pytest.raises(KeyError), stats.one_off():
        now[0] += 0.5
        raise KeyError("an import that failed still took its time")
    assert stats.startup_seconds() - before == 3.5


def test_a_default_mode_segment_starts_at_once_and_tries_within_its_budget(monkeypatch):
    """A segment asks for nothing (no credit): it runs at once until a first deferred run fits
    explore_share of its time."""
    # (a first trial expected to cost a second: JAX and sympy not imported yet, say)
    monkeypatch.setattr(blocks, "first_trial_estimate", lambda: 1.0)
    choice = blocks.BlockChoice("segment:1")
    with config.override(explore_share=0.05):
        assert choice.runs_at_once
        for _ in range(5):
            choice.finished(1.0, True, at_once=True)
        assert choice.runs_at_once   # (5 s: 0.25 s to spend, a first trial expected to cost more)
        for _ in range(30):
            choice.finished(1.0, True, at_once=True)
        assert not choice.runs_at_once


def test_a_segments_first_trial_is_priced_from_its_runs_at_once(monkeypatch):
    """Found by bench.loops: a Llama step's first deferred run (recording ~1,300 new ops,
    replaying them, the compiles it starts) costs 3-5 s, 22-37 of its runs at once, where the
    trial was expected to cost first_trial_estimate() alone; the one trial the budget allowed
    at the 70th step then cost a 100-step loop 20-60% of strict's time.  A default mode's
    segment, and the discovery of its boundaries, now expect SEGMENT_TRIAL_RUNS runs at once
    more; a with-block (credit, no such runs) is priced as before."""
    monkeypatch.setattr(blocks, "first_trial_estimate", lambda: 0.3)
    share, step = 0.05, 0.135
    expected = 0.3 + segments.SEGMENT_TRIAL_RUNS * step
    segment = blocks.BlockChoice("segment:7", trial_runs=segments.SEGMENT_TRIAL_RUNS)
    block = blocks.BlockChoice("block:7", credit=blocks.BLOCK_CREDIT_S)
    with config.override(explore_share=share):
        runs = 0
        while segment.runs_at_once:
            segment.finished(step, True, at_once=True)
            runs += 1
        assert runs * step * share >= expected > (runs - 1) * step * share
        assert not block.runs_at_once   # (its credit covers a first trial at once)


def test_a_compile_that_does_not_fit_the_budget_is_put_off(tier, monkeypatch):
    from deferfuse.exec import executables
    clock = tier(deferred=1.0, at_once=1.0)
    x = torch.randn(23, 5)
    # (every compile estimated at a minute: with 5% of a few seconds to spend, none fits)
    monkeypatch.setattr(executables, "compile_estimate", lambda n_nodes: 60.0)
    deferfuse.reset_stats()
    with config.override(explore_share=0.05):
        for _ in range(80):
            torch.testing.assert_close(_block(x, clock), _strict(x))
    stats = deferfuse.stats()
    # (a with place's first deferred run compiles nothing, and the next one's expected cost
    # includes compiling what it recorded: with a minute to compile, none is tried)
    assert stats["compiles"] == 0 and stats["eager_replays"] >= 1
    # an affordable compile goes ahead at the next deferred run
    monkeypatch.setattr(executables, "compile_estimate", lambda n_nodes: 0.0)
    with config.override(explore_share=0.05):
        for _ in range(80):
            _block(x, clock)
    assert deferfuse.stats()["compiles"] == 1


def test_a_compile_over_the_allowance_is_put_off_and_the_graph_replays(tier, monkeypatch):
    """executables.allow_compiles: what a deferred run may spend compiling (the block tier sets
    it from the budget); a compile estimated over it is put off, and the graph replays eagerly."""
    from deferfuse.exec import executables
    x = torch.randn(29, 3)
    monkeypatch.setattr(executables, "compile_estimate", lambda n_nodes: 60.0)
    deferfuse.reset_stats()
    with config.override(eager_blocks=False):
        for _ in range(3):   # (a graph seen before wants a compile from its second run)
            executables.allow_compiles(1.0)
            try:
                with deferfuse.defer():
                    y = torch.tanh(x * 0.75 + 0.5) * x
            finally:
                executables.allow_compiles(None)
            torch.testing.assert_close(y, _strict(x))
    stats = deferfuse.stats()
    assert stats["compiles"] == 0 and stats["compiles_put_off"] >= 1 and stats["eager_replays"] >= 2


def test_a_run_at_once_is_not_timed_while_a_compile_takes_a_core(monkeypatch):
    from deferfuse.exec import executables
    choice = blocks.BlockChoice("here:5")
    choice.finished(2.0, True)                       # deferred, timed
    assert choice.phase is Phase.MEASURE_AT_ONCE
    monkeypatch.setattr(executables, "compiles_pending", lambda: True)
    choice.starting(True)
    choice.finished(5.0, True, at_once=True)         # slowed by the compile: not a sample
    assert choice.at_once == [] and choice.phase is Phase.MEASURE_AT_ONCE
    monkeypatch.setattr(executables, "compiles_pending", lambda: False)
    choice.starting(True)
    choice.finished(1.0, True, at_once=True)
    assert choice.at_once == [1.0] and choice.phase is Phase.MEASURE_DEFERRED


def test_discovering_a_programs_boundaries_is_priced_from_its_steps(monkeypatch):
    """The default mode's first deferred run (discovery, Segments.may_discover) is the same
    trial: once a step's end has been timed at once, it waits for the budget to cover
    SEGMENT_TRIAL_RUNS of those steps as well as first_trial_estimate()."""
    now = [0.0]
    monkeypatch.setattr(blocks, "clock", lambda: now[0])
    monkeypatch.setattr(blocks, "first_trial_estimate", lambda: 0.3)
    tier = segments.Segments()
    with config.override(explore_share=0.05, eager_segments=True, always_compile=False):
        now[0] = 7.0
        assert tier.may_discover()                     # (nothing timed: the estimate alone)
        step = blocks.BlockChoice("step:3", trial_runs=segments.SEGMENT_TRIAL_RUNS)
        for _ in range(5):
            step.finished(0.135, True, at_once=True)
        tier.choice = step
        assert not tier.may_discover()                 # 0.35 s of budget, ~4.4 s expected
        now[0] = (0.3 + segments.SEGMENT_TRIAL_RUNS * 0.135) / 0.05
        assert tier.may_discover()


# -- a new place's first run: at once, its ops counted (BlockChoice.probes) -------------------
def _chain(x: torch.Tensor, clock: FakeClock, links: int) -> torch.Tensor:
    with deferfuse.defer():
        clock.spend()
        y = x
        for _ in range(links):
            y = torch.tanh(y * 0.75 + 0.5)
    return y


def _strict_chain(x: torch.Tensor, links: int) -> torch.Tensor:
    y = x
    for _ in range(links):
        y = torch.tanh(y * 0.75 + 0.5)
    return y


@pytest.fixture
def probing(tier, monkeypatch):
    """The block tier as users run it: the segment tier on (a first run probes), the budget at
    its default; no one-off costs of this process's, no compile cost."""
    from deferfuse.exec import executables
    monkeypatch.setattr(blocks, "startup_seconds", lambda: 0.0)
    monkeypatch.setattr(executables, "compile_estimate", lambda n_nodes: 0.0)
    with config.override(eager_segments=True, explore_share=config.settings()["explore_share"].default):
        yield tier


@pytest.mark.parametrize("links, explores", [(100, False), (2, True)], ids=["many-ops", "few-ops"])
def test_a_new_places_first_run_runs_at_once_and_prices_its_first_deferred_run(probing, links, explores):
    """A new ``with`` place's first deferred run was its first run, priced after it ran: a
    ResNet step per block paid 0.5 s for it (20 of its runs at once, JAX's start included) to
    learn that exploring there was costly, a 400-step MLP loop 0.3 s of its 1.3.  Its first run
    now runs at once, its ops counted, and the next, warm, prices a first deferred run at
    FIRST_RUN_OP_S an op: many ops over small tensors wait for the budget and never pay it."""
    clock = probing(deferred=0.02, at_once=0.01)
    x = torch.randn(11, 9)
    types = []
    for _ in range(30):
        y = _chain(x, clock, links)
        types.append(type(y))
        torch.testing.assert_close(y, _strict_chain(x, links))
    place = _only_place()
    assert types[:2] == [torch.Tensor, torch.Tensor]   # (the first run counts; the next prices)
    assert place.probed_ops >= 3 * links
    if explores:
        assert types[2] is DeferredTensor
    else:
        assert DeferredTensor not in types, types
        assert place.trial == pytest.approx(place.probed_ops * blocks.FIRST_RUN_OP_S)
        assert "expected to cost" in place.describe()


def test_a_remembered_price_holds_where_the_first_run_runs_as_many_ops(probing, tmp_path):
    """A price an earlier process measured (its first deferred run ended the credit) is kept
    for the place (``with`` line and bytecode), so a later process does not pay that run again.
    The same line may run other work in another process (one script trains a ResNet, then a
    GELU chain, by its arguments): the price holds only where the first run, at once, runs as
    many ops; else the place is priced afresh."""
    clock = probing(deferred=0.3, at_once=0.01)
    x = torch.randn(7, 5)
    with config.override(remember_blocks=True, cache_dir=str(tmp_path)):
        first = [type(_chain(x, clock, 2)) for _ in range(6)]
        # (the probe, the warm run pricing it cheap, the first deferred run: 29 runs over one)
        assert first == [torch.Tensor, torch.Tensor, DeferredTensor] + [torch.Tensor] * 3
        blocks.forget()
        blocks._LOOKED_UP.clear()   # (a later process)
        assert {type(_chain(x, clock, 2)) for _ in range(6)} == {torch.Tensor}
        blocks.forget()
        blocks._LOOKED_UP.clear()   # (a later process, other work at the same line)
        other = [type(_chain(x, clock, 3)) for _ in range(4)]
        assert other[:3] == [torch.Tensor, torch.Tensor, DeferredTensor]


def test_a_first_run_that_raises_is_not_timed_and_the_next_counts_again(probing):
    clock = probing(deferred=0.02, at_once=0.01)
    x = torch.randn(5, 4)

    def block(fail: bool):
        with deferfuse.defer():
            clock.spend()
            y = torch.tanh(x * 0.75 + 0.5)
            if fail:
                raise KeyError("the user's")
        return y
    with pytest.raises(KeyError, match="the user's"):
        block(True)
    place = _only_place()
    assert not place.reference and place.probes()
    torch.testing.assert_close(block(False), torch.tanh(x * 0.75 + 0.5))
    assert place.probed_ops > 0 and place.reference


def _epochs(clock, use_defer: bool) -> list[str]:
    """A block around an epoch's loop over a DataLoader with forked workers, switching modes
    inside each step."""
    import contextlib
    from torch.utils.data import DataLoader, TensorDataset
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(48, 8), torch.randn(48, 1))
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for _ in range(2):
        with deferfuse.defer() if use_defer else contextlib.nullcontext():
            for x, y in DataLoader(data, batch_size=16, num_workers=2, multiprocessing_context="fork"):
                if use_defer:
                    clock.spend()
                loss = (model(x) - y).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                with deferfuse.debug():
                    checked = (x * 2).sum()
                with deferfuse.strict():
                    plain = (x + 1).mean()
                seen.append(f"{loss.item():.6f} {checked.item():.4f} {plain.item():.4f}")
    return seen


_FORKED_EPOCHS = """
import json, sys
sys.path.insert(0, sys.argv[1])
import test_blocks
from deferfuse.exec import blocks

class Clock:
    def spend(self):
        pass

strict = test_blocks._epochs(Clock(), False)
deferred = test_blocks._epochs(Clock(), True)
print(json.dumps({"same": deferred == strict, "loop": any(c.holds_loop for c in blocks.choices()),
                  "probed": any("steps ending" in c.place and c.probed_ops for c in blocks.choices())}))
"""


def test_a_first_run_finds_its_loop_across_forked_workers_and_inner_modes():
    """A new place's first run (at once, its mode on torch's dispatch stack to count ops) around
    a loop over a DataLoader that forks its workers, with debug and strict blocks inside each
    step: strict's results, and the loop found at its second step's end.  In a fresh process
    with the tiers at their defaults (this one has JAX's threads: no fork here)."""
    import json
    import os
    import subprocess
    import sys
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items()
           if k not in ("DEFERFUSE_EAGER_BLOCKS", "DEFERFUSE_EAGER_SEGMENTS")}
    done = subprocess.run([sys.executable, "-c", _FORKED_EPOCHS, tests], capture_output=True, text=True,
                          env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"same": True, "loop": True, "probed": True}


def test_two_reads_on_one_line_of_a_first_run_are_no_loop(probing):
    """At once, every read is seen: ``print(loss.item(), acc.item())`` in a block around one
    step read twice at one line, and the first run took it for a loop coming round (its block
    then went to the segment tier for good).  A read's place there is its instruction."""
    clock = probing(deferred=0.01, at_once=0.01)
    x = torch.randn(6, 3)
    with deferfuse.defer():
        clock.spend()
        a, b = (x * 2).sum(), (x + 1).mean()
        seen = (a.item(), b.item())
    assert seen == ((x * 2).sum().item(), (x + 1).mean().item())
    place = _only_place()
    assert not place.holds_loop and place.probed_ops > 0
