"""The divergence finder, deferfuse.compare and python -m deferfuse --compare: agreeing programs
are reported as agreeing; a lowering broken on purpose (a wrong constant in the table) is named,
with its line, module path and the path that computed it, and the defer run stops there."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import deferfuse
from deferfuse import config, engine
from deferfuse.capture import meta
from deferfuse.lower import registry, table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
aten = torch.ops.aten


def _program(x: torch.Tensor) -> float:
    y = torch.nn.functional.gelu(x * 3)
    z = y.sum(0) - y.mean()
    return (z * 2).abs().max().item()


@pytest.fixture
def broken(monkeypatch):
    """Break the lowering of an op by a factor 1.001 (its XLA results only); the executables made
    with it are forgotten after the test, and none is written to disk."""
    def breaking(op: torch._ops.OpOverload) -> None:
        original = table.get_lowering(op)

        def wrong(ctx, *args, **kwargs):
            return original.rule(ctx, *args, **kwargs) * 1.001
        monkeypatch.setitem(registry.LOWERINGS, op, dataclasses.replace(original, rule=wrong))
        meta.clear_cache()
        engine.clear_cache()
    with config.override(cache_dir=""):
        yield breaking
    meta.clear_cache()
    engine.clear_cache()


def test_an_agreeing_program_is_reported_as_agreeing():
    report = deferfuse.compare(_program, torch.randn(4, 5, generator=torch.Generator().manual_seed(0)))
    assert report.agree and report.op is None
    assert report.ops_compared >= 7
    assert str(report).startswith("deferfuse.compare: strict and defer agree:")


def test_first_sightings_are_named_as_the_path():
    meta.clear_cache()     # (a call is a first sighting while its metadata was never inferred)
    with config.override(eager_unseen_ops=True):
        report = deferfuse.compare(_program, torch.randn(4, 5))
    assert report.agree
    assert any(path.startswith("first sighting") for path in report.paths), report.paths


def test_executables_from_the_disk_cache_are_named_as_the_path(tmp_path):
    x = torch.randn(4, 5)
    with config.override(always_compile=True, cache_dir=str(tmp_path)):
        first = deferfuse.compare(_program, x)
        engine.clear_cache()        # (the executables now come from disk)
        second = deferfuse.compare(_program, x)
    assert first.agree and second.agree
    assert any(path.startswith("compiled (XLA, the first run") for path in first.paths), first.paths
    assert any(path.startswith("disk hit") for path in second.paths), second.paths


def test_a_broken_lowering_is_named_with_its_line_and_path(broken):
    broken(aten.mul.Tensor)
    with config.override(always_compile=True):
        report = deferfuse.compare(_program, torch.randn(4, 5))
    assert not report.agree
    assert report.op == "aten.mul.Tensor" and report.index == 1
    assert report.line.endswith(f"test_compare.py:{_program.__code__.co_firstlineno + 1}")
    assert report.path.startswith("compiled (XLA, the first run")
    text = str(report)
    assert "part at op #1" in text and "the op itself differs under defer" in text


def test_under_a_default_defer_mode():
    deferfuse.set_mode("defer")
    try:
        report = deferfuse.compare(_program, torch.randn(4, 5))
    finally:
        deferfuse.set_mode("strict")
    assert report.agree and report.unmatched == 0, str(report)
    assert report.ops_compared >= 7


def test_the_arguments_are_copied_for_each_run():
    x = torch.ones(3)

    def bump(t):
        t.add_(1)
        return t.sum().item()
    assert deferfuse.compare(bump, x).agree
    assert x.tolist() == [1.0, 1.0, 1.0]


def test_randomness_starts_from_the_same_state_in_both_runs():
    def noisy():
        return (torch.randn(8) * torch.rand(8)).sum().item()
    assert deferfuse.compare(noisy).agree


def _train_llama() -> None:
    from bench import zoo_models as zoo
    model = zoo.MODELS["llama"]
    m = model.make("tiny")
    optimizer = zoo.optimizer_for(m, model)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        zoo.train_step(m, model, optimizer, model.batch("tiny", g))


def test_a_zoo_model_with_a_broken_lowering_names_that_op_and_its_module(broken):
    broken(aten.silu.default)
    with config.override(always_compile=True):
        report = deferfuse.compare(_train_llama)
    print(report)
    assert not report.agree
    assert report.op == "aten.silu.default"
    assert report.module == "model.layers.0.mlp.act_fn (SiLUActivation)"
    assert report.path.startswith("compiled (XLA")
    assert "the op itself differs under defer" in report.difference


def test_the_zoo_model_agrees_when_nothing_is_broken():
    with config.override(always_compile=True):
        report = deferfuse.compare(_train_llama)
    assert report.agree, str(report)
    assert report.ops_compared > 800


# -- python -m deferfuse --compare -------------------------------------------------------------------

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    if "--break" in sys.argv:
        import dataclasses
        from deferfuse.lower import registry, table
        aten = torch.ops.aten
        original = table.get_lowering(aten.exp.default)
        registry.LOWERINGS[aten.exp.default] = dataclasses.replace(
            original, rule=lambda ctx, x: original.rule(ctx, x) + 0.5)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 8)
        loss = model(x).exp().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step}: {loss.item():.4f}")
""")


@pytest.mark.parametrize("broken_exp", [False, True], ids=["agreeing", "broken-exp"])
def test_the_command_line_compares_a_script(tmp_path, broken_exp):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=REPO, DEFERFUSE_CACHE_DIR="", DEFERFUSE_ALWAYS_COMPILE="1")
    env.pop("TORCHTPU_MODE", None)
    args = [sys.executable, "-m", "deferfuse", "--compare", str(script)] + (["--break"] if broken_exp else [])
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    out = done.stdout
    # (the script runs twice; with exp broken, the defer run stops in its first step)
    assert out.count("step 2:") == (1 if broken_exp else 2), out + done.stderr
    if not broken_exp:
        assert done.returncode == 0, out + done.stderr
        assert "strict and defer agree" in out
    else:
        assert done.returncode == 1, out + done.stderr
        assert "aten.exp.default at " + str(script) + ":16" in out
        assert "computed under defer by: compiled (XLA" in out
