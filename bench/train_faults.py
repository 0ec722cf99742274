"""Page faults per training step: how much fresh memory each candidate touches every step.

    python -m bench.train_faults                  # strict, defer and jax, each in a new process
    MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=1073741824 python -m bench.train_faults

The GPT step of bench.train_gpt, one candidate per process (each with the process's allocator
to itself), 15 warm-up steps, then 10 timed steps: the median step time, the median count of
minor page faults per step (``getrusage``: memory touched for the first time since the
allocator got it from the system), and for defer the faults and time inside its XLA calls.
A step that frees a large buffer back to the system (glibc maps blocks above its mmap
threshold, at most 32 MB unless set, and trims its heap's top) faults it in again next step.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def probe(which: str) -> dict:
    from deferfuse.exec import backend
    backend.prepare()   # JAX's client as deferfuse sets it up (bench.harness.machine_info)
    from bench.train_gpt import JaxTrainer, TorchTrainer, make_batches, make_model
    model, batches = make_model(), make_batches()
    inside = [0, 0.0]
    if which == "jax":
        trainer = JaxTrainer(model, batches)
    else:
        import deferfuse
        from deferfuse.exec import runner
        trainer = TorchTrainer(model, batches, context=deferfuse.defer if which == "defer" else None)
        execute_xla = runner.execute_xla

        def counted(*args, **kwargs):
            faults, started = _faults(), time.perf_counter()
            try:
                return execute_xla(*args, **kwargs)
            finally:
                inside[0] += _faults() - faults
                inside[1] += time.perf_counter() - started
        runner.execute_xla = counted
    for _ in range(12):
        trainer.step()
    time.sleep(1.0)   # (a background compile lands)
    for _ in range(3):
        trainer.step()
    steps, faults, xla_faults, xla_ms = [], [], [], []
    for _ in range(10):
        inside[:] = [0, 0.0]
        before, started = _faults(), time.perf_counter()
        trainer.step()
        steps.append(1e3 * (time.perf_counter() - started))
        faults.append(_faults() - before)
        xla_faults.append(inside[0])
        xla_ms.append(1e3 * inside[1])
    median = statistics.median
    return {"step_ms": median(steps), "faults": median(faults), "xla_faults": median(xla_faults),
            "xla_ms": median(xla_ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probe", choices=("strict", "defer", "jax"), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.probe:
        print(json.dumps(probe(options.probe)))
        return
    print("| candidate | step ms | faults per step | in XLA calls: faults, ms |")
    print("|---|---|---|---|")
    for which in ("strict", "defer", "jax"):
        out = subprocess.run([sys.executable, "-m", "bench.train_faults", "--probe", which],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        inside = f"{r['xla_faults']:.0f}, {r['xla_ms']:.1f}" if which == "defer" else "—"
        print(f"| {which} | {r['step_ms']:.1f} | {r['faults']:.0f} | {inside} |")


if __name__ == "__main__":
    main()
