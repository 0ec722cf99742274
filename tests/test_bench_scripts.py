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


@pytest.mark.slow   # (two fresh processes: ~20 s)
@pytest.mark.parametrize("model, way", [("mlp", "block"), ("gelu", "step-block")])
def test_loops_times_a_loop_inside_one_defer_block(tmp_path, monkeypatch, model, way):
    """The loop in one ``with deferfuse.defer():`` (block), or one around each step (step-block)."""
    from bench import loops
    monkeypatch.setattr(loops, "RESULTS_DIR", tmp_path)
    assert loops.main(["--models", model, "--periods", "2", "--rounds", "1", "--steps", f"{model}=8",
                       "--way", way, "--name", "t"]) == 0
    (row,) = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert row["way"] == way and row["same_losses"]
    # deferfuse ran the loop, at its default settings (its stats were reported): the block tier
    # runs a short loop's first block at once while it finds the loop (exec/blocks.py)
    assert "flushes" in row["defer"] and (row["defer"]["flushes"] or row["defer"]["runs_at_once"])


def test_loops_times_a_loop_with_no_optimizer_that_reads_at_its_end(tmp_path, monkeypatch):
    from bench import loops
    monkeypatch.setattr(loops, "RESULTS_DIR", tmp_path)
    assert loops.main(["--models", "sampler", "--periods", "0", "--rounds", "1", "--steps", "sampler=20",
                       "--name", "t"]) == 0
    (row,) = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert row["model"] == "sampler" and row["same_losses"]
    assert row["strict"]["total_s"] > 0 and row["defer"]["total_s"] > 0
    with pytest.raises(ValueError, match="reads only at its end"):
        loops.main(["--models", "sampler", "--periods", "10", "--rounds", "1", "--name", "t"])


def test_read_cost_times_a_step_and_its_read_in_both_modes(tmp_path, monkeypatch, capsys):
    from bench import read_cost
    monkeypatch.setattr(read_cost, "RESULTS_DIR", tmp_path)
    assert read_cost.main(["--steps", "120", "--rounds", "1", "--name", "t"]) == 0
    found = json.loads((tmp_path / "t.json").read_text())
    assert found["losses_agree"] and found["threads"] == 1
    # the defer lane runs at deferfuse's defaults, not at the suite's (tests/conftest.py turns
    # the tiers off): its steps from the first few on run at once, as in a user's process
    (run,) = found["runs"]["defer"]
    assert run["steps_at_once"] > 100
    for mode in ("strict", "defer"):
        assert 0 < found[mode]["read_us"] < found[mode]["step_us"]
    assert "loss.item()" in capsys.readouterr().out


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
    # (the split: a prompt call, three decoding calls and generate()'s own loop make the whole)
    for lane in row["lanes"].values():
        parts = (lane["prompt_call_median_s"], lane["decoding_calls_median_s"], lane["outside_calls_median_s"])
        assert all(p > 0 for p in parts) and abs(sum(parts) - lane["median_s"]) < 0.5 * lane["median_s"]
    assert "tokens/s" in capsys.readouterr().out


def test_a_steps_flops_are_flop_counter_modes_and_mfu_is_flops_over_time_over_peak():
    """bench/flops.py counts a tiny zoo step as FlopCounterMode does (with its formulas for the
    CPU kernels torch's counter lacks), and harness.mfu is that count over the time, as a
    fraction of the peak."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from bench import flops, harness
    from bench import zoo_models as zoo
    bert = zoo.MODELS["bert"]   # mm, addmm and bmm only: torch's counter alone
    network = bert.make("tiny")
    batch = bert.batch("tiny", torch.Generator().manual_seed(1))
    with FlopCounterMode(display=False) as counter:
        zoo.train_step(network, bert, zoo.optimizer_for(network, bert), batch)
    counted = flops.step_flops(bert, "tiny")
    assert counted == counter.get_total_flops() > 0

    llama = zoo.MODELS["llama"]   # SDPA's CPU flash kernel: counted as its math path's products
    network = llama.make("tiny")
    batch = llama.batch("tiny", torch.Generator().manual_seed(1))
    with torch.no_grad():
        with flops.counter() as counter:
            zoo.loss_of(network, llama, batch)
        with sdpa_kernel(SDPBackend.MATH):
            unfused = flops.count(lambda: zoo.loss_of(network, llama, batch))
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu in counter.get_flop_counts()["Global"]
    assert counter.get_total_flops() == unfused > 0

    encoder = zoo.MODELS["encoder-eval"]   # the fused encoder layer: as its unfused path
    network = encoder.make("tiny")
    x = encoder.batch("tiny", torch.Generator().manual_seed(1))["x"]
    with torch.no_grad():
        fast_path = flops.count(lambda: network(x))
        network.train()   # (no fast path in training mode)
        slow_path = flops.count(lambda: network(x))
    assert fast_path == slow_path == flops.step_flops(encoder, "tiny") > 0

    peak = harness.peak_gflops(size=256, reps=2)
    assert peak > 0 and harness.peak_gflops(size=256, reps=2) == peak   # measured once
    assert harness.mfu(counted, 0.5, peak) == counted / 0.5 / (peak * 1e9)
    assert harness.mfu(None, 0.5, peak) is None and harness.mfu(counted, None, peak) is None


def test_compile_bench_shows_each_candidates_mfu(capsys):
    """bench/compile.py's table gains an MFU column (strict alone, tiny, in a child process)."""
    from bench import compile as compile_bench
    from bench import flops, harness
    from bench import zoo_models as zoo
    assert compile_bench.main(["--model", "gpt2", "--size", "tiny", "--steps", "2", "--warmup", "0",
                               "--only", "strict"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("candidate"))
    assert header.split()[-2:] == ["MFU", "%"]
    row = next(line for line in out.splitlines() if line.startswith("strict"))
    steady_ms, mfu_percent = float(row.split()[2]), float(row.split()[-1])
    expected = harness.mfu(flops.step_flops(zoo.MODELS["gpt2"], "tiny"), steady_ms / 1e3,
                           harness.peak_gflops())
    assert mfu_percent == pytest.approx(100 * expected, abs=0.06)


def test_openmp_teams_times_strict_before_and_after_deferred_steps(tmp_path):
    from bench import openmp_teams
    out = tmp_path / "t.json"
    assert openmp_teams.main(["--model", "gpt2", "--size", "tiny", "--steps", "2", "--json", str(out)]) == 0
    found = json.loads(out.read_text())
    assert found["before"]["step_ms"] > 0 and found["after"]["mul_us"] > 0
    assert found["guest_calls"] >= 0 and found["threads_after"]


def test_openmp_teams_times_a_thread_made_for_a_call(capsys):
    import shutil
    from bench import openmp_teams
    if shutil.which("g++") is None:
        pytest.skip("no g++: the host kernels are not built here either")
    assert openmp_teams.main(["--thread-cost"]) == 0
    assert "a thread made for a 2-thread OpenMP region: median" in capsys.readouterr().out


def test_team_release_times_a_step_with_the_serving_team_released_and_kept(capsys):
    from bench import team_release
    assert team_release.main(["--model", "gpt2", "--size", "tiny", "--rounds", "2", "--warm-up", "1"]) == 0
    out = capsys.readouterr().out
    assert "released / kept" in out and "team released" in out
    for lane in team_release.LANES:
        assert f"  {lane}" in out


def test_adamw_parts_splits_a_deferred_optimizer_step(capsys):
    """bench.adamw_parts times each part of a deferred AdamW step's flush (it broke once when the
    engine's run no longer called the function it hooked)."""
    from bench import adamw_parts
    adamw_parts.main(["--count", "3", "--steps", "2", "--warmup", "1"])
    out = capsys.readouterr().out
    for part in ("strict step", "defer: recording", "flush: run executable", "write-back copies"):
        assert part in out


def test_dispatch_floor_times_each_lane_and_records_every_op(capsys):
    """bench.dispatch_floor's deferfuse lane records each op of the chain (nothing at once)."""
    import deferfuse
    from bench import dispatch_floor
    deferfuse.reset_stats()
    best = dispatch_floor.measure(ops=20, rounds=1, calls=1)
    assert set(best) == set(dispatch_floor.lanes(2)) and all(us > 0 for us in best.values())
    assert deferfuse.stats()["ops_recorded"] >= 20 * 31   # (30 warm-up calls and the timed one)
    assert dispatch_floor.main(["--ops", "10", "--rounds", "1", "--calls", "1"]) == 0
    assert "over the floor" in capsys.readouterr().out


def test_a_bench_child_runs_at_deferfuses_defaults_whatever_its_caller_sets(monkeypatch):
    """The suite turns the tiers off (tests/conftest.py); a bench script whose defer lane says it
    runs "every setting at its default" must not inherit that: bench.read_cost's MLP ran every
    step deferred, 4.7x strict, under the suite, and its losses drifted past its check."""
    from bench.harness import default_settings_env
    monkeypatch.setenv("DEFERFUSE_EAGER_SEGMENTS", "0")
    monkeypatch.setenv("TORCHTPU_MODE", "defer")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    env = default_settings_env(DEFERFUSE_CACHE_DIR="/somewhere")
    assert not [k for k in env if k.startswith("DEFERFUSE_") and k != "DEFERFUSE_CACHE_DIR"]
    assert "TORCHTPU_MODE" not in env
    assert env["DEFERFUSE_CACHE_DIR"] == "/somewhere" and env["OMP_NUM_THREADS"] == "3"


@pytest.mark.slow   # (four fresh processes: ~8 s)
def test_warm_start_times_a_blocks_first_calls_on_a_warm_cache(capsys):
    from bench import warm_start
    assert warm_start.main(["--calls", "3", "--runs", "1"]) == 0
    out = capsys.readouterr().out
    assert "run 1 strict" in out and "run 1 defer" in out and "defer - strict over the first 3 calls" in out


@pytest.mark.slow   # (three fresh processes loading the zoo's Llama)
def test_default_mode_runs_generate_and_a_loop_three_ways_with_one_printed_loss(tmp_path, monkeypatch, capsys):
    from bench import default_mode, harness
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    assert default_mode.main(["--calls", "2", "--steps", "3"]) == 0
    found = json.loads((tmp_path / "default_mode.json").read_text())
    assert set(found["results"]) == set(default_mode.WAYS)
    assert "(equal)" in capsys.readouterr().out


@pytest.mark.slow   # (Inductor compiles the tiny Llama's step: ~40 s)
def test_compile_side_by_side_splits_deferfuses_step_and_stricts(capsys):
    """bench.compile's side-by-side lane: beside the four lanes' times, where deferfuse's step
    goes (its XLA programs, the host kernels in them and their hand-over, the rest outside) and
    how much of strict's step its products and attention take."""
    from bench import compile as bench_compile
    assert bench_compile.main(["--model", "llama", "--size", "tiny", "--only", "side-by-side",
                               "--steps", "2", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "side by side, one process, alternating steps: strict" in out
    assert "deferfuse's step in its XLA programs" in out and "AdamW, eager" in out
    assert "strict's products and attention (one step under torch's profiler)" in out


@pytest.mark.slow
def test_call_overhead_times_a_decoding_call_with_the_inputs_generate_renews(tmp_path, monkeypatch, capsys):
    from bench import call_overhead, harness
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    assert call_overhead.main(["--models", "gpt2", "--size", "tiny", "--calls", "20", "--rounds", "1"]) == 0
    (row,) = json.loads((tmp_path / "call_overhead.json").read_text())["rows"]
    # (the token, its position and the mask are new at each call of generate()'s decoding step)
    assert 1 <= row["new_each_call"] < row["inputs"]
    assert set(row["median_us"]) == {"with XLA", "runtime alone"}
    assert "runtime alone" in capsys.readouterr().out
