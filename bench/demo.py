"""What deferfuse does, in under a minute:  python -m bench.demo

Two pieces of ordinary eager PyTorch run twice, side by side in this process: once as usual
(strict: every aten op is its own kernel, reading and writing memory) and once inside
``with deferfuse.defer():`` (the ops are recorded, then run as one jitted XLA computation when
the block ends).  The demo checks that both give the same numbers and prints deferfuse's own
counters, which show how many ops became how many computations.
"""

from __future__ import annotations

import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.harness import (Budget, Candidate, busy_machine_warning, compare, machine_info,
                           private_executable_cache, to_torch_list)
from bench.workloads import DeferProbe, Spec, gelu_spec, mlp_spec

BUDGET = Budget(seconds=3.0, warmup=2, min_rounds=5, max_rounds=40)


class CountAtenOps(TorchDispatchMode):
    """Counts the aten ops that strict eager PyTorch dispatches: one kernel launch each."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _plural(count, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else ("es" if noun.endswith(("sh", "ss")) else "s"))


def count_aten_ops(spec: Spec) -> int:
    inputs = spec.make_inputs()
    with CountAtenOps() as counter:
        spec.torch_fn(*inputs)
    return counter.count


def show(spec: Spec, title: str, formula: str, probe: DeferProbe) -> bool:
    deferfuse = probe.module
    print(f"\n{title}  [{spec.size}]")
    print(f"    {formula}")
    aten_ops = count_aten_ops(spec)
    inputs = spec.make_inputs()

    def run_strict():
        return spec.torch_fn(*inputs)

    def run_defer():
        with deferfuse.defer():
            out = spec.torch_fn(*inputs)
        return out

    # Side by side; defer is warmed up until its graph runs from the executable cache.
    probe.reset()
    timings = compare([Candidate("strict", run_strict),
                       Candidate("defer", run_defer, is_warm=probe.is_warm)],
                      BUDGET, rtol=spec.rtol, atol=spec.atol)
    warm_up = deferfuse.stats()
    strict, defer = timings["strict"], timings["defer"]

    # One more call on its own, so the counters describe exactly one steady-state block, and
    # its result is the one checked against strict.
    deferfuse.reset_stats()
    deferred_out = run_defer()
    one_call = deferfuse.stats()
    try:
        torch.testing.assert_close(to_torch_list(deferred_out), to_torch_list(run_strict()),
                                   rtol=spec.rtol, atol=spec.atol)
        agree = f"yes (torch.testing.assert_close, rtol={spec.rtol:g}, atol={spec.atol:g})"
    except AssertionError as exc:
        agree = "NO: " + " ".join(str(exc).split())[:300]
    del deferred_out

    flushes = one_call.get("flushes", {}) or {}
    print(f"    strict: {aten_ops} aten ops, each its own kernel with its own pass over memory")
    if one_call.get("blocks_run_at_once"):
        from deferfuse.exec import blocks
        place = next((c for c in blocks.choices()
                      if c.place.endswith(f":{run_defer.__code__.co_firstlineno + 1}")), None)
        print("    defer:  this block ran at once, as strict: at its place, deferred runs were "
              "slower (eager_blocks)" + (f"; {place.describe()}" if place else ""))
    else:
        print(f"    defer:  {one_call.get('ops_recorded')} ops recorded -> "
              f"{_plural(sum(flushes.values()), 'flush')} {dict(flushes)} -> "
              f"{_plural(one_call.get('executions'), 'XLA execution')} "
              f"({_plural(one_call.get('cache_hits'), 'cache hit')}, "
              f"{_plural(one_call.get('compiles'), 'compile')})")
    fallbacks = one_call.get("fallbacks", {}) or {}
    if fallbacks:
        print(f"            ops that fell back to eager torch: {dict(fallbacks)}")
    print(f"    results agree: {agree}")
    if defer.median_ms is None:
        print(f"    defer {defer.status}: {defer.reason}")
        return False
    first = f"    first defer call {defer.first_ms:.0f} ms"
    if warm_up.get("unseen_ops_run"):
        first += f" ({_plural(warm_up['unseen_ops_run'], 'op')} seen for the first time ran at once)"
    first += ": then a new graph, " + _plural(warm_up.get("compiles"), "compile")
    replays = warm_up.get("eager_replays")
    if replays and warm_up.get("eager_chosen"):
        # (the counters cover the timed runs too: a graph kept eager replays in every one)
        first += (f"; torch's kernels ran this graph faster than XLA, so the engine choice "
                  f"keeps it eager ({_plural(replays, 'eager run')} in all)")
    elif replays:
        first += f"; the first {_plural(replays, 'run')} replayed eagerly while XLA compiled"
    print(first + f" ({defer.warmup_calls} warm-up calls, untimed)")
    print(f"    strict  {strict.median_ms:8.2f} ms   (median of {len(strict.samples_ms)}, "
          f"min {strict.min_ms:.2f})")
    print(f"    defer   {defer.median_ms:8.2f} ms   (median of {len(defer.samples_ms)}, "
          f"min {defer.min_ms:.2f})" + (f"  [{defer.warning}]" if defer.warning else ""))
    print(f"    speed-up {strict.median_ms / defer.median_ms:.2f}x")
    return agree.startswith("yes") and defer.status == "ok"


def main() -> int:
    with private_executable_cache():
        return _demo()


def _demo() -> int:
    info = machine_info()
    print("deferfuse demo: eager PyTorch ops deferred, fused, and run as one XLA computation")
    print(f"machine: {info['cpu_count']} CPUs, torch {info['torch']} "
          f"({info['torch_threads']} threads), jax {info.get('jax')}, {info['processor']}")
    busy = busy_machine_warning()
    if busy:
        print(busy)
    probe = DeferProbe()
    if probe.module is None:
        print(f"\ncannot run the demo: {probe.unavailable}")
        return 1
    torch.set_grad_enabled(False)
    ok = show(gelu_spec(22), "GELU (tanh form) as explicit elementwise ops",
              "y = x*0.5*(1 + tanh(sqrt(2/pi)*(x + 0.044715*x**3)))", probe)
    ok &= show(mlp_spec(), "RMSNorm + SwiGLU MLP block",
               "h = x*rsqrt(mean(x^2)+eps)*w;  y = x + (silu(h@Wg) * (h@Wu)) @ Wd", probe)
    print("\n(strict and defer run interleaved in one process on the same inputs; "
          "`python -m bench.run` has the full table with jax.jit, torch.compile and a "
          "memory-copy floor.)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
