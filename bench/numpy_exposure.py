"""A tensor once shown to NumPy, then read by a deferred block: its reads cost nothing extra once
the array is gone (issue 35).

    python -m bench.numpy_exposure

A GELU chain on 2^22 floats in a defer block (the block tier off: always deferred), timed with
no NumPy array ever made of its input, after ``_ = x.numpy()`` (the array discarded at once),
and while an array of it is alive (its reads then copy, as memory NumPy may write must be read
when the op runs); strict beside them.  Medians of interleaved rounds, in one process.
"""

from __future__ import annotations

import statistics
import time

import torch

import deferfuse


def gelu(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))


def main() -> int:
    torch.manual_seed(0)
    fresh, discarded, alive = (torch.randn(1 << 22) for _ in range(3))
    with deferfuse.defer():   # (deferfuse in use: as in a program that has run a block already)
        pass
    _ = discarded.numpy()
    del _
    kept = alive.numpy()   # noqa: F841 - alive for the whole run

    def deferred(x):
        with deferfuse.config.override(eager_blocks=False), deferfuse.defer():
            y = gelu(x)
        return y

    runs = {"strict": lambda: gelu(fresh), "defer, never shown to NumPy": lambda: deferred(fresh),
            "defer, after _ = x.numpy()": lambda: deferred(discarded),
            "defer, while an array of x lives": lambda: deferred(alive)}
    for run in runs.values():   # (warm-up: compile, then the executable is cached)
        for _ in range(4):
            run()
        deferfuse.sync()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(15):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    for name, samples in times.items():
        print(f"{name:34s} {statistics.median(samples) * 1e3:7.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
