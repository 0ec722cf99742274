"""torch.compile(backend="deferfuse") against strict and torch.compile's Inductor on the zoo's steps.

``python -m bench.compile [--model llama] [--size tiny|small|medium] [--steps 12]``
(``make bench-compile``)
runs each candidate in a fresh process, so that its first step pays what a user's first step
pays (Dynamo's tracing, AOTAutograd, the compiler) and no candidate warms another's caches:

- ``strict``: plain PyTorch;
- ``aot_eager``: ``torch.compile(backend="aot_eager")``, tracing alone (the floor of a first step);
- ``inductor``: ``torch.compile`` with its default backend, its caches empty (a fresh
  ``TORCHINDUCTOR_CACHE_DIR``: its FX graph and kernel caches otherwise persist in /tmp across
  runs, and a first step measured after an earlier run is a warm one);
- ``inductor-warm``: the same in a second process, with the caches the first one filled;
- ``deferfuse-cold``: ``torch.compile(backend=deferfuse.compile.backend)`` with an empty disk cache;
- ``deferfuse-warm``: the same in a second process, with the disk cache the cold run filled;
- ``deferfuse+defer``: the same compiled model (warm), with AdamW's step in a
  ``with deferfuse.defer():`` block;
- ``side-by-side``: strict, defer mode, Inductor and deferfuse in one process, steps alternating;
  with where deferfuse's step goes (its XLA programs' wall time, of which the host kernels and
  their hand-over; the rest outside them, AdamW's eager step among it) and, from one strict step
  under torch's profiler, how much of strict's step its products and attention take;
- ``rows``: bench/workloads.py's memory-bound rows (the GELU chain at 2^20 and 2^24 floats,
  LayerNorm 4096 x 1024) as single functions, strict, Inductor and deferfuse side by side in
  one process (forward only, no grad), the median of 30 calls after 3 that compile.

The model's forward and backward are compiled; AdamW runs eagerly (one step is the zoo's
``train_step``: forward, backward, AdamW, zero_grad).  Each child prints its first step's wall
time, the median of the steps after ``--warmup`` more, and its losses; the table gives each
candidate's steady-state speed relative to strict (strict's median / its median) and its model
FLOPs utilization (MFU: the step's matrix FLOPs, counted once in this process over one strict
step with torch's FlopCounterMode, bench/flops.py, over the candidate's median step time, as a
fraction of the machine's peak, the best of a few 2048^3 float32 GEMMs on torch's threads,
bench/harness.py's peak_gflops, printed above the table).
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

CANDIDATES = ("strict", "aot_eager", "inductor", "inductor-warm", "deferfuse-cold", "deferfuse-warm",
              "deferfuse+defer", "side-by-side", "rows")
# side-by-side: strict, defer mode (the step in a defer block), Inductor and deferfuse (compiled,
# warm) in one process, their steps
# alternating, so a busy machine's load falls on all three alike; its ratios are the steady ones
# to trust on a shared machine.


# strict's ops whose kernels deferfuse's programs call on the host (lower/host_products.py), with
# its flash attention: what the side-by-side reports of strict's step under torch's profiler
STRICT_KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::convolution",
                  "aten::convolution_backward", "aten::mkldnn_convolution")


def side_by_side(model_name: str, size: str, steps: int, warmup: int) -> dict:
    import contextlib
    import copy
    import torch
    import deferfuse
    import deferfuse.compile
    from bench import zoo_models as zoo
    model = zoo.MODELS[model_name]
    base = model.make(size)
    batch = model.batch(size, torch.Generator().manual_seed(1))
    lanes = {}
    for name, backend in (("strict", None), ("defer", None), ("inductor", "inductor"),
                          ("deferfuse", deferfuse.compile.backend)):
        m = copy.deepcopy(base)
        forward = m if backend is None else torch.compile(m, backend=backend)
        lanes[name] = (forward, zoo.optimizer_for(m, model), [])
    from bench.engine_time import Timers
    from deferfuse.exec import executables
    from deferfuse.native import hostkernels
    timers = Timers()    # (its "execute_xla": seconds in deferfuse's XLA program runs, kernels included)
    timers.wrap(executables, "run", "execute_xla")
    # per timed deferfuse step: hostkernels.counters()' differences, its seconds in XLA runs and
    # in the optimizer's step (eager in every lane but defer's)
    kernels = []

    def one_step(name, forward, optimizer) -> float:
        with (deferfuse.defer() if name == "defer" else contextlib.nullcontext()):
            loss = forward(**batch).loss if model.kind != "torch" else forward(batch["x"]).float().square().mean()
            loss.backward()
            stepped = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad()
            stepped = time.perf_counter() - stepped
        float(loss)
        return stepped

    try:
        for k in range(steps + 1 + warmup):
            for name, (forward, optimizer, times) in lanes.items():
                before, timers.spent["execute_xla"] = hostkernels.counters(), 0.0
                started = time.perf_counter()
                optimizer_s = one_step(name, forward, optimizer)
                if k > warmup:
                    times.append(time.perf_counter() - started)
                    if name == "deferfuse":
                        after = hostkernels.counters()
                        kernels.append([b - a for a, b in zip(before, after)] + [timers.spent["execute_xla"], optimizer_s])
    finally:
        for module, attribute, original in timers.originals:
            setattr(module, attribute, original)
    # strict's products and attention, the part of its step the host kernels run in deferfuse's
    forward, optimizer, _ = lanes["strict"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiled:
        started = time.perf_counter()
        one_step("strict", forward, optimizer)
        profiled_s = time.perf_counter() - started
    kernel_s = sum(e.self_cpu_time_total for e in profiled.key_averages()
                   if e.key in STRICT_KERNELS or "flash_attention" in e.key) * 1e-6
    medians = {name: statistics.median(times) for name, (_, _, times) in lanes.items()}
    median = statistics.median
    return {"candidate": "side-by-side", "first_s": float("nan"), "steady_s": medians["strict"],
            "medians": medians,
            "strict_kernels": {"seconds": kernel_s, "step_s": profiled_s},
            "host_kernels": {"seconds": median(x[0] for x in kernels),
                             "served": median(x[1] for x in kernels),
                             "guest": median(x[2] for x in kernels),
                             "hand_over": median(x[3] for x in kernels),
                             "in_xla": median(x[4] for x in kernels),
                             "optimizer": median(x[5] for x in kernels)} if kernels else None}


def rows() -> dict:
    import torch
    import deferfuse.compile
    from bench import workloads
    out = {}
    for spec in (workloads.gelu_spec(20), workloads.gelu_spec(24), workloads.layer_norm_spec()):
        inputs = spec.make_inputs()
        lanes = {"strict": spec.torch_fn}
        for name, backend in (("inductor", "inductor"), ("deferfuse", deferfuse.compile.backend)):
            torch._dynamo.reset()
            lanes[name] = torch.compile(spec.torch_fn, backend=backend, dynamic=False)
        times: dict = {name: [] for name in lanes}
        with torch.no_grad():
            expected = spec.torch_fn(*inputs)
            for k in range(33):
                for name, fn in lanes.items():
                    started = time.perf_counter()
                    result = fn(*inputs)
                    if k >= 3:
                        times[name].append(time.perf_counter() - started)
                    elif k == 2:
                        torch.testing.assert_close(result, expected, rtol=spec.rtol, atol=spec.atol)
        out[f"{spec.name} {spec.size}"] = {name: statistics.median(t) for name, t in times.items()}
    return {"candidate": "rows", "first_s": float("nan"), "steady_s": float("nan"), "rows": out}


def child(candidate: str, model_name: str, size: str, steps: int, warmup: int) -> dict:
    if candidate == "side-by-side":
        return side_by_side(model_name, size, steps, warmup)
    if candidate == "rows":
        return rows()
    import torch
    from bench import zoo_models as zoo
    model = zoo.MODELS[model_name]
    m = model.make(size)
    optimizer = zoo.optimizer_for(m, model)
    batch = model.batch(size, torch.Generator().manual_seed(1))
    deferfuse = None
    if candidate.startswith("deferfuse"):
        import deferfuse
        import deferfuse.compile
        forward = torch.compile(m, backend=deferfuse.compile.backend)
    elif candidate in ("aot_eager", "inductor", "inductor-warm"):
        forward = torch.compile(m, backend=candidate.removesuffix("-warm"))
    else:
        forward = m
    times, losses = [], []
    for _ in range(steps):
        started = time.perf_counter()
        loss = forward(**batch).loss if model.kind != "torch" else forward(batch["x"]).float().square().mean()
        loss.backward()
        if candidate == "deferfuse+defer":
            with deferfuse.defer():
                optimizer.step()
                optimizer.zero_grad()
        else:
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(loss))
        times.append(time.perf_counter() - started)
    out = {"candidate": candidate, "first_s": times[0],
           "steady_s": statistics.median(times[1 + warmup:]), "losses": losses}
    if deferfuse is not None:
        s = deferfuse.stats()
        out["stats"] = {k: s[k] for k in ("compiles", "disk_cache_hits", "compiled_graphs",
                                          "compiled_partitions", "compiled_fallbacks")}
    return out


def step_flops_and_peak(model_name: str, size: str) -> tuple[int, float]:
    """The MFU column's numerator (one strict step's matrix FLOPs, counted in this process, not
    in a candidate's) and its peak (GFLOP/s)."""
    from bench import flops
    from bench import zoo_models as zoo
    from bench.harness import peak_gflops
    return flops.step_flops(zoo.MODELS[model_name], size), peak_gflops()


def _mfu_percent(step_flops: int | None, seconds: float, peak: float) -> str:
    from bench.harness import mfu
    value = mfu(step_flops, seconds, peak)
    return "-" if value is None else f"{100 * value:.1f}"


def run_child(candidate: str, args: argparse.Namespace, cache: str) -> dict:
    env = dict(os.environ, DEFERFUSE_CACHE_DIR=cache, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"))
    command = [sys.executable, "-m", "bench.compile", "--child", candidate, "--model", args.model,
               "--size", args.size, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        return {"candidate": candidate, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from bench.zoo_models import SIZES
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama")
    parser.add_argument("--size", default="small", choices=SIZES)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="steps after the first left out of the median")
    parser.add_argument("--only", default=",".join(CANDIDATES))
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.model, args.size, args.steps, args.warmup)))
        return 0
    cache = tempfile.mkdtemp(prefix="deferfuse-bench-compile-")
    # (side-by-side has its own cache folder: it must not warm deferfuse-cold's)
    results = [run_child(c, args, tempfile.mkdtemp(prefix="deferfuse-bench-compile-")
                         if c == "side-by-side" else cache) for c in args.only.split(",")]
    strict = next((r for r in results if r["candidate"] == "strict" and "error" not in r), None)
    step_flops, peak = step_flops_and_peak(args.model, args.size)
    print(f"{args.model} ({args.size}) training step, {args.steps} steps, median after {1 + args.warmup}; "
          f"{step_flops / 1e9:.2f} GFLOP of matrix products a step; peak {peak:.1f} GFLOP/s "
          f"(2048^3 float32 GEMM)")
    print(f"{'candidate':<18}{'first step s':>14}{'steady ms':>12}{'vs strict':>11}{'MFU %':>8}")
    for r in results:
        if "error" in r:
            print(f"{r['candidate']:<18} failed: {r['error']}")
            continue
        if "medians" in r or "rows" in r:
            continue
        ratio = f"{strict['steady_s'] / r['steady_s']:.2f}x" if strict else "-"
        print(f"{r['candidate']:<18}{r['first_s']:>14.2f}{r['steady_s'] * 1e3:>12.1f}{ratio:>11}"
              f"{_mfu_percent(step_flops, r['steady_s'], peak):>8}"
              + (f"   {r['stats']}" if "stats" in r else ""))
    for r in results:
        if "medians" in r:
            m = r["medians"]
            print(f"side by side, one process, alternating steps: strict {m['strict'] * 1e3:.1f} ms, "
                  f"defer {m['defer'] * 1e3:.1f} ms ({m['strict'] / m['defer']:.2f}x), "
                  f"inductor {m['inductor'] * 1e3:.1f} ms ({m['strict'] / m['inductor']:.2f}x), deferfuse "
                  f"{m['deferfuse'] * 1e3:.1f} ms ({m['strict'] / m['deferfuse']:.2f}x strict, "
                  f"{m['inductor'] / m['deferfuse']:.2f}x inductor); MFU % "
                  + ", ".join(f"{name} {_mfu_percent(step_flops, m[name], peak)}" for name in m))
            kernels = r.get("host_kernels")
            if kernels:
                print(f"  deferfuse's step: {kernels['seconds'] * 1e3:.1f} ms in the host kernels, "
                      f"{kernels['served']:.0f} calls served by the thread running the program, "
                      f"{kernels['guest']:.0f} on threads made for them; handing them over and back "
                      f"{kernels.get('hand_over', 0.0) * 1e3:.1f} ms")
                if "in_xla" in kernels:
                    own = kernels["in_xla"] - kernels["seconds"] - kernels["hand_over"]
                    print(f"  deferfuse's step in its XLA programs {kernels['in_xla'] * 1e3:.1f} ms (XLA's own work, "
                          f"the kernels and their hand-over left out: {own * 1e3:.1f} ms), outside them "
                          f"{(m['deferfuse'] - kernels['in_xla']) * 1e3:.1f} ms (AdamW, eager: "
                          f"{kernels['optimizer'] * 1e3:.1f} ms; Dynamo, AOTAutograd, the runtime)")
            strict_kernels = r.get("strict_kernels")
            if strict_kernels:
                print(f"  strict's products and attention (one step under torch's profiler): "
                      f"{strict_kernels['seconds'] * 1e3:.1f} ms of its {strict_kernels['step_s'] * 1e3:.1f} ms")
    for r in results:
        for row, m in r.get("rows", {}).items():
            print(f"{row}: strict {m['strict'] * 1e3:.2f} ms, inductor {m['inductor'] * 1e3:.2f} ms "
                  f"({m['strict'] / m['inductor']:.2f}x), deferfuse {m['deferfuse'] * 1e3:.2f} ms "
                  f"({m['strict'] / m['deferfuse']:.2f}x strict)")
    if strict:
        for r in results:
            if r.get("losses") and r is not strict:
                drift = max(abs(a - b) for a, b in zip(r["losses"], strict["losses"]))
                print(f"  {r['candidate']}: largest loss difference from strict {drift:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
