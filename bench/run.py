"""Run every benchmark workload side by side and print one table.

    python -m bench.run                 # full run, ~5-10 minutes on 2 cores
    python -m bench.run --quick         # fewer sizes, shorter budgets, ~1-2 minutes
    python -m bench.run --only gelu     # workloads whose name contains "gelu"

Columns: strict eager PyTorch, defer (deferfuse, default settings), deferred (deferfuse with
the block tier off, eager_blocks=0: every block recorded and fused), jax.jit of the same
computation written in JAX (our ceiling), torch.compile (Inductor), and the memory floor (one
copy_ of the input bytes).  Times are medians in milliseconds of interleaved runs, in one process.  Results go to
bench/results/<name>.json.
"""

from __future__ import annotations

import argparse
import sys
import time

from bench.harness import (Budget, Result, busy_machine_warning, machine_info,
                           private_executable_cache, save_results)
from bench.workloads import DeferProbe, all_specs, run_cold_start, run_spec

COLUMNS = ("strict", "defer", "deferred", "jax", "compile", "floor")
SHORT_STATUS = {"unavailable": "n/a", "failed": "FAIL", "mismatch": "WRONG"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="fewer sizes and shorter budgets (about two minutes)")
    parser.add_argument("--only", metavar="NAME", action="append", default=[],
                        help="run only workloads whose name contains NAME (repeatable; "
                             "'cold-start' selects the fresh-process test)")
    parser.add_argument("--no-compile", action="store_true",
                        help="leave out the torch.compile column (its compiles take seconds)")
    parser.add_argument("--name", default=None,
                        help="results file name (default: 'quick' or 'full')")
    parser.add_argument("--verbose", action="store_true",
                        help="print the traceback of any candidate that fails")
    return parser.parse_args(argv)


def _cell(result: Result, column: str) -> str:
    timing = result.timings.get(column)
    if timing is None:
        return "-"
    if timing.median_ms is None:
        return SHORT_STATUS.get(timing.status, timing.status)
    text = f"{timing.median_ms:.3f}" if timing.median_ms < 10 else f"{timing.median_ms:.1f}"
    return (text + ("!" if timing.status == "mismatch" else "")
            + ("*" if timing.warning else ""))


def _ratio(numerator: float | None, denominator: float | None) -> str:
    if numerator is None or denominator is None or denominator == 0:
        return "-"
    ratio = numerator / denominator
    return f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.3f}x"


def format_table(results: list[Result]) -> str:
    header = ("workload", "size", *(f"{c} ms" for c in COLUMNS), "speed-up", "deferred speed-up",
              "defer/jax")
    rows = [header]
    for result in results:
        defer = result.median("defer")
        rows.append((result.workload, result.size, *(_cell(result, c) for c in COLUMNS),
                     _ratio(result.median("strict"), defer),
                     _ratio(result.median("strict"), result.median("deferred")),
                     _ratio(defer, result.median("jax"))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for index, row in enumerate(rows):
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
        cells += [cell.rjust(width) for cell, width in zip(row[2:], widths[2:])]
        lines.append("  ".join(cells))
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_notes(results: list[Result]) -> str:
    lines = ["speed-up = strict median / defer median (above 1x: defer is faster); deferred "
             "speed-up likewise for the deferred column; defer/jax = defer median / jax median "
             "(1x: we match hand-written JAX).",
             "'!' = output disagrees with strict; '*' = see the warning below; "
             "n/a = not available; FAIL = raised (reasons below)."]
    reasons: dict[str, list[str]] = {}
    for result in results:
        for name, timing in result.timings.items():
            if timing.status != "ok":
                key = f"{name} {timing.status}: {timing.reason}"
                reasons.setdefault(key, []).append(f"{result.workload} {result.size}")
            if timing.warning:
                key = f"{name} warning: {timing.warning}"
                reasons.setdefault(key, []).append(f"{result.workload} {result.size}")
    for key, where in reasons.items():
        lines.append(f"  {key}  [{', '.join(where[:4])}{', ...' if len(where) > 4 else ''}]")
    for result in results:
        label = f"{result.workload} {result.size}"
        stats = result.notes.get("defer_stats")
        if stats:
            lines.append(
                f"  {label}: defer ran {stats['blocks_run_at_once_per_call']:.2f} of its blocks at "
                f"once per call; over its {stats['calls']} calls and deferred's "
                f"{stats['deferred_calls']}, "
                f"recorded {stats['ops_recorded_per_call']:.0f} ops/call, "
                f"{stats['executions_per_call']:.2f} executions/call, "
                f"{stats['flushes_per_call']:.2f} flushes/call {stats['flush_reasons']}, "
                f"{stats['compiles']} compiles, {stats['cache_hits']} cache hits, "
                f"{stats['cache_misses']} misses, "
                f"{result.timings['defer'].warmup_calls} warm-up calls"
                + (f", fallbacks {stats['fallbacks']}" if stats["fallbacks"] else ""))
        us_per_op = result.notes.get("us_per_op")
        if us_per_op:
            lines.append(f"  {label}: " + ", ".join(f"{name} {value:.1f} us/op"
                                                     for name, value in us_per_op.items()))
        first = result.notes.get("first_call_ms", {})
        slow_first = {name: ms for name, ms in first.items()
                      if name in ("defer", "jax", "compile") and ms is not None}
        if slow_first and result.workload != "per-op":
            lines.append(f"  {label}: first call (includes compile) "
                         + ", ".join(f"{name} {ms:.0f} ms" for name, ms in slow_first.items()))
        if result.workload == "cold-start":
            parts = [f"{name} import {result.notes[f'{name}_import_ms']:.0f} ms + compute "
                     f"{result.notes[f'{name}_compute_ms']:.0f} ms"
                     for name in ("strict", "defer") if f"{name}_import_ms" in result.notes]
            lines.append(f"  {label}: launch to printed result; " + "; ".join(parts)
                         + (f"; defer counters {result.notes['defer_process_stats']}"
                            if result.notes.get("defer_process_stats") else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with private_executable_cache() as cache_dir:
        return run(args, cache_dir)


def run(args: argparse.Namespace, cache_dir: str) -> int:
    budget = (Budget(seconds=0.6, warmup=1, min_rounds=3, max_rounds=15, max_warmup_seconds=10)
              if args.quick else
              Budget(seconds=2.5, warmup=2, min_rounds=5, max_rounds=50, max_warmup_seconds=30))
    busy = busy_machine_warning()
    if busy:
        print(busy)
    machine_at_start = machine_info()
    probe = DeferProbe()
    if probe.unavailable:
        print(f"note: the defer column is skipped: {probe.unavailable}")

    specs = all_specs(args.quick)
    want_cold = not args.only or any(name in "cold-start" for name in args.only)
    if args.only:
        specs = [s for s in specs if any(name in s.name for name in args.only)]
    if args.no_compile:
        for spec in specs:
            spec.columns = tuple(c for c in spec.columns if c != "compile")

    started = time.perf_counter()
    results: list[Result] = []
    for spec in specs:
        print(f"  {spec.name} {spec.size} ...", end="", flush=True)
        spec_start = time.perf_counter()
        results.append(run_spec(spec, budget, probe, verbose=args.verbose))
        print(f" {time.perf_counter() - spec_start:.1f}s", flush=True)
    if want_cold:
        print("  cold-start ...", end="", flush=True)
        spec_start = time.perf_counter()
        results.extend(run_cold_start(1 if args.quick else 3, probe))
        print(f" {time.perf_counter() - spec_start:.1f}s", flush=True)

    print()
    print(format_table(results))
    print()
    print(format_notes(results))
    name = args.name or ("quick" if args.quick else "full")
    path = save_results(name, results, {"elapsed_s": time.perf_counter() - started,
                                             "machine_at_start": machine_at_start,
                                             "deferfuse_cache_dir": cache_dir})
    print(f"\nsaved {path.relative_to(path.parent.parent.parent)} "
          f"({time.perf_counter() - started:.0f}s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
