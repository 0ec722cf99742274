"""Does running deferfuse's programs slow the user's own torch ops afterwards?

    .venv/bin/python -m bench.openmp_teams [--model llama] [--steps 12] [--json PATH]

In one process: strict's training step of a zoo model (and a lone 64x1024 ``mul_``, an op too
small to hide a thread wake-up) timed, then the same model's step run deferred
(``eager_blocks=False``, the products in the host kernels), then strict timed again.  A host
kernel that XLA calls on a thread of its own pool once made torch's OpenMP team there, which
outlived the call: with more OpenMP threads than cores, GNU OpenMP's idle workers sleep instead
of spinning, and every parallel region after it paid a wake-up (deferfuse/native/host_kernels.cc,
``Run``).  "after / before" is strict's time after the deferred steps over its time before:
1.0 means deferfuse left torch as it found it.  Also printed: the host-kernel calls XLA made on
its own threads (``hostkernels.guest_calls``; absent before that count existed) and the
process's threads by name (an OpenMP worker takes the name of the thread that made it).

    .venv/bin/python -m bench.openmp_teams --thread-cost

times instead what the fix costs each such call, in a small C++ program built with the C++
compiler (``CXX``, else ``g++``) and GNU OpenMP: a thread made, a 2-thread OpenMP region run
on it, the thread joined; beside a region on the calling thread's own team, and a bare thread;
and what handing a call to the serving thread and back costs (two wake-ups of a sleeping thread).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import torch

from bench import zoo_models as zoo
from bench.harness import RESULTS_DIR, machine_info, write_json


def _threads() -> dict[str, int]:
    names = collections.Counter()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names[f.read().strip()] += 1
        except OSError:
            pass
    return dict(names)


def _median_ms(run, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _strict(step, small, steps: int) -> dict[str, float]:
    step()
    return {"step_ms": _median_ms(step, steps), "mul_us": _median_ms(small, 400) * 1e3}


THREAD_COST = r"""
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>
#include <vector>
#include <omp.h>
int main() {
  volatile double sink = 0;
  auto region = [&] {
    #pragma omp parallel num_threads(2)
    { sink = sink + omp_get_thread_num(); }
  };
  region();
  std::vector<double> made, home, bare;
  auto us = [](auto a, auto b) { return std::chrono::duration<double, std::micro>(b - a).count(); };
  for (int i = 0; i < 200; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    std::thread([&] { region(); }).join();
    auto t1 = std::chrono::steady_clock::now();
    region();
    auto t2 = std::chrono::steady_clock::now();
    std::thread([&] { sink = sink + 1; }).join();
    auto t3 = std::chrono::steady_clock::now();
    made.push_back(us(t0, t1)); home.push_back(us(t1, t2)); bare.push_back(us(t2, t3));
  }
  for (auto* v : {&made, &home, &bare}) std::sort(v->begin(), v->end());
  std::printf("a thread made for a 2-thread OpenMP region: median %.1f us, p90 %.1f\n", made[100], made[180]);
  std::printf("the region on the calling thread's team: median %.1f us\n", home[100]);
  std::printf("a thread made and joined, no region: median %.1f us\n", bare[100]);

  // A served kernel's hand-over (host_kernels.cc, Handed): the caller queues a request and
  // wakes the server asleep on a condition variable, the server answers and wakes the caller.
  std::mutex mu;
  std::condition_variable requested, answered;
  bool asked = false, done = false;
  const int rounds = 1000;
  std::thread server([&] {
    for (int i = 0; i < rounds; ++i) {
      std::unique_lock<std::mutex> lock(mu);
      requested.wait(lock, [&] { return asked; });
      asked = false;
      done = true;
      answered.notify_one();
    }
  });
  std::vector<double> trips;
  for (int i = 0; i < rounds; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    {
      std::unique_lock<std::mutex> lock(mu);
      asked = true;
      requested.notify_one();
      answered.wait(lock, [&] { return done; });
      done = false;
    }
    trips.push_back(us(t0, std::chrono::steady_clock::now()));
    while (us(t0, std::chrono::steady_clock::now()) < 300) {}   // the server falls asleep
  }
  server.join();
  std::sort(trips.begin(), trips.end());
  std::printf("a hand-over to a sleeping thread and back (condition variables): median %.1f us, p10 %.1f, p90 %.1f\n",
              trips[rounds / 2], trips[rounds / 10], trips[rounds * 9 / 10]);
}
"""


def thread_cost() -> int:
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        print(f"no C++ compiler {compiler!r} (set CXX)")
        return 1
    with tempfile.TemporaryDirectory() as folder:
        source, program = os.path.join(folder, "cost.cc"), os.path.join(folder, "cost")
        with open(source, "w") as f:
            f.write(THREAD_COST)
        subprocess.run([compiler, "-O2", "-fopenmp", source, "-o", program], check=True)
        print(subprocess.run([program], check=True, capture_output=True, text=True).stdout, end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama", choices=sorted(zoo.MODELS))
    parser.add_argument("--size", default="small", choices=zoo.SIZES)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", default=str(RESULTS_DIR / "openmp_teams.json"))
    parser.add_argument("--thread-cost", action="store_true",
                        help="time what a thread made for a call and a hand-over cost (C++), and nothing else")
    args = parser.parse_args(argv)
    if args.thread_cost:
        return thread_cost()

    import deferfuse
    from deferfuse.native import hostkernels
    model = zoo.MODELS[args.model]

    def step_of(block):
        network = model.make(args.size, seed=0)
        optimizer = zoo.optimizer_for(network, model)
        batch = model.batch(args.size, torch.Generator().manual_seed(1))

        def step():
            with block():
                return zoo.train_step(network, model, optimizer, batch).item()
        return step

    import contextlib
    strict_step = step_of(contextlib.nullcontext)
    small = torch.randn(64, 1024)
    mul = lambda: small.mul_(1.0)  # noqa: E731
    before = _strict(strict_step, mul, args.steps)
    threads_before = _threads()
    deferred_step = step_of(deferfuse.defer)
    with deferfuse.config.override(eager_blocks=False):
        for _ in range(args.steps):
            deferred_step()
    after = _strict(strict_step, mul, args.steps)
    guest = hostkernels.guest_calls() if hasattr(hostkernels, "guest_calls") else None
    result = {"model": args.model, "size": args.size, "torch_threads": torch.get_num_threads(),
              "before": before, "after": after,
              "step_after_over_before": after["step_ms"] / before["step_ms"],
              "mul_after_over_before": after["mul_us"] / before["mul_us"],
              "guest_calls": guest, "threads_before": threads_before, "threads_after": _threads(),
              "machine": machine_info()}
    print(f"{args.model} ({args.size}), strict, torch threads {result['torch_threads']}: step "
          f"{before['step_ms']:.1f} ms before the deferred steps, {after['step_ms']:.1f} after "
          f"({result['step_after_over_before']:.2f}x); 64x1024 mul_ {before['mul_us']:.1f} us, "
          f"{after['mul_us']:.1f} ({result['mul_after_over_before']:.2f}x); host-kernel calls on "
          f"XLA's threads: {guest}; threads {result['threads_before']} -> {result['threads_after']}")
    print(f"written: {write_json(args.json, result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
