"""Where XLA's CPU time goes in the GPT training step of bench/train_gpt.py, next to torch's.

    .venv/bin/python -m bench.xla_profile [--steps 3]

Profiles the hand-written JAX step (value_and_grad of the same model, one jax.jit; the defer
step compiles to the same kind of program) with jax.profiler, and sums the time of each XLA
thunk by kind (``ynn_fusion`` are dots and what XNNPACK fused into them, ``copy_*``/``transpose_*``
are layout changes, the rest are loop fusions of memory-bound work). Then torch.profiler sums the
strict step's aten ops the same way. The question it answers: is the gap between XLA and torch
in the matmuls or in the memory-bound work that fusion is meant to speed up?

    .venv/bin/python -m bench.xla_profile --defer [--steps 3]

profiles the deferred step instead (``eager_blocks=False``: one XLA computation a step) and sums
its dots (``ynn_fusion`` thunks) by output shape, read from the optimized HLO of the step's
executable: which products the executable's time goes to, and how fast each kind runs.
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


def _trace_events(folder: str) -> list:
    (trace,) = glob.glob(os.path.join(folder, "plugins", "profile", "*", "perfetto_trace.json.gz"))
    return json.load(gzip.open(trace))["traceEvents"]


def defer_breakdown(steps: int) -> tuple[float, dict[str, tuple[float, int]]]:
    """The deferred step's thunks: dots by output shape (from the optimized HLO), the rest by
    kind, per step."""
    import jax
    import deferfuse
    from deferfuse.exec import executables
    trainer = gpt.TorchTrainer(gpt.make_model(), gpt.make_batches())

    def step():
        with deferfuse.config.override(eager_blocks=False), deferfuse.defer():
            trainer.raw_step()
    for _ in range(12):   # (its first runs replay eagerly while the executable compiles)
        step()
    median = _median_ms(step, 5)
    folder = tempfile.mkdtemp(prefix="deferfuse-xla-profile-")
    with jax.profiler.trace(folder, create_perfetto_trace=True):
        for _ in range(steps):
            step()
    hlo = max((c.executable.as_text() for c in executables.snapshot()), key=len)
    shape_of = dict(re.findall(r"%(ynn_fusion[.\d]*) = (\S+) fusion\(", hlo))
    total: dict[str, float] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    for event in _trace_events(folder):
        name = event.get("name", "")
        if event.get("ph") != "X" or name.startswith(("$", "Thunk", "Slinky", "end:", "PjitFunction",
                                                      "CommonPjRt", "Parse", "Threadpool", "Wait",
                                                      "PythonRef")):
            continue
        kind = ("dot -> " + shape_of[name]) if name in shape_of else re.sub(r"\.\d+$", "", name)
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


def _table(title: str, median: float, rows: dict[str, tuple[float, int]], top: int,
           unit: str = "forward+backward") -> str:
    lines = [f"{title}: median {median:.1f} ms per {unit}",
             f"{'ms/step':>9} {'calls':>6}  kind"]
    for name, (ms, calls) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{ms:9.2f} {calls:6d}  {name}")
    lines.append(f"{sum(ms for ms, _ in rows.values()):9.2f}         (sum of all)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--defer", action="store_true",
                        help="the deferred step's executable, dots by output shape")
    args = parser.parse_args(argv)
    if args.defer:
        print(_table("XLA (the deferred step, thunk time summed over threads)",
                     *defer_breakdown(args.steps), args.top, "training step"))
        return 0
    print(_table("XLA (jax.jit of the JAX model)", *xla_breakdown(args.steps), args.top))
    print()
    print(_table("torch (strict, aten self time)", *torch_breakdown(args.steps), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
