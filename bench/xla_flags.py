"""Does any XLA:CPU flag lift XLA's ceiling on this machine?  The bench's GPT training step
written in JAX (``bench.train_gpt``'s ``jax`` candidate: forward, backward and AdamW under one
``jax.jit``) beside strict PyTorch, under several ``XLA_FLAGS`` settings.

    python -m bench.xla_flags                       # every setting below, 3 rounds
    python -m bench.xla_flags --only default,onednn --rounds 2 --steps 5

The hand-written JAX step is the fastest that deferfuse's XLA path can be on a model (defer
lowers the same aten ops to the same XLA), so its ratio to strict is the ceiling of the
deferred engine and of the compile backend on this CPU.  XLA reads ``XLA_FLAGS`` once per
process, so each setting runs in its own processes; strict and the settings alternate round by
round (``train_gpt --own-process``), and each candidate's samples are pooled over the rounds.
Results: ``bench/results/xla_flags.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench.harness import RESULTS_DIR, machine_info

# name -> XLA_FLAGS.  The matrix products are the step's largest part; these are XLA:CPU's
# switches for who runs them (YNNPACK by default in this jaxlib, XNNPACK, oneDNN, Eigen) and the
# scheduling and math switches that could change the rest.
SETTINGS = {
    "default": "",
    "onednn": "--xla_cpu_use_onednn=true",
    "no-ynnpack": "--xla_cpu_experimental_ynn_fusion_type=",
    "eigen-dots": "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_use_xnnpack=false",
    "concurrency-scheduler": "--xla_cpu_enable_concurrency_optimized_scheduler=true",
    "fast-math": "--xla_cpu_enable_fast_math=true",
}


def _steps(candidate: str, flags: str, steps: int, warmup: int) -> list[float]:
    """One fresh process timing ``steps`` steps of a train_gpt candidate under ``flags``."""
    env = dict(os.environ, XLA_FLAGS=flags)
    command = [sys.executable, "-m", "bench.train_gpt", "--own-process", candidate,
               "--steps", str(steps), "--warmup", str(warmup)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{candidate} under XLA_FLAGS={flags!r} failed: {last}")
    return json.loads(lines[-1])["samples_ms"]


def measure(names: list[str], rounds: int, steps: int, warmup: int) -> dict:
    """Pooled step times (ms) of strict and of the JAX step under each named setting."""
    samples: dict[str, list[float]] = {"strict": [], **{n: [] for n in names}}
    for r in range(rounds):
        order = list(samples)
        order = order[r % len(order):] + order[:r % len(order)]
        for name in order:
            if name == "strict":
                samples[name] += _steps("strict", "", steps, warmup)
            else:
                samples[name] += _steps("jax", SETTINGS[name], steps, warmup)
    medians = {n: statistics.median(v) for n, v in samples.items()}
    return {"settings": {n: SETTINGS[n] for n in names}, "rounds": rounds, "steps": steps,
            "warmup": warmup, "samples_ms": samples, "median_ms": medians,
            "speedup_over_strict": {n: medians["strict"] / medians[n] for n in names}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.xla_flags",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SETTINGS),
                        help=f"comma-separated settings, from: {', '.join(SETTINGS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per process")
    parser.add_argument("--name", default="xla_flags", help="results file name")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
    found = measure(names, args.rounds, args.steps, args.warmup)
    strict = found["median_ms"]["strict"]
    print(f"GPT training step (bench.train_gpt's model), {args.rounds} rounds x {args.steps} steps, "
          f"each candidate in its own process:")
    print(f"  {'strict':28s} {strict:8.1f} ms")
    for name in names:
        print(f"  {'jax, ' + name:28s} {found['median_ms'][name]:8.1f} ms  "
              f"{found['speedup_over_strict'][name]:.2f}x strict   XLA_FLAGS={SETTINGS[name]!r}")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{args.name}.json"
    path.write_text(json.dumps({"machine": machine_info(), **found}, indent=1) + "\n")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
