"""torch.compile(backend="deferfuse") (deferfuse/compile/) against eager PyTorch.

Every model is run twice from the same state and seed: eagerly, and compiled with the deferfuse
backend; outputs, gradients, buffers and dropout masks must agree (floating-point tolerances:
XLA fuses and reorders).  ``torch._dynamo.reset()`` before each test keeps Dynamo's caches from
one test out of the next.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import deferfuse
import deferfuse.compile as dcompile
from hlo_text import trig_evaluations

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    deferfuse.reset_stats()
    yield
    torch._dynamo.reset()


def compiled(model, **kwargs):
    return torch.compile(model, backend=dcompile.backend, **kwargs)


def assert_grads_equal(eager: torch.nn.Module, ours: torch.nn.Module) -> None:
    for (name, a), b in zip(eager.named_parameters(), ours.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, **TOL, msg=name)


def test_mlp_forward_and_backward_equal_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 8))
    ours = copy.deepcopy(model)
    f = compiled(ours)
    x = torch.randn(4, 16)
    expected = model(x)
    expected.square().mean().backward()
    got = f(x)
    got.square().mean().backward()
    torch.testing.assert_close(got, expected, **TOL)
    assert_grads_equal(model, ours)
    stats = deferfuse.stats()
    assert stats["compiled_graphs"] == 2            # forward and backward
    assert stats["compiled_partitions"] == 2        # one XLA computation each
    assert stats["compiled_fallbacks"] == {}
    assert stats["compiles"] + stats["disk_cache_hits"] == 2


def test_transformer_layer_with_dropout_trains_as_eager_step_by_step():
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.2, batch_first=True)
    ours = copy.deepcopy(model)
    f = compiled(ours)
    # (SGD: the key projection's bias has a zero gradient in exact arithmetic, and Adam would
    # scale both runs' rounding noise in it up to the learning rate)
    opt_e = torch.optim.SGD(model.parameters(), lr=1e-2)
    opt_o = torch.optim.SGD(ours.parameters(), lr=1e-2)
    x, probe = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    for step in range(3):
        # (a loss that is not a normalized output's mean square, whose gradients cancel to ~1e-7)
        torch.manual_seed(100 + step)
        loss_e = (model(x) * probe).sum()
        loss_e.backward()
        torch.manual_seed(100 + step)
        loss_o = (f(x) * probe).sum()
        loss_o.backward()
        torch.testing.assert_close(loss_o, loss_e, **TOL)
        assert_grads_equal(model, ours)
        opt_e.step()
        opt_o.step()
        opt_e.zero_grad()
        opt_o.zero_grad()
    for a, b in zip(model.parameters(), ours.parameters()):
        torch.testing.assert_close(b, a, **TOL)


def test_batchnorm_running_statistics_after_three_steps():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
    ours = copy.deepcopy(model)
    f = compiled(ours)
    for step in range(3):
        x = torch.randn(2, 3, 8, 8)
        model(x).sum().backward()
        f(x).sum().backward()
    for (name, a), b in zip(model.named_buffers(), ours.buffers()):
        torch.testing.assert_close(b, a, **TOL, msg=name)
    assert int(ours[1].num_batches_tracked) == 3
    assert_grads_equal(model, ours)


@torch.library.custom_op("deferfuse_test::plain_torch", mutates_args=())
def plain_torch(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2


@plain_torch.register_fake
def _(x):
    return torch.empty_like(x)


def test_an_op_with_no_lowering_splits_the_graph_and_runs_on_torch():
    def f(x, w):
        a = torch.tanh(x @ w) + 1          # a fusible chain
        b = plain_torch(a)                 # no lowering: runs on torch
        return (b * a).exp().sum(dim=1)    # another fusible chain

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    got = torch.compile(f, backend=dcompile.backend)(x, w)
    torch.testing.assert_close(got, f(x, w), **TOL)
    stats = deferfuse.stats()
    assert stats["compiled_fallbacks"] == {"deferfuse_test.plain_torch.default": 1}
    assert stats["compiled_partitions"] == 2


def test_a_graph_break_runs_both_sides():
    def f(x):
        y = torch.relu(x) * 3
        if y.sum().item() > 0:             # data-dependent Python: a graph break
            y = y + 1
        print("between graphs", end="\r")  # another break
        return torch.sigmoid(y)

    x = torch.randn(8)
    got = torch.compile(f, backend=dcompile.backend)(x)
    torch.testing.assert_close(got, f(x), **TOL)
    assert deferfuse.stats()["compiled_graphs"] >= 2


def test_shapes_seen_before_compile_nothing():
    def f(x):
        return torch.nn.functional.gelu(x * 2 + 1).sum(dim=-1)

    g = torch.compile(f, backend=dcompile.backend)
    shapes = [(3, 5), (4, 5), (6, 5)]
    for s in shapes:
        x = torch.randn(s)
        torch.testing.assert_close(g(x), f(x), **TOL)
    before = deferfuse.stats()
    for s in shapes:
        x = torch.randn(s)
        torch.testing.assert_close(g(x), f(x), **TOL)
    after = deferfuse.stats()
    # (Dynamo's dynamic graph may now also plan the first shape, which its static graph had:
    # the same computation, so the same executable)
    for counter in ("compiles", "disk_cache_hits", "compiled_rule_calls"):
        assert after[counter] == before[counter], counter
    assert before["compiles"] == 3


def test_options_are_settings_and_unknown_ones_are_refused():
    x = torch.randn(4, 4)
    f = torch.compile(lambda x: (x @ x).relu(), backend=dcompile.backend, options={"order_compute": False})
    torch.testing.assert_close(f(x), (x @ x).relu(), **TOL)
    for mode in dcompile.MODES:          # accepted, and change nothing
        torch._dynamo.reset()
        g = torch.compile(lambda x: (x @ x).relu(), backend=dcompile.backend, mode=mode)
        torch.testing.assert_close(g(x), (x @ x).relu(), **TOL)
    torch._dynamo.reset()
    bad = torch.compile(lambda x: x + 1, backend=dcompile.backend, options={"no_such_setting": 1})
    with pytest.raises(Exception, match="no_such_setting"):
        bad(x)


def test_hugging_face_llama_forward_and_backward_equal_eager():
    sys.path.insert(0, ROOT)
    from bench import zoo_models as zoo
    model = zoo.MODELS["llama"]
    eager = model.make("tiny")
    ours = copy.deepcopy(eager)
    f = compiled(ours)
    batch = model.batch("tiny", torch.Generator().manual_seed(1))
    torch.manual_seed(3)
    loss_e = zoo.loss_of(eager, model, batch)
    loss_e.backward()
    torch.manual_seed(3)
    loss_o = f(**batch).loss
    loss_o.backward()
    torch.testing.assert_close(loss_o, loss_e, rtol=1e-4, atol=1e-4)
    for (name, a), b in zip(eager.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-3, atol=1e-4, msg=name)


_CACHE_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    import deferfuse, deferfuse.compile
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(16, 4))
    f = torch.compile(model, backend=deferfuse.compile.backend)
    x = torch.randn(3, 8)
    torch.manual_seed(1)
    loss = f(x).square().sum()
    loss.backward()
    torch.save([loss.detach()] + [p.grad for p in model.parameters()], sys.argv[1])
    s = deferfuse.stats()
    print(json.dumps({k: s[k] for k in ("compiles", "compiled_rule_calls", "disk_cache_hits",
                                        "compiled_partitions")}), flush=True)
    # (its results are out: skip the interpreter's teardown, where one CI run of this child
    # aborted, "terminate called without an active exception", after printing them; not seen
    # in 32 runs since, alone or under load; the issue note records it)
    import os
    os._exit(0)
""")


def _child(script: str, cache: str, *args: str) -> dict:
    env = dict(os.environ, DEFERFUSE_CACHE_DIR=cache, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                          text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_compiles_and_lowers_nothing(tmp_path):
    cache = str(tmp_path / "cache")
    first = _child(_CACHE_CHILD, cache, str(tmp_path / "first.pt"))
    second = _child(_CACHE_CHILD, cache, str(tmp_path / "second.pt"))
    assert first["compiles"] == first["compiled_partitions"] > 0
    assert first["compiled_rule_calls"] > 0
    assert second["compiles"] == 0
    assert second["compiled_rule_calls"] == 0
    assert second["disk_cache_hits"] == first["compiles"]
    a, b = torch.load(tmp_path / "first.pt"), torch.load(tmp_path / "second.pt")
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def _entry_point_metadata(folder) -> str:
    """A dist-info folder declaring pyproject.toml's torch_dynamo_backends entry points, for a
    process whose installed deferfuse metadata predates them (the venv is installed from another
    tree): Python finds entry points in any ``*.dist-info`` on sys.path, as it finds the
    installed package's."""
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        declared = tomllib.load(f)["project"]["entry-points"]["torch_dynamo_backends"]
    info = folder / "deferfuse_entry_points-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deferfuse-entry-points\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(
        "[torch_dynamo_backends]\n" + "".join(f"{k} = {v}\n" for k, v in declared.items()))
    return str(folder)


def test_the_backend_is_found_by_name_in_a_process_that_never_imported_deferfuse(tmp_path):
    script = textwrap.dedent("""
        import json, sys
        import torch
        listed = "deferfuse" in torch._dynamo.list_backends()
        imported_before = "deferfuse" in sys.modules
        x = torch.randn(4, 4)
        got = torch.compile(lambda x: (x * 2).sin(), backend="deferfuse")(x)
        import deferfuse
        print(json.dumps({"listed": listed, "imported_before": imported_before,
                          "ok": torch.allclose(got, (x * 2).sin(), rtol=1e-5, atol=1e-6),
                          "graphs": deferfuse.stats()["compiled_graphs"]}))
    """)
    # (the metadata folder only where the installed package does not declare the entry point yet)
    from importlib.metadata import entry_points
    installed = "deferfuse" in entry_points(group="torch_dynamo_backends").names
    path = [ROOT] + ([] if installed else [_entry_point_metadata(tmp_path)])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=240, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"listed": True, "imported_before": False, "ok": True, "graphs": 1}


def test_importing_deferfuse_registers_no_backend():
    script = textwrap.dedent("""
        import torch
        from torch._dynamo.backends import registry
        before = set(registry._COMPILER_FNS)
        import sys
        import deferfuse
        assert "deferfuse.compile" not in sys.modules      # loaded on first use
        assert callable(deferfuse.compile.backend)
        print(sorted(set(registry._COMPILER_FNS) - before))
    """)
    done = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=ROOT),
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_compiled_function_inside_a_defer_block_is_recorded_with_the_code_around_it():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    f = compiled(model)
    x = torch.randn(4, 8)
    f(x)                                   # compiled outside any block
    deferfuse.reset_stats()
    with deferfuse.defer():
        out = f(x * 2) + 1                 # Dynamo runs the code under the mode: its aten ops are recorded
    torch.testing.assert_close(out, model(x * 2) + 1, **TOL)
    stats = deferfuse.stats()
    assert stats["ops_recorded"] > 2 and stats["compiled_specializations"] == 0
    assert sum(stats["flushes"].values()) == 1


def test_debug_mode_runs_a_compiled_function_op_by_op_with_its_checks():
    f = compiled(lambda x, i: x[i] * 2)
    x, i = torch.randn(4), torch.tensor([0, 3])
    torch.testing.assert_close(f(x, i), x[i] * 2)
    with deferfuse.debug():
        torch.testing.assert_close(f(x, i), x[i] * 2)
        with pytest.raises(IndexError):
            f(x, torch.tensor([0, 7]))


def test_explain_shows_partitions_and_fallbacks_and_stablehlo_works():
    def f(x):
        return plain_torch(torch.tanh(x) + 1).exp()

    x = torch.randn(4)
    torch.testing.assert_close(torch.compile(f, backend=dcompile.backend)(x), f(x), **TOL)
    graph = dcompile.compiled_graphs()[-1]
    text = dcompile.explain(graph)
    assert "XLA partition 0" in text and "plain_torch" in text and "no lowering" in text
    assert "stablehlo" in dcompile.stablehlo(graph, 0) or "func.func" in dcompile.stablehlo(graph, 0)


def test_a_compiled_foreach_adamw_step_is_one_xla_computation_equal_to_eager():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    ours = copy.deepcopy(model)
    opt_e = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True)
    opt_o = torch.optim.AdamW(ours.parameters(), lr=0.1, foreach=True)
    step = torch.compile(opt_o.step, backend=dcompile.backend)
    for _ in range(3):
        x = torch.randn(4, 8)
        model(x).sum().backward()
        ours(x).sum().backward()
        opt_e.step()
        step()
        opt_e.zero_grad()
        opt_o.zero_grad()
    for a, b in zip(model.parameters(), ours.parameters()):
        torch.testing.assert_close(b, a, **TOL)
    stats = deferfuse.stats()
    assert stats["compiled_fallbacks"] == {}      # the foreach ops unrolled into lowered element ops
    assert stats["compiled_partitions"] == stats["compiled_specializations"]


def test_random_ops_draw_eager_numbers_in_eager_order():
    def f(x):
        a = x + torch.rand_like(x)
        b = torch.randn(3, 4) * a
        return torch.nn.functional.dropout(b, 0.5) + torch.randint(0, 5, (3, 4))

    x = torch.randn(3, 4)
    g = torch.compile(f, backend=dcompile.backend)
    for seed in (0, 1):
        torch.manual_seed(seed)
        expected = f(x)
        torch.manual_seed(seed)
        torch.testing.assert_close(g(x), expected, **TOL)
    assert deferfuse.stats()["compiled_fallbacks"] == {}


def test_writes_into_inputs_through_views_and_under_no_grad():
    def f(x, p):
        x[:, 0] = 5.0                      # a write through a view of an input
        with torch.no_grad():
            p.mul_(0.5).add_(1.0)          # in-place on another input
        return x.sum() + p.sum()

    x, p = torch.randn(3, 4), torch.randn(4)
    x2, p2 = x.clone(), p.clone()
    expected = f(x, p)
    got = torch.compile(f, backend=dcompile.backend)(x2, p2)
    torch.testing.assert_close(got, expected, **TOL)
    torch.testing.assert_close(x2, x, **TOL)
    torch.testing.assert_close(p2, p, **TOL)


def test_dynamic_shapes_with_size_arithmetic():
    def f(x):
        n = x.shape[0]
        return (x.reshape(n, -1) * n).softmax(-1)[: n // 2]

    g = torch.compile(f, backend=dcompile.backend, dynamic=True)
    for n in (4, 6, 4):
        x = torch.randn(n, 3, 2)
        torch.testing.assert_close(g(x), f(x), **TOL)
    assert deferfuse.stats()["compiles"] + deferfuse.stats()["disk_cache_hits"] == 2


def test_specializations_are_bounded_with_one_warning(caplog):
    g = torch.compile(lambda x: (x * 2).cos(), backend=dcompile.backend, dynamic=True,
                      options={"compile_max_specializations": 2})
    with caplog.at_level("WARNING", logger="deferfuse"):
        for n in (2, 3, 4, 5, 2):
            x = torch.randn(n)
            torch.testing.assert_close(g(x), (x * 2).cos(), **TOL)
    graph = dcompile.compiled_graphs()[-1]
    assert len(graph.plans) == 2
    assert sum("compile_max_specializations" in r.message for r in caplog.records) == 1
    assert deferfuse.stats()["compiled_specializations"] == 5


def test_a_call_unlike_the_last_finds_its_own_plan():
    """A graph checks each call's inputs against its last call's (runtime._LastSpec) before
    keying them: a call whose inputs differ from the last in strides, dtype or requires_grad
    runs its own plan, with strict's results and strides.  (Dynamo makes a graph per dtype,
    requires_grad and stride order, so the graph is also called directly, as AOTAutograd calls
    it, with inputs Dynamo would have sent elsewhere.)"""
    earlier = set(map(id, dcompile.compiled_graphs()))
    f = compiled(lambda x: x * 2 + 1, dynamic=True)
    base = torch.randn(6, 6)
    grad = base.clone().requires_grad_()
    variants = (base, base.t(), base.double(), base.t().double(), grad)
    for x in (*variants, torch.randn(4, 6), *variants):
        out, want = f(x), x * 2 + 1
        assert (out.dtype, out.shape, out.stride()) == (want.dtype, want.shape, want.stride())
        torch.testing.assert_close(out, want, **TOL)
    # the graph of the first input, square: (its size, the input)
    graph = next(g for g in dcompile.compiled_graphs() if id(g) not in earlier)
    assert len(graph.placeholders) == 2
    gapped = torch.randn(6, 12)[:, ::2]
    with torch.no_grad():
        for x in (base, base.t(), base, base.double(), base.t().double(), gapped, base.t(), base):
            (out,) = graph([6, x])
            want = x * 2 + 1
            assert (out.dtype, out.stride()) == (want.dtype, want.stride()), x.stride()
            torch.testing.assert_close(out, want, **TOL)


def test_a_small_input_new_at_each_call_is_staged_and_results_stay_apart():
    """A small graph input that is a new tensor at each call (a decoding step's token) is
    copied into a staging buffer viewed once (runtime._Staged): each call reads its own values,
    results of earlier calls (an output equal to the input among them) are not overwritten by
    later ones, and a call from another thread, or with an input that requires grad, imports
    the input as before.  An input renewed less often (a KV cache, new at each generate()) is
    not staged."""
    import threading
    from deferfuse.compile import runtime

    def f(x, t, c):
        return x * t + t.sum() + c, t * 1, (t + 1).double()

    earlier = set(map(id, dcompile.compiled_graphs()))
    g = compiled(f)
    x = torch.randn(16, 8)
    kept, wanted = [], []
    with torch.no_grad():
        for step in range(7):
            t = torch.randn(16, 8)                           # a new tensor each call
            if step % 3 == 0:
                c = torch.randn(16, 8)                       # a new tensor every third call
            kept.append(g(x, t, c))
            wanted.append(f(x, t, c))
        staged = [e for graph in runtime.compiled_graphs() if id(graph) not in earlier
                  for plan in graph.plans.values() for p in plan.partitions for e in (p.imports or [])
                  if isinstance(e, runtime._Staged)]
        assert len(staged) == 1
        t = torch.randn(16, 8)
        elsewhere = []
        thread = threading.Thread(target=lambda: elsewhere.append(g(x, t, c)))
        thread.start()
        thread.join()
        kept.append(elsewhere[0])
        wanted.append(f(x, t, c))
    t = torch.randn(16, 8, requires_grad=True)
    kept.append(g(x, t, c))
    wanted.append(f(x, t, c))
    for got, want in zip(kept, wanted):
        for a, b in zip(got, want):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, **TOL)


def test_a_runtime_check_raises_on_any_call_of_a_compiled_graph():
    """A program with runtime checks returns its flags after its results: the first call and
    the later ones (whose results are made by handlers built at the first: entryformat's
    LoadedProgram) raise the same error at an index out of range, and go on afterwards."""
    f = compiled(lambda x, i: (x * 3)[i] + 1)
    x = torch.randn(5)
    for i in ([0, 4], [1, 2], [3, 3]):
        i = torch.tensor(i)
        torch.testing.assert_close(f(x, i), (x * 3)[i] + 1, **TOL)
    for _ in range(2):
        with pytest.raises(IndexError):
            f(x, torch.tensor([0, 7]))
    i = torch.tensor([4, 0])
    torch.testing.assert_close(f(x, i), (x * 3)[i] + 1, **TOL)


def test_a_partition_whose_lowering_fails_runs_on_torch(monkeypatch):
    from deferfuse.lower import table

    def broken(ctx, *args, **kwargs):
        raise ValueError("a broken rule")

    lowering = table.get_lowering(torch.ops.aten.cos.default)
    import dataclasses
    monkeypatch.setitem(table.LOWERINGS, torch.ops.aten.cos.default, dataclasses.replace(lowering, rule=broken))

    def f(x):
        return (x * 3).cos() + 1

    x = torch.randn(5)
    torch.testing.assert_close(torch.compile(f, backend=dcompile.backend)(x), f(x), **TOL)
    assert deferfuse.stats()["compiled_fallbacks"]["aten.cos.default"] == 1


def test_compute_engine_torch_runs_products_on_torch_between_partitions():
    def f(x, w):
        return torch.tanh(torch.relu(x * 2) @ w + 1)

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    g = torch.compile(f, backend=dcompile.backend, options={"compute_engine": "torch"})
    torch.testing.assert_close(g(x, w), f(x, w), **TOL)
    stats = deferfuse.stats()
    assert stats["compiled_partitions"] == 2 and stats["compiled_fallbacks"] == {}


def test_a_compiled_backward_called_inside_a_defer_block():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    ours = copy.deepcopy(model)
    f = compiled(ours)
    x = torch.randn(4, 8)
    model(x).mul(2).sum().backward()
    out = f(x)                             # compiled forward, outside the block
    with deferfuse.defer():
        (out * 2).sum().backward()         # its tangent is deferred: computed, then the graph runs
    assert_grads_equal(model, ours)
    assert deferfuse.stats()["compiled_graphs"] == 2


def test_a_compiled_step_with_adamw_in_a_defer_block_trains_as_eager(user_defaults):
    """The bench's ``deferfuse+defer`` step under every default setting: the model's forward and
    backward compiled, the loss read and AdamW's step inside one ``with deferfuse.defer():``
    block per step (first sighting, replays while compiling, compiled; the block tier measuring
    or deferred).  Losses, parameters and AdamW's state equal eager's step by step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    ours = copy.deepcopy(model)
    f = compiled(ours)
    opt_e = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_o = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 12, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(5)]
    for call in user_defaults.calls(len(data)):
        x, y = data[call - 1]
        loss_e = torch.nn.functional.cross_entropy(model(x), y)
        loss_e.backward()
        opt_e.step()
        opt_e.zero_grad()
        with deferfuse.defer():
            loss_o = torch.nn.functional.cross_entropy(f(x), y)
            loss_o.backward()
            opt_o.step()
            opt_o.zero_grad()
            read = loss_o.item()
        assert read == pytest.approx(loss_e.item(), rel=1e-5), call
        for a, b in zip(model.parameters(), ours.parameters()):
            torch.testing.assert_close(b, a, **TOL)
    for state_e, state_o in zip(opt_e.state.values(), opt_o.state.values()):
        torch.testing.assert_close(state_o["exp_avg_sq"], state_e["exp_avg_sq"], **TOL)
    assert not deferfuse.stats()["fallbacks"] and not deferfuse.stats()["compiled_fallbacks"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_a_broadcast_sine_or_cosine_is_computed_once(dtype):
    """XLA counts sine and cosine as cheap and fused RoPE's ``cos(emb)`` ([S, D]) into the
    products with the [B, H, S, D] queries, evaluating it once per element of the queries (the
    Llama step spent ~15 ms a step so).  The value is materialized where it is broadcast; its
    bits are kept (-0.0, NaN and infinities among the angles)."""
    from deferfuse.exec import executables
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 32, 2, 16, generator=g, dtype=dtype).transpose(1, 2)   # [B, S, H, D] physically
    emb = torch.randn(1, 32, 16, generator=g, dtype=torch.float32) * 10
    emb[0, 0, :5] = torch.tensor([-0.0, math.nan, math.inf, -math.inf, 1e30])

    def rope(q, emb):
        cos, sin = (emb.cos() * 0.5).to(q.dtype).unsqueeze(1), emb.sin().to(q.dtype).unsqueeze(1)
        half = q.shape[-1] // 2
        rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        return q * cos + rotated * sin, torch.tan(emb) + q.sum(), emb.sin()

    executables.clear()
    fn = compiled(rope)
    for _ in range(2):
        for got, want in zip(fn(q, emb), rope(q, emb)):
            torch.testing.assert_close(got, want, equal_nan=True)
    texts = [c.executable.as_text() for c in executables.snapshot() if hasattr(c.executable, "as_text")]
    evaluations = [e for t in texts for e in trig_evaluations(t)]
    assert evaluations, "the program evaluates no sine or cosine"
    assert all(fused <= own for own, fused in evaluations), evaluations


def test_a_call_reads_its_inputs_as_they_are_at_the_call():
    """A graph input's JAX view is reused from the last call only while it is the same tensor at
    the same address: values written in place, a parameter's ``.data`` swapped for another
    tensor and a new input tensor each call all give eager's results, and an input that dies
    leaves no view (nor its memory) behind."""
    import gc
    import weakref
    from deferfuse.compile import runtime

    lin = torch.nn.Linear(8, 8)

    def f(x):
        return torch.relu(lin(x)) * 2 + x

    g = torch.compile(f, backend=dcompile.backend)
    x = torch.randn(4, 8)
    with torch.no_grad():
        for step in range(4):
            torch.testing.assert_close(g(x), f(x), **TOL)
            x.add_(1.0)                                  # the same tensor, new values
            if step == 1:
                lin.weight.data = torch.randn(8, 8)      # the same Parameter, other memory
            if step == 2:
                x = torch.randn(4, 8)                    # another tensor
        torch.testing.assert_close(g(x), f(x), **TOL)
        y = torch.randn(4, 8)
        torch.testing.assert_close(g(y), f(y), **TOL)
    gone = weakref.ref(y)
    del y
    gc.collect()
    assert gone() is None
    entries = [entry for graph in runtime.compiled_graphs() for plan in graph.plans.values()
               for p in plan.partitions for entry in (p.imports or []) if entry is not None]
    assert entries and all(isinstance(e, runtime._Staged) or e[0] is None or e[0]() is not None
                           for e in entries)
