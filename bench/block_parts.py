"""Where a small defer block's time goes, next to strict and jax.jit of the same work.

    python -m bench.block_parts               # GELU-tanh on 2^16 floats, 300 shuffled rounds
    python -m bench.block_parts --log2-size 18

Each round runs strict, the defer block and ``jax.jit`` of the same GELU-tanh chain in a seeded
random order (what ran just before a candidate changes its time: bench/harness.py).  The block
is timed in parts: entering it, recording its 8 ops, and leaving it (the flush), and inside the
flush the XLA call (``runner.execute_xla``: signature, executable lookup, DLPack crossings and
the executable itself).  Medians in milliseconds.  For a lone op run at once, see
bench.lone_op.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch

# The block tier off (before deferfuse reads its settings): this script times the deferred path,
# which a block measured faster at once would skip.
os.environ.setdefault("DEFERFUSE_EAGER_BLOCKS", "0")

import deferfuse
from bench import workloads
from bench.harness import print_medians
from deferfuse.exec import runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log2-size", type=int, default=16, help="floats in the input, as a power of 2")
    parser.add_argument("--rounds", type=int, default=300)
    options = parser.parse_args()

    import jax
    import jax.numpy as jnp

    x = torch.linspace(-4.0, 4.0, 2 ** options.log2_size)
    x_jax = jnp.asarray(x.numpy())
    jitted = jax.jit(workloads.gelu_tanh_jax)
    parts: dict[str, list[float]] = {"strict": [], "jax.jit": [], "block": [], "block: enter": [],
                                     "block: record": [], "block: leave": [],
                                     "block: leave: XLA call": []}
    xla_seconds = [0.0]
    execute_xla = runner.execute_xla

    def timed_execute_xla(*args, **kwargs):   # (the flush's frame, not the recording's)
        started = time.perf_counter()
        try:
            return execute_xla(*args, **kwargs)
        finally:
            xla_seconds[0] += time.perf_counter() - started

    def block():
        xla_seconds[0] = 0.0
        started = time.perf_counter()
        context = deferfuse.defer()
        context.__enter__()
        entered = time.perf_counter()
        out = workloads.gelu_tanh(x)
        recorded = time.perf_counter()
        context.__exit__(None, None, None)
        left = time.perf_counter()
        return out, (left - started, entered - started, recorded - entered, left - recorded, xla_seconds[0])

    runner.execute_xla = timed_execute_xla
    try:
        candidates = {"strict": lambda: workloads.gelu_tanh(x),
                      "jax.jit": lambda: jitted(x_jax).block_until_ready(), "block": block}
        for _ in range(100):   # warm-up: past the eager tier; then the background compile lands
            for run in candidates.values():
                run()
        time.sleep(1.0)
        for _ in range(30):
            block()
        deferfuse.reset_stats()
        order = random.Random(0)
        for _ in range(options.rounds):
            for name in order.sample(list(candidates), len(candidates)):
                if name == "block":
                    _, times = block()
                    for part, seconds in zip(("block", "block: enter", "block: record", "block: leave",
                                              "block: leave: XLA call"), times):
                        parts[part].append(seconds)
                else:
                    started = time.perf_counter()
                    candidates[name]()
                    parts[name].append(time.perf_counter() - started)
    finally:
        runner.execute_xla = execute_xla
    print_medians(f"GELU-tanh on 2^{options.log2_size} floats, {options.rounds} shuffled rounds "
                  "(medians, ms):", parts)
    stats = deferfuse.stats()
    print(f"  XLA runs {stats['executions']}, eager replays {stats['eager_replays']} in "
          f"{options.rounds} blocks")


if __name__ == "__main__":
    main()
