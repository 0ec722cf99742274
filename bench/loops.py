"""Training loops that log every N steps: strict against defer mode as users run it.

    python -m bench.loops [--models mlp,llama,gpt2|all] [--periods 1,10,50,0] [--rounds 3]
                          [--steps mlp=400,llama=100,gpt2=100] [--size tiny|small|medium]
                          [--long 4000] [--lengths 24] [--deterministic] [--way block|step-block]

Each cell runs ``corpus/train_logging.py`` in a fresh process: strict (plain ``python``) and
defer (``python -m deferfuse --mode defer``, every setting at its default, a fresh disk-cache
folder per round so that nothing is warm), alternating round by round.  A period of 0 reads the
loss only at the end.  For each cell: the loop's time (all steps, and the first 100), the
compiles and distinct signatures (cache misses) defer mode made, and the peak resident memory of
each, and the loop from its 15th step on.  ``--long N`` adds a run of the MLP for N steps, reading every 50, with its resident memory
every 1,000 steps.  ``--models all``: the MLP and every zoo model that trains.  ``--models sampler
--periods 0``: ``corpus/sample_loop.py``, a loop with no optimizer that reads only at its end.  ``--lengths L``:
a language model's batches take L token lengths in turn (a text loader without bucketing); the
"from step L" columns then time the loop from its second epoch of lengths on.
``--deterministic``: both sides call ``torch.use_deterministic_algorithms(True)`` first.  ``--way
block``: the defer side is the loop inside one ``with deferfuse.defer():`` block (plain ``python``,
the program's ``--block``), not the default mode; ``--way step-block``: one such block around each
step (``--block step``).  Results:
bench/results/<name>.json and a table (docs/performance.md, "Loops").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.harness import RESULTS_DIR, default_settings_env, machine_info, write_json
from bench.zoo_models import SIZES

ROOT = Path(__file__).resolve().parent.parent
CLIENT = ROOT / "corpus" / "train_logging.py"
# a loop with no optimizer and no read until its end (a sampler's, an ODE integrator's shape):
# the model "sampler", period 0 only
SAMPLER = ROOT / "corpus" / "sample_loop.py"
DEFAULT_STEPS = {"mlp": 400, "llama": 100, "gpt2": 100, "sampler": 500, "gelu": 600}


def run_one(model: str, period: int, steps: int, size: str, mode: str, cache_dir: str,
            extra_env: dict[str, str] | None = None, extra_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """One loop in a fresh process; its report, with its stdout (the losses it printed)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        report_path = f.name
    if model == "sampler":
        if period != 0 or extra_args:
            raise ValueError("the sampler reads only at its end: --periods 0, no --lengths or --deterministic")
        args = [str(SAMPLER), "--steps", str(steps), "--report", report_path]
    else:
        args = [str(CLIENT), "--model", model, "--period", str(period), "--steps", str(steps),
                "--size", size, "--report", report_path, *extra_args]
    if mode == "strict":
        command = [sys.executable, *args]
    elif mode in ("block", "step-block"):
        command = [sys.executable, *args, "--block", "loop" if mode == "block" else "step"]
    else:
        command = [sys.executable, "-m", "deferfuse", "--mode", "defer", *args]
    env = default_settings_env(DEFERFUSE_CACHE_DIR=cache_dir, **(extra_env or {}))
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    with open(report_path) as f:
        report = json.load(f)
    os.unlink(report_path)
    report["stdout"] = done.stdout
    return report


def summary(reports: list[dict[str, Any]], skip: int = 0) -> dict[str, Any]:
    """Medians over rounds of one cell's figures; ``skip``: also the time after that many steps."""
    def med(values: list[float]) -> float:
        return statistics.median(values)
    ends = [r["step_ends"] for r in reports]
    first = [e[min(99, len(e) - 1)] for e in ends]
    out = {"total_s": med([e[-1] for e in ends]), "first100_s": med(first),
           "from15_s": med([e[-1] - e[min(13, len(e) - 1)] for e in ends]),
           "peak_rss_mib": med([r["peak_rss_mib"] for r in reports]),
           "totals": [e[-1] for e in ends]}
    stats = [r.get("stats") for r in reports if r.get("stats")]
    if stats:
        out["compiles"] = max(s["compiles"] for s in stats)
        out["signatures"] = max(s["cache_misses"] for s in stats)
        out["flushes"] = stats[0]["flushes"]
        out["runs_at_once"] = stats[0].get("blocks_run_at_once", 0)
    if skip:
        out["after_skip_s"] = med([e[-1] - e[skip - 1] for e in ends])
    return out


def measure(models: list[str], periods: list[int], rounds: int, steps: dict[str, int],
            size: str, lengths: int = 0, deterministic: bool = False, way: str = "default") -> list[dict[str, Any]]:
    extra = (("--lengths", str(lengths)) if lengths else ()) + (("--deterministic",) if deterministic else ())
    rows = []
    for model in models:
        for period in periods:
            runs: dict[str, list] = {"strict": [], "defer": []}
            for k in range(rounds):
                order = ("strict", "defer") if k % 2 == 0 else ("defer", "strict")
                for mode in order:
                    with tempfile.TemporaryDirectory() as cache:
                        run_as = way if mode == "defer" and way != "default" else mode
                        runs[mode].append(run_one(model, period, steps[model], size, run_as, cache,
                                                  extra_args=extra))
            same = all(r["stdout"] == runs["strict"][0]["stdout"] for r in runs["defer"])
            row = {"model": model, "period": period, "steps": steps[model], "lengths": lengths, "way": way,
                   "deterministic": deterministic,
                   "strict": summary(runs["strict"], lengths), "defer": summary(runs["defer"], lengths),
                   "same_losses": same}
            if not same:
                row["losses"] = {"strict": runs["strict"][0]["stdout"], "defer": runs["defer"][0]["stdout"]}
            rows.append(row)
            print(line(row), flush=True)
    return rows


def long_run(steps: int, size: str) -> dict[str, Any]:
    out = {}
    for mode in ("strict", "defer"):
        with tempfile.TemporaryDirectory() as cache:
            report = run_one("mlp", 50, steps, size, mode, cache)
        out[mode] = {"total_s": report["step_ends"][-1], "rss_mib_every_100": report["rss_mib_every_100"],
                     "peak_rss_mib": report["peak_rss_mib"]}
    print(f"long run, mlp, {steps} steps, read every 50: strict {out['strict']['total_s']:.2f} s, "
          f"defer {out['defer']['total_s']:.2f} s; resident MiB every 1,000 steps: strict "
          f"{out['strict']['rss_mib_every_100'][9::10]}, defer {out['defer']['rss_mib_every_100'][9::10]}")
    return out


def _ratio(a: float, b: float) -> str:
    """``a / b`` as a speed ratio, or "-" where ``b`` timed nothing (a loop of 14 steps or fewer
    has no time from step 15 on)."""
    return f"{a / b:.2f}x" if b > 0 else "-"


def _period(p: int) -> str:
    return "end" if p == 0 else str(p)


def line(row: dict[str, Any]) -> str:
    s, d = row["strict"], row["defer"]
    return (f"{row['model']:>6} every {_period(row['period']):>3}: strict {s['total_s']:7.2f} s "
            f"(first 100 {s['first100_s']:6.2f}) {s['peak_rss_mib']:6.0f} MiB | defer {d['total_s']:7.2f} s "
            f"(first 100 {d['first100_s']:6.2f}) {d['peak_rss_mib']:6.0f} MiB, {d.get('compiles')} compiles, "
            f"{d.get('signatures')} signatures | defer/strict time {d['total_s'] / s['total_s']:.2f}x, "
            f"first 100 {d['first100_s'] / s['first100_s']:.2f}x, from step 15 "
            f"{_ratio(d['from15_s'], s['from15_s'])}, memory {d['peak_rss_mib'] - s['peak_rss_mib']:+.0f} MiB"
            + (f", from step {row['lengths']} {_ratio(d['after_skip_s'], s['after_skip_s'])}" if row.get("lengths") else "")
            + ("" if row["same_losses"] else " | LOSSES DIFFER"))


def table(rows: list[dict[str, Any]]) -> str:
    lengths = any(r.get("lengths") for r in rows)
    head = ("| model | read every | steps | strict s (first 100) | defer s (first 100) | defer / strict (first 100) "
            "| defer / strict from step 15 ")
    rule = "|---|---|---|---|---|---|---|"
    if lengths:
        head, rule = head + "| defer / strict from the second epoch of lengths ", rule + "---|"
    out = [head + "| compiles (signatures) | peak MiB strict / defer | losses |", rule + "---|---|---|"]
    for r in rows:
        s, d = r["strict"], r["defer"]
        epoch2 = f"| {_ratio(d['after_skip_s'], s['after_skip_s'])} " if lengths else ""
        out.append(f"| {r['model']} | {_period(r['period'])} | {r['steps']} | {s['total_s']:.2f} ({s['first100_s']:.2f}) "
                   f"| {d['total_s']:.2f} ({d['first100_s']:.2f}) | {d['total_s'] / s['total_s']:.2f}x "
                   f"({d['first100_s'] / s['first100_s']:.2f}x) | {_ratio(d['from15_s'], s['from15_s'])} "
                   f"{epoch2}| {d.get('compiles')} ({d.get('signatures')}) "
                   f"| {s['peak_rss_mib']:.0f} / {d['peak_rss_mib']:.0f} | {'same' if r['same_losses'] else 'differ'} |")
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,llama,gpt2")
    parser.add_argument("--periods", default="1,10,50,0")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", default="", help="e.g. mlp=400,llama=100")
    parser.add_argument("--size", default="small", choices=SIZES, help="the zoo models' size")
    parser.add_argument("--long", type=int, default=0, help="also run the MLP this many steps")
    parser.add_argument("--lengths", type=int, default=0, help="language models' batches take this many lengths")
    parser.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True)")
    parser.add_argument("--way", default="default", choices=("default", "block", "step-block"),
                        help="defer as the default mode, with the loop in one `with deferfuse.defer():` "
                             "(block), or with one around each step (step-block)")
    parser.add_argument("--name", default="loops")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    steps = dict(DEFAULT_STEPS)
    for part in filter(None, args.steps.split(",")):
        name, value = part.split("=")
        steps[name] = int(value)
    models = args.models.split(",")
    if models == ["all"]:
        from bench import zoo_models
        models = ["mlp"] + [name for name, spec in zoo_models.MODELS.items() if spec.trains]
    for m in models:
        steps.setdefault(m, 100)
    rows = measure(models, [int(p) for p in args.periods.split(",")], args.rounds, steps, args.size,
                   args.lengths, args.deterministic, args.way)
    result: dict[str, Any] = {"machine": machine_info(), "rounds": args.rounds, "size": args.size, "way": args.way,
                              "lengths": args.lengths, "deterministic": args.deterministic, "rows": rows}
    if args.long:
        result["long"] = long_run(args.long, args.size)
    print()
    print(table(rows))
    print(f"\nwritten: {write_json(RESULTS_DIR / f'{args.name}.json', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
