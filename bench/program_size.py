"""What a deferred program costs to compile as it grows: the measurement behind program_nodes.

    python -m bench.program_size [--unroll 1,2,4,8,16,32] [--model mlp]

A training step of ``corpus/train_logging.py``'s model (the MLP of issue 40, or a zoo model)
is recorded ``k`` steps at a time as one program (``deferfuse.defer(span="block")``, every flush
compiled), each ``k`` in a fresh process: the program's ops, the seconds XLA takes to compile it,
and how far the process's resident memory rises while it does (peak over the resident memory
before).  Results: bench/results/program_size.json; docs/architecture.md ("Step boundaries")
quotes them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import RESULTS_DIR, machine_info

ROOT = Path(__file__).resolve().parent.parent

CHILD = r'''
import json, os, resource, sys, time
model_name, root = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
import torch, deferfuse
from deferfuse import config
from deferfuse.exec import executables
import runpy
client = runpy.run_path(os.path.join(root, "corpus", "train_logging.py"), run_name="client")
k = int(os.environ["UNROLL"])
model, loss_of = client["build"](model_name, "small")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
def steps():
    for s in range(k):
        loss = loss_of(s)
        opt.zero_grad(); loss.backward(); opt.step()
    return loss
steps()                       # strict: the optimizer state exists, every kernel warm
import jax; jax.jit(lambda x: x + 1)(1.0).block_until_ready()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
before = rss()
peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
with config.override(always_compile=True, eager_blocks=False, cache_dir=""):
    with deferfuse.defer(span="block"):
        steps()
stats = deferfuse.stats()
print(json.dumps({"unroll": k, "ops": stats["ops_recorded"], "compiles": stats["compiles"],
                  "compile_s": executables.compile_seconds(), "rss_before_mib": before,
                  "peak_rise_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - max(before, peak_before)}))
'''


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unroll", default="1,2,4,8,16")
    parser.add_argument("--model", default="mlp")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(CHILD)
        child = f.name
    try:
        for k in (int(x) for x in args.unroll.split(",")):
            env = dict(os.environ, UNROLL=str(k))
            env.pop("TORCHTPU_MODE", None)
            done = subprocess.run([sys.executable, child, args.model, str(ROOT)], capture_output=True,
                                  text=True, env=env, cwd=ROOT, timeout=3600)
            if done.returncode != 0:
                print(done.stderr[-3000:])
                return 1
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{args.model} x{k}: {row['ops']} ops, {row['compile_s']:.1f} s to compile, resident memory "
                  f"+{row['peak_rise_mib']:.0f} MiB at its peak", flush=True)
    finally:
        os.unlink(child)
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"program_size_{args.model}.json"
    path.write_text(json.dumps({"machine": machine_info(), "rows": rows}, indent=1))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
