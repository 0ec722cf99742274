"""Custom kernels (``deferfuse.jax_op``, docs/kernels.md) against the same computation in torch ops.

    python -m bench.kernels [--reps 20] [--only rmsnorm,attention]

Two of the shipped examples (deferfuse/kernels/examples/), each as a training step (forward,
``.square().mean()``, backward) with a pointwise op on each side, so defer mode has something
to fuse the kernel with:

- ``rmsnorm``: the Pallas RMSNorm (interpret mode on a CPU) with its ``bwd=``, 4096 x 512
  float32; torch ops: the same math (``rmsnorm_reference``);
- ``attention``: the JAX attention, batch 4, 8 query heads over 2 key/value heads, 256 tokens,
  head dim 64, causal; torch ops: ``F.scaled_dot_product_attention(..., enable_gqa=True)``.

Six ways each: torch ops and the kernel, each under strict, under defer, and compiled with
``torch.compile(backend="deferfuse")`` (the step's forward and backward graphs, the kernel
inlined into them; ``loss.backward()`` is a graph break, as with any backend).  Defer runs with
``eager_blocks`` off, so that every step is deferred (the block tier would otherwise run a
block at once when that measures faster).  Reported: the median of
``--reps`` steps after 3 warm-up steps (which compile), in milliseconds.  Results:
``bench/results/kernels.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import deferfuse

RESULTS = Path(__file__).resolve().parent / "results" / "kernels.json"


def _rmsnorm_case():
    from deferfuse.kernels.examples.rmsnorm import rmsnorm, rmsnorm_reference
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 512, generator=g).requires_grad_()
    w = torch.randn(512, generator=g).requires_grad_()

    def step(norm):
        def run():
            loss = norm(torch.tanh(x), w, 1e-6).mul(2.0).square().mean()
            loss.backward()
            return loss
        return run
    return {"torch ops": step(rmsnorm_reference), "kernel": step(rmsnorm)}, (x, w)


def _attention_case():
    from deferfuse.kernels.examples.attention import attention
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 8, 256, 64, generator=g).requires_grad_()
    k = torch.randn(4, 2, 256, 64, generator=g).requires_grad_()
    v = torch.randn(4, 2, 256, 64, generator=g).requires_grad_()

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def jax_attention(q, k, v):
        return attention(q, k, v, None, None, True)

    def step(attend):
        def run():
            loss = attend(q * 0.5, k, v).tanh().square().mean()
            loss.backward()
            return loss
        return run
    return {"torch ops": step(sdpa), "kernel": step(jax_attention)}, (q, k, v)


CASES = {"rmsnorm": _rmsnorm_case, "attention": _attention_case}
MODES = {"strict": contextlib.nullcontext, "defer": deferfuse.defer, "compile": contextlib.nullcontext}


def _time(run, mode, leaves, reps: int) -> tuple[float, float]:
    times = []
    loss = None
    if mode == "compile":
        torch._dynamo.reset()
        run = torch.compile(run, backend="deferfuse")
    for i in range(3 + reps):
        for t in leaves:
            t.grad = None
        start = time.perf_counter()
        with MODES[mode]():
            loss = run().detach()
        loss = loss.item()            # (the step is done when its loss is read)
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--only", default=",".join(CASES))
    args = parser.parse_args()
    results = {"torch": torch.__version__, "reps": args.reps, "rows": []}
    with deferfuse.config.override(eager_blocks=False):
        for name in args.only.split(","):
            ways, leaves = CASES[name]()
            for impl, run in ways.items():
                for mode in MODES:
                    ms, loss = _time(run, mode, leaves, args.reps)
                    row = {"case": name, "impl": impl, "mode": mode, "ms": round(ms, 3), "loss": loss}
                    results["rows"].append(row)
                    print(f"{name:10s} {impl:10s} {mode:7s} {ms:9.2f} ms   loss {loss:.6f}", flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
