"""The defer-block costs of two git revisions, measured in alternating processes.

    python -m bench.revisions 669ab91 HEAD          # 3 rounds: A B A B A B
    python -m bench.revisions 669ab91 HEAD --rounds 5

A change to the recorder or the flush moves a defer block by a few percent, less than this VM's
noise between two ``make bench`` runs.  This checks both revisions out into temporary git
worktrees and runs the same probe (``python -m bench.revisions --probe``) in each, alternately,
so both see the same machine; each probe runs every case interleaved with strict, and prints
medians and minimums.  The table shows each figure's median over the rounds.

Cases (the ``make bench`` workloads at their sizes): 200 chained ops on 64x64, an AdamW step over
50 tensors of 64x1024, the GELU-tanh chain on 2^16 and 2^18 floats, LayerNorm on 4096x1024.
Per case: strict (median, min), the whole defer block (median, min), and recording alone (the
block's body, thread CPU time, min), in milliseconds.  Blocks are always deferred
(``DEFERFUSE_EAGER_BLOCKS=0``): these are the costs of the deferred path.
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

REPO_ROOT = Path(__file__).resolve().parent.parent
FIGURES = ("strict", "strict_min", "defer", "defer_min", "recording_min")


def _cases() -> dict:
    import torch

    from bench import workloads as w
    g = torch.Generator().manual_seed(0)
    x64 = torch.randn(64, 64, generator=g)
    params = [torch.randn(64, 1024, generator=g) for _ in range(50)]
    grads = [torch.randn(64, 1024, generator=g) for _ in range(50)]
    exp_avgs = [torch.zeros(64, 1024) for _ in range(50)]
    exp_avg_sqs = [torch.zeros(64, 1024) for _ in range(50)]
    step = w.StepCounter(10, advance=False)
    x16, x18 = torch.randn(2**16, generator=g), torch.randn(2**18, generator=g)
    xl, wl, bl = torch.randn(4096, 1024, generator=g), torch.randn(1024, generator=g), torch.randn(1024, generator=g)
    return {
        "per-op 200 ops 64x64": lambda: w.chained_ops(x64),
        "adamw 50x64x1024": lambda: w.adamw_step(params, grads, exp_avgs, exp_avg_sqs, step),
        "gelu-tanh 2^16": lambda: w.gelu_tanh(x16),
        "gelu-tanh 2^18": lambda: w.gelu_tanh(x18),
        "layernorm 4096x1024": lambda: w.layer_norm(xl, wl, bl),
    }


def probe(samples: int) -> dict:
    """Every case in this process: strict, the defer block, and recording alone, interleaved."""
    import deferfuse
    results = {}
    for name, fn in _cases().items():
        def block():
            with deferfuse.defer():
                return fn()
        for _ in range(40):   # warm-up: past the eager tier and the background compile
            block()
        time.sleep(0.2)
        strict, defer, recording = [], [], []
        for _ in range(samples):
            start = time.perf_counter()
            fn()
            strict.append(time.perf_counter() - start)
            start = time.perf_counter()
            block()
            defer.append(time.perf_counter() - start)
            with deferfuse.defer():
                start = time.thread_time()
                fn()
                recording.append(time.thread_time() - start)
        results[name] = dict(zip(FIGURES, (1e3 * v for v in (
            statistics.median(strict), min(strict), statistics.median(defer), min(defer), min(recording)))))
    return results


def _worktree(revision: str, where: str) -> str:
    path = os.path.join(where, revision.replace("/", "_"))
    subprocess.run(["git", "worktree", "add", "--detach", "-q", path, revision], cwd=REPO_ROOT, check=True)
    return path


def _run_probe(tree: str, samples: int, cache_dir: str) -> dict:
    # (the block tier off, in revisions that have it: the probe times the deferred path)
    env = dict(os.environ, PYTHONPATH=tree, DEFERFUSE_CACHE_DIR=cache_dir, DEFERFUSE_EAGER_BLOCKS="0")
    # (the probe is this file's, so an old revision without it can be measured too)
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--probe", "--samples", str(samples)],
                         cwd=tree, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(a: str, b: str, rounds: int, samples: int) -> None:
    with tempfile.TemporaryDirectory(prefix="deferfuse-revisions-") as where:
        trees = {a: _worktree(a, where), b: _worktree(b, where)}
        try:
            runs: dict[str, list[dict]] = {a: [], b: []}
            for i in range(rounds):
                for revision, tree in trees.items():
                    print(f"round {i + 1}/{rounds}: {revision} ...", flush=True)
                    runs[revision].append(_run_probe(tree, samples, os.path.join(where, "cache")))
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=REPO_ROOT, check=False)
    print(f"\nmedians over {rounds} rounds, ms ({', '.join(FIGURES)}); speed-up = strict / defer")
    for case in runs[a][0]:
        print(case)
        for revision in (a, b):
            figures = {k: statistics.median(r[case][k] for r in runs[revision]) for k in FIGURES}
            print(f"  {revision:>12}  " + "  ".join(f"{figures[k]:8.3f}" for k in FIGURES)
                  + f"  speed-up {figures['strict'] / figures['defer']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("revisions", nargs="*", help="two git revisions (A B)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        sys.path.insert(0, os.getcwd())
        print(json.dumps(probe(args.samples)))
        return
    if len(args.revisions) != 2:
        parser.error("give two revisions")
    compare(*args.revisions, args.rounds, args.samples)


if __name__ == "__main__":
    main()
