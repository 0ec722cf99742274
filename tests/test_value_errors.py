"""Errors that depend on values (issue 35): raised once, where strict raises them, on every path.

- A flush that fails names the op that raised; that op leaves the pending graph (its dependent
  results are poisoned, a user's memory drops the writes that depended on it) and the error is
  never raised again by a later flush.
- Every check strict makes on values runs on every path: eager replay, compiled, warm, the
  torch.compile backend; and an op whose result nobody reads is still computed for its check.
- Inside a ``try`` whose handler would catch it, an op that may raise runs at once
  (capture/handlers.py), so the ``except`` runs where strict runs it.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import deferfuse
from deferfuse import config, engine
from deferfuse.capture import handlers
from deferfuse.capture.storage import EXPOSED

# Ops that raise on bad values in strict, each with a bad call on computed inputs.  (x is
# computed by a recorded op, so the bad call is recorded, not run at once on plain tensors.)
BAD_CALLS = {
    "index": lambda x: x[torch.tensor([10])],
    "index_select": lambda x: x.index_select(0, torch.tensor([1, 9])),
    "gather": lambda x: x.gather(0, torch.tensor([1, 8])),
    "scatter": lambda x: torch.zeros(6).scatter(0, torch.tensor([7]), 1.0),
    "take": lambda x: x.take(torch.tensor([20])),
    "index_add": lambda x: x.index_add(0, torch.tensor([9]), torch.ones(1)),
    "index_put": lambda x: x.index_put((torch.tensor([11]),), torch.ones(1)),
    "embedding": lambda x: F.embedding(torch.tensor([1, 7]), x.reshape(6, 1)),
    "one_hot": lambda x: F.one_hot((x > 0).long() + 3, num_classes=3),
    "cross_entropy": lambda x: F.cross_entropy(x.reshape(2, 3), torch.tensor([0, 5])),
    "nll_loss": lambda x: F.nll_loss(x.reshape(2, 3), torch.tensor([-2, 1])),
    "floor_divide": lambda x: (x > 0).long() // torch.zeros(6, dtype=torch.long),
    "remainder": lambda x: (x > 0).long() % torch.zeros(6, dtype=torch.long),
}


def _strict_error(name: str) -> type:
    x = torch.linspace(-1.0, 1.0, 6)
    with pytest.raises(Exception) as raised:
        BAD_CALLS[name](x)
    return type(raised.value)


@pytest.fixture
def fresh_engine():
    engine.wait_for_compiles()
    engine.clear_cache()
    with config.override(cache_dir="", background_compile=False):
        yield
    engine.clear_cache()


PATHS = {
    "replay": dict(always_compile=False, eager_first_runs=1),
    "compiled": dict(always_compile=True),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_a_bad_value_raises_strict_error_once_on_every_path(name, path, fresh_engine):
    error = _strict_error(name)
    x0 = torch.linspace(-1.0, 1.0, 6)
    for attempt in range(3):   # (replay, then compiling and compiled: a check on each)
        with config.override(**PATHS[path]):
            with pytest.raises(error):
                with deferfuse.defer():
                    x = x0 * 1.0
                    y = BAD_CALLS[name](x)
                    y.sum().item() if y.is_floating_point() else y.sum().item()
            # the failed op is gone: the next block computes without raising it again
            with deferfuse.defer():
                z = (x0 * 2.0).sum()
            assert z.item() == pytest.approx(float((x0 * 2.0).sum()), abs=1e-6)


@pytest.mark.parametrize("name", ["index", "floor_divide", "one_hot", "cross_entropy"])
def test_an_unread_result_still_raises_at_the_end_of_its_block(name, fresh_engine):
    """strict raises on the line; deferred, nothing reads the result, and the check runs when
    the block's flush computes it anyway."""
    error = _strict_error(name)
    x0 = torch.linspace(-1.0, 1.0, 6)
    with config.override(always_compile=True):
        with pytest.raises(error):
            with deferfuse.defer():
                BAD_CALLS[name](x0 * 1.0)


def test_the_compile_backend_checks_values_too():
    def step(x, idx):
        return x.index_select(0, idx).sum() + x.gather(0, idx).sum()
    compiled = torch.compile(step, backend="deferfuse")
    x = torch.randn(6)
    assert compiled(x, torch.tensor([1, 2])).item() == pytest.approx(step(x, torch.tensor([1, 2])).item())
    with pytest.raises(IndexError):
        compiled(x, torch.tensor([1, 9]))


def test_a_caught_error_is_never_raised_again():
    """issue 35's program: the error caught at the read, then a loop that must not see it."""
    x = torch.randn(5)
    caught = 0
    with config.override(always_compile=True), deferfuse.defer():
        y = x[torch.tensor([10]) + 0]   # (recorded: no handler here; the read below raises)
        try:
            y.tolist()
        except IndexError:
            caught += 1
        for step in range(4):
            assert (x * step).sum().item() == pytest.approx(float((x * step).sum()), abs=1e-5)
        with pytest.raises(IndexError):   # (the failed value itself raises when read again)
            y.tolist()
        y.copy_(torch.ones(1))            # (written whole, it is a value again)
        assert y.tolist() == [1.0]
    assert caught == 1


def _training(model, opt, batches, mode: str) -> list:
    """A loop whose steps run in defer blocks inside try: a bad batch's error surfaces at the
    block's end (the ops are recorded: no try inside the block), inside the try."""
    losses = []
    for x, labels in batches:
        try:
            with deferfuse.mode(mode), deferfuse.defer(span="block") if mode == "defer" else deferfuse.strict():
                loss = F.cross_entropy(model(x), labels)
                opt.zero_grad()
                loss.backward()
                opt.step()
            losses.append(round(loss.item(), 5))
        except IndexError:
            losses.append("skipped")
    return losses + [p.detach().clone() for p in model.parameters()]


def test_a_failed_step_leaves_the_parameters_as_strict_does(fresh_engine):
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(6)]
    batches[2][1][3] = 9
    runs = []
    for mode in ("strict", "defer"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with config.override(always_compile=True):
            runs.append(_training(model, opt, batches, mode))
    strict, defer = runs
    assert defer[:6] == strict[:6] and defer[2] == "skipped"
    for a, b in zip(strict[6:], defer[6:]):
        torch.testing.assert_close(b, a)


# -- inside a try, an op that may raise runs at once --------------------------------------------
def test_inside_a_try_the_except_runs_where_strict_runs_it(fresh_engine):
    table = nn.Embedding(10, 4)
    seen = []
    deferfuse.reset_stats()
    with config.override(always_compile=True), deferfuse.defer():
        for ids in (torch.tensor([1, 2]), torch.tensor([1, 12]), torch.tensor([0, 9])):
            try:
                emb = table(ids + 0)
            except IndexError:
                emb = None
            seen.append(emb is None)
    assert seen == [False, True, False]
    assert deferfuse.stats()["raising_ops_run"] == 3


def test_handlers_that_would_not_catch_leave_the_op_deferred(fresh_engine):
    x = torch.randn(6)
    deferfuse.reset_stats()
    with config.override(always_compile=True):
        with deferfuse.defer():
            try:
                y = x.gather(0, torch.tensor([1, 2]) + 0)
            except (KeyboardInterrupt, ValueError):
                y = None
            try:
                z = x[torch.tensor([3]) + 0]
            finally:
                pass
        assert deferfuse.stats()["raising_ops_run"] == 0
        # a handler around the block encloses its flush: it catches the late error as it is
        try:
            with deferfuse.defer():
                w = x[torch.tensor([30]) + 0]
        except IndexError:
            w = None
    assert deferfuse.stats()["raising_ops_run"] == 0
    assert y is not None and z.shape == (1,) and w is None


def _probe(kind: str, errors: tuple, scope) -> bool:
    """Whether handlers.catches says an error of ``errors``, raised inside a handler of
    ``kind``, would be caught (asked while that frame runs)."""
    ask = lambda: handlers.catches(sys._getframe(1), errors, scope)  # noqa: E731

    def bare():
        try:
            return ask()
        except:  # noqa: E722
            pass

    def typed():
        try:
            return ask()
        except (ValueError, torch.linalg.LinAlgError):
            pass

    def base():
        try:
            return ask()
        except Exception:
            pass

    def with_only():
        with open(__file__):
            return ask()

    def finally_only():
        try:
            return ask()
        finally:
            pass

    def in_except_body():
        try:
            raise KeyError
        except KeyError:
            return ask()

    def nested_call():
        try:
            return inner()
        except IndexError:
            pass

    def inner():
        return handlers.catches(sys._getframe(), errors, scope)

    return {"bare": bare, "typed": typed, "base": base, "with": with_only, "finally": finally_only,
            "except body": in_except_body, "caller": nested_call}[kind]()


@pytest.mark.parametrize("kind, catches_index, catches_runtime, catches_linalg", [
    ("bare", True, True, True), ("typed", False, False, True), ("base", True, True, True),
    ("with", False, False, False), ("finally", False, False, False),
    ("except body", False, False, False), ("caller", True, False, False)])
def test_which_handlers_catch(kind, catches_index, catches_runtime, catches_linalg):
    # (this test's frame is the scope: pytest's handlers above it enclose everything)
    scope = handlers.scope_of(sys._getframe())
    assert _probe(kind, (IndexError,), scope) is catches_index
    assert _probe(kind, (RuntimeError,), scope) is catches_runtime
    assert _probe(kind, (torch.linalg.LinAlgError,), scope) is catches_linalg
    # with no scope, pytest's own handler around the test catches everything
    assert _probe("with", (IndexError,), None) is True


# -- memory NumPy sees ----------------------------------------------------------------------------
def test_a_numpy_view_sees_torch_writes_and_costs_nothing_once_gone(fresh_engine):
    with config.override(always_compile=True):
        for _ in range(3):
            with deferfuse.defer():
                t = torch.arange(3.0)
                a = t.numpy()
                t[0] = -5.0
                assert a.tolist() == [-5.0, 1.0, 2.0]
        x = torch.zeros(4)
        view = x.numpy()
        with deferfuse.defer():
            x.add_(1.0)
            assert view.tolist() == [1.0] * 4
        ptr = x.untyped_storage().data_ptr()
        assert ptr in EXPOSED
        del view
        assert ptr not in EXPOSED
        from deferfuse.capture.storage import foreign
        assert not foreign(x.untyped_storage())
