"""Whole programs under the default mode (``TORCHTPU_MODE=defer``, no code change), against strict.

    python -m bench.default_mode [--model llama] [--calls 16] [--steps 30]

Under the default mode no ``with`` line marks the work, so the block tier has nothing to time;
the segment tier (``eager_segments``, docs/architecture.md "Segments") times the work between
two reads of a value instead.  This runs two programs a user runs, each in a fresh process with
a fresh (cold) disk cache, three ways: strict; ``python -m deferfuse --mode defer``; the same
with ``DEFERFUSE_EAGER_SEGMENTS=0`` (what the default mode did before the segment tier):

- ``generate()``: greedy decoding of 32 tokens with the KV cache, ``--calls`` calls; reported:
  the first call, and the median of the calls from the second on;
- a training loop that prints its loss with ``f"{loss:.4f}"`` every step, ``--steps`` AdamW
  steps; reported: the first step, and the median of the last 10.

The zoo's model (bench/zoo_models.py, size small).  Results: ``bench/results/default_mode.json``.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WAYS = {
    "strict": ([], {}),
    "defer": (["-m", "deferfuse", "--mode", "defer"], {}),
    "defer, no segments": (["-m", "deferfuse", "--mode", "defer"], {"DEFERFUSE_EAGER_SEGMENTS": "0"}),
}


def child(model_name: str, calls: int, steps: int) -> dict:
    import torch

    from bench import zoo_models as zoo
    model = zoo.MODELS[model_name]
    lm = model.make("small")
    lm.eval()
    prompt = model.prompt("small", torch.Generator().manual_seed(0))
    generate = []
    for _ in range(calls):
        start = time.perf_counter()
        zoo.generate(lm, prompt).tolist()
        generate.append(time.perf_counter() - start)
    net = model.make("small")
    optimizer = zoo.optimizer_for(net, model)
    g = torch.Generator().manual_seed(1)
    train, printed = [], ""
    for _ in range(steps):
        batch = model.batch("small", g)
        start = time.perf_counter()
        loss = zoo.train_step(net, model, optimizer, batch)
        printed = f"{loss:.4f}"
        train.append(time.perf_counter() - start)
    return {"generate_s": generate, "train_s": train, "last_loss": printed}


def _run(way: str, args: argparse.Namespace) -> dict:
    prefix, extra_env = WAYS[way]
    with tempfile.TemporaryDirectory(prefix="deferfuse-default-mode-") as cache:
        from bench.harness import default_settings_env
        env = default_settings_env(DEFERFUSE_CACHE_DIR=cache, PYTHONPATH=str(ROOT), **extra_env)
        command = [sys.executable, *prefix, str(Path(__file__).resolve()), "--child", "--model", args.model,
                   "--calls", str(args.calls), "--steps", str(args.steps)]
        out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama")
    parser.add_argument("--calls", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.model, args.calls, args.steps)))
        return 0
    results = {way: _run(way, args) for way in WAYS}
    losses = {r["last_loss"] for r in results.values()}
    print(f"{args.model}, size small; fresh process and cold disk cache per way; seconds")
    print(f"{'':22} {'generate 1st':>13} {'generate 2nd+':>14} {'train 1st':>10} {'train last 10':>14}")
    for way, r in results.items():
        g, t = r["generate_s"], r["train_s"]
        print(f"{way:22} {g[0]:13.3f} {statistics.median(g[1:]):14.3f} {t[0]:10.3f} {statistics.median(t[-10:]):14.3f}")
    print(f"last printed loss: {', '.join(sorted(losses))} ({'equal' if len(losses) == 1 else 'DIFFERENT'})")
    from bench.harness import RESULTS_DIR, write_json
    out = write_json(RESULTS_DIR / "default_mode.json", {"model": args.model, "calls": args.calls,
                                                         "steps": args.steps, "results": results})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
