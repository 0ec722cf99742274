"""A sampler: a small network applied hundreds of times with no gradient and no optimizer, the
sample read once at the end (a diffusion sampler's or an ODE integrator's shape of loop).

    python corpus/sample_loop.py [--steps S] [--report PATH]
"""

import argparse
import json
import resource
import sys
import time

import torch
import torch.nn as nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--report")
    args = parser.parse_args()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(65, 256), nn.SiLU(), nn.Linear(256, 256), nn.SiLU(), nn.Linear(256, 64))
    x = torch.randn(128, 64)
    ends = []
    started = time.perf_counter()
    with torch.no_grad():
        for step in range(args.steps):
            t = torch.full((128, 1), 1.0 - step / args.steps)
            eps = net(torch.cat([x, t], dim=1))
            x = x - 0.01 * eps + 0.001 * torch.sin(x)
            ends.append(time.perf_counter() - started)
    print(f"{x.abs().mean().item():.5f} {x.std().item():.5f}")
    if args.report:
        report = {"step_ends": ends, "rss_mib_every_100": [],
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        deferfuse = sys.modules.get("deferfuse")
        if deferfuse is not None:
            stats = deferfuse.stats()
            report["stats"] = {k: stats[k] for k in ("compiles", "cache_misses", "cache_hits",
                                                     "disk_cache_hits", "flushes", "blocks_run_at_once")}
        with open(args.report, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
