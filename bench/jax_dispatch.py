"""What JAX's asynchronous CPU dispatch costs a caller that waits for every result.

    python -m bench.jax_dispatch              # GELU-tanh under jax.jit on 2^10 to 2^22 floats
    python -m bench.jax_dispatch --alternations 8

deferfuse waits for each XLA computation it starts (exec/backend.py).  This times a jitted
GELU-tanh, call and wait, in two processes: one with JAX's default asynchronous dispatch and one
with ``jax_cpu_enable_async_dispatch`` off (what deferfuse sets).  Before each call the process
spins for a gap of Python-like busy work, as a defer block records and plans before its flush:
with no gap, JAX's worker thread is still awake; after a few hundred microseconds it sleeps.
Each process reports medians; the table gives the median over the processes of each kind, in
microseconds.  The processes alternate (async, sync, async, ...), so a slow minute of this noisy
machine touches both columns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

SIZES = (10, 16, 20, 22)
GAPS_US = (0, 400)


def _spin(microseconds: float) -> None:
    end = time.perf_counter() + microseconds * 1e-6
    while time.perf_counter() < end:
        pass


def probe(asynchronous: bool, rounds: int) -> dict:
    """(size, gap) -> (median call, median wait) in microseconds, in this process."""
    import jax
    jax.config.update("jax_cpu_enable_async_dispatch", asynchronous)
    import jax.numpy as jnp
    from bench.workloads import gelu_tanh_jax

    jitted = jax.jit(gelu_tanh_jax)
    results = {}
    for log2_size in SIZES:
        x = jnp.linspace(-3.0, 3.0, 2 ** log2_size, dtype=jnp.float32)
        jitted(x).block_until_ready()
        for gap in GAPS_US:
            calls, waits = [], []
            for _ in range(rounds):
                _spin(gap)
                start = time.perf_counter()
                out = jitted(x)
                called = time.perf_counter()
                out.block_until_ready()
                calls.append(called - start)
                waits.append(time.perf_counter() - called)
            results[f"{log2_size},{gap}"] = (1e6 * statistics.median(calls), 1e6 * statistics.median(waits))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=100, help="timed calls per probe")
    parser.add_argument("--alternations", type=int, default=4,
                        help="probe processes per kind, alternating async and sync (default 4)")
    parser.add_argument("--probe", choices=("async", "sync"), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.probe:
        print(json.dumps(probe(options.probe == "async", options.rounds)))
        return
    probes: dict[str, list[dict]] = {"async": [], "sync": []}
    for _ in range(options.alternations):
        for kind in probes:
            out = subprocess.run([sys.executable, "-m", "bench.jax_dispatch", "--probe", kind,
                                  "--rounds", str(options.rounds)], capture_output=True, text=True, check=True)
            probes[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
    # the median over the processes of each process's medians
    runs = {kind: {key: tuple(statistics.median(p[key][i] for p in found) for i in range(2))
                   for key in found[0]} for kind, found in probes.items()}
    print("| size | gap before the call | async: call + wait µs | sync: call + wait µs |")
    print("|---|---|---|---|")
    for log2_size in SIZES:
        for gap in GAPS_US:
            key = f"{log2_size},{gap}"
            cells = [f"{c:.0f} + {w:.0f}" for c, w in (runs["async"][key], runs["sync"][key])]
            print(f"| 2^{log2_size} | {gap} µs | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
