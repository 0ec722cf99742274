"""bench/zoo.py end to end, on two tiny models: it runs, writes its JSON and chart, and finds
the deferred candidates equal to strict (the timings themselves are not checked)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from bench import flops  # noqa: E402  (the repository root is on sys.path under pytest)
from bench import zoo as zoo_bench  # noqa: E402
from bench import zoo_models as zoo  # noqa: E402


def test_zoo_bench_writes_equal_results_and_a_chart(tmp_path, capsys, monkeypatch):
    # (peaks another test of this worker measured at another thread count stay out of the
    # machine info this run records)
    from bench import harness
    monkeypatch.setattr(harness, "_peaks", {})
    path = tmp_path / "zoo.json"
    assert zoo_bench.main(["--size", "tiny", "--only", "gpt2,resnet", "--steps", "3", "--quick",
                           "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| gpt2" in out and "MFU % s/d/dd" in out and "gen MFU % s/d/dd" in out

    results = json.loads(path.read_text())
    assert set(results["models"]) == {"gpt2", "resnet"}
    for name, model in results["models"].items():
        assert model["error"] is None, name
        training = model["training"]["candidates"]
        assert len(training["strict"]["losses"]) == 3
        for candidate in ("defer", "deferred"):
            assert training[candidate]["error"] is None, (name, candidate)
            assert training[candidate]["equal"] is True, (name, candidate, training[candidate])
            assert training[candidate]["speedup"] > 0
    generation = results["models"]["gpt2"]["generation"]["candidates"]
    assert generation["defer"]["equal"] is True and generation["deferred"]["equal"] is True
    assert results["models"]["resnet"]["generation"] is None
    assert results["machine"]["torch"]
    assert path.with_suffix(".png").is_file()

    # MFU: the step's FLOPs (one strict step, counted once) over each candidate's steady time,
    # against the peak recorded in the machine info
    peak = results["plan"]["peak_gflops"]
    assert list(results["machine"]["peak_gflops"].values()) == [pytest.approx(peak, abs=0.05)]
    for name, model in results["models"].items():
        for what in ("training", "generation"):
            measurement = model[what]
            if measurement is None:
                continue
            counted = (flops.step_flops(zoo.MODELS[name], "tiny") if what == "training" else
                       flops.generate_flops(zoo.MODELS[name], "tiny", zoo_bench.QUICK_TOKENS))
            assert measurement["flops_per_call"] == counted > 0
            for candidate, run in measurement["candidates"].items():
                assert run["mfu"] == pytest.approx(counted / (run["steady_ms"] / 1e3) / (peak * 1e9)), \
                    (name, what, candidate)



def test_engine_time_splits_each_deferred_step_into_parts_that_add_up(always_compile):
    """bench/engine_time.py on the tiny Llama: each deferred step's parts add up to its time,
    XLA ran (compiled at once: ``always_compile``), and the engine's entry points are put back
    afterwards."""
    import argparse
    import math

    from bench import engine_time
    from deferfuse import engine
    from deferfuse.exec import runner
    entry_points = (engine.execute, runner.execute_xla)
    args = argparse.Namespace(model="llama", size="tiny", steps=2, engine="xla")
    with engine_time.engine_timers() as timers:
        split = engine_time.measure(args, timers)
    assert (engine.execute, runner.execute_xla) == entry_points
    assert split["ops_recorded"] > 0 and split["executions"] >= 1
    for step in split["steps"]:
        assert step["xla"] > 0 and step["record"] > 0
        assert all(step[part] >= 0 for part in engine_time.PARTS), step
    assert all(math.isfinite(split[part]) for part in engine_time.PARTS)
