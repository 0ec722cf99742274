"""Side-by-side timing in one process.

Every candidate of a workload runs on the same machine state, interleaved round by round, so
drift in clock speed or background load hits all of them alike.  Each round runs the candidates
in a new order, a seeded shuffle: what ran just before a candidate changes its time (torch's
OpenMP threads and XLA's keep spinning for a while after a parallel kernel and take cores from
whatever runs next; measured on attention, a jax.jit call took 14.3 ms right after strict and
10.8 ms right after another jax.jit call), so a fixed order (or a rotation of one, which keeps
every candidate's predecessor) would charge one candidate for another.  Each
candidate is called once (timed separately: for a compiler that first call is its compile) and
warmed up before the timed rounds; its first output is compared against the reference's
(strict PyTorch) so a fast wrong answer is reported as a mismatch, not as a speed-up.

A candidate that cannot be built or that raises keeps its column, with the reason, and the
others go on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.metadata
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from corpus.run import default_settings_env  # noqa: F401 - (re-exported: bench scripts' children)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REFERENCE = "strict"


@dataclasses.dataclass
class Candidate:
    """One way of running a workload.

    ``run`` makes one complete call and returns its output; the output must be computed when
    ``run`` returns (a JAX candidate blocks until ready, a deferred one has left its block).
    ``check_run`` makes the call whose output is compared with the reference's, after warm-up
    (so a runtime that starts on a slower path is checked on the path we time); a workload that
    updates its inputs in place passes one that runs on fresh inputs.  Default: ``run``.
    ``unavailable`` says why the candidate could not be built; ``run`` is then None.
    ``failure_label`` is what the table shows when the first call raises.
    ``is_warm``, polled between warm-up calls (outside any timed region), says whether the
    candidate has reached its steady state; until then warm-up goes on, up to
    ``Budget.max_warmup_seconds`` (a runtime that compiles in the background runs its first
    calls another way, and those are not what we time).
    """

    name: str
    run: Callable[[], Any] | None
    check: bool = True
    unavailable: str | None = None
    failure_label: str = "failed"
    is_warm: Callable[[], bool] | None = None
    check_run: Callable[[], Any] | None = None


@dataclasses.dataclass
class Timing:
    name: str
    status: str  # "ok", "mismatch", "unavailable", "failed"
    reason: str = ""
    first_ms: float | None = None
    samples_ms: list[float] = dataclasses.field(default_factory=list)
    warmup_calls: int = 0
    warning: str = ""  # shown as a footnote: the number stands, but something was off

    @property
    def timed(self) -> bool:
        return self.status in ("ok", "mismatch") and bool(self.samples_ms)

    @property
    def min_ms(self) -> float | None:
        return min(self.samples_ms) if self.timed else None

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.samples_ms) if self.timed else None

    def as_dict(self, reference_median: float | None) -> dict[str, Any]:
        median = self.median_ms
        ratio = median / reference_median if median is not None and reference_median else None
        return {"status": self.status, "reason": self.reason, "warning": self.warning,
                "first_ms": self.first_ms, "warmup_calls": self.warmup_calls,
                "min_ms": self.min_ms, "median_ms": median,
                "median_over_strict": ratio, "samples_ms": self.samples_ms}


@dataclasses.dataclass
class Result:
    workload: str
    size: str
    timings: dict[str, Timing]
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)

    def median(self, name: str) -> float | None:
        timing = self.timings.get(name)
        return timing.median_ms if timing is not None else None

    def as_dict(self) -> dict[str, Any]:
        reference = self.median(REFERENCE)
        return {"workload": self.workload, "size": self.size,
                "timings": {name: t.as_dict(reference) for name, t in self.timings.items()},
                "notes": self.notes}


@dataclasses.dataclass(frozen=True)
class Budget:
    """How long to spend on one workload: the timed rounds stop near ``seconds`` of total
    run time, but never fewer than ``min_rounds`` nor more than ``max_rounds``.  Each candidate
    gets ``warmup`` untimed calls after its first, more while it says it is not yet warm, up
    to ``max_warmup_seconds``.  When one round takes so long that ``min_rounds`` would exceed
    ``slow_factor`` times ``seconds``, fewer rounds run (at least two)."""

    seconds: float = 2.0
    warmup: int = 2
    min_rounds: int = 5
    max_rounds: int = 50
    max_warmup_seconds: float = 30.0
    slow_factor: float = 8.0


def short_reason(exc: BaseException) -> str:
    first_line = (str(exc).strip().splitlines() or [""])[0]
    text = f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def to_torch_list(output: Any) -> list[torch.Tensor]:
    """Flatten an output (tensor, JAX array, or nested list/tuple/dict of them) into a list of
    detached CPU torch tensors, copied so later in-place runs cannot change them."""
    flat: list[torch.Tensor] = []
    pending = [output]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            flat.append(item.detach().clone())
        elif isinstance(item, dict):
            pending.extend(reversed(list(item.values())))
        elif isinstance(item, (list, tuple)):
            pending.extend(reversed(item))
        elif hasattr(item, "block_until_ready"):  # a JAX array
            flat.append(torch.from_numpy(np.array(item)))
        else:
            raise TypeError(f"cannot compare an output of type {type(item).__name__}")
    return flat


def compare_outputs(reference: list[torch.Tensor], candidate: list[torch.Tensor],
                    rtol: float, atol: float) -> str | None:
    """None when the outputs agree, else a one-line description of the first difference."""
    if len(reference) != len(candidate):
        return f"{len(candidate)} outputs, expected {len(reference)}"
    for index, (want, got) in enumerate(zip(reference, candidate)):
        try:
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, check_device=False)
        except AssertionError as exc:
            detail = " ".join(str(exc).split())
            return f"output {index}: {detail[:200]}"
    return None


def _timed_call(run: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    output = run()
    return (time.perf_counter() - start) * 1e3, output


def compare(candidates: list[Candidate], budget: Budget, *, rtol: float = 1e-4,
            atol: float = 1e-5, on_first_call: Callable[[str], None] | None = None,
            verbose: bool = False) -> dict[str, Timing]:
    """Time ``candidates`` interleaved; the first one is the reference for output checks.

    ``on_first_call(name)`` runs just before each candidate's first call (used to reset the
    deferfuse counters, so they describe that candidate's runs only).
    """
    timings: dict[str, Timing] = {}
    live: list[Candidate] = []
    reference_output: list[torch.Tensor] | None = None

    for candidate in candidates:
        if candidate.run is None:
            timings[candidate.name] = Timing(candidate.name, "unavailable",
                                             candidate.unavailable or "not built")
            continue
        timing = Timing(candidate.name, "ok")
        timings[candidate.name] = timing
        try:
            if on_first_call is not None:
                on_first_call(candidate.name)
            timing.first_ms, _ = _timed_call(candidate.run)
            _warm_up(candidate, timing, budget)
            if candidate.check:
                # Flattened copies at once: a later in-place run would change them.
                flat = to_torch_list((candidate.check_run or candidate.run)())
                if reference_output is None:
                    reference_output = flat
                else:
                    mismatch = compare_outputs(reference_output, flat, rtol, atol)
                    if mismatch is not None:
                        timing.status, timing.reason = "mismatch", mismatch
        except Exception as exc:  # a candidate's failure is a result, not a crash
            timing.status = candidate.failure_label
            timing.reason = short_reason(exc)
            if verbose:
                traceback.print_exc()
            continue
        live.append(candidate)

    if not live:
        return timings
    # Size the rounds from a single timed pass over every live candidate.
    round_ms = 0.0
    for candidate in live:
        elapsed_ms, _ = _timed_call(candidate.run)
        round_ms += elapsed_ms
    rounds = int(budget.seconds * 1e3 / max(round_ms, 1e-3))
    rounds = max(budget.min_rounds, min(budget.max_rounds, rounds))
    # A pathologically slow candidate may cut the rounds below min_rounds, never below 2.
    ceiling = int(budget.seconds * budget.slow_factor * 1e3 / max(round_ms, 1e-3))
    rounds = max(2, min(rounds, ceiling))

    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        order = random.Random(0)
        for index in range(rounds):
            if index % GC_EVERY == 0:
                _collect_and_settle(live)
            for candidate in order.sample(live, len(live)):
                timing = timings[candidate.name]
                try:
                    elapsed_ms, _ = _timed_call(candidate.run)
                except Exception as exc:
                    timing.status, timing.reason = "failed", short_reason(exc)
                    continue
                timing.samples_ms.append(elapsed_ms)
            live = [c for c in live if timings[c.name].status in ("ok", "mismatch")]
    finally:
        if gc_was_enabled:
            gc.enable()
    return timings


# The timed rounds run with Python's collector off (a collection inside a timed call would land
# on whichever candidate it hit); garbage is collected every GC_EVERY rounds, and then every
# candidate runs once untimed before the next timed round.  A full collection walks every
# object of a process holding torch and JAX (~400k) and leaves the caches cold: with one after
# every round, as before, a GELU chain of 2^16 floats took 252 us strict and 1121 us deferred
# against 119 and 323 us without (interleaved loop, same process), so the bench measured
# mostly the recovery from its own collections, and the deferred path, touching more Python
# state, three times as much as strict.  User programs collect rarely (deferfuse's blocks
# freeze the objects older than the block, gc_freeze).
GC_EVERY = 10


def _collect_and_settle(live: list[Candidate]) -> None:
    gc.collect()
    for candidate in live:
        try:
            candidate.run()
        except Exception:   # (reported by its timed call)
            pass


def _warm_up(candidate: Candidate, timing: Timing, budget: Budget) -> None:
    deadline = time.perf_counter() + budget.max_warmup_seconds
    for _ in range(budget.warmup):
        candidate.run()
        timing.warmup_calls += 1
    if candidate.is_warm is None:
        return
    while not candidate.is_warm():
        if time.perf_counter() > deadline:
            timing.warning = (f"not warm after {timing.warmup_calls} warm-up calls "
                              f"({budget.max_warmup_seconds:.0f} s): timed as it was")
            return
        candidate.run()
        timing.warmup_calls += 1


PEAK_GEMM_SIZE, PEAK_GEMM_REPS = 2048, 5
_peaks: dict[tuple[int, int], float] = {}


def peak_gflops(size: int = PEAK_GEMM_SIZE, reps: int = PEAK_GEMM_REPS) -> float:
    """The machine's peak for the MFU columns: a float32 ``size`` x ``size`` GEMM on the threads
    torch uses, its best of ``reps`` timed calls after one untimed, in GFLOP/s.  Measured once
    per process (and thread count); a busy machine lowers it, as it lowers the steps' times."""
    key = (size, torch.get_num_threads())
    if key not in _peaks:
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(size, size, generator=generator)
        b = torch.randn(size, size, generator=generator)
        out = torch.empty(size, size)
        torch.mm(a, b, out=out)
        best = math.inf
        for _ in range(reps):
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            best = min(best, time.perf_counter() - start)
        _peaks[key] = 2 * size ** 3 / best / 1e9
    return _peaks[key]


def mfu(flops: float | None, seconds: float | None, peak: float | None) -> float | None:
    """Model FLOPs utilization: a step's matrix FLOPs (bench/flops.py) over its time, as a
    fraction of ``peak`` GFLOP/s (peak_gflops); None when a part is missing."""
    if not flops or not seconds or not peak:
        return None
    return flops / seconds / (peak * 1e9)


def _cpu_model() -> dict[str, Any]:
    """The CPU's model name and vector extensions (Linux): which BLAS path torch takes and how
    fast XLA's dots are differ by vendor and ISA (MKL's sgemm on an AMD EPYC with AVX-512 ran
    at half the speed of XLA's dot), so numbers from different machines are not comparable."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return {}
    model = flags = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = value
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
    return {"cpu_model": model, "cpu_vector_flags": [f for f in wanted if f in flags.split()],
            "torch_blas": "mkl" if torch.backends.mkl.is_available() else "other"}


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "command": " ".join(getattr(sys, "orig_argv", sys.argv)),
        "cwd": os.getcwd(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }
    info.update(_cpu_model())
    if _peaks:
        info["peak_gflops"] = {f"{size}x{size} float32 GEMM, {threads} threads": round(value, 1)
                               for (size, threads), value in _peaks.items()}
    if hasattr(os, "sched_getaffinity"):
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    if hasattr(os, "getloadavg"):
        info["load_average_1_5_15m"] = [round(load, 2) for load in os.getloadavg()]
    try:
        # JAX's CPU client is created by its first use, here: set up as deferfuse sets it up
        # (synchronous dispatch, exec/backend.py), as in a process where deferfuse ran first.
        # The jax.jit column shares that client.
        from deferfuse.exec import backend
        backend.prepare()
        import jax
        info["jax"] = jax.__version__
        info["jax_devices"] = [str(device) for device in jax.devices()]
        info["jax_cpu_async_dispatch"] = jax.config.values.get("jax_cpu_enable_async_dispatch")
    except Exception as exc:
        info["jax"] = "unavailable: " + short_reason(exc)
    try:
        info["deferfuse"] = importlib.metadata.version("deferfuse")
    except importlib.metadata.PackageNotFoundError:
        info["deferfuse"] = "not installed"
    info["git_commit"] = _git_commit()
    return info


def _git_commit() -> str | None:
    """The repository's commit, with '+dirty' when the work tree has changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                                capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode != 0:
        return None
    return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


@contextlib.contextmanager
def private_executable_cache() -> Iterator[str]:
    """Run with a fresh, empty deferfuse on-disk executable cache, so first-call times mean a
    real compile and nothing left by another version of the code is loaded.  A folder the user
    chose with DEFERFUSE_CACHE_DIR is respected.  Must be entered before deferfuse is imported:
    its settings are read from the environment once."""
    variable = "DEFERFUSE_CACHE_DIR"
    if variable in os.environ:
        yield os.environ[variable]
        return
    if "deferfuse" in sys.modules:
        raise RuntimeError("private_executable_cache() entered after deferfuse was imported")
    with tempfile.TemporaryDirectory(prefix="deferfuse-bench-cache-") as folder:
        os.environ[variable] = folder
        try:
            yield folder
        finally:
            del os.environ[variable]


def busy_machine_warning() -> str | None:
    """A warning when other processes already load the CPUs: medians will be noisy (ratios,
    measured interleaved, suffer less)."""
    if not hasattr(os, "getloadavg"):
        return None
    load = os.getloadavg()[0]
    cpus = os.cpu_count() or 1
    if load > 0.5 * cpus:
        return (f"warning: load average {load:.1f} on {cpus} CPUs before starting; other "
                f"processes compete for the cores, so absolute times will be noisy")
    return None


def save_results(name: str, results: list[Result], extra: dict[str, Any] | None = None) -> Path:
    """Write ``bench/results/<name>.json`` (and ``<name>.png`` when matplotlib is present)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine_info(), "results": [r.as_dict() for r in results]}
    if extra:
        payload.update(extra)
    path = write_json(RESULTS_DIR / f"{name}.json", payload)
    plot_results(name, results)
    return path


def write_json(path: Path | str, payload: Any) -> Path:
    """Write ``payload`` to ``path`` as indented JSON, whole (a temporary file renamed), making
    its folder; the bench scripts' results."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    temporary.replace(path)
    return path


def plot_results(name: str, results: list[Result]) -> Path | None:
    """A grouped bar chart of median time relative to strict, per workload and candidate."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(matplotlib is not installed: no plot for {name}; the JSON has every number)")
        return None
    names: list[str] = []
    for result in results:
        for candidate in result.timings:
            if candidate not in names:
                names.append(candidate)
    labels = [f"{r.workload}\n{r.size}" for r in results]
    width = 0.8 / max(len(names), 1)
    figure, axes = plt.subplots(figsize=(max(8, 1.1 * len(results)), 5))
    for offset, candidate in enumerate(names):
        heights = []
        for result in results:
            reference = result.median(REFERENCE)
            median = result.median(candidate)
            heights.append(median / reference if median is not None and reference else 0.0)
        positions = [i + offset * width for i in range(len(results))]
        axes.bar(positions, heights, width, label=candidate)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_yscale("log")
    axes.set_ylabel("median time / strict median (lower is faster)")
    axes.set_xticks([i + 0.4 - width / 2 for i in range(len(results))])
    axes.set_xticklabels(labels, fontsize=7)
    axes.legend()
    figure.tight_layout()
    path = RESULTS_DIR / f"{name}.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def print_medians(title: str, parts: dict[str, list[float]]) -> None:
    """``title``, then each part's median in milliseconds (samples in seconds), one per line."""
    width = max(len(name) for name in parts)
    print(title)
    for name, values in parts.items():
        print(f"  {name:<{width}} {statistics.median(values) * 1e3:8.3f}")
