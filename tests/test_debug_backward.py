"""Errors name the user's forward line: in debug mode, a check that fails in a backward op (and an
error torch raises there) names the forward line and module path that recorded its autograd node
beside the backward() line; a forward check names its module; a torch.compile(backend=
"deferfuse") graph's errors name the line from the fx node's stack trace."""

from __future__ import annotations

import inspect
import re
from typing import Callable

import pytest
import torch

import deferfuse
from deferfuse import config
from deferfuse.errors import IndexBoundsError, IndexBoundsIndexError, NonFiniteError

HERE = "test_debug_backward.py"


def _line(fn: Callable, mark: str) -> int:
    source, first = inspect.getsourcelines(fn)
    return first + next(i for i, text in enumerate(source) if text.rstrip().endswith(f"# {mark}"))


class Inner(torch.nn.Module):
    def forward(self, x):
        return torch.sqrt(x) * 0.0  # forward


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(torch.nn.Identity(), Inner())

    def forward(self, x):
        return self.blocks(x)


def test_strict_nan_in_backward_is_silent():
    x = torch.zeros(3, requires_grad=True)
    (torch.sqrt(x) * 0.0).sum().backward()
    assert torch.isnan(x.grad).all()


def test_a_nan_made_in_backward_names_its_forward_line_and_module():
    def program():
        x = torch.zeros(3, requires_grad=True)
        y = Net()(x)
        y.sum().backward()  # backward
    with config.override(check_nans=True), deferfuse.debug(), pytest.raises(NonFiniteError) as info:
        program()
    text = str(info.value)
    assert text.startswith("aten.div.Tensor: produced 3 NaN")
    assert re.search(rf"\n  at .*{HERE}:{_line(program, 'backward')},", text), text
    forward = _line(Inner.forward, "forward")
    assert re.search(rf"in backward, autograd node SqrtBackward0, recorded in forward at .*{HERE}:{forward} "
                     rf"in module blocks\.1 \(Inner\)", text), text


def test_the_issue_example_names_the_sqrt_line():
    def program():
        x = torch.tensor([0.0, 1.0], requires_grad=True)
        y = torch.sqrt(x) * 0.0  # forward
        y.sum().backward()  # backward
    with config.override(check_nans=True), deferfuse.debug(), pytest.raises(NonFiniteError) as info:
        program()
    text = str(info.value)
    assert f"{HERE}:{_line(program, 'backward')}," in text
    assert f"recorded in forward at {__file__}:{_line(program, 'forward')}" in text


class GatherBack(torch.autograd.Function):
    """Its backward gathers with an index out of range."""

    @staticmethod
    def forward(ctx, x):
        return x * 2  # function forward

    @staticmethod
    def backward(ctx, grad):
        return torch.gather(grad, 0, torch.tensor([0, 9]))  # function backward


class ShapeBack(torch.autograd.Function):
    """Its backward multiplies shapes that do not fit (torch raises)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2  # function forward

    @staticmethod
    def backward(ctx, grad):
        return grad @ torch.ones(5, 5)  # function backward


def test_a_bounds_check_in_backward_names_the_forward_line():
    def program():
        x = torch.ones(2, requires_grad=True)
        GatherBack.apply(x).sum().backward()  # backward
    with deferfuse.debug(), pytest.raises(IndexBoundsError) as info:
        program()
    text = str(info.value)
    # (the user's line is the innermost of the user's frames: the Function's own backward)
    assert f"{HERE}:{_line(GatherBack.backward, 'function backward')}," in text
    assert re.search(rf"autograd node GatherBackBackward, recorded in forward at .*{HERE}:"
                     rf"{_line(GatherBack.forward, 'function forward')}", text), text


def test_an_error_torch_raises_in_backward_gets_a_note_naming_the_forward_line():
    def program():
        x = torch.ones(3, requires_grad=True)
        ShapeBack.apply(x).sum().backward()  # backward
    with pytest.raises(RuntimeError) as strict_error:
        program()
    with deferfuse.debug(), pytest.raises(RuntimeError) as info:
        program()
    assert str(info.value) == str(strict_error.value)       # torch's own message and type
    (note,) = info.value.__notes__
    assert f"{HERE}:{_line(ShapeBack.backward, 'function backward')}," in note
    assert f"recorded in forward at {__file__}:{_line(ShapeBack.forward, 'function forward')}" in note


def test_a_forward_check_names_the_running_module():
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.parts = torch.nn.ModuleDict({"emb": torch.nn.Embedding(4, 2)})

        def forward(self, ids):
            return self.parts["emb"](ids)
    with deferfuse.debug(), pytest.raises(IndexBoundsIndexError, match=r"in module parts\.emb \(Embedding\)"):
        Model()(torch.tensor([7]))


def test_module_hooks_are_installed_only_while_debug_mode_runs():
    from torch.nn.modules import module as module_hooks
    before = len(module_hooks._global_forward_pre_hooks)
    with deferfuse.debug():
        assert len(module_hooks._global_forward_pre_hooks) == before + 1
        with deferfuse.strict():
            assert len(module_hooks._global_forward_pre_hooks) == before
    assert len(module_hooks._global_forward_pre_hooks) == before


# -- torch.compile(backend="deferfuse") --------------------------------------------------------------

def test_a_compiled_value_check_names_the_users_line():
    def f(x, index):
        y = x * 2
        return torch.gather(y, 0, index)  # gather
    compiled = torch.compile(f, backend="deferfuse", dynamic=False)
    with pytest.raises(RuntimeError, match=rf"index 7 is out of bounds.*\(at .*{HERE}:{_line(f, 'gather')}\)"):
        compiled(torch.ones(4), torch.tensor([1, 7]))


def test_a_compiled_nan_names_the_users_line_in_forward_and_backward():
    def f(x):
        return torch.log(x * 0.0)  # log

    def g(x):
        y = torch.sqrt(x) * 0.0  # sqrt
        return y.sum()
    compiled_f = torch.compile(f, backend="deferfuse", dynamic=False)
    compiled_g = torch.compile(g, backend="deferfuse", dynamic=False)
    assert torch.isinf(compiled_f(torch.ones(3))).all()       # off by default: no check
    with config.override(check_nans=True):
        with pytest.raises(NonFiniteError, match=rf"aten\.log\.default.*\n  at .*{HERE}:{_line(f, 'log')}"):
            compiled_f(torch.ones(3))
        loss = compiled_g(torch.zeros(3, requires_grad=True))
        # (the backward graph's div: AOTAutograd gives it the stack of the forward sqrt)
        with pytest.raises(NonFiniteError, match=rf"aten\.div\.Tensor.*\n  at .*{HERE}:{_line(g, 'sqrt')}"):
            loss.backward()


def test_labelling_skips_views_made_under_no_grad():
    """Regression (Gemma's embedding init): torch refuses the grad_fn of a view made under
    no_grad and modified in place, once grad mode is back; labelling must not ask for it."""
    with deferfuse.debug():
        w = torch.nn.Parameter(torch.ones(3, 2))
        with torch.no_grad():
            w[0].fill_(0)
        assert torch.tensor(2.0).item() == 2.0
