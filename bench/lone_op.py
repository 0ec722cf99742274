"""Where a defer block around one lone op spends its time, next to strict.

    python -m bench.lone_op               # LayerNorm on 4096x1024, 300 shuffled rounds
    python -m bench.lone_op --rows 64     # a small LayerNorm: the same code, warm caches

The LayerNorm and softmax rows of ``make bench`` are one op per block, which deferfuse runs at
once on torch's kernel (eager_lone_ops).  Each round runs strict and the defer block in a
seeded random order; the block is timed in three parts: entering it, the op (our dispatch
checks plus torch's kernel), and leaving it.  Medians in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch
import torch.nn.functional as F

# The block tier off (before deferfuse reads its settings): this script times the deferred path,
# which a block measured faster at once would skip.
os.environ.setdefault("DEFERFUSE_EAGER_BLOCKS", "0")

import deferfuse
from bench.harness import print_medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096, help="rows of 1024 floats (default 4096)")
    parser.add_argument("--rounds", type=int, default=300)
    options = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(options.rows, 1024, generator=g)
    weight, bias = 1 + 0.1 * torch.randn(1024, generator=g), 0.1 * torch.randn(1024, generator=g)
    parts: dict[str, list[float]] = {"strict": [], "block: enter": [], "block: op": [],
                                     "block: leave": [], "block: all": []}

    def strict():
        return F.layer_norm(x, (1024,), weight, bias, eps=1e-5)

    def block():
        started = time.perf_counter()
        context = deferfuse.defer()
        context.__enter__()
        entered = time.perf_counter()
        out = F.layer_norm(x, (1024,), weight, bias, eps=1e-5)
        ran = time.perf_counter()
        context.__exit__(None, None, None)
        left = time.perf_counter()
        return out, (entered - started, ran - entered, left - ran, left - started)

    for _ in range(30):   # warm-up: past the first sighting and the first lone flush
        strict()
        block()
    deferfuse.reset_stats()
    order = random.Random(0)
    for _ in range(options.rounds):
        for which in order.sample(["strict", "block"], 2):
            if which == "strict":
                started = time.perf_counter()
                strict()
                parts["strict"].append(time.perf_counter() - started)
            else:
                _, times = block()
                for name, seconds in zip(("block: enter", "block: op", "block: leave", "block: all"), times):
                    parts[name].append(seconds)
    print_medians(f"LayerNorm {options.rows}x1024, {options.rounds} shuffled rounds (medians, ms):", parts)
    stats = deferfuse.stats()
    print(f"  ops run at once where their flushes were lone: {stats['lone_ops_run']} of "
          f"{options.rounds} blocks; flushes {stats['flushes']}")


if __name__ == "__main__":
    main()
