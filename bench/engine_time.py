"""Where the deferred engine's time goes on a zoo model's training step, next to strict.

    python -m bench.engine_time [--model llama] [--size small] [--steps 12] [--engine xla]

Runs the zoo model's training step (forward, backward, AdamW, the loss read with ``.item()``)
strict and deferred (``eager_blocks=False``: the engine itself, not the block tier's choice)
alternately in one process, and splits each steady deferred step (the median of the last half
of ``--steps``) by wrapping the engine's entry points with timers:

- ``xla``: XLA runs (``exec/runner.execute_xla`` less the signature build below), DLPack in and
  out included; of which ``kernels``: the time inside the host kernels (torch's products and
  attention called from the programs, ``hostkernels.kernel_seconds()``), with how many calls
  the thread running the program served and how many ran on a thread made for them, and what
  handing the served ones over and back cost (``hostkernels.handover_seconds()``: waking the
  serving thread and being woken, not waiting while another kernel runs);
- ``signature``: building the flushed graph's signature and program (``exec/program.build``);
- ``torch``: groups run on torch's kernels (``exec/replay.execute_eager``: eager replays,
  products under ``--engine torch``);
- ``plan``: the rest of the flush (``engine.execute``: partitioning, plan records, write-back);
- ``record``: everything outside flushes (the Python of the dispatch mode recording each aten
  op, plus torch's own autograd and optimizer Python).

The timers cost about a microsecond a call; ``--engine torch`` sets ``compute_engine="torch"``
(products on torch's kernels, the memory-bound work between them on XLA).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Callable, Iterator

import torch

from bench import zoo_models as zoo
from deferfuse.native import hostkernels

PARTS = ("xla", "signature", "torch", "plan", "record")


class Timers:
    """Seconds spent in wrapped functions during the current step (outermost calls only)."""

    def __init__(self) -> None:
        self.spent = {name: 0.0 for name in ("flush", "execute_xla", "build", "replay")}
        self.kernels = hostkernels.counters()
        self.originals: list[tuple[object, str, Callable]] = []

    def wrap(self, module, attribute: str, name: str) -> None:
        original = getattr(module, attribute)
        self.originals.append((module, attribute, original))
        spent = self.spent

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - started
        setattr(module, attribute, timed)

    def take(self, total: float) -> dict[str, float]:
        s = self.spent
        parts = {"xla": s["execute_xla"] - s["build"], "signature": s["build"], "torch": s["replay"],
                 "plan": s["flush"] - s["execute_xla"] - s["replay"]}
        parts["record"] = total - s["flush"]
        for name in s:
            s[name] = 0.0
        now = hostkernels.counters()
        parts["kernels"], parts["served_calls"], parts["guest_calls"], parts["hand_over"] = \
            (b - a for a, b in zip(self.kernels, now))
        self.kernels = now
        return parts


@contextlib.contextmanager
def engine_timers() -> Iterator[Timers]:
    """The engine's entry points timed while the block runs (put back as they were after)."""
    from deferfuse import engine
    from deferfuse.exec import program, replay, runner
    timers = Timers()
    timers.wrap(engine, "execute", "flush")
    timers.wrap(runner, "execute_xla", "execute_xla")
    timers.wrap(program, "build", "build")
    timers.wrap(replay, "execute_eager", "replay")
    try:
        yield timers
    finally:
        for module, attribute, original in reversed(timers.originals):
            setattr(module, attribute, original)


def step_of(model: zoo.ZooModel, size: str, block: Callable[[], contextlib.AbstractContextManager]):
    network = model.make(size, seed=0)
    optimizer = zoo.optimizer_for(network, model)
    batch = model.batch(size, torch.Generator().manual_seed(1))

    def step() -> float:
        with block():
            return zoo.train_step(network, model, optimizer, batch).item()
    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama", choices=sorted(zoo.MODELS))
    parser.add_argument("--size", default="small", choices=zoo.SIZES)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--engine", default="xla", choices=("xla", "torch"))
    args = parser.parse_args(argv)
    with engine_timers() as timers:
        split = measure(args, timers)
    print(f"{args.model} ({args.size}) training step, steady state (median of the last "
          f"{split['steady_steps']} of {args.steps}), compute_engine={args.engine}:")
    print(f"  strict   {split['strict_ms']:7.1f} ms")
    print(f"  deferred {split['deferred_ms']:7.1f} ms ({split['strict_ms'] / split['deferred_ms']:.2f}x "
          f"strict; last step: {split['executions']} XLA runs, {split['torch_groups']} torch groups, "
          f"{split['ops_recorded']} ops recorded)")
    for part in PARTS:
        print(f"    {part:<10}{split[part]:7.1f} ms")
        if part == "xla":
            print(f"      of which host kernels {split['kernels']:.1f} ms ({split['served_calls']:.0f} calls "
                  f"served, {split['guest_calls']:.0f} on threads made for them; handing them to "
                  f"the serving thread and back {split['hand_over']:.1f} ms)")
    return 0


def measure(args: argparse.Namespace, timers: Timers) -> dict:
    """Strict and deferred steps alternating; the steady medians and the deferred step's parts
    (ms), which add up to its total step by step."""
    import deferfuse

    @contextlib.contextmanager
    def deferred():
        with deferfuse.config.override(eager_blocks=False, compute_engine=args.engine), deferfuse.defer():
            yield

    strict_step = step_of(zoo.MODELS[args.model], args.size, contextlib.nullcontext)
    deferred_step = step_of(zoo.MODELS[args.model], args.size, deferred)
    strict_times, deferred_times, splits = [], [], []
    for _ in range(args.steps):
        started = time.perf_counter()
        strict_step()
        strict_times.append(time.perf_counter() - started)
        timers.take(0.0)
        deferfuse.reset_stats()
        started = time.perf_counter()
        deferred_step()
        total = time.perf_counter() - started
        deferred_times.append(total)
        splits.append(timers.take(total))
    steady = slice(args.steps // 2, None)
    stats = deferfuse.stats()
    split = {"steady_steps": len(strict_times[steady]),
             "strict_ms": 1e3 * statistics.median(strict_times[steady]),
             "deferred_ms": 1e3 * statistics.median(deferred_times[steady]),
             "executions": stats["executions"], "torch_groups": stats["eager_replays"],
             "ops_recorded": stats["ops_recorded"], "steps": splits}
    for part in PARTS:
        split[part] = 1e3 * statistics.median(s[part] for s in splits[steady])
    split["kernels"] = 1e3 * statistics.median(s["kernels"] for s in splits[steady])
    split["hand_over"] = 1e3 * statistics.median(s["hand_over"] for s in splits[steady])
    for count in ("served_calls", "guest_calls"):
        split[count] = statistics.median(s[count] for s in splits[steady])
    return split


if __name__ == "__main__":
    raise SystemExit(main())
