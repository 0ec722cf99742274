"""The serving thread's OpenMP team released between kernels, against kept, in one process.

    python -m bench.team_release [--model llama] [--size medium] [--rounds 12] [--front compile]

A zoo model's training step (forward, backward, AdamW, the loss read with ``.item()``) runs
strict and deferred (``eager_blocks=False, autotune_engine=False``: every step one recorded
program, its products in the host kernels, served; ``--front compile``: the model under
``torch.compile(backend="deferfuse")``, its forward and backward two programs, AdamW eager),
and the deferfuse step alternates between
``host_kernel_team_release_us`` at ``--release-us`` (released) and -1 (kept), the three in a
shuffled order each round
(bench/harness.py: what ran just before a candidate changes its time).  Prints the medians in
ms, each deferred lane against strict, and released over kept; and how many times the team was
released (``hostkernels.team_releases()``).  Both lanes run the same executables: the setting
is read at each served run, not compiled in.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time

import torch  # noqa: F401 - before deferfuse, as users import it

import deferfuse
from bench import zoo_models as zoo
from bench.engine_time import step_of
from deferfuse.native import hostkernels

LANES = ("strict", "kept", "released")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama", choices=sorted(zoo.MODELS))
    parser.add_argument("--size", default="medium", choices=zoo.SIZES)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warm-up", type=int, default=3)
    parser.add_argument("--front", choices=("defer", "compile"), default="defer")
    parser.add_argument("--release-us", type=int, default=deferfuse.config.get("host_kernel_team_release_us"),
                        help="the released lane's host_kernel_team_release_us (default: the setting's)")
    args = parser.parse_args(argv)

    @contextlib.contextmanager
    def deferred():
        with deferfuse.config.override(eager_blocks=False, autotune_engine=False), deferfuse.defer():
            yield

    model = zoo.MODELS[args.model]
    strict_step = step_of(model, args.size, contextlib.nullcontext)
    deferred_step = step_of(model, args.size, deferred) if args.front == "defer" \
        else compiled_step_of(model, args.size)
    for _ in range(args.warm_up):
        strict_step()
        deferred_step()
    times: dict[str, list[float]] = {lane: [] for lane in LANES}
    releases = hostkernels.team_releases()
    order = list(LANES)
    shuffle = random.Random(0)
    for _ in range(args.rounds):
        shuffle.shuffle(order)
        for lane in order:
            release_us = args.release_us if lane == "released" else -1
            with deferfuse.config.override(host_kernel_team_release_us=release_us):
                started = time.perf_counter()
                (strict_step if lane == "strict" else deferred_step)()
                times[lane].append(time.perf_counter() - started)
    median = {lane: 1e3 * statistics.median(times[lane]) for lane in LANES}
    print(f"{args.model} ({args.size}) training step, {args.front}, released after {args.release_us} us, medians of {args.rounds} shuffled rounds:")
    for lane in LANES:
        against = "" if lane == "strict" else f"  ({median['strict'] / median[lane]:.2f}x strict)"
        print(f"  {lane:<9}{median[lane]:8.1f} ms{against}")
    print(f"  released / kept {median['released'] / median['kept']:.3f}; team released "
          f"{hostkernels.team_releases() - releases} times")
    return 0


def compiled_step_of(model: zoo.ZooModel, size: str):
    """bench.engine_time's step, the model under torch.compile(backend="deferfuse")."""
    import deferfuse.compile
    network = model.make(size, seed=0)
    optimizer = zoo.optimizer_for(network, model)
    batch = model.batch(size, torch.Generator().manual_seed(1))
    compiled = torch.compile(network, backend=deferfuse.compile.backend)

    def step() -> float:
        return zoo.train_step(compiled, model, optimizer, batch).item()
    return step


if __name__ == "__main__":
    raise SystemExit(main())
