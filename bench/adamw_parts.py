"""Where an AdamW step's time goes under defer: recording, and the parts of its flush.

    python -m bench.adamw_parts              # 50 tensors of 64x1024, 30 timed steps
    python -m bench.adamw_parts --count 10
    python -m bench.adamw_parts --write-back-both   # steps alternate memmove and torch copy_

The same hand-written AdamW as ``make bench`` (bench.workloads.adamw_step), one step per defer
block.  For each step it measures, with wall-clock time: the strict step; recording (the body of
the block); the flush (leaving the block); inside the flush's XLA call, importing the inputs by
DLPack, running the executable until its results are ready, and exporting the results; the
write-back copies into the user's tensors (the flush's ``write_back`` calls).  It also counts minor
page faults per step (``getrusage``: fresh memory touched for the first time) and the resident
memory after every step, which shows a leak as growth.  Medians over the timed steps; the
machine is noisy, so compare the parts of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import time

import torch

# The block tier off (before deferfuse reads its settings): this script times the deferred path,
# which a block measured faster at once would skip.
os.environ.setdefault("DEFERFUSE_EAGER_BLOCKS", "0")

import deferfuse
from bench.workloads import adamw_spec
from deferfuse.capture import flush
from deferfuse.exec import executables, interop


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


class _Timer:
    """Sums the wall time of calls to one function while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
        return timed


@contextlib.contextmanager
def _instrumented(parts: dict[str, _Timer]):
    """Time interop's DLPack crossings, the executable (``executables.run``: its call and the
    wait for its results) and the flush's write-back copies."""
    to_jax, to_torch, run = interop.to_jax, interop.to_torch, executables.run
    write_back = flush.write_back
    interop.to_jax = parts["import inputs (DLPack)"].wrap(to_jax)
    interop.to_torch = parts["export results (DLPack)"].wrap(to_torch)
    executables.run = parts["run executable"].wrap(run)
    flush.write_back = parts["write-back copies"].wrap(write_back)
    try:
        yield
    finally:
        interop.to_jax, interop.to_torch, executables.run = to_jax, to_torch, run
        flush.write_back = write_back


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=50, help="parameter tensors (default 50)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps (default 30)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    parser.add_argument("--write-back-both", action="store_true",
                        help="alternate steps between the write-back as one memmove per tensor "
                             "(deferfuse's default up to 1 MB) and torch's copy_, and show both")
    options = parser.parse_args(argv)
    memmove_bytes = flush.MEMMOVE_BYTES

    spec = adamw_spec(count=options.count)
    strict_inputs, defer_inputs = spec.make_inputs(), spec.make_inputs()
    rows: dict[str, list[float]] = {}
    rss: list[float] = []
    with deferfuse.config.override(always_compile=True):
        for _ in range(options.warmup):   # (compiles now rather than on a background thread)
            with deferfuse.defer():
                spec.torch_fn(*spec.make_inputs())
    for step in range(options.warmup + options.steps):
        parts = {name: _Timer() for name in ("import inputs (DLPack)", "run executable",
                                             "export results (DLPack)", "write-back copies")}
        started = time.perf_counter()
        spec.torch_fn(*strict_inputs)
        strict = time.perf_counter() - started
        faults = _faults()
        by_copy = options.write_back_both and step % 2 == 1
        flush.MEMMOVE_BYTES = -1 if by_copy else memmove_bytes
        started = time.perf_counter()
        instrument = _instrumented(parts)
        with deferfuse.defer():
            spec.torch_fn(*defer_inputs)
            recorded = time.perf_counter()
            instrument.__enter__()   # (timing the flush that leaving the block runs)
        flushed = time.perf_counter()
        instrument.__exit__(None, None, None)
        if step < options.warmup:
            continue
        measured = {"strict step": strict, "defer: recording": recorded - started,
                    "defer: flush (leaving the block)": flushed - recorded}
        suffix = (" (torch copy_)" if by_copy else " (memmove)") if options.write_back_both else ""
        measured["defer: flush (leaving the block)" + suffix] = measured.pop("defer: flush (leaving the block)")
        measured.update({f"  flush: {name}" + (suffix if name == "write-back copies" else ""): t.seconds
                         for name, t in parts.items()})
        for name, seconds in measured.items():
            rows.setdefault(name, []).append(seconds * 1e3)
        rows.setdefault("page faults per defer step", []).append(_faults() - faults)
        rss.append(_rss_mb())

    print(f"AdamW over {options.count} tensors of 64x1024, {options.steps} steps (medians):")
    for name, values in rows.items():
        unit = "" if name.startswith("page") else " ms"
        print(f"  {name:<42} {statistics.median(values):9.2f}{unit}")
    print(f"  resident memory: {rss[0]:.0f} MB after the first timed step, {rss[-1]:.0f} MB after the last")
    print(f"  deferfuse counters: {deferfuse.stats()}")


if __name__ == "__main__":
    main()
