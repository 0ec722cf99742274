"""Observation points flush exactly what is needed, with the right reason."""

import copy
import io
import pickle

import numpy as np
import pytest
import torch

import deferfuse
from deferfuse.capture.tensor import DeferredTensor


@pytest.fixture(autouse=True)
def _fresh_stats():
    deferfuse.reset_stats()
    with deferfuse.config.override(always_compile=True):
        yield


def flushes():
    return deferfuse.stats()["flushes"]


OBSERVERS = [
    ("item", lambda t: t.sum().item(), "item"),
    ("bool", lambda t: bool(t.sum() > 0), "item"),
    ("int", lambda t: int(t.sum()), "item"),
    ("float", lambda t: float(t.sum()), "item"),
    ("tolist", lambda t: t.tolist(), "tolist"),
    ("numpy", lambda t: t.numpy().tolist(), "numpy"),
    ("asarray", lambda t: np.asarray(t).tolist(), "numpy"),
    ("repr", lambda t: repr(t), "repr"),
    ("str", lambda t: str(t), "repr"),
    ("fstring", lambda t: f"{t}", "repr"),
    ("data_ptr", lambda t: t.data_ptr() != 0, "data_ptr"),
    ("equal", lambda t: torch.equal(t, t.clone()), "observing_op"),
    ("nonzero", lambda t: torch.nonzero(t > 2).tolist(), "data_dependent"),
    ("mask", lambda t: t[t > 2].tolist(), "data_dependent"),
    ("masked_select", lambda t: torch.masked_select(t, t > 2).tolist(), "data_dependent"),
    ("unique", lambda t: torch.unique(t.round()).tolist(), "data_dependent"),
]


@pytest.mark.parametrize("name,observe,reason", OBSERVERS, ids=[o[0] for o in OBSERVERS])
def test_observation_flushes_with_reason(name, observe, reason):
    x = torch.linspace(-1.0, 5.0, 12).reshape(3, 4)
    expected = observe(x * 2 + (-1))
    with deferfuse.defer():
        y = x * 2 + (-1)
        assert not deferfuse.is_materialized(y)
        got = observe(y)
        assert flushes().get(reason, 0) >= 1, flushes()
    if isinstance(expected, str):
        assert got == expected
    else:
        assert got == expected


def test_if_on_tensor_flushes():
    x = torch.ones(3)
    with deferfuse.defer():
        y = x * 2
        branch = "yes" if (y > 1).all() else "no"
    assert branch == "yes"
    assert flushes()["item"] == 1


def test_flush_computes_only_ancestors():
    x = torch.ones(4)
    with deferfuse.defer():
        a = x + 1
        b = x * 3           # independent of a
        a.sum().item()
        assert deferfuse.is_materialized(a)
        assert not deferfuse.is_materialized(b)
        c = b + (-1)
    assert torch.equal(c, torch.full((4,), 2.0))


def test_flush_takes_along_pending_work_that_shares_its_graph():
    # b reuses a: computing a alone now would compute it again when b is read
    x = torch.ones(4)
    with deferfuse.defer():
        a = x * 2
        b = a + 1
        unrelated = x - 1
        a.sum().item()
        assert deferfuse.is_materialized(b)
        assert not deferfuse.is_materialized(unrelated)
        before = deferfuse.stats()["executions"] + deferfuse.stats()["eager_replays"]
        assert b.tolist() == [3.0] * 4
        assert deferfuse.stats()["executions"] + deferfuse.stats()["eager_replays"] == before


def test_flush_writing_back_memory_runs_its_pending_readers_first():
    x = torch.ones(4)
    with deferfuse.defer():
        y = x * 2           # reads x's memory as it is now
        x.mul_(0)
        x.sum().item()      # writes x's new contents back into its memory
        assert y.tolist() == [2.0] * 4


def test_scalar_bookkeeping_flush_leaves_the_rest_pending():
    # an optimizer's step counter: reading it must not run the pending training step
    step = torch.tensor(0.0)
    w = torch.ones(64, 64)
    with deferfuse.defer():
        big = w @ w + step          # reads the counter's memory before it changes
        step += 1
        assert step.item() == 1.0
        assert not deferfuse.is_materialized(big)
    assert torch.equal(big, torch.full((64, 64), 64.0))


def test_sync_specific_and_all():
    x = torch.ones(2)
    with deferfuse.defer():
        a, b = x + 1, x + 2
        deferfuse.sync(a)
        assert deferfuse.is_materialized(a) and not deferfuse.is_materialized(b)
        deferfuse.sync()
        assert deferfuse.is_materialized(b)
    assert flushes()["sync"] == 2


def test_leaving_context_materializes():
    x = torch.ones(2)
    with deferfuse.defer():
        a = x + 1
    assert deferfuse.is_materialized(a)
    assert flushes()["context_exit"] == 1


def test_node_limit_bounds_pending_graph():
    x = torch.ones(8)
    with deferfuse.config.override(max_pending_nodes=50):
        with deferfuse.defer():
            y = x
            for _ in range(200):
                y = y + 1
            assert flushes().get("node_limit", 0) >= 3
    assert torch.equal(y, torch.full((8,), 201.0))


def test_pickle_save_deepcopy_produce_plain_tensors():
    x = torch.arange(6.0)
    with deferfuse.defer():
        y = x * 2
        restored = pickle.loads(pickle.dumps(y))
        buf = io.BytesIO()
        torch.save(y, buf)
        buf.seek(0)
        loaded = torch.load(buf)
        clone = copy.deepcopy(y)
    for t in (restored, loaded, clone):
        assert type(t) is torch.Tensor
        assert torch.equal(t, x * 2)


def test_repr_matches_strict_including_grad():
    w = torch.ones(2, requires_grad=True)
    with deferfuse.defer():
        y = w * 2
        text = repr(y)
    assert text == repr(torch.ones(2, requires_grad=True) * 2)


def test_deferred_tensors_work_after_context():
    x = torch.ones(3)
    with deferfuse.defer():
        y = x * 2
    z = y + 1                    # plain eager now
    assert type(z) is torch.Tensor
    y.add_(1)                    # in place, on the materialized data
    assert isinstance(y, DeferredTensor)
    assert torch.equal(y, torch.full((3,), 3.0))
    assert torch.equal(z, torch.full((3,), 3.0))


def _storage_values(t):
    return torch.frombuffer(bytearray(t.untyped_storage()), dtype=t.dtype).tolist()


def _dlpack_values(t):
    return np.from_dlpack(t).tolist()


def _saved(t):
    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    return torch.load(buffer).tolist()


PLAIN_READERS = [
    ("tolist", lambda t: t.tolist()),
    ("numpy", lambda t: t.numpy().tolist()),
    ("asarray", lambda t: np.asarray(t).tolist()),
    ("repr", repr),
    ("str", str),
    ("format", lambda t: f"{t}"),
    ("untyped_storage", _storage_values),
    ("dlpack", _dlpack_values),
    ("pickle", lambda t: pickle.loads(pickle.dumps(t)).tolist()),
    ("deepcopy", lambda t: copy.deepcopy(t).tolist()),
    ("save", _saved),
    ("parameter_repr", lambda t: repr(torch.nn.Parameter(t, requires_grad=False))),
]


@pytest.mark.parametrize("name,read", PLAIN_READERS, ids=[r[0] for r in PLAIN_READERS])
def test_python_reads_of_a_plain_tensor_see_its_pending_contents(name, read):
    """A user tensor written in place inside the block, then read by Python code that reads
    its memory directly (no aten op): the pending contents are written back first."""
    def program(x):
        x.mul_(2).add_(1)
        return read(x)
    expected = program(torch.arange(6.0))
    x = torch.arange(6.0)
    with deferfuse.defer():
        got = program(x)
    assert got == expected


@pytest.mark.parametrize("name,read", PLAIN_READERS, ids=[r[0] for r in PLAIN_READERS])
def test_python_reads_of_a_deferred_tensor_see_its_contents(name, read):
    def program():
        return read(torch.arange(6.0).mul(2).add(1))
    expected = program()
    with deferfuse.defer():
        got = program()
    assert got == expected


def test_matrix_rank_out_is_written_inside_a_block():
    a = torch.diag(torch.tensor([1.0, 2.0, 0.0]))
    out = torch.zeros((), dtype=torch.int64)
    with deferfuse.defer():
        torch.linalg.matrix_rank(a * 1, out=out)
    assert out.item() == 2


GUARDED = ["tolist", "__repr__", "__format__", "data_ptr", "untyped_storage",
           "__dlpack__", "__reduce_ex__", "__deepcopy__"]


def _methods():
    return {name: torch.Tensor.__dict__.get(name) for name in GUARDED}, torch.linalg.matrix_rank


def test_guarded_methods_are_torchs_own_again_after_blocks():
    before = _methods()
    x = torch.arange(3.0)
    with deferfuse.defer():
        read_only = _methods()
        x.add_(1)
        inside = _methods()
        with deferfuse.defer():
            pass
        with deferfuse.strict():
            assert _methods() == before
        assert _methods()[1] is inside[1]
    # matrix_rank's out= is wrapped in every block; Python-level reads only once the block
    # has written a plain tensor (until then every plain tensor's memory is current)
    assert read_only[0] == before[0] and read_only[1] is not before[1]
    assert all(inside[0][name] is not before[0][name] for name in GUARDED) and inside[1] is not before[1]
    assert _methods() == before
    # numpy() and __array__ stay wrapped from import on: an array NumPy makes of torch's
    # memory, in a block or not, is known while it lives (capture/patches.NUMPY_READS)
    assert all(hasattr(getattr(torch.Tensor, name), "__wrapped__") for name in ("numpy", "__array__"))
    with pytest.raises(ZeroDivisionError):
        with deferfuse.defer():
            x.add_(1)
            1 / 0
    assert _methods() == before
    assert x.tolist() == [2.0, 3.0, 4.0]


def test_a_read_after_a_suspension_sees_a_new_pending_write():
    """Suspending a block (a debug block inside it) flushes it and takes the read wrappers
    off; the next plain write after it puts them back."""
    before = _methods()
    x = torch.arange(3.0)
    with deferfuse.defer():
        x.mul_(2)
        assert x.tolist() == [0.0, 2.0, 4.0]
        with deferfuse.debug():
            assert _methods() == before
            assert x.tolist() == [0.0, 2.0, 4.0]
        x.add_(1)
        assert x.tolist() == [1.0, 3.0, 5.0]
        assert repr(x) == "tensor([1., 3., 5.])"
    assert x.tolist() == [1.0, 3.0, 5.0]


def test_a_thread_outside_defer_reads_through_the_guard_untouched():
    """While the main thread's block is open, another thread's reads call torch's methods
    directly: they neither flush the main thread's graph nor fail.  (Starting the thread
    computes what was pending, once: processes._computing_start.)"""
    import threading
    x = torch.arange(4.0)
    seen = {}
    with deferfuse.defer():
        x.mul_(3)

        def other():
            before = dict(flushes())
            y = torch.arange(4.0)
            seen["values"] = (y.tolist(), y.numpy().tolist(), repr(y))
            seen["flushed"] = dict(flushes()) != before
        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
        assert seen["flushed"] is False
    assert seen["values"][0] == [0.0, 1.0, 2.0, 3.0] == seen["values"][1]
    assert x.tolist() == [0.0, 3.0, 6.0, 9.0]


def test_each_recorded_op_names_the_line_that_recorded_it():
    # the fast path (pure and in-place), torch's Python operator wrappers (``**`` and ``1 - t`` go
    # through torch/_tensor.py) and the general path each keep the user's line per node
    from deferfuse.plan import records
    import inspect
    x, p = torch.randn(8), torch.randn(8)
    lines = {}
    for _ in range(3):   # past the first sightings, which run at once
        with deferfuse.defer():
            here = inspect.currentframe().f_lineno
            y = x * 2.0                   # here + 1
            p.mul_(0.5)                   # here + 2
            z = y ** 3                    # here + 3
            w = 1 - z                     # here + 4
            v = torch.cumsum(w, 0)        # here + 5
        lines = {"mul.Tensor": here + 1, "pow.Tensor_Scalar": here + 3, "rsub.Scalar": here + 4,
                 "cumsum": here + 5}
    group = records.latest().groups[0]
    found: dict = {}
    for op, source in zip(group.ops, group.sources):
        found.setdefault(op, set()).add(str(source))
    for op, line in lines.items():
        assert f"{__file__}:{line}" in found[op], (op, found)
    # p.mul_ is recorded as its functional twin: a second mul.Tensor, on its own line
    assert found["mul.Tensor"] == {f"{__file__}:{here + 1}", f"{__file__}:{here + 2}"}, found
    assert v.shape == (8,)


def test_explain_gives_the_span_of_lines_in_line_order():
    # sorted as text, line 10 came before line 9 ("recorded at f.py:10 ... f.py:9")
    code = compile("\n" * 8 + "y = x * 2.0\nz = y + 1.0\n", "padded.py", "exec")
    x = torch.randn(8)
    for _ in range(3):   # past the first sightings, which run at once
        with deferfuse.defer():
            names = {"x": x}
            exec(code, names)
    assert "recorded at padded.py:9 ... padded.py:10" in deferfuse.explain(last=1)


def test_explain_prints_as_the_report_and_a_repl_shows_it(capsys):
    # as torch._dynamo.explain's result: print() and a REPL's echo both give the report's
    # lines, not one escaped string; it is still a str for code that searches or splits it
    import sys
    x = torch.randn(8)
    for _ in range(3):   # past the first sightings, which run at once
        with deferfuse.defer():
            y = (x * 2.0).sin()
        float(y.sum())
    report = deferfuse.explain(last=1)
    text = str(report)
    assert isinstance(report, str) and text.startswith("flush #") and "\n" in text
    assert repr(report) == text
    assert "group 0" in report and report.splitlines() == text.splitlines()
    capsys.readouterr()
    print(report)
    assert capsys.readouterr().out == text + "\n"
    sys.displayhook(report)   # what the interactive interpreter calls on an expression's value
    assert capsys.readouterr().out == text + "\n"
