"""Where XLA's CPU time goes in the GPT training step of bench/train_gpt.py, next to torch's.

    .venv/bin/python -m bench.xla_profile [--steps 3]

Profiles the hand-written JAX step (value_and_grad of the same model, one jax.jit; the defer
step compiles to the same kind of program) with jax.profiler, and sums the time of each XLA
thunk by kind (``ynn_fusion`` are dots and what XNNPACK fused into them, ``copy_*``/``transpose_*``
are layout changes, the rest are loop fusions of memory-bound work). Then torch.profiler sums the
strict step's aten ops the same way. The question it answers: is the gap between XLA and torch
in the matmuls or in the memory-bound work that fusion is meant to speed up?
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

import torch

from bench import train_gpt as gpt


def _median_ms(step, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e3


def xla_breakdown(steps: int) -> tuple[float, dict[str, tuple[float, int]]]:
    import jax
    import jax.numpy as jnp
    model, batches = gpt.make_model(), gpt.make_batches()
    params = {k: jnp.asarray(p.detach().numpy()) for k, p in model.named_parameters()}
    idx, targets = (jnp.asarray(t.numpy()) for t in batches[0])
    grad = jax.jit(jax.value_and_grad(gpt.jax_loss))

    def step():
        jax.block_until_ready(grad(params, idx, targets))
    step()
    median = _median_ms(step, 5)
    folder = tempfile.mkdtemp(prefix="deferfuse-xla-profile-")
    with jax.profiler.trace(folder, create_perfetto_trace=True):
        for _ in range(steps):
            step()
    (trace,) = glob.glob(os.path.join(folder, "plugins", "profile", "*", "perfetto_trace.json.gz"))
    events = json.load(gzip.open(trace))["traceEvents"]
    total: dict[str, float] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    for event in events:
        name = event.get("name", "")
        if event.get("ph") != "X" or name.startswith(("$", "Thunk", "Slinky", "end:", "PjitFunction",
                                                      "CommonPjRt", "Parse")):
            continue
        kind = re.sub(r"\.\d+$", "", name)
        total[kind] += event.get("dur", 0) / 1e3 / steps
        count[kind] += 1
    return median, {k: (total[k], count[k] // steps) for k in total}


def torch_breakdown(steps: int) -> tuple[float, dict[str, tuple[float, int]]]:
    model, batches = gpt.make_model(), gpt.make_batches()
    x, y = batches[0]

    def step():
        model.zero_grad(set_to_none=True)
        model(x, y).backward()
    step()
    median = _median_ms(step, 5)
    with torch.profiler.profile() as prof:
        for _ in range(steps):
            step()
    rows = {e.key: (e.self_cpu_time_total / 1e3 / steps, e.count // steps)
            for e in prof.key_averages() if e.key.startswith("aten::")}
    return median, rows


def _table(title: str, median: float, rows: dict[str, tuple[float, int]], top: int) -> str:
    lines = [f"{title}: median {median:.1f} ms per forward+backward",
             f"{'ms/step':>9} {'calls':>6}  kind"]
    for name, (ms, calls) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{ms:9.2f} {calls:6d}  {name}")
    lines.append(f"{sum(ms for ms, _ in rows.values()):9.2f}         (sum of all)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    print(_table("XLA (jax.jit of the JAX model)", *xla_breakdown(args.steps), args.top))
    print()
    print(_table("torch (strict, aten self time)", *torch_breakdown(args.steps), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
