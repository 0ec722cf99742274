"""torch.distributed under defer mode: strict vs defer on 2 ranks (gloo over 127.0.0.1), in one run.

    python -m bench.dist [--model llama] [--size tiny] [--steps 5] [--rounds 3]   (make bench-dist)

Two workloads, each timed under strict, under defer (deferfuse's defaults: a block that ran
faster at once runs at once, ``eager_blocks``) and deferred (defer with the block tier off: every
op recorded), interleaved round by round on the same ranks (each mode trains its own copy of the model from the same initial weights), after untimed
warm-up steps that wait for deferfuse's background compiles:

- ``ddp``: a DistributedDataParallel training step (forward, backward with the gradient
  all-reduces, AdamW) of a zoo model (bench/zoo_models.py), the loss read every step as a
  training loop's log line does;
- ``pipeline``: a hand-written 2-stage pipeline (rank 0: the first half of an MLP, rank 1: the
  second half and the loss), 4 microbatches per step, activations and gradients by send/recv.

A step's time is the slower rank's (all-reduced with MAX).  A ratio is strict's median over the
mode's (above 1: faster than strict).  Results go to bench/results/dist.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _deferred():
    """defer with the block tier off: every block recorded, never run at once."""
    import contextlib

    import deferfuse
    stack = contextlib.ExitStack()
    stack.enter_context(deferfuse.config.override(eager_blocks=False))
    stack.enter_context(deferfuse.defer())
    return stack


def _modes():
    import deferfuse
    return {"strict": deferfuse.strict, "defer": deferfuse.defer, "deferred": _deferred}


def _timed(run, steps: int) -> float:
    """Seconds per step of ``run`` on the slower rank."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        run()
    took = torch.tensor([(time.perf_counter() - start) / steps], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def _ddp_workload(args, rank):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bench import zoo_models
    zoo = zoo_models.MODELS[args.model]
    runners = {}
    for mode_name, mode in _modes().items():
        with mode():
            model = DDP(zoo.make(args.size, seed=0))
            opt = zoo_models.optimizer_for(model.module, zoo)
        generator = torch.Generator().manual_seed(100 + rank)
        batches = [zoo.batch(args.size, generator) for _ in range(4)]

        def step(model=model, opt=opt, batches=batches, mode=mode, state={"i": 0}):
            with mode():
                batch = batches[state["i"] % len(batches)]
                state["i"] += 1
                loss = zoo_models.train_step(model, zoo, opt, batch)
                f"{loss:.4f}"   # (the training loop's log line)
        runners[mode_name] = step
    return runners


def _pipeline_workload(args, rank, width: int = 256, micro: int = 4):
    runners = {}
    for mode_name, mode in _modes().items():
        torch.manual_seed(rank)
        with mode():
            if rank == 0:
                stage = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(),
                                            torch.nn.Linear(width, width), torch.nn.GELU())
            else:
                stage = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(),
                                            torch.nn.Linear(width, 8))
            opt = torch.optim.AdamW(stage.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(7)
        xs = [torch.randn(32, width, generator=generator) for _ in range(micro)]
        ys = [torch.randn(32, 8, generator=generator) for _ in range(micro)]

        def step(stage=stage, opt=opt, mode=mode):
            with mode():
                for x, y in zip(xs, ys):
                    if rank == 0:
                        h = stage(x)
                        dist.send(h.detach(), 1)
                        grad = torch.empty_like(h)
                        dist.recv(grad, 1)
                        h.backward(grad)
                    else:
                        h = torch.empty(32, width)
                        dist.recv(h, 0)
                        h.requires_grad_()
                        loss = torch.nn.functional.mse_loss(stage(h), y)
                        loss.backward()
                        dist.send(h.grad, 0)
                opt.step()
                opt.zero_grad()
        runners[mode_name] = step
    return runners


def rank_main(args) -> None:
    dist.init_process_group("gloo", init_method=f"file://{args.init}", rank=args.rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    sys.path.insert(0, REPO)
    from deferfuse import engine
    rows = {}
    for name, make in (("ddp", _ddp_workload), ("pipeline", _pipeline_workload)):
        runners = make(args, args.rank)
        for run in runners.values():
            # warm-up, untimed: past the eager tiers, with the background compiles landed
            for _ in range(args.warmup):
                run()
                engine.wait_for_compiles(300)
                dist.barrier()
        times = {mode: [] for mode in runners}
        for _ in range(args.rounds):
            for mode, run in runners.items():
                times[mode].append(_timed(run, args.steps))
        medians = {mode: statistics.median(t) for mode, t in times.items()}
        rows[name] = {**{f"{m}_ms": t * 1e3 for m, t in medians.items()},
                      **{f"ratio_{m}": medians["strict"] / medians[m] for m in medians if m != "strict"},
                      "rounds_ms": {m: [x * 1e3 for x in t] for m, t in times.items()}}
    if args.rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dist", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama", help="a zoo model (bench/zoo_models.py) for the DDP step")
    parser.add_argument("--size", default="tiny", choices=("tiny", "small"))
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=3, help="timed blocks per mode, interleaved")
    parser.add_argument("--warmup", type=int, default=6, help="untimed steps per mode first")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--init", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank_main(args)
        return 0
    from bench import harness
    warning = harness.busy_machine_warning()
    if warning:
        print(warning)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        common = ["--model", args.model, "--size", args.size, "--steps", str(args.steps), "--rounds", str(args.rounds),
                  "--warmup", str(args.warmup),
                  "--init", os.path.join(tmp, "init"), "--out", out]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
        procs = [subprocess.Popen([sys.executable, "-m", "bench.dist", "--rank", str(r), *common], env=env, cwd=REPO)
                 for r in range(2)]
        codes = [p.wait(timeout=1800) for p in procs]
        if any(codes):
            print(f"a rank failed: exit codes {codes}")
            return 1
        with open(out) as f:
            rows = json.load(f)
    print(f"torch.distributed, 2 ranks on gloo: strict vs defer ({args.model} {args.size}, "
          f"{args.steps} steps x {args.rounds} rounds; ratio = strict / defer)")
    print(f"{'workload':<10} {'strict ms':>10} {'defer ms':>10} {'ratio':>7} {'deferred ms':>12} {'ratio':>7}")
    for name, row in rows.items():
        print(f"{name:<10} {row['strict_ms']:>10.1f} {row['defer_ms']:>10.1f} {row['ratio_defer']:>7.2f} "
              f"{row['deferred_ms']:>12.1f} {row['ratio_deferred']:>7.2f}")
    result = {"command": "python -m bench.dist " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": args.model, "size": args.size, "steps": args.steps, "rounds": args.rounds,
              "machine": harness.machine_info(), "rows": rows}
    path = os.path.join(HERE, "results", "dist.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {os.path.relpath(path, REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
