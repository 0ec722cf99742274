"""Debug mode's check_uninitialized: a read of memory allocated without values (empty*, new_empty*,
resize_ growth, out= resizes) that nothing wrote raises UninitializedReadError naming both lines;
programs that write before they read raise nothing, and compute what strict computes."""

from __future__ import annotations

import re
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

import deferfuse
from deferfuse import config
from deferfuse.debugging import uninit
from deferfuse.errors import DebugCheckError, UninitializedReadError

HERE = "test_debug_uninitialized.py"


def _lines(fn: Callable, *marks: str) -> list[int]:
    """The line numbers of ``fn``'s source lines ending with each ``# mark`` comment."""
    import inspect
    source, first = inspect.getsourcelines(fn)
    return [first + next(i for i, text in enumerate(source) if text.rstrip().endswith(f"# {mark}"))
            for mark in marks]


def _raises_naming(fn: Callable, allocated: str, read: str, op: str) -> UninitializedReadError:
    with deferfuse.debug(), pytest.raises(UninitializedReadError) as info:
        fn()
    alloc_line, read_line = _lines(fn, allocated, read)
    text = str(info.value)
    assert text.startswith(op), text
    assert re.search(rf"allocated by aten\.\w+(\.\w+)? at .*{HERE}:{alloc_line}\b", text), text
    assert re.search(rf"\n  at .*{HERE}:{read_line}\b", text), text
    return info.value


# -- reads of unwritten memory ---------------------------------------------------------------------

def test_strict_reads_uninitialized_memory_silently():
    e = torch.empty(3)
    assert (e + 1).shape == (3,)   # whatever it holds


def test_debug_names_the_allocation_and_the_read():
    def program():
        e = torch.empty(3)  # alloc
        return e + 1  # read
    error = _raises_naming(program, "alloc", "read", "aten.add.Tensor")
    assert isinstance(error, DebugCheckError) and isinstance(error, RuntimeError)
    assert "reads 3 element(s) of `self`" in str(error)


def test_a_partly_written_tensor_names_the_first_unwritten_element():
    def program():
        e = torch.empty(2, 3)  # alloc
        e[0] = 1.0
        e[1, :2] = 2.0
        first_row = e[0].sum()          # a view of written elements only
        torch.testing.assert_close(first_row, torch.tensor(3.0))
        return e.sum()  # read
    error = _raises_naming(program, "alloc", "read", "aten.sum.default")
    assert "reads 1 element(s)" in str(error) and "position (1, 2)" in str(error)


def test_an_in_place_op_reads_what_it_updates():
    def program():
        e = torch.empty(4)  # alloc
        e.mul_(2)  # read
    _raises_naming(program, "alloc", "read", "aten.mul_.Tensor")


@pytest.mark.parametrize("make", [
    lambda: torch.empty_like(torch.ones(3)),
    lambda: torch.ones(3).new_empty(3),
    lambda: torch.empty_strided((3,), (1,)),
    lambda: torch.ones(3).new_empty_strided((3,), (1,)),
], ids=["empty_like", "new_empty", "empty_strided", "new_empty_strided"])
def test_every_allocation_is_tracked(make):
    with deferfuse.debug(), pytest.raises(UninitializedReadError):
        make().exp()


def test_resize_growth_is_unwritten_until_written():
    def program():
        t = torch.ones(2)
        t.resize_(4)  # alloc
        torch.testing.assert_close(t[:2].sum(), torch.tensor(2.0))   # the old elements stay written
        return t.sum()  # read
    _raises_naming(program, "alloc", "read", "aten.sum.default")
    with deferfuse.debug():
        t = torch.ones(2)
        t.resize_(4)
        t[2:] = 3.0
        assert t.sum().item() == 8.0


def test_an_out_resize_is_written_by_its_op():
    with deferfuse.debug():
        out = torch.empty(0)
        torch.add(torch.ones(3), 1, out=out)      # resized to 3, then written
        assert out.sum().item() == 6.0


def test_indexing_reads_only_the_rows_it_reads():
    def program():
        e = torch.empty(4, 2)  # alloc
        e[:2] = 1.0
        torch.testing.assert_close(e.index_select(0, torch.tensor([1, 0])), torch.ones(2, 2))
        torch.testing.assert_close(e[torch.tensor([0, 1])], torch.ones(2, 2))
        torch.testing.assert_close(F.embedding(torch.tensor([[1]]), e), torch.ones(1, 1, 2))
        return e.index_select(0, torch.tensor([0, 3]))  # read
    _raises_naming(program, "alloc", "read", "aten.index_select.default")


def test_partial_writes_mark_exactly_what_they_write():
    with deferfuse.debug():
        e = torch.empty(4)
        e.masked_fill_(torch.tensor([True, False, True, False]), 1.0)
        e.scatter_(0, torch.tensor([1]), 2.0)
        with pytest.raises(UninitializedReadError, match="reads 1 element"):
            e.sum()
        e.index_fill_(0, torch.tensor([3]), 4.0)
        assert e.tolist() == [1.0, 2.0, 1.0, 4.0]


def test_the_setting_turns_the_check_off():
    assert config.get("check_uninitialized") is True
    assert config.settings()["check_uninitialized"].env_var == "DEFERFUSE_CHECK_UNINITIALIZED"
    with config.override(check_uninitialized=False), deferfuse.debug():
        e = torch.empty(3)
        e + 1
        assert uninit.tracked_count() == 0


def test_leaving_debug_mode_forgets_what_it_tracked():
    with deferfuse.debug():
        e = torch.empty(3)
        assert uninit.tracked_count() == 1
    e.fill_(1.0)                         # a write debug mode does not see
    with deferfuse.debug():
        assert (e + 1).tolist() == [2.0, 2.0, 2.0]


# -- programs that write before they read: nothing raised, strict's values -------------------------

def _written_before_read(kind: str) -> torch.Tensor:
    src = torch.arange(6.0).reshape(2, 3)
    if kind == "copy_":
        e = torch.empty(2, 3)
        e.copy_(src)
    elif kind == "fill_":
        e = torch.empty(2, 3).fill_(2.5)
    elif kind == "zero_":
        e = torch.empty_like(src).zero_()
    elif kind == "slices":
        e = torch.empty(2, 3)
        e[0] = src[1]
        e[1, :] = src[0]
    elif kind == "index_put":
        e = torch.empty(2, 3)
        e[torch.tensor([1, 0])] = src
    elif kind == "uniform_":
        e = torch.empty(2, 3).uniform_(generator=torch.Generator().manual_seed(0))
    elif kind == "out=":
        e = torch.empty(2, 3)
        torch.mul(src, 2, out=e)
    elif kind == "cat out=":
        e = torch.empty(0)
        torch.cat([src, src], out=e)
    elif kind == "view dtype":
        e = torch.empty(2, 3)
        e.view(torch.int32).fill_(0)
    else:
        raise AssertionError(kind)
    return e * 1 + e.sum()


@pytest.mark.parametrize("kind", ["copy_", "fill_", "zero_", "slices", "index_put", "uniform_", "out=",
                                  "cat out=", "view dtype"])
def test_writes_before_reads_raise_nothing_and_match_strict(kind):
    expected = _written_before_read(kind)
    with deferfuse.debug():
        got = _written_before_read(kind)
    torch.testing.assert_close(got, expected)


def test_a_module_and_adamw_states_raise_nothing():
    """nn.Linear's parameters come from torch.empty and its init; AdamW's state from zeros_like;
    gradients are accumulated into new_empty_strided + copy_."""
    def train() -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(3):
            model(torch.ones(2, 4)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()]
    expected = train()
    with config.override(check_nans=True), deferfuse.debug():
        got = train()
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_a_zoo_model_trains_and_generates_under_every_check():
    from bench import zoo_models as zoo
    model = zoo.MODELS["llama"]

    def run() -> list[float]:
        m = model.make("tiny")
        optimizer = zoo.optimizer_for(m, model)
        g = torch.Generator().manual_seed(1)
        losses = [zoo.train_step(m, model, optimizer, model.batch("tiny", g)).item() for _ in range(2)]
        m.eval()
        zoo.generate(m, model.prompt("tiny", torch.Generator().manual_seed(2)), tokens=3)
        return losses
    expected = run()
    with config.override(check_nans=True, check_uninitialized=True), deferfuse.debug():
        got = run()
    assert got == expected


def test_a_defer_block_inside_debug_mode_pauses_tracking():
    """A defer block's writes reach memory at its flushes, which debug mode does not see."""
    with deferfuse.debug():
        e = torch.empty(3)
        with deferfuse.defer():
            e.fill_(1.0)
            f = torch.empty(2)          # (an allocation runs at once, through debug mode)
            f.copy_(torch.ones(2))
        assert (e + 1).tolist() == [2.0, 2.0, 2.0]
        assert (f + 1).tolist() == [2.0, 2.0]
        with pytest.raises(UninitializedReadError):     # tracked again after the block
            torch.empty(2) + 1


def test_sparse_and_quantized_allocations_are_not_tracked():
    with deferfuse.debug():
        s = torch.empty((3, 3), layout=torch.sparse_coo)
        assert s.coalesce().to_dense().sum().item() == 0.0
        assert uninit.tracked_count() == 0
