"""What one call of a compiled graph costs outside XLA: a decoder's step under generate().

    python -m bench.call_overhead [--models llama,gpt2] [--size small] [--calls 2000] [--rounds 3]

``generate()`` with ``torch.compile(model.forward, backend="deferfuse")`` and a static KV cache
calls one compiled graph per token, and each call's work outside its XLA program is deferfuse's
runtime (``compile/runtime.py``): finding the plan for the inputs' shapes, importing ~55 inputs
(parameters, the cache, the new token) through DLPack, exporting the results, writing the
cache's update back into its tensors.  A token's XLA program takes under a millisecond here, so
that work counts; ``bench.generate``'s ``forward ms`` and ``in XLA ms`` columns show it in wall
time, where the machine's noise is as large as the effect.

This script measures it alone.  It catches the inputs of one decoding call (those generate()
makes anew for each token, the token, its position and the mask, are new tensors at each call
here too; the counters the call writes back are restored before it), then calls the graph
``--calls`` times and reports the calling thread's CPU time per call (``time.thread_time``:
another process taking the core does not count):

- ``with XLA``: as users run it (XLA's pool threads are not counted, the caller's wait is);
- ``runtime alone``: each XLA execution replaced by its first results, so what is left is
  deferfuse's own Python and the crossings into and out of torch.

Medians and minima over ``--rounds`` rounds; written to ``bench/results/call_overhead.json``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import Any, Callable


def _capture(model: Any, prompt: Any) -> tuple[Any, list, set]:
    """(the decoding step's CompiledGraph, a copy of one of its calls' inputs, the positions
    of the inputs that generate() passes as new tensors at each call: the token, its position,
    the mask)."""
    import torch
    from bench.generate import _generate
    from deferfuse.compile import runtime
    caught: dict[str, Any] = {}
    call = runtime.CompiledGraph.__call__

    def catching(self: Any, args: list) -> list:
        decoding = any(not p.compiled.hosted for plan in self.plans.values() for p in plan.partitions
                       if p.compiled is not None)
        if decoding and "graph" not in caught:
            caught["graph"] = self
            caught["ids"] = [id(a) for a in args]
            caught["args"] = [a.clone() if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter)
                              and a.numel() < 100 else a for a in args]
            caught["live"] = list(args)   # (held until the next call: the ids stay theirs)
        elif self is caught.get("graph") and "new" not in caught:
            caught["new"] = {i for i, a in enumerate(args) if id(a) != caught["ids"][i]}
            del caught["live"]
        return call(self, args)
    runtime.CompiledGraph.__call__ = catching
    try:
        for _ in range(2):
            _generate(model, prompt, 8, cache_implementation="static")
    finally:
        runtime.CompiledGraph.__call__ = call
    if "new" not in caught:
        raise RuntimeError("no two decoding calls were seen")
    return caught["graph"], caught["args"], caught["new"]


def _cpu_per_call(graph: Any, args: list, new: set, calls: int) -> list[float]:
    """The calling thread's CPU time of each call.  The inputs that generate() makes anew for
    each token (``new``) are new tensors at each call here too, cloned before the clock
    starts; the others are the same tensors at every call, the small ones (the counters the
    step writes back) restored before it."""
    import torch
    small = [(a, a.clone()) for i, a in enumerate(args)
             if i not in new and isinstance(a, torch.Tensor) and a.numel() < 100]
    samples = []
    with torch.no_grad():
        for _ in range(calls):
            for a, saved in small:
                a.copy_(saved)
            call = [a.clone() if i in new else a for i, a in enumerate(args)]
            started = time.thread_time()
            graph(call)
            samples.append(time.thread_time() - started)
    return samples


def _without_xla() -> Callable[[], None]:
    """Replace each XLA execution by its first results; returns the undo."""
    from deferfuse.exec import executables
    run, first = executables.run, {}

    def replay(compiled: Any, inputs: list, scalars: Any) -> Any:
        if compiled not in first:
            first[compiled] = run(compiled, inputs, scalars)
        return first[compiled]
    executables.run = replay

    def undo() -> None:
        executables.run = run
    return undo


def bench_model(name: str, size: str, calls: int, rounds: int) -> dict[str, Any]:
    import torch
    from bench import zoo_models as zoo
    spec = zoo.MODELS[name]
    model = copy.deepcopy(spec.make(size).eval())
    prompt = spec.prompt(size, torch.Generator().manual_seed(0))
    model.forward = torch.compile(model.forward, backend="deferfuse")
    graph, args, new = _capture(model, prompt)
    lanes: dict[str, list[float]] = {"with XLA": [], "runtime alone": []}
    for _ in range(rounds):
        lanes["with XLA"].append(statistics.median(_cpu_per_call(graph, args, new, calls)))
        undo = _without_xla()
        try:
            lanes["runtime alone"].append(statistics.median(_cpu_per_call(graph, args, new, calls)))
        finally:
            undo()
    return {"model": name, "size": size, "calls": calls, "inputs": len(args), "new_each_call": len(new),
            "median_us": {k: statistics.median(v) * 1e6 for k, v in lanes.items()},
            "min_us": {k: min(v) * 1e6 for k, v in lanes.items()},
            "rounds_us": {k: [x * 1e6 for x in v] for k, v in lanes.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama,gpt2")
    parser.add_argument("--size", default="small")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    from bench import harness
    rows = [bench_model(name, args.size, args.calls, args.rounds) for name in args.models.split(",")]
    print(f"a decoding step's compiled graph, CPU time of the calling thread per call, "
          f"median of {args.rounds} rounds x {args.calls} calls (min of the rounds' medians)")
    print(f"{'model':<8}{'inputs':>7}{'new each call':>15}{'with XLA us':>22}{'runtime alone us':>22}")
    for row in rows:
        cells = "".join(f"{row['median_us'][k]:>13.0f} ({row['min_us'][k]:.0f})" for k in ("with XLA", "runtime alone"))
        print(f"{row['model']:<8}{row['inputs']:>7}{row['new_each_call']:>15}{cells}")
    harness.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = harness.write_json(harness.RESULTS_DIR / "call_overhead.json",
                              {"machine": harness.machine_info(), "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
