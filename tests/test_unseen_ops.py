"""Ops that run at once inside a defer block: first sightings (eager_unseen_ops) and ops whose
flushes were lone (eager_lone_ops), both on by default.

An op whose metadata this process has never inferred, called from a place in the user's code
that has not made that call before, runs on torch's kernel as strict would when its inputs hold
their values already, and returns a plain tensor; a call that comes back to its place (a loop,
a function called again) is deferred.  An op whose last flush at its place was lone (one op,
run on torch's kernel anyway) runs at once there too, until its result feeds a recorded op.
tests/conftest.py turns both settings off for the rest of the suite, so these tests turn them on.  Shapes here are used by no other test: a shape another
test has run makes its metadata cached, and a cached op is deferred wherever it is called from.
"""

import pytest
import torch

import deferfuse
from deferfuse import config
from deferfuse.capture.tensor import DeferredTensor


@pytest.fixture
def unseen_on():
    with config.override(eager_unseen_ops=True, always_compile=False, eager_first_runs=1):
        yield


def test_first_sighting_runs_at_once_and_returns_plain_tensors(unseen_on):
    x = torch.randn(37, 43)
    deferfuse.reset_stats()
    with deferfuse.defer():
        y = (x * 2.5).exp()
        assert type(y) is torch.Tensor
        z = y.sum(dim=1)
    assert type(z) is torch.Tensor
    torch.testing.assert_close(z, (x * 2.5).exp().sum(dim=1), rtol=0, atol=0)
    stats = deferfuse.stats()
    assert stats["unseen_ops_run"] == 3 and stats["eager_replays"] == 0
    assert stats["executions"] == 0 and not stats["fallbacks"]


def test_the_same_call_twice_on_one_line_runs_at_once_both_times(unseen_on):
    x = torch.randn(41, 3)
    deferfuse.reset_stats()
    with deferfuse.defer():
        y = x * 0.5 * (x * 0.25)   # two calls of mul(Tensor, float) on 41x3, at two places
    assert type(y) is torch.Tensor and deferfuse.stats()["unseen_ops_run"] == 3
    torch.testing.assert_close(y, x * 0.5 * (x * 0.25), rtol=0, atol=0)


def test_a_loop_defers_from_its_second_iteration(unseen_on):
    x = torch.randn(29, 31)
    types = []
    for _ in range(3):
        with deferfuse.defer():
            y = torch.tanh(x * 1.5 + 1.0)
            types.append(type(y))
        torch.testing.assert_close(y, torch.tanh(x * 1.5 + 1.0))
    assert types == [torch.Tensor, DeferredTensor, DeferredTensor]


def test_a_loop_inside_one_block_defers_from_its_second_iteration(unseen_on):
    x = torch.randn(23, 19)
    expected = x.clone()
    for _ in range(4):
        expected = expected * 0.5 + 1.0
    deferfuse.reset_stats()
    with deferfuse.defer():
        y = x
        kinds = []
        for _ in range(4):
            y = y * 0.5 + 1.0
            kinds.append(type(y))
    assert kinds == [torch.Tensor] + [DeferredTensor] * 3
    assert deferfuse.stats()["unseen_ops_run"] == 2
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


def test_an_op_on_a_pending_value_is_recorded(unseen_on):
    x = torch.randn(17, 13)
    x_strict = x.clone()
    with deferfuse.defer():
        x.add_(1.0)                # written in place: x's new values are pending
        z = x * 3.0               # first sighting, but its input is not computed
        assert type(z) is DeferredTensor
    x_strict.add_(1.0)
    torch.testing.assert_close(x, x_strict, rtol=0, atol=0)
    torch.testing.assert_close(z, x_strict * 3.0, rtol=0, atol=0)


def test_an_error_at_first_sighting_is_torchs_and_the_block_goes_on(unseen_on):
    a, b = torch.randn(11), torch.randn(12)
    with pytest.raises(RuntimeError) as strict:
        a + b
    with deferfuse.defer():
        with pytest.raises(RuntimeError) as deferred:
            a + b
        c = a * 2.0
    assert str(deferred.value) == str(strict.value)
    torch.testing.assert_close(c, a * 2.0, rtol=0, atol=0)


@pytest.mark.parametrize("settings,columns", [(dict(eager_unseen_ops=False), 53),
                                              (dict(always_compile=True), 59),
                                              (dict(eager_first_runs=0), 61)], ids=str)
def test_settings_that_turn_it_off(settings, columns):
    x = torch.randn(7, columns)   # (a shape of its own: a cached op is deferred anyway)
    with config.override(**{"eager_unseen_ops": True, "always_compile": False,
                            "eager_first_runs": 1, **settings}):
        with deferfuse.defer():
            y = x - 0.75
            assert type(y) is DeferredTensor
    torch.testing.assert_close(y, x - 0.75, rtol=0, atol=0)


# -- ops whose flushes were lone -------------------------------------------------------------

@pytest.fixture
def lone_on(monkeypatch):
    """The lone settings on, and no place learned yet: places are the process's (the helper
    below is one place for every test that calls it)."""
    from deferfuse.capture import meta
    monkeypatch.setattr(meta, "LONE_PLACES", set())
    with config.override(eager_lone_ops=True, lone_op_on_torch=True, eager_unseen_ops=False,
                         always_compile=False):
        yield


def _layer_norm_block(x, w, b, consume: bool = False, first=None):
    with deferfuse.defer():
        if first is not None:
            first()
        y = torch.nn.functional.layer_norm(x, x.shape[-1:], w, b)
        kind = type(y)
        z = y * 2.0 if consume else None
    return y, z, kind


def test_a_lone_flush_runs_at_once_from_then_on(lone_on):
    x, w, b = torch.randn(67, 5), torch.randn(5), torch.randn(5)
    deferfuse.reset_stats()
    kinds = []
    for _ in range(4):
        y, _, kind = _layer_norm_block(x, w, b)
        kinds.append(kind)
        torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (5,), w, b), rtol=0, atol=0)
    assert kinds == [DeferredTensor, torch.Tensor, torch.Tensor, torch.Tensor]
    assert deferfuse.stats()["lone_ops_run"] == 3


def test_a_lone_place_runs_at_once_for_other_shapes_too(lone_on):
    """A place is learned once, whatever shapes it sees later: where an op runs never changes
    its result, and asking costs one lookup before any argument is looked at."""
    first = torch.randn(113, 5), torch.randn(5), torch.randn(5)
    other = torch.randn(3, 9), torch.randn(9), torch.randn(9)
    kinds = [_layer_norm_block(*first)[2]]
    for x, w, b in (other, first):
        y, _, kind = _layer_norm_block(x, w, b)
        kinds.append(kind)
        torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, x.shape[-1:], w, b), rtol=0, atol=0)
    assert kinds == [DeferredTensor, torch.Tensor, torch.Tensor]


def test_learned_lone_places_are_bounded(lone_on, monkeypatch):
    from deferfuse.capture import meta
    monkeypatch.setattr(meta, "LONE_PLACES_LIMIT", 2)
    x, w, b = torch.randn(115, 3), torch.randn(3), torch.randn(3)
    for _ in range(2):
        with deferfuse.defer():
            y1 = torch.nn.functional.layer_norm(x, (3,), w, b)
        with deferfuse.defer():
            y2 = torch.nn.functional.layer_norm(x, (3,), w, b)
        with deferfuse.defer():
            y3 = torch.nn.functional.layer_norm(x, (3,), w, b)
        assert len(meta.LONE_PLACES) <= 2
    for y in (y1, y2, y3):
        torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (3,), w, b), rtol=0, atol=0)


def test_a_result_feeding_a_recorded_op_makes_its_place_record_again(lone_on):
    x, w, b = torch.randn(71, 6), torch.randn(6), torch.randn(6)
    expected = torch.nn.functional.layer_norm(x, (6,), w, b)
    kinds = []
    for consume in (False, False, True, True):
        y, z, kind = _layer_norm_block(x, w, b, consume)
        kinds.append(kind)
        torch.testing.assert_close(y, expected, rtol=0, atol=0)
        if consume:
            torch.testing.assert_close(z, expected * 2.0, rtol=0, atol=0)
    # lone, at once, at once but read by the recorded mul (the place records again), recorded
    assert kinds == [DeferredTensor, torch.Tensor, torch.Tensor, DeferredTensor]


def test_a_lone_place_with_a_pending_input_is_recorded(lone_on):
    x, w, b = torch.randn(73, 7), torch.randn(7), torch.randn(7)
    assert [_layer_norm_block(x, w, b)[2] for _ in range(2)] == [DeferredTensor, torch.Tensor]
    x2 = x.clone()
    # x2's values are pending when the learned place runs layer_norm on it
    y, _, kind = _layer_norm_block(x2, w, b, first=lambda: x2.mul_(3.0))
    assert kind is DeferredTensor
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x * 3.0, (7,), w, b))


def test_a_lone_place_runs_at_once_on_computed_deferred_inputs_and_parameters(lone_on):
    """Plain tensors go to the kernel as they are; a computed deferred tensor (a result of an
    earlier block) and a Parameter go through realize, which hands the kernel their data."""
    x, b = torch.randn(61, 8), torch.randn(8)
    w = torch.nn.Parameter(torch.randn(8), requires_grad=False)
    with deferfuse.defer():
        x_deferred = x * 1.5
    deferfuse.sync(x_deferred)
    assert type(x_deferred) is DeferredTensor and x_deferred._storage.contents is None
    expected = torch.nn.functional.layer_norm(x * 1.5, (8,), w, b)
    deferfuse.reset_stats()
    kinds = []
    for _ in range(3):
        y, _, kind = _layer_norm_block(x_deferred, w, b)
        kinds.append(kind)
        torch.testing.assert_close(y, expected, rtol=0, atol=0)
    assert kinds == [DeferredTensor, torch.Tensor, torch.Tensor]
    assert deferfuse.stats()["lone_ops_run"] == 2


@pytest.mark.parametrize("settings,rows", [(dict(eager_lone_ops=False), 79),
                                           (dict(lone_op_on_torch=False), 83),
                                           (dict(always_compile=True), 89)], ids=str)
def test_settings_that_keep_lone_ops_recorded(settings, rows):
    x, w, b = torch.randn(rows, 3), torch.randn(3), torch.randn(3)
    with config.override(**{"eager_lone_ops": True, "lone_op_on_torch": True,
                            "eager_unseen_ops": False, "always_compile": False, **settings}):
        kinds = [_layer_norm_block(x, w, b)[2] for _ in range(3)]
    assert kinds == [DeferredTensor] * 3


def test_first_sightings_are_remembered_within_a_bound(unseen_on, monkeypatch):
    """A program whose shapes never repeat sights a new call every time: the memory of
    sightings is bounded (forgetting only costs a place one more eager run)."""
    from deferfuse.capture import meta
    monkeypatch.setattr(meta, "SIGHTED_LIMIT", 3)
    with meta.separate_sightings():
        for rows in range(101, 108):
            x = torch.randn(rows, 2)
            with deferfuse.defer():
                y = x - 1.25
            assert type(y) is torch.Tensor and meta.sighted_count() <= 3
            torch.testing.assert_close(y, x - 1.25, rtol=0, atol=0)


def test_explain_says_how_many_ops_ran_at_once(unseen_on):
    x = torch.randn(109, 2)
    deferfuse.reset_stats()
    with deferfuse.defer():
        y = x * 3.5
    text = deferfuse.explain()
    assert "1 op(s) ran at once" in text and "1 seen for the first time" in text, text
    torch.testing.assert_close(y, x * 3.5, rtol=0, atol=0)


def test_a_long_block_keeps_a_bounded_watch_on_results_run_at_once(lone_on, monkeypatch):
    """A block that runs a lone op at once on every iteration of a long loop watches a bounded
    number of its results for consumers."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    from deferfuse.capture import at_once
    monkeypatch.setattr(at_once, "AT_ONCE_LIMIT", 8)
    x, w, b = torch.randn(97, 4), torch.randn(4), torch.randn(4)

    def norm():
        return torch.nn.functional.layer_norm(x, (4,), w, b)

    with deferfuse.defer():
        first = norm()                           # recorded; flushed alone at the exit
    kept, watched = [], []
    with deferfuse.defer():
        watcher = _get_current_dispatch_mode().recorder
        for _ in range(40):
            kept.append(norm())                  # at once: learned lone
            watched.append(len(watcher.at_once))
    assert type(first) is DeferredTensor and all(type(y) is torch.Tensor for y in kept)
    assert max(watched) <= 8 * 3, watched        # (three results per layer norm call)
    torch.testing.assert_close(kept[-1], torch.nn.functional.layer_norm(x, (4,), w, b), rtol=0, atol=0)


def test_a_view_of_a_result_run_at_once_makes_its_place_record_again(lone_on):
    x, w, b = torch.randn(103, 8), torch.randn(8), torch.randn(8)
    expected = torch.nn.functional.layer_norm(x, (8,), w, b)
    kinds = []
    for reshape in (False, False, True, False):
        with deferfuse.defer():
            y = torch.nn.functional.layer_norm(x, (8,), w, b)
            kinds.append(type(y))
            z = y.view(-1).mul(2.0) if reshape else None
        torch.testing.assert_close(y, expected, rtol=0, atol=0)
        if reshape:
            torch.testing.assert_close(z, expected.view(-1) * 2.0, rtol=0, atol=0)
    assert kinds == [DeferredTensor, torch.Tensor, torch.Tensor, DeferredTensor]


def test_code_compiled_again_from_the_same_source_is_the_same_place(unseen_on):
    """A notebook cell run again is new code from the same text: its ops are not first
    sightings any more (a loop-free cell would otherwise run at once forever)."""
    x = torch.randn(113, 2)
    source = "with deferfuse.defer():\n    y = x / 1.75\n"
    kinds = []
    for _ in range(3):
        namespace = {"deferfuse": deferfuse, "x": x}
        exec(compile(source, "<cell-113>", "exec"), namespace)
        kinds.append(type(namespace["y"]))
        torch.testing.assert_close(namespace["y"], x / 1.75, rtol=0, atol=0)
    assert kinds == [torch.Tensor, DeferredTensor, DeferredTensor]
