"""Step boundaries (capture/steps.py): a deferred program ends where the user's step ends,
whenever the user reads, so a loop compiles the same few programs however often it logs.

Issue 40's loops: a training loop that reads its loss every N steps left N steps pending before
each read, and each read compiled a new program unrolling them.  Here the compiles and the
signatures a loop makes are counted over its steps at several logging periods (they must not
depend on the period, nor grow with the steps), and every result is compared with strict.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import deferfuse
from deferfuse import config, engine
from deferfuse.errors import ModeError
from deferfuse.exec import executables
from deferfuse.plan import records


def _mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(steps: int, period: int, mode: str, read_before_backward: bool = False) -> tuple[list, dict]:
    """Losses read every ``period`` steps (0: at the end) of an MLP trained under ``mode``, and
    defer mode's stats over the loop."""
    model, opt = _mlp()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(3)]
    read = []
    deferfuse.reset_stats()
    with deferfuse.mode(mode):
        for step in range(steps):
            x, y = data[step % 3]
            loss = F.mse_loss(model(x), y)
            if read_before_backward and period and step % period == 0:
                read.append(loss.item())
            opt.zero_grad()
            loss.backward()
            opt.step()
            if not read_before_backward and period and step % period == 0:
                read.append(loss.item())
    read.append(loss.item())
    return read + [p.detach().clone() for p in model.parameters()], deferfuse.stats()


@pytest.fixture
def fresh_engine():
    engine.wait_for_compiles()
    engine.clear_cache()
    with config.override(background_compile=False, cache_dir=""):
        yield
    engine.clear_cache()


@pytest.mark.parametrize("read_before_backward", [False, True], ids=["read-after-step", "read-after-forward"])
def test_the_compiles_of_a_loop_do_not_depend_on_how_often_it_logs(fresh_engine, read_before_backward):
    """Distinct compiled programs (executables made) over a run: the same at every logging
    period and however many steps, and every value read equal to strict's."""
    programs = {}
    for period in (1, 10, 50, 0):
        for steps in (120, 240):
            expected, _ = _train(steps, period, "strict", read_before_backward)
            engine.clear_cache()
            actual, stats = _train(steps, period, "defer", read_before_backward)
            for i, (e, a) in enumerate(zip(expected, actual)):
                torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5, msg=f"period {period}, value {i}")
            assert stats["flushes"]["step"] == steps, stats["flushes"]
            programs[period, steps] = executables.size()
    for period in (1, 10, 50, 0):
        assert programs[period, 120] == programs[period, 240], programs
    # the same few programs at every period (a loop that reads inside its step runs the step's
    # forward and the rest of it too, which one reading only at the end never does), never one
    # per window of steps
    logging = {programs[p, s] for p in (1, 10, 50) for s in (120, 240)}
    assert len(logging) == 1 and programs[0, 240] <= min(logging) <= (4 if read_before_backward else 2), programs


def test_no_program_spans_two_steps(fresh_engine):
    """The plan history: every flush of the loop holds one step's ops at most."""
    with config.override(explain_history=64):
        # (the history is the process's: only this loop's flushes count, not an earlier test's)
        before = max((p.number for p in records.history()), default=-1)
        _train(40, 0, "defer")
        plans = [p for p in records.history() if p.number > before]
    sizes = {p.n_nodes for p in plans}
    assert len(plans) >= 40 and max(sizes) < 2 * min(s for s in sizes if s > 20), sizes


def _integrate(steps: int, mode: str) -> torch.Tensor:
    """An ODE integrator: no optimizer, no backward, one read at the end."""
    x = torch.linspace(-2.0, 2.0, 64)
    v = torch.zeros(64)
    deferfuse.reset_stats()
    with deferfuse.mode(mode):
        for _ in range(steps):
            a = -torch.sin(x) - 0.1 * v
            v = v + 0.01 * a
            x = x + 0.01 * v
        total = float(x.sum())
    return torch.tensor(total), x


@pytest.mark.parametrize("steps", [300, 900])
def test_a_loop_with_no_optimizer_is_cut_where_it_comes_round(fresh_engine, steps):
    expected = _integrate(steps, "strict")
    with config.override(program_nodes=100):
        actual = _integrate(steps, "defer")
        stats = deferfuse.stats()
    for e, a in zip(expected, actual):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)
    # the first cut at an arbitrary op, then the loop's own body (here one iteration: 12 ops,
    # at least program_nodes // 8) at a time, one program
    assert stats["flushes"]["loop"] >= steps - 20
    assert stats["compiles"] == 1, stats


def test_loop_compiles_do_not_grow_with_the_steps(fresh_engine):
    with config.override(program_nodes=100):
        _integrate(200, "defer")
        few = deferfuse.stats()["compiles"]
        engine.clear_cache()
        _integrate(1000, "defer")
        many = deferfuse.stats()["compiles"]
    assert many == few


def test_a_block_spanning_steps_on_purpose_is_one_program(fresh_engine):
    model, opt = _mlp()
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    deferfuse.reset_stats()
    with deferfuse.defer(span="block"):
        for _ in range(3):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert dict(deferfuse.stats()["flushes"]) == {"context_exit": 1}
    with deferfuse.defer():
        for _ in range(3):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert deferfuse.stats()["flushes"]["step"] == 3


def test_a_span_block_inside_the_default_mode_and_a_bad_span(fresh_engine):
    model, opt = _mlp()
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    deferfuse.set_mode("defer")
    try:
        deferfuse.reset_stats()
        with deferfuse.defer(span="block"):
            for _ in range(2):
                F.mse_loss(model(x), y).backward()
                opt.step()
        assert "step" not in deferfuse.stats()["flushes"]
        F.mse_loss(model(x), y).backward()
        opt.step()
        assert deferfuse.stats()["flushes"]["step"] == 1
    finally:
        deferfuse.set_mode("strict")
    with pytest.raises(ModeError, match="span='steps'.*'step'.*'block'"):
        with deferfuse.defer(span="steps"):
            pass


def test_step_boundaries_off_leaves_the_program_to_the_reads(fresh_engine):
    with config.override(step_boundaries=False):
        _, stats = _train(20, 0, "defer")
    assert "step" not in stats["flushes"]
