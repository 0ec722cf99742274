"""Pointwise ops on one-element CPU tensors with computed contents run at once
(host_scalars_at_once): an optimizer's ``step += 1`` then ``step.item()`` costs a kernel call,
not a recorded node and a flush.  Every test compares with strict."""

from __future__ import annotations

import pytest
import torch

import deferfuse
from deferfuse.stats import STATS

from oracle import assert_same, run_both


def both(fn, *inputs):
    """run_both with the host-scalar path on (always_compile turns it off)."""
    return run_both(fn, *inputs, always_compile=False)


def test_step_counter_then_item_needs_no_flush():
    step = torch.tensor(0.0)
    x = torch.randn(8)
    deferfuse.reset_stats()
    with deferfuse.defer():
        y = x * 2
        step += 1
        assert step.item() == 1.0
        assert type(step) is torch.Tensor
        assert STATS.flushes == {}, "the counter's .item() flushed the pending graph"
        assert STATS.host_scalar_ops_run == 1
        assert STATS.executions == 0
    assert "1 on one-element CPU tensors (host_scalars_at_once)" in deferfuse.explain()
    assert_same(x * 2, y)


def test_pending_reader_keeps_the_old_value():
    def fn(s, x):
        before = x * s        # pending: reads s
        s += 1                # at once
        after = x * s
        s.mul_(3)             # at once again
        return before, after, s.clone(), x + s
    deferfuse.reset_stats()
    expected, actual, strict_in, defer_in = both(fn, torch.tensor(2.0), torch.arange(4.0))
    assert STATS.host_scalar_ops_run == 3   # +=, mul_, clone
    assert_same(expected, actual)
    assert_same(strict_in, defer_in)


def test_scalar_with_pending_contents_is_recorded():
    def fn(s, x):
        s.copy_(x.sum())      # s now has pending contents
        s += 1                # must wait for them: recorded, not at once
        return s.item(), s * x
    deferfuse.reset_stats()
    expected, actual, strict_in, defer_in = both(fn, torch.tensor(0.0), torch.arange(4.0))
    assert_same(expected, actual)
    assert_same(strict_in, defer_in)


@pytest.mark.parametrize("case", ["int_add", "bool_logic", "float_to_int_inplace_error",
                                  "shape_1", "where", "div_int", "nan_inf"])
def test_results_match_strict(case):
    def fn(a, b):
        if case == "int_add":
            return a + 3, a * b, a.add_(2)
        if case == "bool_logic":
            return (a > 1) & (b < 5), ~(a == b)
        if case == "float_to_int_inplace_error":
            a += 0.5          # Long += float: torch's own error, under both
            return a
        if case == "shape_1":
            return a.reshape(1) + b, (a.reshape(1) * b).add_(1)
        if case == "where":
            return torch.where(a > b, a, b), torch.maximum(a, b)
        if case == "div_int":
            return a / b, a // b, torch.remainder(a, b)
        return a / 0, (b - b) / (b - b), torch.exp(a * 1000)
    a, b = (torch.tensor(7), torch.tensor(2)) if case not in ("nan_inf",) else (torch.tensor(3.0), torch.tensor(1.0))
    try:
        expected, actual, strict_in, defer_in = both(fn, a, b)
    except RuntimeError:
        assert case == "float_to_int_inplace_error"
        return
    assert_same(expected, actual)
    assert_same(strict_in, defer_in)


def test_big_tensors_and_non_pointwise_ops_are_recorded():
    s = torch.tensor(2.0)
    x = torch.randn(16)
    deferfuse.reset_stats()
    with deferfuse.config.override(always_compile=False), deferfuse.defer():
        y = x * s                       # a 16-element tensor: recorded
        z = s.expand(4) + 1             # a 4-element view: recorded
        r = torch.bernoulli(torch.full((), 0.5))  # random: torch's generator, as strict
        assert STATS.host_scalar_ops_run == 0
        assert STATS.ops_recorded >= 2
    assert_same(x * 2, y)
    assert_same(torch.full((4,), 3.0), z)
    assert r.item() in (0.0, 1.0)


def test_view_of_a_big_tensor_with_a_pending_reader():
    def fn(big):
        doubled = big * 2             # pending: reads big
        first = big[0]                # a view of big's storage
        first.add_(100)               # writes into big: the pending read keeps the old values
        return doubled, big.clone()
    expected, actual, strict_in, defer_in = both(fn, torch.arange(6.0))
    assert_same(expected, actual)
    assert_same(strict_in, defer_in)


@pytest.mark.parametrize("value", [torch.tensor(3), torch.tensor([True]), torch.tensor(-0.0),
                                   torch.tensor(float("nan"), dtype=torch.float64),
                                   torch.tensor([1 + 2j]).conj(), torch.tensor([[7.5]])])
@pytest.mark.parametrize("host_scalars", [True, False])
def test_item_of_a_computed_scalar_reads_it_at_once(value, host_scalars):
    x = torch.randn(4)
    deferfuse.reset_stats()
    with deferfuse.config.override(host_scalars_at_once=host_scalars), deferfuse.defer():
        y = x * 2
        got = value.item()
        if host_scalars or not value.is_conj():
            # (a conjugate view is resolved by an op first: recorded, with the setting off)
            assert STATS.flushes == {}
    expected = value.item()
    assert type(got) is type(expected)
    assert got == expected or (got != got and expected != expected)
    assert_same(x * 2, y)


def test_item_of_a_scalar_in_pending_memory_flushes():
    x = torch.zeros(3)
    with deferfuse.config.override(always_compile=True), deferfuse.defer():
        x.add_(torch.arange(3.0) + 1)
        assert x[1].item() == 2.0
        assert STATS.flushes


def test_setting_off_records_the_op():
    step = torch.tensor(0.0)
    deferfuse.reset_stats()
    with deferfuse.config.override(host_scalars_at_once=False), deferfuse.defer():
        step += 1
        assert STATS.host_scalar_ops_run == 0
        assert step.item() == 1.0
        assert STATS.flushes, "recorded, so .item() flushed"
    with deferfuse.config.override(always_compile=True), deferfuse.defer():
        step += 1
        assert STATS.host_scalar_ops_run == 0
    assert step.item() == 2.0


def test_adamw_step_is_one_flush_and_matches_strict():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    twin = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    twin.load_state_dict(model.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in (model, twin)]
    x, y = torch.randn(7, 6), torch.randn(7, 1)

    def step(m, opt):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    for i in range(4):
        expected = step(model, opts[0])
        deferfuse.reset_stats()
        with deferfuse.config.override(always_compile=False), deferfuse.defer():
            actual = step(twin, opts[1])
        assert actual == pytest.approx(expected, rel=1e-5)
        # the 4 parameters' step counters ran at once, and from the second step the
        # one-element exp_avg_sq.mul_(beta2) of the last layer's bias (the optimizer state is
        # a plain tensor from then on: capture/modules.py); only loss.item() flushed
        assert STATS.host_scalar_ops_run == (4 if i == 0 else 5)
        assert sum(STATS.flushes.values()) == 1, STATS.flushes
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for s0, s1 in zip(opts[0].state.values(), opts[1].state.values()):
        assert s1["step"].item() == s0["step"].item() == 4.0
