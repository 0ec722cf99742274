"""The fusion planner: how many computations a program makes, what leaves them, and the dumps."""

import sys

import pydot
import pytest
import torch

import deferfuse
from deferfuse.plan import records


@pytest.fixture(autouse=True)
def _fresh():
    deferfuse.reset_stats()
    with deferfuse.config.override(always_compile=False, eager_first_runs=0):
        yield


def _last_record():
    return records.latest()


def test_ten_op_pointwise_chain_is_one_computation_with_one_output():
    x = torch.randn(256)
    with deferfuse.defer():
        y = x
        for i in range(5):
            y = y * 1.5
            y = y + float(i)
        total = y
    record = _last_record()
    assert deferfuse.stats()["executions"] == 1
    assert len(record.groups) == 1
    assert record.groups[0].n_outputs == 1
    expected = x
    for i in range(5):
        expected = expected * 1.5 + float(i)
    torch.testing.assert_close(total, expected)


def test_dead_intermediate_is_not_an_output():
    x = torch.randn(64)
    with deferfuse.defer():
        a = x * 2
        b = a + 1          # a stays alive, b is dropped before the flush
        c = b * 3
        del b
        deferfuse.sync(c)
    # a is live, so it leaves the computation; b is dead and stays inside
    record = _last_record()
    assert record.n_outputs == 2, deferfuse.explain()


def test_matmul_between_chains_on_torch_engine_splits_in_three():
    a, w = torch.randn(32, 64), torch.randn(64, 16)
    with deferfuse.config.override(compute_engine="torch", peak_gflops=0.001):
        with deferfuse.defer():
            h = (a * 2 + 1) @ w
            out = h * 0.5 + 3
            deferfuse.sync(out)
    record = _last_record()
    engines = [g.engine for g in record.groups]
    assert engines == ["xla", "torch", "xla"], deferfuse.explain()
    assert record.groups[1].reason == "runs on another engine"
    assert record.groups[1].bounds == ["compute-bound"]
    torch.testing.assert_close(out, ((a * 2 + 1) @ w) * 0.5 + 3)


def test_matmul_on_xla_fuses_with_neighbours():
    a, w = torch.randn(32, 64), torch.randn(64, 16)
    with deferfuse.config.override(peak_gflops=0.001):
        with deferfuse.defer():
            out = ((a * 2 + 1) @ w) * 0.5 + 3
            deferfuse.sync(out)
    (group,) = _last_record().groups
    # the one-group plan still classifies each op (explain() and the DOT dump show it)
    assert group.bounds[group.ops.index("mm")] == "compute-bound", deferfuse.explain()
    assert group.bounds.count("memory-bound") == len(group.ops) - 1


def test_fusion_fuel_limits_merges():
    x = torch.randn(16)
    with deferfuse.config.override(fusion_fuel=2):
        with deferfuse.defer():
            y = x * 2 + 1 - 3 * x
            deferfuse.sync(y)
    record = _last_record()
    assert len(record.groups) > 1
    assert any(g.reason == "fusion fuel exhausted" for g in record.groups)
    torch.testing.assert_close(y, x * 2 + 1 - 3 * x)


def test_explain_names_reason_and_trigger_line():
    x = torch.ones(3)
    with deferfuse.defer():
        y = x * 2
        y.sum().item()
    text = deferfuse.explain(last=1)
    assert "(item at" in text and "test_planner.py" in text
    assert "group 0" in text


def test_dot_dump_parses_with_clusters():
    x = torch.ones(3)
    with deferfuse.defer():
        y = (x * 2 + 1).sum()
        deferfuse.sync(y)
    graphs = pydot.graph_from_dot_data(deferfuse.plan_dot())
    assert graphs and len(graphs) == 1
    clusters = graphs[0].get_subgraphs()
    assert [c.get_name() for c in clusters] == ["cluster_0"]
    assert len(graphs[0].get_edges()) >= 2


def test_stablehlo_text_parses():
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    x = torch.ones(3)
    with deferfuse.config.override(always_compile=True):
        with deferfuse.defer():
            y = x * 2 + 1
            deferfuse.sync(y)
    text = deferfuse.stablehlo(0)
    assert "stablehlo.multiply" in text
    with mlir.make_ir_context():
        module = ir.Module.parse(text)
    assert module is not None


def test_a_computation_without_runtime_checks_returns_only_its_outputs():
    x, index = torch.randn(8), torch.tensor([1, 7])
    with deferfuse.config.override(always_compile=True):
        with deferfuse.defer():
            y = x * 2 + 1
            deferfuse.sync(y)
        plain = deferfuse.stablehlo(0)
        with deferfuse.defer():
            z = torch.index_select(x * 2, 0, index)
            deferfuse.sync(z)
        checked = deferfuse.stablehlo(0)
    # (the result list of the entry function: one tensor, then the index check's flag and value)
    main = lambda text: next(line for line in text.splitlines() if "func.func public @main" in line)
    assert main(plain).count("jax.result_info") == 1, main(plain)
    assert main(checked).count("jax.result_info") == 3, main(checked)
    torch.testing.assert_close(z, (x * 2)[index])
    with pytest.raises(IndexError):
        with deferfuse.config.override(always_compile=True), deferfuse.defer():
            deferfuse.sync(torch.index_select(x * 2, 0, torch.tensor([8])))


@pytest.mark.parametrize("program", [
    lambda x, w, b: torch.softmax(x, -1),
    lambda x, w, b: torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b),
    lambda x, w, b: x.t().log_softmax(0),     # through a view of the input
], ids=["softmax", "layer_norm", "view"])
def test_a_lone_op_runs_on_torch_and_never_compiles(program):
    """A flush of one op has nothing to fuse: torch's fused CPU kernel runs it, with no compile."""
    x, w, b = torch.randn(16, 32), torch.randn(32), torch.randn(32)
    for _ in range(3):
        with deferfuse.defer():
            y = program(x, w, b)
            deferfuse.sync(y)
        torch.testing.assert_close(y, program(x, w, b), rtol=0, atol=0)
        record = _last_record()
        assert [(g.engine, g.reason) for g in record.groups] == [("torch", "one op, nothing to fuse")], \
            deferfuse.explain()
    assert deferfuse.stats()["compiles"] == 0 and deferfuse.stats()["executions"] == 0


def test_two_ops_or_always_compile_still_go_to_xla():
    x = torch.randn(16, 32)
    with deferfuse.defer():
        deferfuse.sync(torch.softmax(x, -1) * 2)
    assert deferfuse.stats()["executions"] == 1
    with deferfuse.config.override(always_compile=True), deferfuse.defer():
        deferfuse.sync(torch.softmax(x, -1))
    assert deferfuse.stats()["executions"] == 2


def test_explain_names_the_with_line_for_a_flush_at_block_exit():
    x = torch.ones(3)
    with deferfuse.defer():
        y = x * 2
    line = sys._getframe().f_lineno - 2
    text = deferfuse.explain(last=1)
    assert f"(context_exit at {__file__}:{line})" in text, text


def test_profiler_ranges_around_flush_compile_and_execute():
    x = torch.randn(64)
    deferfuse.reset_stats()
    with deferfuse.config.override(always_compile=True):
        with torch.profiler.profile() as prof:
            with deferfuse.defer():
                y = (x * 3.5 + 1.25).tanh()
    names = {e.name for e in prof.events()}
    assert {"deferfuse.flush", "deferfuse.execute"} <= names
    # a new signature is compiled inside the flush
    assert "deferfuse.compile" in names or deferfuse.stats()["disk_cache_hits"]
