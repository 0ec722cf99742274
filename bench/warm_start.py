"""Time to steady state with a warm disk cache: the first calls of a block in a fresh process.

    python -m bench.warm_start [--calls 20] [--runs 3]

A LayerNorm -> GELU -> residual block over 512 x 2048 floats, called ``--calls`` times in a
fresh interpreter (each call reads its result with ``.item()``), under strict and under
``with deferfuse.defer():``.  One untimed defer process first fills a private disk cache (it
runs the block ``FILL_CALLS`` times, enough for the block tier to choose: the cache then holds
the executable and the tier's choice, remember_blocks); then strict and defer processes
alternate ``--runs`` times, all on that warm cache.  Reported per run: the import of torch and
deferfuse, each call's time, and the sum of the calls; the question is how much more than
strict the defer process spends before it reaches its steady state (issue 24: at most 0.3 s
over 20 calls).  ``--every-call-deferred`` runs the defer processes (the filling one too) with
the block tier off (eager_blocks=0): the warm start of a block that runs deferred.  Where the
extra time goes, call by call: ``python -X importtime`` on the same child (``--child defer``)
shows the imports.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

FILL_CALLS = 60   # calls of the untimed process filling the cache: the block tier chooses by then


def child(mode: str, calls: int) -> dict:
    start = time.perf_counter()
    import torch
    import deferfuse
    imported = time.perf_counter() - start
    torch.manual_seed(0)
    x, w, b = torch.randn(512, 2048), torch.randn(2048), torch.randn(2048)

    def block(x):
        return x + torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, (2048,), w, b))
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        if mode == "defer":
            with deferfuse.defer():
                y = block(x)
        else:
            y = block(x)
        y.sum().item()
        times.append(time.perf_counter() - t)
    return {"mode": mode, "import_s": imported, "calls_s": times, "total_s": sum(times)}


def _run(mode: str, calls: int, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.warm_start", "--child", mode, "--calls", str(calls)],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.warm_start", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--every-call-deferred", action="store_true",
                        help="the block tier off in the defer processes (eager_blocks=0)")
    parser.add_argument("--child", choices=("strict", "defer"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.calls)))
        return 0
    from bench.harness import default_settings_env
    env = default_settings_env(DEFERFUSE_CACHE_DIR=tempfile.mkdtemp(prefix="deferfuse-warm-start-"))
    if args.every_call_deferred:
        env["DEFERFUSE_EAGER_BLOCKS"] = "0"
    _run("defer", max(args.calls, FILL_CALLS), env)   # fills the disk cache
    extra = []
    for run in range(args.runs):
        strict, defer = _run("strict", args.calls, env), _run("defer", args.calls, env)
        extra.append(defer["total_s"] - strict["total_s"])
        for r in (strict, defer):
            first = " ".join(f"{s * 1e3:.0f}" for s in r["calls_s"][:5])
            print(f"run {run + 1} {r['mode']:6s}: import {r['import_s']:.2f} s, {args.calls} calls "
                  f"{r['total_s']:.3f} s (first five, ms: {first})")
    print(f"defer - strict over the first {args.calls} calls: median {statistics.median(extra):.3f} s "
          f"(runs: {', '.join(f'{e:.3f}' for e in extra)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
