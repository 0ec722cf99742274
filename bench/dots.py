"""The GPT step's matmul shapes, timed alone in torch and in XLA: which engine's dots are faster
on this machine.

    .venv/bin/python -m bench.dots [--runs 40]

Matmuls are most of a training step's time (bench.train_gpt), so whether the deferred step can
beat strict depends first on this: torch's CPU matmul is MKL's sgemm (oneDNN for some dtypes),
XLA's is its own (YNNPACK/Eigen) code, and which is faster varies by CPU vendor and vector
extensions.  Each shape runs as one jitted dot on jax arrays and as torch.mm on tensors, the
two interleaved run by run; GFLOP/s from the medians.  "weight grad" contracts the batch
dimension (x^T @ g, a transposed operand), "input grad" multiplies by the weight as stored.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

from bench.harness import machine_info

# (name, M, K, N, transpose lhs): the step's Linear layers at batch 8 x 128 = 1024 rows
SHAPES = (
    ("qkv forward 1024x256 @ 256x768", 1024, 256, 768, False),
    ("fc forward 1024x256 @ 256x1024", 1024, 256, 1024, False),
    ("fc2 forward 1024x1024 @ 1024x256", 1024, 1024, 256, False),
    ("fc weight grad (1024x1024)^T @ 1024x256", 1024, 1024, 256, True),
    ("qkv input grad 1024x768 @ 768x256", 1024, 768, 256, False),
    ("head forward 1024x256 @ 256x512", 1024, 256, 512, False),
)


def _median_seconds(fn, runs: int) -> float:
    fn()
    fn()
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure(runs: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from jax import lax
    rng = np.random.default_rng(0)
    rows = []
    for name, m, k, n, transposed in SHAPES:
        a = rng.standard_normal((k, m) if transposed else (m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        ja, jb = jnp.asarray(a), jnp.asarray(b)
        contract = 0 if transposed else 1
        dot = jax.jit(lambda x, y: lax.dot_general(x, y, (((contract,), (0,)), ((), ()))))
        torch_fn = (lambda: torch.mm(ta.t(), tb)) if transposed else (lambda: torch.mm(ta, tb))
        xla_fn = lambda: dot(ja, jb).block_until_ready()   # noqa: E731
        np.testing.assert_allclose(np.asarray(dot(ja, jb)), torch_fn().numpy(),
                                   rtol=1e-3, atol=1e-2)
        torch_s, xla_s = [], []
        for _ in range(3):   # interleaved thirds, so both share the machine's drift
            torch_s.append(_median_seconds(torch_fn, runs // 3))
            xla_s.append(_median_seconds(xla_fn, runs // 3))
        flops = 2 * m * k * n
        t, x = statistics.median(torch_s), statistics.median(xla_s)
        rows.append({"shape": name, "torch_us": t * 1e6, "xla_us": x * 1e6,
                     "torch_gflops": flops / t / 1e9, "xla_gflops": flops / x / 1e9,
                     "torch_over_xla_time": t / x})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dots", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=42)
    parser.add_argument("--json", default=None, help="also write the rows and machine here")
    args = parser.parse_args(argv)
    info = machine_info()
    print(f"{info.get('cpu_model', '?')} {info.get('cpu_vector_flags', [])}, torch BLAS "
          f"{info.get('torch_blas', '?')}, {torch.get_num_threads()} torch threads")
    rows = measure(args.runs)
    print(f"{'shape':44s} {'torch GF/s':>10s} {'XLA GF/s':>9s} {'torch time / XLA time':>22s}")
    for r in rows:
        print(f"{r['shape']:44s} {r['torch_gflops']:10.0f} {r['xla_gflops']:9.0f} "
              f"{r['torch_over_xla_time']:21.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
