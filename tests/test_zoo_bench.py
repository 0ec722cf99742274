"""bench/zoo.py end to end, on two tiny models: it runs, writes its JSON and chart, and finds
the deferred candidates equal to strict (the timings themselves are not checked)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from bench import zoo as zoo_bench  # noqa: E402  (the repository root is on sys.path under pytest)


def test_zoo_bench_writes_equal_results_and_a_chart(tmp_path, capsys):
    path = tmp_path / "zoo.json"
    assert zoo_bench.main(["--size", "tiny", "--only", "gpt2,resnet", "--steps", "3", "--quick",
                           "--json", str(path)]) == 0
    assert "| gpt2" in capsys.readouterr().out

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
