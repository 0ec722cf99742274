"""Threads of torch's kernels inside XLA programs: does a host kernel oversubscribe the cores?

    .venv/bin/python -m bench.host_threads [--runs 30] [--json bench/results/host_threads.json]

A host kernel (deferfuse/native/host_kernels.cc) runs torch's product, whose MKL gemm spreads
over torch's OpenMP threads (``torch.get_num_threads()``), from inside an XLA:CPU program,
whose own parallel loops and concurrently runnable thunks use XLA's intra-op thread pool (one
thread per core).  On a machine with few cores the two pools can compete: two independent
products that XLA starts together each ask OpenMP for every core, and OpenMP's workers keep
spinning after a product while XLA's pool runs the fused loops that follow.  Measured here,
each case as a jitted program calling the host kernel beside strict torch, interleaved:

- ``one product``: 512x2048 @ 2048x512, alone;
- ``two independent products``: a @ b and c @ d of those shapes, summed, with the products free
  to run together (as XLA schedules them) and tied one after the other (an optimization barrier
  on the second's operand, which is not transposed, so nothing is copied);
- ``product then GELU``: the product and a GELU over its 512 x 512 result, which XLA fuses into a
  parallel loop on its pool right after the kernel returns;

each at torch's default thread count and with ``torch.set_num_threads(1)``.  The process's
thread count (``/proc/self/task``) is printed after each case: XLA's pool and OpenMP's team
(one per thread that ran a parallel region) both show there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

from bench.harness import machine_info


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _time(fn, runs: int) -> list[float]:
    fn()
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _cases():
    import jax
    import jax.numpy as jnp
    from jax import lax

    from deferfuse.ir.meta import TensorMeta
    from deferfuse.lower import host_products
    from deferfuse.lower.registry import LoweringContext

    rng = np.random.default_rng(0)
    m, k, n = 512, 2048, 512
    a, b, c, d = (rng.standard_normal(s, dtype=np.float32) for s in ((m, k), (k, n), (m, k), (k, n)))
    ta, tb, tc, td = (torch.from_numpy(x) for x in (a, b, c, d))
    ja, jb, jc, jd = (jnp.asarray(x) for x in (a, b, c, d))
    ctx = LoweringContext(torch.ops.aten.mm.default, (TensorMeta.of(ta), TensorMeta.of(tb)), {},
                          (TensorMeta.of(torch.empty(m, n)),))

    def host(x, y):
        return host_products.product(ctx, x, y)

    def tied(x, y, z, w):
        first = host(x, y)
        z, _ = lax.optimization_barrier((z, first))
        return first + host(z, w)

    one = jax.jit(host)
    free = jax.jit(lambda x, y, z, w: host(x, y) + host(z, w))
    ordered = jax.jit(tied)
    gelu = jax.jit(lambda x, y: jax.nn.gelu(host(x, y), approximate=False))
    xla_gelu = jax.jit(lambda x, y: jax.nn.gelu(jnp.matmul(x, y, precision="highest"), approximate=False))
    return {
        "one product": {
            "torch": lambda: torch.mm(ta, tb),
            "host program": lambda: one(ja, jb).block_until_ready()},
        "two independent products": {
            "torch": lambda: torch.mm(ta, tb) + torch.mm(tc, td),
            "host program, free": lambda: free(ja, jb, jc, jd).block_until_ready(),
            "host program, tied": lambda: ordered(ja, jb, jc, jd).block_until_ready()},
        "product then GELU": {
            "torch": lambda: torch.nn.functional.gelu(torch.mm(ta, tb)),
            "host program": lambda: gelu(ja, jb).block_until_ready(),
            "xla program": lambda: xla_gelu(ja, jb).block_until_ready()},
    }


def measure(runs: int) -> list[dict]:
    from deferfuse.native import hostkernels
    if not hostkernels.ensure():
        raise SystemExit(f"host kernels unavailable: {hostkernels.status().get('error')}")
    cases = _cases()
    rows = []
    default_threads = torch.get_num_threads()
    for threads in (default_threads, 1):
        torch.set_num_threads(threads)
        for case, candidates in cases.items():
            samples: dict[str, list[float]] = {name: [] for name in candidates}
            for _ in range(3):
                for name, fn in candidates.items():
                    samples[name] += _time(fn, max(1, runs // 3))
            rows.append({"case": case, "torch_threads": threads, "process_threads": _threads(),
                         "ms": {name: {"min": min(s) * 1e3, "median": statistics.median(s) * 1e3}
                                for name, s in samples.items()}})
    torch.set_num_threads(default_threads)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.host_threads", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--json", default=None, help="also write the rows and machine here")
    args = parser.parse_args(argv)
    info = machine_info()
    print(f"{info.get('cpu_model', '?')}, {os.cpu_count()} cores, torch threads "
          f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
    rows = measure(args.runs)
    for row in rows:
        print(f"{row['case']} (torch threads {row['torch_threads']}, process threads "
              f"{row['process_threads']}): " + ", ".join(
                  f"{name} {t['min']:.2f} / {t['median']:.2f} ms" for name, t in row["ms"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "load_average": os.getloadavg(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
