"""``generate()`` with a compiled forward and a static KV cache: strict, Inductor and deferfuse.

    python -m bench.generate [--models llama,gpt2] [--size small] [--tokens 32] [--rounds 7]
                             [--lanes strict,inductor,deferfuse,deferfuse-xla-dots]

Greedy decoding (``do_sample=False``) of ``--tokens`` new tokens from the zoo's prompt (one
sequence, a quarter of the batch's length), each model in one process, the lanes side by side:

- ``strict``: eager ``generate(cache_implementation="static")``;
- ``inductor``: the same with ``model.forward = torch.compile(model.forward)`` (Inductor, its
  caches empty: a fresh ``TORCHINDUCTOR_CACHE_DIR`` unless one is set);
- ``deferfuse``: ``torch.compile(model.forward, backend="deferfuse")`` (an empty disk cache
  unless ``DEFERFUSE_CACHE_DIR`` is set);
- ``deferfuse-xla-dots``: the same with ``options={"host_kernels": False}``: the products are
  XLA's dots instead of calls into torch's kernels (where the decode step's time goes).

Each lane has its own copy of the model.  Its first ``generate`` is timed alone (for a compiler,
that call compiles the prefill and the decode step), then ``--warmup`` more, then ``--rounds``
timed rounds with the lanes in a new seeded order each round (bench/harness.py says why); each
lane's median, its tokens per second and its ratio to strict are printed and written to
``bench/results/generate.json`` with the machine.  Every lane's tokens are checked against
strict's (static cache) and against eager with the default dynamic cache, and the graphs Dynamo
made and deferfuse's plans and compiles are counted: after the first call, none.

Each timed ``generate()`` is also split (medians over the rounds): ``forward ms``, one decoding
call; ``in XLA ms``, deferfuse's XLA executions in it; ``prompt ms``, the first call (the
prompt's prefill); ``decoding ms``, the sum of the other calls; ``outside ms``, the rest:
``generate()``'s own loop between the calls (logits processing, stopping checks, the cache's
positions), which every lane runs.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

LANES = ("strict", "inductor", "deferfuse", "deferfuse-xla-dots")


def _generate(model: Any, prompt: Any, tokens: int, **kwargs: Any) -> Any:
    import torch
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                              pad_token_id=0, **kwargs)


def _counts() -> dict[str, int]:
    import deferfuse
    from torch._dynamo.utils import counters
    s = deferfuse.stats()
    return {"dynamo_graphs": counters["stats"]["unique_graphs"],
            **{k: s[k] for k in ("compiled_graphs", "compiled_specializations", "compiles", "disk_cache_hits")}}


def _difference(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def bench_model(name: str, size: str, tokens: int, lanes: list[str], rounds: int, warmup: int,
                seed: int = 0) -> dict[str, Any]:
    import torch
    from bench import zoo_models as zoo
    spec = zoo.MODELS[name]
    base = spec.make(size).eval()
    prompt = spec.prompt(size, torch.Generator().manual_seed(seed))
    dynamic_ids = _generate(base, prompt, tokens)
    models: dict[str, Any] = {}
    for lane in lanes:
        m = base if lane == "strict" else copy.deepcopy(base)
        if lane == "inductor":
            m.forward = torch.compile(m.forward)
        elif lane == "deferfuse":
            m.forward = torch.compile(m.forward, backend="deferfuse")
        elif lane == "deferfuse-xla-dots":
            m.forward = torch.compile(m.forward, backend="deferfuse", options={"host_kernels": False})
        models[lane] = m

    def call(lane: str) -> Any:
        return _generate(models[lane], prompt, tokens, cache_implementation="static")

    forward_s: dict[str, list[float]] = {lane: [] for lane in lanes}
    xla_s: dict[str, list[float]] = {lane: [] for lane in lanes}
    spans: dict[str, list[tuple[float, float]]] = {lane: [] for lane in lanes}
    timing = [False]
    for lane in lanes:
        _time_forward(models[lane], lane, forward_s, xla_s, timing, spans)

    row: dict[str, Any] = {"model": name, "size": size, "tokens": tokens, "prompt_tokens": prompt.shape[1],
                           "lanes": {}}
    reference = None
    for lane in lanes:   # first calls, one lane at a time: each compiles what it needs
        before = _counts()
        started = time.perf_counter()
        ids = call(lane)
        first_s = time.perf_counter() - started
        reference = ids if lane == "strict" else reference
        row["lanes"][lane] = {"first_s": first_s, "first_call_counts": _difference(_counts(), before),
                              "same_as_dynamic_cache": bool(torch.equal(ids, dynamic_ids)), "ids": ids}
    for _ in range(warmup):
        for lane in lanes:
            call(lane)
    samples: dict[str, list[float]] = {lane: [] for lane in lanes}
    # per timed generate(): its first forward call (the prompt), the decoding calls' sum, and
    # the rest (generate()'s own loop between the calls, which every lane runs)
    parts: dict[str, list[tuple[float, float, float]]] = {lane: [] for lane in lanes}
    order = list(lanes)
    shuffle = random.Random(seed)
    before = _counts()
    timing[0] = True
    for _ in range(rounds):
        shuffle.shuffle(order)
        for lane in order:
            spans[lane].clear()
            started = time.perf_counter()
            ids = call(lane)
            total = time.perf_counter() - started
            samples[lane].append(total)
            calls = [end - start for start, end in spans[lane]]
            parts[lane].append((calls[0], sum(calls[1:]), total - sum(calls)))
            row["lanes"][lane]["ids_changed"] = row["lanes"][lane].get("ids_changed", False) \
                or not torch.equal(ids, row["lanes"][lane]["ids"])
    timing[0] = False
    row["counts_while_timed"] = _difference(_counts(), before)
    strict_median = statistics.median(samples["strict"]) if "strict" in samples else None
    for lane in lanes:
        entry = row["lanes"][lane]
        median = statistics.median(samples[lane])
        ids = entry.pop("ids")
        entry.update(median_s=median, samples_s=samples[lane], tokens_per_s=tokens / median,
                     vs_strict=None if strict_median is None else strict_median / median,
                     forward_median_s=statistics.median(forward_s[lane]),
                     xla_median_s=statistics.median(xla_s[lane]) if xla_s[lane] else None,
                     prompt_call_median_s=statistics.median(p[0] for p in parts[lane]),
                     decoding_calls_median_s=statistics.median(p[1] for p in parts[lane]),
                     outside_calls_median_s=statistics.median(p[2] for p in parts[lane]),
                     same_as_strict=None if reference is None else bool(torch.equal(ids, reference)))
    return row


def _time_forward(model: Any, lane: str, forward_s: dict, xla_s: dict, timing: list, spans: dict) -> None:
    """Time each ``model.forward`` call of ``lane`` while ``timing[0]`` (its span kept in
    ``spans[lane]``), and for a deferfuse lane the XLA executions inside it."""
    from deferfuse.exec import executables
    forward, run = model.forward, executables.run
    inside = [0.0]

    def timed_run(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - started

    def timed_forward(*args: Any, **kwargs: Any) -> Any:
        if not timing[0]:
            return forward(*args, **kwargs)
        inside[0] = 0.0
        executables.run = timed_run
        started = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            ended = time.perf_counter()
            forward_s[lane].append(ended - started)
            spans[lane].append((started, ended))
            executables.run = run
            if lane.startswith("deferfuse"):
                xla_s[lane].append(inside[0])
    model.forward = timed_forward


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'model':<7}{'lane':<20}{'first call s':>13}{'median ms':>11}{'tokens/s':>10}{'vs strict':>11}"
             f"{'same ids':>10}{'forward ms':>12}{'in XLA ms':>11}{'prompt ms':>11}{'decoding ms':>13}"
             f"{'outside ms':>12}  first call made"]
    for row in rows:
        for lane, e in row["lanes"].items():
            same = e["same_as_strict"] is not False and e["same_as_dynamic_cache"] and not e.get("ids_changed")
            ratio = "-" if e["vs_strict"] is None else f"{e['vs_strict']:.2f}x"
            made = e["first_call_counts"]
            what = "" if lane == "strict" else f"{made['dynamo_graphs']} Dynamo graphs" + (
                f", {made['compiled_specializations']} deferfuse plans, {made['compiles']} XLA compiles"
                if lane.startswith("deferfuse") else "")
            xla = "-" if e["xla_median_s"] is None else f"{e['xla_median_s'] * 1e3:.3f}"
            lines.append(f"{row['model']:<7}{lane:<20}{e['first_s']:>13.2f}{e['median_s'] * 1e3:>11.1f}"
                         f"{e['tokens_per_s']:>10.1f}{ratio:>11}{'yes' if same else 'NO':>10}"
                         f"{e['forward_median_s'] * 1e3:>12.3f}{xla:>11}{e['prompt_call_median_s'] * 1e3:>11.2f}"
                         f"{e['decoding_calls_median_s'] * 1e3:>13.2f}{e['outside_calls_median_s'] * 1e3:>12.2f}  {what}")
        lines.append(f"{'':<7}(while timed: {row['counts_while_timed']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama,gpt2")
    parser.add_argument("--size", default="small")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lanes", default=",".join(LANES))
    args = parser.parse_args(argv)
    lanes = args.lanes.split(",")
    unknown = [lane for lane in lanes if lane not in LANES]
    if unknown:
        parser.error(f"unknown lanes {unknown}; choose from {', '.join(LANES)}")
    if "strict" not in lanes:
        lanes.insert(0, "strict")
    # caches empty unless the user chose folders: first calls are cold compiles
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="deferfuse-bench-inductor-"))
    os.environ.setdefault("DEFERFUSE_CACHE_DIR", tempfile.mkdtemp(prefix="deferfuse-bench-cache-"))
    from bench import harness
    warning = harness.busy_machine_warning()
    if warning:
        print(warning)
    import torch
    rows = []
    for name in args.models.split(","):
        torch._dynamo.reset()
        rows.append(bench_model(name, args.size, args.tokens, lanes, args.rounds, args.warmup))
    print(f"generate(), static cache, greedy, {args.tokens} new tokens, size {args.size}; "
          f"median of {args.rounds} alternating rounds after {args.warmup} warm-up")
    print(_table(rows))
    harness.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = harness.RESULTS_DIR / "generate.json"
    payload = {"machine": harness.machine_info(), "busy_warning": warning, "rows": rows}
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
