"""What debug mode costs on a zoo model's training step, check by check, next to strict.

    python -m bench.debug_overhead                     # llama, tiny and small, 12 shuffled rounds
    python -m bench.debug_overhead --model gpt2 --sizes tiny --rounds 5
    python -m bench.debug_overhead --zoo               # every zoo model at tiny under all checks

A step is forward, backward and AdamW (bench/zoo_models.py's ``train_step``).  Each round runs
every variant once, in a seeded shuffled order, on its own copy of the model (so each variant
trains the same way):

  strict       plain PyTorch
  debug        debug mode with its default checks: index bounds, overlapping writes,
               uninitialized reads (check_uninitialized); every op labels its autograd node
               with its line and module (for errors in backward)
  debug-uninit-off   the same without check_uninitialized: what tracking memory costs
  debug-no-places    the same without the forward-line labels and module paths (no setting
               turns them off; they are patched out here): what naming them costs
  debug-all    every check, check_nans too (one pass over each floating-point output)

It prints and writes (bench/results/debug_overhead.json) the median and the fastest step time
of each and the median CPU time of the process (on a shared machine the fastest round is the
least disturbed, and other processes' work does not count in CPU time), their ratios to strict
and the extra time per aten op.  ``--zoo`` runs every zoo model at tiny for two
steps (and ``generate()`` for the language models) under debug with every check on, and lists
what each check reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import deferfuse
from deferfuse.debugging import backward, scopes
from bench import zoo_models as zoo
from bench.harness import RESULTS_DIR

VARIANTS: dict[str, dict[str, bool]] = {
    "debug": dict(check_uninitialized=True, check_nans=False),
    "debug-uninit-off": dict(check_uninitialized=False, check_nans=False),
    "debug-no-places": dict(check_uninitialized=True, check_nans=False),
    "debug-all": dict(check_uninitialized=True, check_nans=True),
}


@contextlib.contextmanager
def _without_places():
    """Debug mode without labelling autograd nodes with forward lines nor tracking modules
    (no setting turns these off: this variant measures what they cost)."""
    saved = backward.remember, scopes.hold, scopes.release
    backward.remember = lambda *args: None
    scopes.hold = scopes.release = lambda: None
    try:
        yield
    finally:
        backward.remember, scopes.hold, scopes.release = saved


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _stepper(name: str, size: str, variant: str) -> Callable[[], float]:
    """A function running one training step of its own model under ``variant``; returns seconds."""
    model = zoo.MODELS[name]
    m = model.make(size)
    optimizer = zoo.optimizer_for(m, model)
    g = torch.Generator().manual_seed(1)
    batches = [model.batch(size, g) for _ in range(4)]
    turn = [0]

    def step() -> tuple[float, float]:
        batch = batches[turn[0] % len(batches)]
        turn[0] += 1
        started, cpu = time.perf_counter(), time.process_time()
        if variant == "strict":
            zoo.train_step(m, model, optimizer, batch)
        else:
            places = _without_places() if variant == "debug-no-places" else contextlib.nullcontext()
            with places, deferfuse.config.override(**VARIANTS[variant]), deferfuse.debug():
                zoo.train_step(m, model, optimizer, batch)
        return time.perf_counter() - started, time.process_time() - cpu
    return step


def ops_per_step(name: str, size: str) -> int:
    model = zoo.MODELS[name]
    m = model.make(size)
    optimizer = zoo.optimizer_for(m, model)
    batch = model.batch(size, torch.Generator().manual_seed(1))
    zoo.train_step(m, model, optimizer, batch)   # (the optimizer's state exists from here)
    with _Counter() as counter:
        zoo.train_step(m, model, optimizer, batch)
    return counter.ops


def time_steps(name: str, size: str, rounds: int, warmup: int = 2) -> dict[str, Any]:
    variants = ["strict", *VARIANTS]
    steppers = {v: _stepper(name, size, v) for v in variants}
    for v in variants:
        for _ in range(warmup):
            steppers[v]()
    samples: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    order = random.Random(0)
    for _ in range(rounds):
        shuffled = list(variants)
        order.shuffle(shuffled)
        for v in shuffled:
            wall, used = steppers[v]()
            samples[v].append(wall)
            cpu[v].append(used)
    ops = ops_per_step(name, size)
    medians = {v: statistics.median(s) * 1e3 for v, s in samples.items()}
    # (the fastest round of each: on a shared machine, the one least disturbed by other work;
    # and the process's CPU time, which other processes' work does not add to)
    fastest = {v: min(s) * 1e3 for v, s in samples.items()}
    cpu_ms = {v: statistics.median(s) * 1e3 for v, s in cpu.items()}
    return {
        "model": name, "size": size, "rounds": rounds, "ops_per_step": ops, "threads": torch.get_num_threads(),
        "median_ms": {v: round(ms, 2) for v, ms in medians.items()},
        "min_ms": {v: round(ms, 2) for v, ms in fastest.items()},
        "cpu_ms": {v: round(ms, 2) for v, ms in cpu_ms.items()},
        "ratio_to_strict": {v: round(ms / medians["strict"], 2) for v, ms in medians.items()},
        "min_ratio_to_strict": {v: round(ms / fastest["strict"], 2) for v, ms in fastest.items()},
        "cpu_ratio_to_strict": {v: round(ms / cpu_ms["strict"], 2) for v, ms in cpu_ms.items()},
        "extra_us_per_op": {v: round((ms - fastest["strict"]) * 1e3 / ops, 1)
                            for v, ms in fastest.items() if v != "strict"},
        "extra_cpu_us_per_op": {v: round((ms - cpu_ms["strict"]) * 1e3 / ops, 1)
                                for v, ms in cpu_ms.items() if v != "strict"},
    }


def zoo_sweep() -> list[dict[str, Any]]:
    """Every zoo model at tiny, two steps (and generate()), strict and under every check."""
    rows = []
    for name, model in zoo.MODELS.items():
        def run() -> None:
            m = model.make("tiny")
            optimizer = zoo.optimizer_for(m, model)
            g = torch.Generator().manual_seed(1)
            for _ in range(2):
                zoo.train_step(m, model, optimizer, model.batch("tiny", g))
            if model.generates:
                m.eval()
                zoo.generate(m, model.prompt("tiny", torch.Generator().manual_seed(2)), tokens=4)
        run()   # (warm: imports, first calls)
        started = time.perf_counter()
        run()
        strict = time.perf_counter() - started
        reports = []
        for check, settings in (("uninitialized", dict(check_uninitialized=True, check_nans=False)),
                                ("all", dict(check_uninitialized=True, check_nans=True))):
            started = time.perf_counter()
            try:
                with deferfuse.config.override(**settings), deferfuse.debug():
                    run()
            except deferfuse.errors.DebugCheckError as exc:
                reports.append({"checks": check, "error": type(exc).__name__, "message": str(exc).splitlines()[:2]})
            if check == "all":
                debug = time.perf_counter() - started
        rows.append({"model": name, "strict_s": round(strict, 3), "debug_all_checks_s": round(debug, 3),
                     "ratio": round(debug / strict, 1), "reports": reports})
        print(f"{name:14s} strict {strict:6.2f} s  debug, all checks {debug:6.2f} s  x{debug / strict:4.1f}  "
              f"reports: {[r['checks'] + ': ' + r['error'] for r in reports] or 'none'}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama", choices=list(zoo.MODELS))
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--zoo", action="store_true", help="every zoo model at tiny under every check")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's threads (default 1: on a shared 2-core VM, torch's two OpenMP "
                             "threads wait for each other whenever another process runs; 0: torch's own)")
    parser.add_argument("--out", default=str(RESULTS_DIR / "debug_overhead.json"))
    options = parser.parse_args(argv)
    if options.threads:
        torch.set_num_threads(options.threads)
    results: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if options.zoo:
        results["zoo"] = zoo_sweep()
    else:
        results["steps"] = []
        for size in options.sizes.split(","):
            row = time_steps(options.model, size, options.rounds)
            results["steps"].append(row)
            print(f"{options.model} {size}: {row['ops_per_step']} aten ops a step")
            print(f"  {'':18s} {'median':>9s}     x       {'fastest':>9s}     x       {'cpu':>9s}     x")
            for v, ms in row["median_ms"].items():
                extra = row["extra_us_per_op"].get(v)
                extra_cpu = row["extra_cpu_us_per_op"].get(v)
                print(f"  {v:18s} {ms:9.2f} ms  x{row['ratio_to_strict'][v]:5.2f}  "
                      f"{row['min_ms'][v]:9.2f} ms  x{row['min_ratio_to_strict'][v]:5.2f}  "
                      f"{row['cpu_ms'][v]:9.2f} ms  x{row['cpu_ratio_to_strict'][v]:5.2f}"
                      + (f"  +{extra:.1f} us/op (+{extra_cpu:.1f} cpu)" if extra is not None else ""))
    try:
        previous = json.loads(open(options.out).read())
    except (OSError, ValueError):
        previous = {}
    previous.update(results)
    with open(options.out, "w") as f:
        json.dump(previous, f, indent=1)
    print(f"written to {options.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
