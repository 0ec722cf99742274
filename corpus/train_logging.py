"""A training loop that logs its loss every N steps, the way most scripts do.

    python corpus/train_logging.py [--model mlp|gelu|llama|gpt2|...] [--period N] [--steps S]
                                   [--size tiny|small|medium] [--lengths L] [--deterministic]
                                   [--report PATH] [--block [loop|step]]

``--period 0`` reads the loss only at the end.  The model is the 64 -> 256 -> 256 -> 1 MLP
(LayerNorm, GELU) of issue 40, ``gelu`` (a GELU-tanh chain over 2^21 floats: memory-bound,
where deferring pays on a CPU), or a model of the zoo (bench/zoo_models.py) at ``--size``;
AdamW.  Plain PyTorch: run it under ``TORCHTPU_MODE=defer python -m deferfuse`` to defer it, or
with ``--block``, which puts the whole loop in one ``with deferfuse.defer():`` block (the README's
way in), or ``--block step``, one block per step.
``--report`` writes the loop's own timings and peak memory as JSON (bench/loops.py reads it).
"""

import argparse
import contextlib
import json
import os
import resource
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def build(name: str, size: str, lengths: int = 0):
    """The model and its loss at each step; ``lengths``: a zoo language model's batches take
    that many token lengths in turn (a text loader without bucketing), not one."""
    if name == "gelu":
        # memory-bound: a GELU-tanh chain over 2^21 floats, where deferring pays on a CPU
        # (one fused pass instead of ~10); a parameter vector, SGD-like through AdamW
        weight = nn.Parameter(torch.randn(2 ** 21) * 0.1)
        x = torch.randn(2 ** 21)

        def gelu_loss(step):
            h = weight * x
            y = h * 0.5 * (1.0 + torch.tanh(0.79788456 * (h + 0.044715 * h ** 3)))
            return (y - x).square().mean()
        holder = nn.Module()
        holder.weight = weight
        return holder, gelu_loss
    if name == "mlp":
        model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 256),
                              nn.GELU(), nn.Linear(256, 1))
        x, y = torch.randn(32, 64), torch.randn(32, 1)
        return model, lambda step: nn.functional.mse_loss(model(x), y)
    from bench import zoo_models as zoo
    spec = zoo.MODELS[name]
    model = spec.make(size)
    generator = torch.Generator().manual_seed(1)
    batches = [spec.batch(size, generator) for _ in range(4)]
    if lengths:
        full = batches[0]["input_ids"].shape[1]
        cut = [full - 3 * k for k in range(lengths)]
        batches = [{k: v[:, :cut[i % lengths]] for k, v in batches[i % 4].items()} for i in range(lengths)]
    return model, lambda step: zoo.loss_of(model, spec, batches[step % len(batches)])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from bench.zoo_models import SIZES
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--period", type=int, default=50)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--size", default="small", choices=SIZES, help="a zoo model's size")
    parser.add_argument("--lengths", type=int, default=0, help="a language model's batches take this many lengths")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms(True) first, as a reproducible run does")
    parser.add_argument("--report")
    parser.add_argument("--block", nargs="?", const="loop", choices=("loop", "step"),
                        help="the loop inside one `with deferfuse.defer():` (loop, the default), or "
                             "each step inside one (step)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model, loss_of = build(args.model, args.size, args.lengths)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ends, rss = [], []
    block = step_block = contextlib.nullcontext
    if args.block:
        import deferfuse
        if args.block == "loop":
            block = deferfuse.defer
        else:
            step_block = deferfuse.defer
    started = time.perf_counter()
    with block():
        for step in range(args.steps):
            with step_block():
                loss = loss_of(step)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            if args.period and step % args.period == 0:
                print(step, f"{loss.item():.4f}")
            ends.append(time.perf_counter() - started)
            if (step + 1) % 100 == 0:
                rss.append(round(rss_mib(), 1))
        print("final", f"{loss.item():.4f}")
    if args.report:
        report = {"step_ends": ends, "rss_mib_every_100": rss,
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
