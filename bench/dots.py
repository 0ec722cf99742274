"""Matrix products of a training step, timed in torch, in XLA, and inside deferfuse's programs.

    .venv/bin/python -m bench.dots [--runs 45] [--json bench/results/dots.json]

Products are most of a training step's time (bench.train_gpt), and on the CPU deferfuse's XLA
programs call torch's own kernels for them (host kernels, deferfuse/native/): this measures what
that buys.  Each shape runs, in one process, interleaved round by round on the same inputs:

- ``torch``: strict, ``torch.mm``/``torch.bmm`` on the tensors (a transposed operand is a view);
- ``xla``: one jitted ``dot_general`` on jax arrays, XLA's own dot (the transposed operand is
  contracted on its first dim, as XLA sees ``x.t() @ g``);
- ``host jit``: the same product as a jitted program calling the host kernel's FFI target
  (deferfuse/lower/host_products.py), with the transposition passed as strides: the kernel
  inside an XLA program, with nothing of deferfuse around it;
- ``defer host`` and ``defer xla``: the product in a ``with deferfuse.defer():`` block (the
  block tier off, so every block records, flushes and runs its XLA program), with the host
  kernels on and off (``host_kernels``): what a user's deferred product costs, recording and
  the flush included.

Times are the minimum and the median over ``--runs`` runs per candidate (taken in thirds, the
candidates in turn, so they share the machine's drift); GFLOP/s from the medians.

``--single-thread`` runs every candidate on one thread (``torch.set_num_threads(1)``, XLA's
intra-op parallelism off through ``XLA_FLAGS``, set before JAX starts) and times the process's
CPU time (``time.process_time``) instead of the wall clock: what each kernel costs, whatever
else the machine runs.  (With several threads CPU time would count OpenMP's spinning.)
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

# (name, batch or None, M, K, N, transposed lhs, transposed rhs)
SHAPES = (
    ("weight grad (256x1024)^T @ 256x512", None, 1024, 256, 512, True, False),
    ("512x2048 @ 2048x512", None, 512, 2048, 512, False, False),
    ("linear 1024x256 @ (1024x256)^T", None, 1024, 256, 1024, False, True),
    ("fc2 forward 1024x1024 @ 1024x256", None, 1024, 1024, 256, False, False),
    ("fc weight grad (1024x1024)^T @ 1024x256", None, 1024, 1024, 256, True, False),
    ("attention scores 32 x 128x64 @ (128x64)^T", 32, 128, 64, 128, False, True),
    ("attention values 32 x 128x128 @ 128x64", 32, 128, 128, 64, False, False),
)
CANDIDATES = ("torch", "xla", "host jit", "defer host", "defer xla")


CLOCK = [time.perf_counter]   # time.process_time under --single-thread
SINGLE_THREAD_XLA = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def _samples(fn, runs: int) -> list[float]:
    fn()
    clock = CLOCK[0]
    out = []
    for _ in range(runs):
        start = clock()
        fn()
        out.append(clock() - start)
    return out


def _operands(batch, m, k, n, lhs_t, rhs_t, rng):
    lead = (batch,) if batch else ()
    a = rng.standard_normal(lead + ((k, m) if lhs_t else (m, k)), dtype=np.float32)
    b = rng.standard_normal(lead + ((n, k) if rhs_t else (k, n)), dtype=np.float32)
    return a, b


def _candidates(batch, m, k, n, lhs_t, rhs_t, a, b) -> dict:
    import jax
    import jax.numpy as jnp
    from jax import lax

    import deferfuse
    from deferfuse import config
    from deferfuse.ir.meta import TensorMeta
    from deferfuse.lower import host_products
    from deferfuse.lower.registry import LoweringContext
    from deferfuse.native import hostkernels

    # (torch's own memory: a tensor sharing NumPy's is foreign memory, which a deferred op copies)
    ta, tb = torch.from_numpy(a).clone(), torch.from_numpy(b).clone()
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    # the user's operands as strict sees them: views for the transposed ones
    va = ta.transpose(-1, -2) if lhs_t else ta
    vb = tb.transpose(-1, -2) if rhs_t else tb
    product = torch.bmm if batch else torch.mm
    b_dims = (0,) if batch else ()
    contract = ((a.ndim - 2 if lhs_t else a.ndim - 1,), (b.ndim - 1 if rhs_t else b.ndim - 2,))
    xla = jax.jit(lambda x, y: lax.dot_general(x, y, (contract, (b_dims, b_dims))))
    found = {"torch": lambda: product(va, vb), "xla": lambda: xla(ja, jb).block_until_ready()}

    if hostkernels.ensure():
        op = torch.ops.aten.bmm.default if batch else torch.ops.aten.mm.default
        out_shape = ((batch,) if batch else ()) + (m, n)
        ctx = LoweringContext(op, (TensorMeta.of(va), TensorMeta.of(vb)), {},
                              (TensorMeta.of(torch.empty(out_shape)),))
        swap = lambda x, t: jnp.swapaxes(x, -1, -2) if t else x   # noqa: E731
        host = jax.jit(lambda x, y: host_products.product(ctx, swap(x, lhs_t), swap(y, rhs_t)))
        found["host jit"] = lambda: host(ja, jb).block_until_ready()

    def deferred(host_kernels: bool):
        def run():
            with config.override(host_kernels=host_kernels):
                with deferfuse.defer():
                    out = product(va, vb)
                deferfuse.sync(out)
            return out
        return run
    found["defer host"] = deferred(True)
    found["defer xla"] = deferred(False)
    expected = found["torch"]()
    for name, fn in found.items():
        got = fn()
        got = torch.from_numpy(np.array(got)) if not isinstance(got, torch.Tensor) else got
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-2, msg=name)
    return found


def measure(runs: int, only: str | None = None) -> list[dict]:
    from deferfuse import config
    from deferfuse.exec import backend
    # JAX's CPU client as deferfuse sets it up (synchronous dispatch, malloc tuning), before the
    # jitted candidates create it: every candidate runs on the same client
    backend.prepare()
    rng = np.random.default_rng(0)
    rows = []
    # every block deferred and compiled, so each timed run is the deferred engine's (record,
    # flush, run the cached executable); the disk cache left as the user has it
    with config.override(eager_blocks=False, eager_segments=False, eager_unseen_ops=False,
                         eager_lone_ops=False, lone_op_on_torch=False, autotune_engine=False,
                         eager_first_runs=0, background_compile=False):
        for name, batch, m, k, n, lhs_t, rhs_t in SHAPES:
            if only and only not in name:
                continue
            a, b = _operands(batch, m, k, n, lhs_t, rhs_t, rng)
            found = _candidates(batch, m, k, n, lhs_t, rhs_t, a, b)
            samples: dict[str, list[float]] = {c: [] for c in found}
            for _ in range(3):
                for c, fn in found.items():
                    samples[c] += _samples(fn, max(1, runs // 3))
            flops = 2 * (batch or 1) * m * k * n
            row = {"shape": name, "flops": flops}
            for c, s in samples.items():
                row[c] = {"min_us": min(s) * 1e6, "median_us": statistics.median(s) * 1e6,
                          "gflops": flops / statistics.median(s) / 1e9}
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dots", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=45)
    parser.add_argument("--only", default=None, help="shapes whose name contains this")
    parser.add_argument("--json", default=None, help="also write the rows and machine here")
    parser.add_argument("--single-thread", action="store_true",
                        help="one thread everywhere, timed by CPU time (see above)")
    args = parser.parse_args(argv)
    if args.single_thread:
        if "jax" in sys.modules:
            raise SystemExit("--single-thread must set XLA_FLAGS before JAX is imported")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + SINGLE_THREAD_XLA).strip()
        torch.set_num_threads(1)
        CLOCK[0] = time.process_time
    info = machine_info()
    print(f"{info.get('cpu_model', '?')} {info.get('cpu_vector_flags', [])}, torch BLAS "
          f"{info.get('torch_blas', '?')}, {torch.get_num_threads()} torch threads, "
          f"{CLOCK[0].__name__}, load average {os.getloadavg()[0]:.2f}")
    rows = measure(args.runs, args.only)
    present = [c for c in CANDIDATES if any(c in r for r in rows)]
    print("min / median microseconds (GFLOP/s of the median); ratios: torch's median over each")
    print(f"{'shape':44s} " + " ".join(f"{c:>22s}" for c in present))
    for r in rows:
        cells = [f"{r[c]['min_us']:7.0f} / {r[c]['median_us']:6.0f} ({r[c]['gflops']:3.0f})" if c in r
                 else f"{'-':>22s}" for c in present]
        print(f"{r['shape']:44s} " + " ".join(f"{cell:>22s}" for cell in cells))
        ratios = [f"{r['torch']['median_us'] / r[c]['median_us']:.2f}x" if c in r else "-" for c in present]
        print(f"{'  torch / candidate':44s} " + " ".join(f"{x:>22s}" for x in ratios))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "torch_threads": torch.get_num_threads(),
                       "clock": CLOCK[0].__name__, "load_average": os.getloadavg(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
