"""order_compute: each matrix product and convolution of one XLA computation is tied to the
previous one's result through its left-hand operand, in record order (exec/program.py).
Results stay strict's; the program shows the ties."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import deferfuse
from deferfuse import config
from deferfuse.plan import cost


@pytest.fixture(autouse=True)
def _xla_dots():
    """These ties are for XLA's own dots: products on the host kernels take none
    (tests/test_host_kernels.py), so they are off here."""
    with config.override(host_kernels=False):
        yield


def _barriers() -> int:
    return deferfuse.stablehlo(0).count("stablehlo.optimization_barrier")


def _run(fn, *args, **settings):
    with config.override(always_compile=True, **settings):
        with deferfuse.defer():
            out = fn(*args)
            deferfuse.sync(out)
    return out


def _two_layers(x, w1, w2, b):
    # independent products (x @ w1 and x.t() @ x) and a chain (... @ w2)
    return torch.addmm(b, x, w1) + x @ (x.t() @ x) @ w2


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 256, generator=g).to(dtype)
    w1 = torch.randn(256, 256, generator=g).to(dtype)
    w2 = torch.randn(256, 256, generator=g).to(dtype)
    b = torch.randn(256, generator=g).to(dtype)
    return x, w1, w2, b


def test_products_after_the_first_are_each_ordered_once():
    args = _inputs()
    out = _run(_two_layers, *args)
    # four products: addmm, x.t() @ x, x @ (...), (...) @ w2
    assert _barriers() == 3
    torch.testing.assert_close(out, _two_layers(*args), rtol=1e-4, atol=1e-2)


def test_setting_off_leaves_the_program_without_ties():
    args = _inputs()
    out = _run(_two_layers, *args, order_compute=False)
    assert _barriers() == 0
    torch.testing.assert_close(out, _two_layers(*args), rtol=1e-4, atol=1e-2)


def test_the_setting_is_part_of_the_executable_key():
    # switching back and forth never runs the other setting's executable
    args = _inputs()
    for setting, ties in ((True, 3), (False, 0), (True, 3), (False, 0)):
        out = _run(_two_layers, *args, order_compute=setting)
        assert _barriers() == ties
        torch.testing.assert_close(out, _two_layers(*args), rtol=1e-4, atol=1e-2)


def test_small_products_are_not_ordered():
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    assert 2 * 8 * 8 * 8 < cost.ORDER_MIN_FLOPS
    out = _run(lambda a, b: (a @ b) @ b + a @ b.t(), x, w)
    assert _barriers() == 0
    torch.testing.assert_close(out, (x @ w) @ w + x @ w.t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_ordered_products_match_strict_on_awkward_operands(dtype):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(192, 320, generator=g)
    if dtype is torch.int64:
        base = (base * 4).round()
    base = base.to(dtype)
    lhs_t = base.t()[:, ::2]            # transposed and strided: (320, 96)
    rhs = base[:96]                     # a row slice: (96, 320)
    batch = base[:180].reshape(3, 60, 320)

    def fn(a, b, c):
        first = a @ b                                        # (320, 320), transposed lhs
        second = torch.bmm(c, first.expand(3, 320, 320))     # broadcast rhs
        third = torch.baddbmm(second, c, first.expand(3, 320, 320), beta=2, alpha=-1)
        return first.sum() + third.sum(dim=(1, 2)).sum()

    out = _run(fn, lhs_t, rhs, batch)
    assert _barriers() == 2
    expected = fn(lhs_t, rhs, batch)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-2 if dtype is torch.float32 else 0)


def test_convolutions_are_ordered_through_their_input():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 8, 64, 64, generator=g)
    w1, w2 = torch.randn(16, 8, 3, 3, generator=g), torch.randn(8, 16, 3, 3, generator=g)

    def fn(x):
        return F.conv2d(torch.relu(F.conv2d(x, w1, padding=1)), w2, padding=1) + F.conv2d(x, w1[:8], padding=1)

    out = _run(fn, x)
    assert _barriers() == 2
    torch.testing.assert_close(out, fn(x), rtol=1e-4, atol=1e-4)


def test_a_training_step_matches_strict_with_ordering():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))
    twin = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))
    twin.load_state_dict(model.state_dict())
    x = torch.randn(64, 128)

    def step(m):
        m.zero_grad(set_to_none=True)
        loss = m(x).square().mean()
        loss.backward()
        return loss

    with config.override(always_compile=True):
        with deferfuse.defer():
            loss = step(model)
            loss.item()
    assert _barriers() >= 4   # forward 2, backward 3 (the first layer's input gradient is unused)
    expected = step(twin)
    torch.testing.assert_close(loss, expected)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


def test_only_a_cpu_backend_gets_ties(monkeypatch):
    # (on a GPU or TPU XLA's runtime and layouts differ: the program is left as it was)
    from deferfuse.exec import program as exec_program
    monkeypatch.setattr(exec_program.jax, "default_backend", lambda: "gpu")
    args = _inputs()
    with config.override(always_compile=True, cache_dir=""):
        program = None
        real_build = exec_program.build

        def spying_build(nodes, outputs):
            nonlocal program
            sig, make_program, leaves, scalars = real_build(nodes, outputs)
            program = make_program
            return sig, make_program, leaves, scalars

        monkeypatch.setattr(exec_program, "build", spying_build)
        _run(_two_layers, *args)
    assert program is not None
    assert all(step.ordered_by is None for step in program().steps)
