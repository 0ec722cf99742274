"""Executable caching in memory, and tiered execution; the bounds of the in-memory caches.  The
disk cache, across processes, is tests/test_disk_cache.py."""

import json
import os
import subprocess
import sys
import textwrap

import torch

import deferfuse


def test_new_signature_runs_eagerly_then_compiled():
    x = torch.randn(64)
    deferfuse.reset_stats()
    with deferfuse.config.override(always_compile=False, eager_first_runs=2, background_compile=False,
                                   cache_dir=""):
        results = []
        for _ in range(4):
            with deferfuse.defer():
                results.append((x * 3.25 + 1).sin())
    s = deferfuse.stats()
    assert s["eager_replays"] == 2 and s["executions"] == 2 and s["compiles"] == 1
    for r in results:
        torch.testing.assert_close(r, (x * 3.25 + 1).sin())


def test_one_off_graph_never_compiles_and_a_repeated_one_compiles_in_background():
    import time
    from deferfuse.exec import executables
    x = torch.randn(128)
    deferfuse.reset_stats()
    with deferfuse.config.override(always_compile=False, eager_first_runs=1, background_compile=True,
                                   cache_dir=""):
        with deferfuse.defer():
            first = (x * 1.75 - 2).cos()
        assert deferfuse.stats()["eager_replays"] == 1 and not executables.compiles_pending()
        assert deferfuse.stats()["compiles"] == 0          # seen once: nothing compiled
        with deferfuse.defer():
            second = (x * 1.75 - 2).cos()                  # seen again: compiles off the path
        assert deferfuse.stats()["eager_replays"] == 2
        deadline = time.time() + 60
        while executables.compiles_pending() and time.time() < deadline:
            time.sleep(0.05)
        with deferfuse.defer():
            third = (x * 1.75 - 2).cos()
    s = deferfuse.stats()
    assert s["background_compiles"] == 1 and s["executions"] == 1
    torch.testing.assert_close(first, second)
    torch.testing.assert_close(first, third)


def test_engine_autotune_keeps_faster_eager_graphs_eager(monkeypatch):
    """A signature whose eager runs beat its XLA runs stays eager; results stay right."""
    from deferfuse.exec import autotune
    x = torch.randn(32, 16)
    deferfuse.reset_stats()
    # make XLA look slow: every XLA run reports a long time
    real = autotune.observe_xla_time
    monkeypatch.setattr(autotune, "observe_xla_time", lambda sig, seconds: real(sig, seconds + 10.0))
    with deferfuse.config.override(always_compile=False, eager_first_runs=1, background_compile=False,
                                   cache_dir="", autotune_engine=True):
        results = []
        for _ in range(7):
            with deferfuse.defer():
                results.append(torch.softmax(x * 2.5, dim=-1))
    s = deferfuse.stats()
    assert s["eager_chosen"] == 1
    assert s["executions"] == 3          # the three timed XLA runs, then eager
    for r in results:
        torch.testing.assert_close(r, torch.softmax(x * 2.5, dim=-1))


def test_engine_autotune_hears_xla_again_after_a_while(monkeypatch):
    """A choice made from timings of a busy moment is not forever: a signature kept eager is
    timed against XLA again every RECHECK_EAGER runs, and goes back to XLA if XLA now wins."""
    from deferfuse.exec import autotune
    x = torch.randn(32, 16)
    deferfuse.reset_stats()
    penalty = {"seconds": 10.0}
    real = autotune.observe_xla_time
    monkeypatch.setattr(autotune, "observe_xla_time", lambda sig, s: real(sig, s + penalty["seconds"]))
    monkeypatch.setattr(autotune, "RECHECK_EAGER", 4)
    with deferfuse.config.override(always_compile=False, eager_first_runs=1, background_compile=False,
                                   cache_dir="", autotune_engine=True):
        def run(times):
            for _ in range(times):
                with deferfuse.defer():
                    out = torch.softmax(x * 2.5, dim=-1)
                torch.testing.assert_close(out, torch.softmax(x * 2.5, dim=-1))
        run(1 + 3)                          # eager first run, three slow XLA runs: eager chosen
        assert deferfuse.stats()["eager_chosen"] == 1
        penalty["seconds"] = -10.0          # the machine is quiet now: XLA wins
        run(4)                              # kept eager; the fourth run triggers a new hearing
        executions = deferfuse.stats()["executions"]
        assert executions == 3
        run(3 + 5)                          # three timed XLA runs, then XLA stays
        assert deferfuse.stats()["executions"] == executions + 8
        assert deferfuse.stats()["eager_chosen"] == 1


ONE_OFF = textwrap.dedent("""
    import json, math, sys, torch, deferfuse
    x = torch.linspace(-3.0, 3.0, 1 << 12)
    with deferfuse.defer():
        y = x * 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    total = float(y.sum())
    strict = x * 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    stats = deferfuse.stats()
    print(json.dumps({"imported": [m for m in ("jax", "torch._dynamo", "sympy",
                                               "torch.distributed.tensor") if m in sys.modules],
                      "equal": torch.equal(y, strict), "plain": type(y) is torch.Tensor,
                      "total": total, "strict": float(strict.sum()),
                      "replays": stats["eager_replays"], "unseen": stats["unseen_ops_run"]}))
""")


def _one_off(tmp_path, **settings) -> dict:
    env = dict(os.environ, DEFERFUSE_CACHE_DIR=str(tmp_path))
    for name in ("DEFERFUSE_ALWAYS_COMPILE", "DEFERFUSE_EAGER_UNSEEN_OPS"):
        env.pop(name, None)
    env.update({"DEFERFUSE_" + name.upper(): value for name, value in settings.items()})
    out = subprocess.run([sys.executable, "-c", ONE_OFF], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["equal"] and report["total"] == report["strict"], report
    return report


def test_one_off_script_runs_as_strict_does(tmp_path):
    """With the default settings a one-off script's ops, each seen once, run at once on torch's
    kernels (eager_unseen_ops): no graph, no meta kernels (whose first use imports sympy), plain
    results (an op on a tensor subclass makes torch import torch.distributed.tensor), no JAX."""
    report = _one_off(tmp_path)
    assert report["unseen"] == 8 and report["replays"] == 0 and report["plain"], report
    assert report["imported"] == [], f"a one-off script imported {report['imported']}"


def test_one_off_graph_never_imports_jax_or_dynamo(tmp_path):
    """Recorded from the first op, a graph seen once replays eagerly, so a one-off script never
    pays JAX's import (about a second): lowering rules import it at their first use, the disk
    cache only when a graph comes back.  torch's Python meta kernels import Dynamo at their
    first call (torch._disable_dynamo); meta inference keeps them from it
    (deferfuse/capture/dynamo_free.py)."""
    report = _one_off(tmp_path, eager_unseen_ops="0")
    assert report["replays"] >= 1 and report["unseen"] == 0 and not report["plain"], report
    assert "jax" not in report["imported"], "JAX was imported by a one-off script"
    assert "torch._dynamo" not in report["imported"], "torch._dynamo was imported by a one-off script"


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_executables_in_memory_are_bounded_least_recently_used_first():
    """Found as a crash: the deep program suite compiled thousands of graphs in one process,
    each executable kept for good (~1.6 MB and 7 memory mappings), until XLA's compiler ran out
    of mappings (vm.max_map_count) and segfaulted.  The cache keeps executable_cache_size of
    them, dropping the least recently used; a hot signature stays, a dropped one still gives
    the right result when it comes back, and the process's mappings stop growing."""
    from deferfuse import engine
    from deferfuse.exec import executables
    engine.clear_cache()

    def run(n: int) -> torch.Tensor:
        x = torch.arange(n, dtype=torch.float32)
        with deferfuse.defer():
            y = (x * 0.5 + 2.0).tanh() * x
        return y

    with deferfuse.config.override(always_compile=True, cache_dir="", executable_cache_size=8):
        hot = run(3)
        deferfuse.reset_stats()
        for n in range(4, 44):
            run(n)
            torch.testing.assert_close(run(3), hot)   # the hot graph, between every new one
            if n == 24:
                maps = _maps()
        stats = deferfuse.stats()
        assert stats["compiles"] == 40, stats   # the hot graph compiled once, before
        assert stats["executables_evicted"] == 33   # 41 executables, 8 kept
        assert executables.size() == 8
        assert _maps() <= maps + 8   # (40 more compiles left the mappings where they were)
        torch.testing.assert_close(run(4), (torch.arange(4.0) * 0.5 + 2.0).tanh() * torch.arange(4.0))
        assert deferfuse.stats()["compiles"] == 41   # evicted, compiled again


def test_executables_in_memory_are_bounded_by_the_mappings_they_hold(monkeypatch):
    """Found as a crash: the model zoo bench (bench/zoo.py) died of SIGSEGV after nine models
    ("LLVM compilation error: Cannot allocate memory"), with fewer executables than
    executable_cache_size: a model's executable holds hundreds of memory mappings (a Llama
    training step ~1,450), not 7.  Past executables.MAPPING_SHARE of the process's limit, the oldest
    executables go.  Here the limit is made small: 60 mappings above what the process holds."""
    from deferfuse import engine
    from deferfuse.exec import executables
    with deferfuse.config.override(always_compile=True, cache_dir=""), deferfuse.defer():
        torch.ones(2) * 3   # (JAX's client started: its own mappings are not the cache's)
    engine.clear_cache()
    budget = _maps() + 60
    monkeypatch.setattr(executables, "max_map_count", lambda: int(budget / executables.MAPPING_SHARE) + 1)

    def run(n: int) -> torch.Tensor:
        x = torch.arange(n, dtype=torch.float32)
        with deferfuse.defer():
            y = (x * 0.25 - 1.0).sin() * x
        return y

    with deferfuse.config.override(always_compile=True, cache_dir="", executable_cache_size=0):
        deferfuse.reset_stats()
        for n in range(1, 41):
            torch.testing.assert_close(run(n), (torch.arange(float(n)) * 0.25 - 1.0).sin() * torch.arange(float(n)))
            assert _maps() <= budget + 20   # (one executable's worth above the budget at most)
        assert deferfuse.stats()["executables_evicted"] > 0
        assert 0 < executables.size() < 40


def test_executables_in_memory_are_bounded_in_bytes():
    """Issue 40: a cache bounded only by count held 512 model-step executables (~50 MB each
    resident).  Each executable is sized by the kernels its compile mapped; past
    executable_cache_bytes the least recently used go, and the hot one stays."""
    from deferfuse import engine
    from deferfuse.exec import executables
    engine.clear_cache()

    def run(n: int) -> torch.Tensor:
        x = torch.arange(n, dtype=torch.float32)
        with deferfuse.defer():
            y = (x * 0.75 + 1.0).cos() * x
        return y

    with deferfuse.config.override(always_compile=True, cache_dir="", executable_cache_size=0):
        run(2)
        one = executables.held_bytes()
        assert one >= executables.KERNEL_BYTES
        with deferfuse.config.override(executable_cache_bytes=6 * one):
            deferfuse.reset_stats()
            hot = run(3)
            for n in range(4, 30):
                run(n)
                torch.testing.assert_close(run(3), hot)
                assert executables.held_bytes() <= 6 * one + one
            assert deferfuse.stats()["executables_evicted"] >= 15
            assert deferfuse.stats()["compiles"] == 27   # (the hot graph never evicted)
    engine.clear_cache()
    assert executables.held_bytes() == 0


def test_the_metadata_cache_is_bounded(monkeypatch):
    """A program whose shapes never repeat must not grow the metadata cache without end: past
    its limit it is emptied, and inference goes on giving strict's metadata."""
    from deferfuse.capture import meta
    meta.clear_cache()
    monkeypatch.setattr(meta, "CACHE_LIMIT", 16)
    with deferfuse.config.override(always_compile=True):
        for n in range(1, 60):
            with deferfuse.defer():
                y = torch.ones(n, 2) * 2 + 1
            assert y.shape == (n, 2) and torch.equal(y, torch.full((n, 2), 3.0))
            assert meta.cache_size() <= 16
