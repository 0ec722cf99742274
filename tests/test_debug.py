"""Debug mode: ops run one by one with checks; strict PyTorch is the oracle for everything else.

For each check: what strict does (raise or stay silent), the richer error debug raises (its
type still matches strict's, its message names the op, the offending value, the bound, the dim
and this file's line), and what defer does with the same code: where defer does not yet raise
strict's exception type, the case is marked ``xfail(strict=True)`` with the reason, so it turns
into a failure (remove the mark) the day defer does.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from hypothesis import event, given, settings
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import deferfuse
from deferfuse import EagerMode, config
from deferfuse.debugging import DebugMode
from deferfuse.errors import (DebugCheckError, IndexBoundsError, IndexBoundsIndexError, NonFiniteError,
                              OverlapError)
from program_gen import programs
from test_programs import Outcome, _run_steps, compare

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _source() -> torch.Tensor:
    return torch.arange(20.0).reshape(4, 5)


def _modes() -> list[type]:
    return [type(m) for m in _get_current_dispatch_mode_stack()]


def _line(fn: Callable) -> str:
    return f"test_debug.py:{fn.__code__.co_firstlineno}"


# -- index bounds ----------------------------------------------------------------------------------

def _setitem(x: torch.Tensor, index, value) -> torch.Tensor:
    x[index] = value
    return x


@dataclasses.dataclass(frozen=True)
class BadIndex:
    name: str
    run: Callable[[torch.Tensor], torch.Tensor]   # one line, so the error's line is its line
    strict_raises: type                            # what torch raises on CPU
    value: int                                     # the first offending index
    size: int                                      # the bound
    dim: Optional[int]                             # None: take's flattened input
    defer_pending: Optional[str] = None            # why defer does not raise like strict yet

    def __repr__(self) -> str:
        return self.name


BAD_INDICES = [
    BadIndex("embedding", lambda x: F.embedding(torch.tensor([1, 7]), x), IndexError, 7, 4, 0),
    BadIndex("embedding_negative", lambda x: F.embedding(torch.tensor([-1, 2]), x), IndexError, -1, 4, 0),
    BadIndex("embedding_bag", lambda x: F.embedding_bag(torch.tensor([1, 7]), x, torch.tensor([0])),
             RuntimeError, 7, 4, 0),
    BadIndex("index_select", lambda x: torch.index_select(x, 1, torch.tensor([0, 5])), RuntimeError, 5, 5, 1),
    BadIndex("gather", lambda x: torch.gather(x, 1, torch.tensor([[0, 5]] * 4)), RuntimeError, 5, 5, 1),
    BadIndex("gather_negative", lambda x: torch.gather(x, 1, torch.tensor([[0, -1]] * 4)), RuntimeError, -1, 5, 1),
    BadIndex("scatter_", lambda x: x.clone().scatter_(1, torch.tensor([[0, 5]]), 1.0), RuntimeError, 5, 5, 1),
    BadIndex("scatter_add", lambda x: torch.scatter_add(x, 0, torch.tensor([[4]]), torch.ones(1, 1)),
             RuntimeError, 4, 4, 0),
    BadIndex("scatter_reduce", lambda x: torch.scatter_reduce(x, 0, torch.tensor([[5]]), torch.ones(1, 1), "amax"),
             RuntimeError, 5, 4, 0),
    BadIndex("index", lambda x: x[torch.tensor([0, 4])], IndexError, 4, 4, 0),
    BadIndex("index_second_dim", lambda x: x[:, torch.tensor([0, 7])], IndexError, 7, 5, 1),
    BadIndex("index_negative", lambda x: x[torch.tensor([0, -5])], IndexError, -5, 4, 0),
    BadIndex("index_put", lambda x: x.clone().index_put_((torch.tensor([4]),), torch.tensor(1.0)), IndexError, 4, 4, 0),
    BadIndex("setitem", lambda x: _setitem(x.clone(), (slice(None), torch.tensor([6])), 1.0), IndexError, 6, 5, 1),
    BadIndex("take", lambda x: torch.take(x, torch.tensor([3, 20])), IndexError, 20, 20, None),
    BadIndex("take_negative", lambda x: torch.take(x, torch.tensor([-21])), IndexError, -21, 20, None),
    BadIndex("index_add_", lambda x: x.clone().index_add_(0, torch.tensor([4]), torch.ones(1, 5)), RuntimeError, 4, 4, 0),
    BadIndex("index_copy_", lambda x: x.clone().index_copy_(0, torch.tensor([4]), torch.ones(1, 5)), IndexError, 4, 4, 0),
    BadIndex("index_fill_", lambda x: x.clone().index_fill_(0, torch.tensor([-5]), 1.0), IndexError, -5, 4, 0),
]


@pytest.mark.parametrize("case", BAD_INDICES, ids=repr)
def test_strict_rejects_bad_index(case: BadIndex):
    with pytest.raises(case.strict_raises):
        case.run(_source())


@pytest.mark.parametrize("case", BAD_INDICES, ids=repr)
def test_debug_names_bad_index_value_bound_dim_and_line(case: BadIndex):
    with deferfuse.debug():
        with pytest.raises(case.strict_raises) as caught:
            case.run(_source())
    error = caught.value
    assert isinstance(error, IndexBoundsError)
    text = str(error)
    assert f"index {case.value} is out of bounds" in text
    assert f"with size {case.size}" in text
    assert ("the flattened input" if case.dim is None else f"dimension {case.dim}") in text
    # the line that called torch: the case's lambda, or the assignment inside _setitem
    where = f"test_debug.py:{_setitem.__code__.co_firstlineno + 1}" if case.name == "setitem" else _line(case.run)
    assert where in text
    assert "aten." in text.splitlines()[0]


def _defer_case(case: BadIndex):
    marks = [pytest.mark.xfail(strict=True, reason=case.defer_pending)] if case.defer_pending else []
    return pytest.param(case, marks=marks, id=case.name)


@pytest.mark.parametrize("case", [_defer_case(c) for c in BAD_INDICES])
def test_defer_raises_strict_type_for_bad_index(case: BadIndex):
    with config.override(always_compile=True):
        with pytest.raises(case.strict_raises):
            with deferfuse.defer():
                result = case.run(_source())
                (result if result is not None else torch.zeros(())).tolist()  # observe it


def test_debug_error_types_match_strict():
    # one class per kind of check; the index error is an IndexError for ops where torch raises one
    assert issubclass(IndexBoundsIndexError, IndexError) and issubclass(IndexBoundsIndexError, RuntimeError)
    assert issubclass(IndexBoundsError, RuntimeError) and not issubclass(IndexBoundsError, IndexError)
    assert issubclass(NonFiniteError, FloatingPointError) and issubclass(NonFiniteError, deferfuse.DeferfuseError)
    assert issubclass(OverlapError, DebugCheckError)


@pytest.mark.parametrize("run", [
    lambda x: x[torch.tensor([-4, 3])],
    lambda x: x[:, torch.tensor([[-5], [4]])],
    lambda x: torch.take(x, torch.tensor([-20, 19])),
    lambda x: x.clone().index_fill_(1, torch.tensor([-1]), 7.0),
    lambda x: x.clone().index_put_((torch.tensor([-1]), torch.tensor([-5])), torch.tensor(9.0)),
    lambda x: torch.gather(x, 0, torch.tensor([[3, 0, 1, 2, 3]])),
    lambda x: F.embedding(torch.tensor([[0, 3], [3, 3]]), x),
    lambda x: x[torch.tensor([True, False, True, False]), torch.tensor([4, -5])],
    lambda x: torch.index_select(x, 0, torch.tensor([], dtype=torch.long)),
], ids=["index_neg", "index_2d", "take_neg", "index_fill_neg", "index_put_neg", "gather", "embedding",
        "mask_and_index", "empty_index"])
def test_indices_torch_allows_run_and_match_strict(run):
    expected = run(_source())
    with deferfuse.debug():
        actual = run(_source())
    assert torch.equal(actual, expected)


def test_torch_shape_errors_win_over_bounds_errors():
    """When torch would reject the call for its shapes or dtypes, debug raises that error."""
    x = _source()
    with deferfuse.debug():
        with pytest.raises(IndexError, match="shape mismatch") as caught:
            x[torch.tensor([0, 9]), torch.tensor([0, 1, 2])]
        assert not isinstance(caught.value, DebugCheckError)
        with pytest.raises(RuntimeError, match="long tensor") as caught:
            torch.take(x, torch.tensor([99], dtype=torch.int32))
        assert not isinstance(caught.value, DebugCheckError)


def test_torch_errors_in_debug_mode_name_the_op_and_line():
    with deferfuse.debug():
        with pytest.raises(RuntimeError, match="cannot be multiplied") as caught:
            line = sys._getframe().f_lineno + 1
            torch.randn(2, 3) @ torch.randn(4, 5)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "aten.mm" in notes and f"test_debug.py:{line}" in notes


# -- overlapping writes ----------------------------------------------------------------------------

def _shift_dense(a):
    return a[1:].copy_(a[:-1])


def _shift_strided(a):
    # columns 0-1 written from columns 1-2 of a 2x5 view: element (0, 1) is read and written
    return a.view(2, 5)[:, :2].copy_(a.view(2, 5)[:, 1:3])


def _add_out_overlapping(a):
    return torch.add(a[:-1], 1, out=a[1:])


def test_strict_rejects_dense_overlap_but_not_strided_overlap():
    with pytest.raises(RuntimeError, match="single memory location"):
        _shift_dense(torch.arange(10.0))
    with pytest.raises(RuntimeError, match="single memory location"):
        _add_out_overlapping(torch.arange(10.0))
    a = torch.arange(10.0)
    _shift_strided(a)  # torch does not check non-dense layouts: the result depends on the kernel
    assert a[:5].tolist() == [1.0, 2.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("write", [_shift_dense, _shift_strided, _add_out_overlapping], ids=lambda f: f.__name__)
def test_debug_rejects_overlapping_write(write):
    a = torch.arange(10.0)
    with deferfuse.debug():
        with pytest.raises(OverlapError) as caught:
            write(a)
    text = str(caught.value)
    assert text.startswith(("aten.copy_", "aten.add.out")), text
    assert "another view of the same memory" in text and "is also read" in text
    assert f"test_debug.py:{write.__code__.co_firstlineno + (2 if write is _shift_strided else 1)}" in text
    assert a.tolist() == list(map(float, range(10))), "the check runs before the op writes anything"


@pytest.mark.parametrize("write", [
    lambda a: a.add_(a),
    lambda a: a.mul_(a.view(2, 5).view(10)),                    # another tensor, the same view
    lambda a: a[::2].copy_(a[1::2]),                            # interleaved but disjoint
    lambda a: a.view(2, 5)[:, :2].copy_(a.view(2, 5)[:, 2:4]),  # strided, disjoint
    lambda a: a[:5].copy_(a[5:]),
    lambda a: torch.add(a, 1, out=a),
    lambda a: a.copy_(a.flip(0)),                               # flip copies
    lambda a: a.index_put_((torch.tensor([0, 1]),), a[2:4].clone()),
    lambda a: a.fill_(a[1]),                                    # a 0-dim value is read as a number first
    lambda a: a.masked_fill_(a > 2, a[4]),
    lambda a: a.view(1, 10)[None].fill_(a[3]),
], ids=["add_self", "same_view", "interleaved", "strided_disjoint", "halves", "out_is_input", "flip", "index_put",
        "fill_0d_value", "masked_fill_0d_value", "fill_view_0d_value"])
def test_writes_that_do_not_overlap_their_inputs_run_and_match_strict(write):
    expected = torch.arange(10.0)
    write(expected)
    actual = torch.arange(10.0)
    with deferfuse.debug():
        write(actual)
    assert torch.equal(actual, expected)


def test_defer_rejects_dense_overlap_like_strict():
    with pytest.raises(RuntimeError):
        with deferfuse.defer():
            _shift_dense(torch.arange(10.0))


# -- NaN / Inf producers ---------------------------------------------------------------------------

def test_nan_check_is_off_by_default():
    assert config.get("check_nans") is False
    assert config.settings()["check_nans"].env_var == "DEFERFUSE_CHECK_NANS"
    x = torch.tensor([1.0, -1.0, 0.0])
    expected = torch.log(x)
    with deferfuse.debug():
        actual = torch.log(x)
    torch.testing.assert_close(actual, expected, equal_nan=True)


def _produce_nan(x):
    y = x * 2
    z = torch.log(y)  # the first op to produce NaN: log of a negative
    return z + 1      # propagates it, not reported


def test_nan_check_reports_the_first_producing_op_by_name():
    x = torch.tensor([1.0, -1.0, 3.0])
    with config.override(check_nans=True), deferfuse.debug():
        with pytest.raises(FloatingPointError) as caught:
            _produce_nan(x)
    text = str(caught.value)
    assert isinstance(caught.value, NonFiniteError)
    assert text.startswith("aten.log"), text
    assert "1 NaN" in text
    assert "self: float32[3] min=-2 max=6 has_nan=False has_inf=False" in text
    assert f"test_debug.py:{_produce_nan.__code__.co_firstlineno + 2}" in text
    # strict and defer compute the NaN silently
    assert torch.isnan(_produce_nan(x)).any()


@pytest.mark.parametrize("produce,op", [
    (lambda x: x / 0, "aten.div"),
    (lambda x: x.sqrt_(), "aten.sqrt_"),
    (lambda x: torch.exp(x * 100).half(), "aten.exp"),   # overflow: exp(300) is inf in float32
    (lambda x: torch.zeros_like(x).log(), "aten.log"),
], ids=["div_by_zero", "inplace_sqrt", "exp_overflow", "log_zero"])
def test_nan_check_names_producers(produce, op):
    x = torch.tensor([1.0, -1.0, 3.0])
    with config.override(check_nans=True), deferfuse.debug():
        with pytest.raises(NonFiniteError, match=op):
            produce(x)


def test_nan_check_ignores_values_that_were_already_there():
    x = torch.tensor([1.0, float("nan"), float("inf")])
    mask = torch.tensor([True, False, False])
    with config.override(check_nans=True), deferfuse.debug():
        y = x + 1                                            # propagated from the input
        scores = torch.zeros(3).masked_fill(mask, float("-inf"))  # a non-finite Python number
        probabilities = torch.softmax(scores, 0)             # finite again
        empty = torch.empty(1000)                            # garbage by contract
        ints = torch.tensor([1, 0]) // torch.tensor([1, 1])
    assert torch.isnan(y[1]) and torch.isinf(scores[0]) and probabilities[0] == 0
    assert empty.shape == (1000,) and ints.tolist() == [1, 0]


# -- results equal strict ---------------------------------------------------------------------------

def _train_step(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    embedding = torch.nn.Embedding(10, 8)
    tokens = torch.randint(0, 10, (6,))
    target = torch.randint(0, 4, (6,))
    loss = F.cross_entropy(model(embedding(tokens)), target)
    loss.backward()
    return [loss.detach()] + [p.grad for p in [*model.parameters(), *embedding.parameters()]]


@pytest.mark.parametrize("check_nans", [False, True])
def test_model_forward_backward_matches_strict(check_nans):
    expected = _train_step(0)
    with config.override(check_nans=check_nans), deferfuse.debug():
        actual = _train_step(0)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert type(a) is torch.Tensor
        assert torch.equal(a, e)  # the same kernels in the same order: bitwise equal


def _run_program(program, debug: bool):
    built = [spec.build() for spec in program.inputs]
    observed: list = []

    def observe(t: torch.Tensor, how: str) -> None:
        observed.append((t.tolist() if how == "tolist" else t.item() if how == "item" else bool(t), t.dtype))

    namespace: dict = {"torch": torch, "_observe": observe}
    namespace.update({f"v{i}": tensor for i, (tensor, _) in enumerate(built)})
    if debug:
        with deferfuse.debug():
            error = _run_steps(program.steps, namespace)
    else:
        error = _run_steps(program.steps, namespace)
    values = {k: v for k, v in namespace.items() if k.startswith("v")}
    return Outcome(values, [base for _, base in built], observed, error)


def _check_program(program):
    expected, actual = _run_program(program, False), _run_program(program, True)
    if actual.error and issubclass(actual.error[1], OverlapError) and (
            expected.error is None or expected.error[0] > actual.error[0]):
        # a check strict does not make for strided layouts (torch rejects the same write when
        # both tensors are dense): compare the program up to that step
        event("debug rejected an overlapping write that strict ran")
        truncated = dataclasses.replace(program, steps=program.steps[:actual.error[0]])
        expected, actual = _run_program(truncated, False), _run_program(truncated, True)
    if expected.error and actual.error and issubclass(actual.error[1], expected.error[1]):
        actual.error = (actual.error[0], expected.error[1], actual.error[2])  # a richer error is fine
    problems = compare(expected, actual)
    assert not problems, "debug differs from strict:\n" + "\n".join(problems) + f"\n\n{program!r}"


@settings(max_examples=40)
@given(programs("mutation"))
def test_random_view_and_mutation_programs_match_strict(program):
    _check_program(program)


@settings(max_examples=40)
@given(programs("mixed"))
def test_random_mixed_programs_match_strict(program):
    _check_program(program)


# -- entering and nesting ---------------------------------------------------------------------------

@pytest.mark.parametrize("enter", [deferfuse.debug, lambda: deferfuse.mode("debug"),
                                   lambda: deferfuse.mode(EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING)],
                         ids=["debug", "mode_name", "torchtpu_name"])
def test_debug_block_pushes_and_pops_a_debug_mode(enter):
    assert _modes() == []
    with enter():
        assert _modes() == [DebugMode]
        assert deferfuse.get_mode() is EagerMode.DEBUG
        assert type(torch.ones(2) + 1) is torch.Tensor  # runs at once, on plain tensors
    assert _modes() == []


def test_debug_block_pops_its_mode_when_the_block_raises():
    with pytest.raises(IndexError):
        with deferfuse.debug():
            _source()[torch.tensor([9])]
    assert _modes() == [] and deferfuse.get_mode() is EagerMode.STRICT


def test_set_mode_debug_is_the_default_until_changed():
    deferfuse.set_mode("debug")
    try:
        assert _modes() == [DebugMode]
        with pytest.raises(IndexBoundsIndexError):
            _source()[torch.tensor([9])]
        with deferfuse.strict():
            assert _modes() == []
            with pytest.raises(IndexError) as caught:
                _source()[torch.tensor([9])]
            assert not isinstance(caught.value, DebugCheckError)
        assert _modes() == [DebugMode]
        with deferfuse.defer():
            y = _source() + 1
            assert isinstance(y, deferfuse.DeferredTensor)
        assert _modes() == [DebugMode]
        deferfuse.set_mode("defer")
        assert len(_modes()) == 1 and _modes() != [DebugMode]
    finally:
        deferfuse.set_mode("strict")
    assert _modes() == []


def test_debug_inside_defer_suspends_defer():
    x = _source()
    with deferfuse.defer():
        before = x + 1
        with deferfuse.debug():
            assert _modes() == [DebugMode]
            assert deferfuse.is_materialized(before)  # flushed on the way in
            inside = x * 2
            assert type(inside) is torch.Tensor
            with pytest.raises(IndexBoundsIndexError):
                x[torch.tensor([9])]
        after = x - 1
        assert isinstance(after, deferfuse.DeferredTensor) and not deferfuse.is_materialized(after)
    assert _modes() == []
    assert torch.equal(after, x - 1) and torch.equal(inside, x * 2)


def test_defer_inside_debug_records_and_debug_resumes_after():
    x = _source()
    with deferfuse.debug():
        with deferfuse.defer():
            assert len(_modes()) == 2 and _modes()[0] is DebugMode  # the innermost mode wins
            y = x + 1
            assert isinstance(y, deferfuse.DeferredTensor) and not deferfuse.is_materialized(y)
            assert deferfuse.get_mode() is EagerMode.DEFER
        assert _modes() == [DebugMode]
        assert torch.equal(y, x + 1)
        with pytest.raises(IndexBoundsIndexError):
            x[torch.tensor([9])]
    assert _modes() == []


def test_ops_defer_runs_eagerly_inside_debug_are_still_checked():
    # embedding_bag has no lowering: defer runs it in torch, through the DebugMode below
    with deferfuse.debug(), deferfuse.defer():
        with pytest.raises(IndexBoundsError, match="index 7 is out of bounds for dimension 0"):
            F.embedding_bag(torch.tensor([1, 7]), _source(), torch.tensor([0]))


def test_strict_inside_defer_inside_debug_steps_out_of_both():
    x = _source()
    with deferfuse.debug():
        with deferfuse.defer():
            y = x + 1
            with deferfuse.strict():
                assert _modes() == [] and deferfuse.is_materialized(y)
                with pytest.raises(IndexError) as caught:
                    x[torch.tensor([9])]
                assert not isinstance(caught.value, DebugCheckError)
            assert len(_modes()) == 2
            z = x + 2
            assert isinstance(z, deferfuse.DeferredTensor)
            with deferfuse.debug():   # debug inside defer inside debug: one DebugMode
                assert _modes() == [DebugMode]
            assert len(_modes()) == 2
        assert _modes() == [DebugMode]
    assert _modes() == [] and torch.equal(z, x + 2)


def test_debug_inside_debug_pushes_nothing_more():
    with deferfuse.debug():
        with deferfuse.debug():
            assert _modes() == [DebugMode]
        assert _modes() == [DebugMode]
    assert _modes() == []


def test_nested_blocks_restore_the_stack_when_an_inner_one_raises():
    x = _source()
    with deferfuse.debug():
        with pytest.raises(IndexError):
            with deferfuse.defer():
                with deferfuse.debug():
                    x[torch.tensor([9])]
        assert _modes() == [DebugMode]
        with pytest.raises(ValueError):
            with deferfuse.strict():
                raise ValueError
        assert _modes() == [DebugMode]
    assert _modes() == []


def test_switching_modes_below_a_foreign_dispatch_mode_is_a_clear_error():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with deferfuse.debug():
        with Passthrough():
            with pytest.raises(deferfuse.ModeError, match="Passthrough"):
                with deferfuse.strict():
                    pass
            assert _modes() == [DebugMode, Passthrough]
    assert _modes() == []


def test_environment_selects_debug_mode_and_nan_check():
    script = textwrap.dedent("""
        import torch, deferfuse
        assert deferfuse.get_mode() is deferfuse.EagerMode.DEBUG
        x = torch.tensor([4.0, -1.0])
        y = torch.sqrt(x)
    """)
    env = dict(os.environ, TORCHTPU_MODE="debug", DEFERFUSE_CHECK_NANS="1", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "NonFiniteError: aten.sqrt.default: produced 1 NaN" in out.stderr
    assert "<string>:5" in out.stderr
