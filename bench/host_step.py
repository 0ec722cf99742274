"""A zoo model's deferred training step with its products on the host kernels and on XLA's dots.

    python -m bench.host_step [--model llama] [--size small] [--steps 16] [--json PATH]

Three candidates in one process, step by step in turn, each on its own copy of the model:
strict; deferred with the host kernels (``host_kernels=True``: the step's products and
convolutions call torch's kernels inside the XLA program); deferred with XLA's own dots
(``host_kernels=False``).  Deferred means ``always_compile``: every flush is the XLA program,
compiled at its first sight, with no tier running anything at once, so the two deferred
candidates differ only in how their products run.  Reported: the minimum and the median of
the steps after the first quarter (compiles).  On a shared machine the minimum is the
steadier figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch

from bench import zoo_models as zoo
from bench.engine_time import step_of
from bench.harness import machine_info


def main(argv: list[str] | None = None) -> int:
    import deferfuse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama", choices=sorted(zoo.MODELS))
    parser.add_argument("--size", default="small", choices=zoo.SIZES)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--json", default=None, help="also write the samples and machine here")
    args = parser.parse_args(argv)

    def deferred(host_kernels: bool):
        @contextlib.contextmanager
        def block():
            with deferfuse.config.override(always_compile=True, host_kernels=host_kernels), deferfuse.defer():
                yield
        return block

    model = zoo.MODELS[args.model]
    candidates = {"strict": step_of(model, args.size, contextlib.nullcontext),
                  "deferred, host kernels": step_of(model, args.size, deferred(True)),
                  "deferred, XLA dots": step_of(model, args.size, deferred(False))}
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    losses: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(args.steps):
        for name, step in candidates.items():
            deferfuse.reset_stats()
            started = time.perf_counter()
            losses[name].append(step())
            samples[name].append(time.perf_counter() - started)
    steady = slice(max(1, args.steps // 4), None)
    print(f"{args.model} ({args.size}) training step, {args.steps} steps, steady = the last "
          f"{len(samples['strict'][steady])}; load average {os.getloadavg()[0]:.2f}, "
          f"{torch.get_num_threads()} torch threads")
    strict_min = min(samples["strict"][steady])
    strict_median = statistics.median(samples["strict"][steady])
    for name, s in samples.items():
        low, mid = min(s[steady]), statistics.median(s[steady])
        print(f"  {name:24s} min {low * 1e3:8.1f} ms ({strict_min / low:.2f}x strict)   "
              f"median {mid * 1e3:8.1f} ms ({strict_median / mid:.2f}x strict)")
    from deferfuse.native import hostkernels
    print(f"  host kernels: {hostkernels.status()}")
    print(f"  losses, last step: " + ", ".join(f"{n} {v[-1]:.6f}" for n, v in losses.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "load_average": os.getloadavg(), "args": vars(args),
                       "seconds": samples, "losses": losses}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
