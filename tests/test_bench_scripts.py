"""Bench scripts that measure the machine rather than deferfuse: they run end to end and write
what they print (the timings themselves are not checked)."""

from __future__ import annotations

import json

import pytest

from bench import xla_flags


def test_xla_flags_times_the_jax_step_beside_strict_in_fresh_processes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(xla_flags, "RESULTS_DIR", tmp_path)
    assert xla_flags.main(["--only", "onednn", "--rounds", "1", "--steps", "1", "--warmup", "1"]) == 0
    found = json.loads((tmp_path / "xla_flags.json").read_text())
    assert found["settings"] == {"onednn": "--xla_cpu_use_onednn=true"}
    assert len(found["samples_ms"]["strict"]) == 1 and len(found["samples_ms"]["onednn"]) == 1
    assert found["speedup_over_strict"]["onednn"] > 0
    assert "XLA_FLAGS='--xla_cpu_use_onednn=true'" in capsys.readouterr().out


def test_xla_flags_names_an_unknown_setting():
    with pytest.raises(SystemExit, match="unknown settings \\['avx9'\\]"):
        xla_flags.main(["--only", "avx9"])


def test_debug_overhead_times_every_variant_of_a_step(tmp_path):
    from bench import debug_overhead
    out = tmp_path / "debug_overhead.json"
    assert debug_overhead.main(["--sizes", "tiny", "--rounds", "1", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["steps"]
    assert set(row["median_ms"]) == {"strict", *debug_overhead.VARIANTS}
    assert row["ops_per_step"] > 500


def test_loops_times_a_loop_of_changing_lengths_from_its_second_epoch(tmp_path, monkeypatch):
    from bench import loops
    monkeypatch.setattr(loops, "RESULTS_DIR", tmp_path)
    assert loops.main(["--models", "gpt2", "--periods", "0", "--rounds", "1", "--steps", "gpt2=6",
                       "--size", "tiny", "--lengths", "3", "--deterministic", "--name", "t"]) == 0
    (row,) = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert row["lengths"] == 3 and row["deterministic"] and row["same_losses"]
    for side in ("strict", "defer"):
        assert 0 < row[side]["after_skip_s"] < row[side]["total_s"]


def test_generate_times_compiled_generate_beside_strict_and_checks_its_tokens(tmp_path, monkeypatch, capsys):
    from bench import generate, harness
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    assert generate.main(["--models", "gpt2", "--size", "tiny", "--tokens", "4", "--rounds", "1",
                          "--warmup", "0", "--lanes", "deferfuse"]) == 0
    (row,) = json.loads((tmp_path / "generate.json").read_text())["rows"]
    assert set(row["lanes"]) == {"strict", "deferfuse"}
    ours = row["lanes"]["deferfuse"]
    assert ours["same_as_strict"] and ours["same_as_dynamic_cache"] and not ours["ids_changed"]
    assert 1 <= ours["first_call_counts"]["compiled_graphs"] <= 3
    assert row["counts_while_timed"]["compiled_specializations"] == 0
    assert "tokens/s" in capsys.readouterr().out
