"""Every recorded op carries the user's line that made it (record_source): the line names the
op in errors and explain().  The walk up the stack is cached per running frame of torch's
(debugging/source.py); these check that the cache never hands one call's line to another."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import deferfuse
from deferfuse.capture.storage import state_at
from deferfuse.debugging import source
from deferfuse.ir import graph


def _nodes(value) -> list:
    """The pending aten nodes computing ``value``, in record order (storage-model nodes left out)."""
    return [n for n in graph.ancestors([value]) if not isinstance(n.op, graph.InternalOp)]


def _of(t: torch.Tensor):
    """The pending value of a deferred tensor, or of a plain tensor's storage (read without
    torch.Tensor.untyped_storage, which a block that wrote plain tensors makes flush)."""
    state = t._storage if hasattr(t, "_storage") else state_at(torch._C.TensorBase.untyped_storage(t).data_ptr())
    return state.contents[1]


def _lines(nodes) -> set:
    return {int(str(n.source).rsplit(":", 1)[1]) for n in nodes}


def _here() -> int:
    return sys._getframe(1).f_lineno


def test_one_torch_function_called_from_two_lines_gets_both_lines():
    x = torch.randn(4, 8) + 1
    with deferfuse.config.override(eager_unseen_ops=False), deferfuse.defer():
        a = F.normalize(x * 2); line_a = _here()     # noqa: E702 (the call and its line number)
        b = F.normalize(x * 3); line_b = _here()     # noqa: E702
        nodes_a, nodes_b = _nodes(_of(a)), _nodes(_of(b))
        only_a = [n for n in nodes_a if n not in nodes_b]
        only_b = [n for n in nodes_b if n not in nodes_a]
        # normalize's ops all run in one frame of torch's: each call's ops name its own line
        assert len(only_a) >= 3 and len(only_b) >= 3
        assert _lines(only_a) == {line_a} and _lines(only_b) == {line_b}
    torch.testing.assert_close(a, F.normalize(x * 2))


def test_backward_and_optimizer_ops_name_the_lines_that_ran_them():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(16, 8)
    for _ in range(2):   # (the second time the ops are seen before, so all are recorded)
        # (span="block": the step's ops stay pending past its end, to be looked at)
        with deferfuse.defer(span="block"):
            opt.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            loss.backward(); line_backward = _here()   # noqa: E702
            grad_nodes = _nodes(_of(model.weight.grad))
            opt.step(); line_step = _here()            # noqa: E702
            step_nodes = [n for n in _nodes(_of(model.weight)) if n not in grad_nodes]
            lines_grad, lines_step = _lines(grad_nodes), _lines(step_nodes)
            loss.item()
    assert line_backward in lines_grad
    assert step_nodes and lines_step == {line_step}


def test_a_generator_resumed_from_two_lines_names_its_own_line():
    x = torch.randn(4, 8) + 1

    def user_gen():
        while True:
            y = yield
            yield F.normalize(y); line = _here()   # noqa: E702
            yield line

    gen = user_gen()
    with deferfuse.config.override(eager_unseen_ops=False), deferfuse.defer():
        next(gen); a = gen.send(x * 2); line_a = _here()   # noqa: E702
        line = next(gen)
        next(gen); b = gen.send(x * 3); line_b = _here()   # noqa: E702
        # the generator is the user's code: its own line, whoever resumed it (and the product
        # on the sending line)
        assert _lines(_nodes(_of(a))) == {line, line_a}
        assert _lines(_nodes(_of(b))) == {line, line_b}


def test_leaving_a_block_forgets_the_frames():
    x = torch.randn(4, 8) + 1
    with deferfuse.config.override(eager_unseen_ops=False), deferfuse.defer():
        y = F.normalize(x * 2)
        assert source._last_walk[0] is not None
    assert source._last_walk[0] is None
    torch.testing.assert_close(y, F.normalize(x * 2))


def test_line_numbers_are_remembered_per_code_and_offset():
    """A SourceLine's line number (worked out from the code's line table, then remembered): each
    offset of one code object gets its own line, asked for once or many times."""
    def two_lines():
        first = source.user_line()
        second = source.user_line()
        return first, second
    first, second = two_lines()
    start = two_lines.__code__.co_firstlineno
    for _ in range(2):
        assert (first.line, second.line) == (start + 1, start + 2)
    assert str(first).endswith(f"test_source_lines.py:{start + 1}")
