"""Matrix products of a training step, timed in torch, in XLA, and inside deferfuse's programs.

    .venv/bin/python -m bench.dots [--runs 45] [--json bench/results/dots.json]
    .venv/bin/python -m bench.dots --shapes decode [--dtypes float32,bfloat16] [--forms ...]

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

``--shapes decode`` measures where the host kernels pay (the products of a decode step have one
row per sequence): for each form (``linear`` ``x @ W.T``, ``addmm`` ``bias + x @ W.T``, ``bmm``
over a batch of 8, ``wgrad`` ``A.T @ G`` contracting the M rows), each M in ``--ms`` and each
K = N in ``--kn``, the product as deferfuse lowers it inside ``jax.jit`` with the host kernel
(``host``: its FFI custom call) and with XLA's own dot (``xla``: the same lowering with
``host_kernels`` off), and torch eager for reference; rounds interleave the three candidates,
each round timing a batch of calls of each, and the medians are printed with the ratio
host / xla (above 1: XLA's dot is faster).  A 1x1x1 product first gives the per-call fixed
cost of the FFI call (host minus xla: both pay JAX's dispatch of one jitted call).

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


# --shapes decode: the forms and sizes (see the docstring)
DECODE_FORMS = ("linear", "addmm", "bmm", "wgrad")
DECODE_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
DECODE_KN = (256, 512, 1024)
DECODE_BATCH = 8   # (bmm's batch)


def _decode_case(form: str, m: int, k: int, n: int, dtype: torch.dtype, rng) -> dict:
    """The three candidates of one decode-set product: torch eager, and deferfuse's lowering of
    its aten op inside ``jax.jit`` with the host kernel and with XLA's dot."""
    import jax
    import jax.numpy as jnp

    from deferfuse import config
    from deferfuse.ir.meta import TensorMeta
    from deferfuse.lower import linalg
    from deferfuse.lower.registry import LoweringContext

    aten = torch.ops.aten

    def t(*shape):
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to(dtype)

    if form in ("linear", "addmm"):
        x, w = t(m, k), t(n, k)                    # W stored (out, in); the product reads W.T, a view
        args = (x, w.t()) if form == "linear" else (t(n), x, w.t())
        op = aten.mm.default if form == "linear" else aten.addmm.default
        eager = (lambda: torch.mm(x, w.t())) if form == "linear" else (lambda: torch.addmm(args[0], x, w.t()))
        flops = 2 * m * k * n
    elif form == "bmm":
        a, b = t(DECODE_BATCH, m, k), t(DECODE_BATCH, k, n)
        args, op, eager = (a, b), aten.bmm.default, (lambda: torch.bmm(a, b))
        flops = 2 * DECODE_BATCH * m * k * n
    else:   # wgrad: A.T @ G, A (M, K), G (M, N): a (K, N) result contracting the M rows
        a, g = t(m, k), t(m, n)
        args, op, eager = (a.t(), g), aten.mm.default, (lambda: torch.mm(a.t(), g))
        flops = 2 * m * k * n
    expected = eager()
    metas = tuple(TensorMeta.of(v) for v in args)
    ctx = LoweringContext(op, metas, {}, (TensorMeta.of(expected),))
    # the arrays a program holds: each operand as stored (W as (out, in)), a transposed view
    # transposed inside the program, as deferfuse records ``w.t()`` (XLA cancels that transpose
    # against the host kernel's, or folds it into its dot)
    flipped = tuple(v.dim() == 2 and v.stride() == (1, v.shape[0]) and v.shape[0] > 1 for v in args)
    jdtype = jnp.bfloat16 if dtype == torch.bfloat16 else jnp.float32
    arrays = tuple(jnp.asarray((v.t() if f else v).float().contiguous().numpy()).astype(jdtype)
                   for v, f in zip(args, flipped))
    rule = linalg.mm if op in (aten.mm.default, aten.bmm.default) else linalg.addmm

    def program(*xs):
        return rule(ctx, *(jnp.swapaxes(x, 0, 1) if f else x for x, f in zip(xs, flipped)))

    def lowered(host: bool):
        # (deferfuse traces its programs with 64-bit types on: addmm's beta and alpha are float64)
        with config.override(host_kernels=host, host_kernel_min_flops=0), jax.enable_x64(True):
            # (traced now, under the override: a new function each time, which JAX's trace
            # cache cannot answer from the other candidate's trace)
            fn = jax.jit(lambda *xs: program(*xs)).lower(*arrays).compile()
        run = lambda: fn(*arrays).block_until_ready()   # noqa: E731
        run.text = fn.as_text()
        return run

    found = {"torch": eager, "host": lowered(True), "xla": lowered(False)}
    for name in ("host", "xla"):
        # (each is what it says: the host kernel's custom call, or none)
        assert ("deferfuse_host_" in found[name].text) == (name == "host"), name
        got = torch.from_numpy(np.asarray(found[name]()).astype(np.float32))
        torch.testing.assert_close(got, expected.float(), rtol=2e-2, atol=2e-1 if dtype == torch.bfloat16 else 1e-2,
                                   msg=lambda text: f"{form} {m}x{k}x{n} {name}: {text}")
    return {"found": found, "flops": flops}


def _interleaved(found: dict, rounds: int, budget_s: float) -> dict[str, list[float]]:
    """Samples of each candidate: ``rounds`` rounds, the candidates in turn, each taking about
    ``budget_s`` (at least 3 calls, at most 200) of calls per round."""
    clock = CLOCK[0]
    estimate = {}
    for name, fn in found.items():
        fn()
        start = clock()
        fn()
        estimate[name] = max(clock() - start, 1e-7)
    samples: dict[str, list[float]] = {name: [] for name in found}
    for _ in range(rounds):
        for name, fn in found.items():
            for _ in range(max(3, min(200, int(budget_s / estimate[name])))):
                start = clock()
                fn()
                samples[name].append(clock() - start)
    return samples


def measure_decode(dtypes: list[str], forms: list[str], ms: list[int], kns: list[int],
                   rounds: int, budget_s: float) -> dict:
    from deferfuse.exec import backend
    from deferfuse.native import hostkernels
    backend.prepare()
    if not hostkernels.ensure():
        raise SystemExit(f"host kernels unavailable: {hostkernels.status().get('error')}")
    rng = np.random.default_rng(0)
    rows = []
    # the per-call fixed cost: a 1x1x1 product, host minus xla
    fixed = _decode_case("linear", 1, 1, 1, torch.float32, rng)
    samples = _interleaved(fixed["found"], rounds * 4, budget_s)
    overhead = {c: statistics.median(s) * 1e6 for c, s in samples.items()}
    print(f"1x1x1 float32 product, median us: " + ", ".join(f"{c} {v:.1f}" for c, v in overhead.items())
          + f"; the FFI call's fixed cost (host - xla): {overhead['host'] - overhead['xla']:.1f} us", flush=True)
    print(f"{'dtype':9s} {'form':7s} {'M':>5s} {'K=N':>5s} {'MFLOP':>9s} {'torch us':>9s} {'host us':>9s} "
          f"{'xla us':>9s} {'host/xla':>8s}", flush=True)
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for form in forms:
            for kn in kns:
                for m in ms:
                    case = _decode_case(form, m, kn, kn, dtype, rng)
                    samples = _interleaved(case["found"], rounds, budget_s)
                    med = {c: statistics.median(s) * 1e6 for c, s in samples.items()}
                    row = {"dtype": dtype_name, "form": form, "m": m, "k": kn, "n": kn,
                           "batch": DECODE_BATCH if form == "bmm" else 1, "flops": case["flops"],
                           **{f"{c}_median_us": v for c, v in med.items()},
                           **{f"{c}_min_us": min(s) * 1e6 for c, s in samples.items()},
                           "host_over_xla": med["host"] / med["xla"]}
                    rows.append(row)
                    print(f"{dtype_name:9s} {form:7s} {m:5d} {kn:5d} {case['flops'] / 1e6:9.2f} "
                          f"{med['torch']:9.1f} {med['host']:9.1f} {med['xla']:9.1f} "
                          f"{row['host_over_xla']:8.2f}", flush=True)
    return {"fixed_cost_us": overhead, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dots", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=45)
    parser.add_argument("--only", default=None, help="shapes whose name contains this")
    parser.add_argument("--json", default=None, help="also write the rows and machine here")
    parser.add_argument("--single-thread", action="store_true",
                        help="one thread everywhere, timed by CPU time (see above)")
    parser.add_argument("--shapes", default="training", choices=("training", "decode"),
                        help="the training step's shapes, or the decode set (see above)")
    parser.add_argument("--dtypes", default="float32", help="decode set: dtypes, comma-separated")
    parser.add_argument("--forms", default=",".join(DECODE_FORMS), help="decode set: forms")
    parser.add_argument("--ms", default=",".join(map(str, DECODE_MS)), help="decode set: rows M")
    parser.add_argument("--kn", default=",".join(map(str, DECODE_KN)), help="decode set: K = N")
    parser.add_argument("--rounds", type=int, default=7, help="decode set: interleaved rounds")
    parser.add_argument("--budget", type=float, default=0.01,
                        help="decode set: seconds of calls per candidate per round")
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
          f"{CLOCK[0].__name__}, load average {os.getloadavg()[0]:.2f}", flush=True)
    if args.shapes == "decode":
        found = measure_decode(args.dtypes.split(","), args.forms.split(","),
                               [int(v) for v in args.ms.split(",")], [int(v) for v in args.kn.split(",")],
                               args.rounds, args.budget)
        print(f"load average at the end {os.getloadavg()[0]:.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": info, "torch_threads": torch.get_num_threads(), "clock": CLOCK[0].__name__,
                           "load_average": os.getloadavg(), **found}, f, indent=1)
        return 0
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
