"""The model zoo, side by side: strict PyTorch against deferfuse, model by model.

    python -m bench.zoo                          # every model, size small, 24 steps
    python -m bench.zoo --size tiny --only llama,gpt2,resnet --steps 4 --quick
    python -m bench.zoo --memory                 # and peak memory, one process per candidate
    python -m bench.zoo --size medium            # activations past the CPU caches (zoo_models.py)

Candidates (bench/zoo_models.py builds the models; each candidate has its own copy, built with
the same seed, its own optimizer and its own batch generator, so step k sees equal weights and
equal batches):
  strict    plain torch
  defer     each step inside ``with deferfuse.defer():``, deferfuse's default settings
  deferred  the same with the block tier off (``config.override(eager_blocks=False)``): the
            block tier runs a whole defer block as strict once that measured faster, so
            "deferred" shows what the engine itself does with every step

Per model:
  training    (inference steps for ``torch-eval``) ``--steps`` steps, interleaved: round k
              runs step k of every candidate in a seeded shuffle (what ran just before a
              candidate changes its time, bench/harness.py).  A step is timed wall-clock up to
              and including ``loss.item()``: a training script prints its loss, so that
              observation is part of the step.  The global RNG is seeded before every step
              (dropout: every candidate's step k draws the same masks).
  generation  (LMs and seq2seq) greedy decoding with the KV cache, the whole ``generate`` call
              inside one defer block, the ids read with ``.tolist()``; a fresh eval-mode copy
              per candidate; warm-up calls then timed calls, interleaved the same way.
  memory      (``--memory``) each candidate alone in a fresh process running a few training
              steps; its peak resident set (VmHWM: see _peak_rss_mib for why not ru_maxrss).

Reported: whether every step's loss is strict's (relative difference <= 1e-4) and whether the
generated ids are, the steady-state time (median of the last 10 steps; of the timed calls for
generation), the speed-up over strict, the model FLOPs utilization (MFU: the matrix FLOPs of
one call, counted once per model over a strict call with torch's FlopCounterMode, bench/flops.py,
divided by the candidate's steady time and by the machine's peak, the best of a few 2048^3
float32 GEMMs on torch's threads, harness.peak_gflops, recorded in the JSON's machine info), the
warm-up cost (the sum over all calls of the call's time minus the steady median), and the ops
that fell back to eager torch, counted over that candidate's calls only.  Results:
``bench/results/zoo.json`` and ``zoo.png`` beside it.

Sharing one process has costs a user running one candidate never sees: defer and deferred
record the same graphs, so whichever reaches a graph first compiles it and the other finds it
compiled (the warm-up of the later one looks cheaper); deferfuse's background compiles are
waited for after each defer call, untimed, and charged to that call's warm-up, so that they do
not land in the next candidate's timed call (_run_call); the block tier's choices are forgotten
between models (``blocks.forget()``), as if each model ran in its own script.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch

from bench import flops
from bench import zoo_models as zoo
from bench.harness import (GC_EVERY, PEAK_GEMM_SIZE, RESULTS_DIR, busy_machine_warning, machine_info,
                           mfu, peak_gflops, private_executable_cache, short_reason)

CANDIDATES = ("strict", "defer", "deferred")
REFERENCE = "strict"
DEFER_CANDIDATES = ("defer", "deferred")
LOSS_RTOL = 1e-4
PERTURBATION, SENSITIVITY_FACTOR = 1e-7, 10.0   # strict's own sensitivity (_judge_by_sensitivity)
STEADY_STEPS = 10          # the steady state: the median of the last this many steps
# generate() under defer settles late: each call meets new KV-cache shapes, so the block tier
# times its runs only from the fourth on and then alternates five deferred and five at once
# (deferfuse/exec/blocks.py) before it chooses; the timed calls come after that.
GENERATE_WARMUP, GENERATE_CALLS = 14, 5
QUICK_STEPS, QUICK_GENERATE_WARMUP, QUICK_GENERATE_CALLS, QUICK_TOKENS = 8, 1, 2, 8
MEMORY_STEPS = 6
STEP_SEED = 1000           # the global RNG is seeded STEP_SEED + k before every candidate's step k
BATCH_SEED, PROMPT_SEED, MODEL_SEED = 1, 2, 0
ORDER_SEED = 0
COMPILE_TIMEOUT_S = 600.0
_VERBOSE = False           # --verbose: print the traceback of every failure


# --------------------------------------------------------------------------------------------
# Candidates: how a call is wrapped.  The ``with`` line of a defer block is where the block
# tier keys its choice, so the training step and the generate call each write their own
# ``with mode():`` (below), and ``defer`` hands back deferfuse's own context manager: a wrapper
# of ours would make its line the place of both.

def _deferfuse():
    import deferfuse
    return deferfuse


def _strict() -> ContextManager[Any]:
    return contextlib.nullcontext()


def _defer() -> ContextManager[Any]:
    return _deferfuse().defer()


@contextlib.contextmanager
def _deferred():
    deferfuse = _deferfuse()
    with deferfuse.config.override(eager_blocks=False), deferfuse.defer():
        yield


MODES: dict[str, Callable[[], ContextManager[Any]]] = {
    "strict": _strict, "defer": _defer, "deferred": _deferred}


# --------------------------------------------------------------------------------------------
# Results.

@dataclasses.dataclass
class CandidateRun:
    """One candidate's calls of one measurement (training or generation): each call's time and
    what it observed (a loss, or the generated ids), and deferfuse's counters over its calls."""

    candidate: str
    seconds: list[float] = dataclasses.field(default_factory=list)
    values: list[Any] = dataclasses.field(default_factory=list)
    fallbacks: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    compiles: int = 0
    compile_wait_s: float = 0.0     # background compiles waited for after its calls (_run_call)
    error: str | None = None
    # filled in by Measurement.summarize()
    steady_ms: float | None = None
    warmup_s: float | None = None
    speedup: float | None = None
    mfu: float | None = None        # the measurement's FLOPs per call / steady time / peak
    equal: bool | None = None
    max_rel_diff: float | None = None
    # set where the losses differ by more than LOSS_RTOL but stay within strict's own
    # sensitivity to rounding (_judge_by_sensitivity): the largest ratio of the difference to it
    sensitivity_ratio: float | None = None

    @property
    def fallback_count(self) -> int:
        return sum(self.fallbacks.values())

    def as_dict(self, with_values: bool) -> dict[str, Any]:
        out = {"error": self.error, "equal": self.equal, "max_rel_diff": self.max_rel_diff,
               "sensitivity_ratio": self.sensitivity_ratio,
               "steady_ms": self.steady_ms, "speedup": self.speedup, "mfu": self.mfu,
               "warmup_s": self.warmup_s,
               "fallbacks": dict(self.fallbacks.most_common()), "compiles": self.compiles,
               "compile_wait_s": self.compile_wait_s,
               "call_ms": [s * 1e3 for s in self.seconds]}
        if with_values:
            out["losses"] = self.values
        return out


@dataclasses.dataclass
class Measurement:
    """Training (or inference) steps, or generate calls, of every candidate on one model."""

    what: str                       # "training", "inference" or "generation"
    steady_from: int                # calls from this index on are the steady state
    runs: dict[str, CandidateRun]
    tokens: int | None = None       # generation: new tokens per call
    flops: int | None = None        # matrix FLOPs of one call, counted on strict (bench/flops.py)
    peak_gflops: float | None = None
    flops_error: str | None = None  # why the FLOPs could not be counted

    def summarize(self) -> None:
        reference = self.runs.get(REFERENCE)
        for run in self.runs.values():
            steady = run.seconds[self.steady_from:]
            if run.error is None and steady:
                median = statistics.median(steady)
                run.steady_ms = median * 1e3
                run.warmup_s = sum(s - median for s in run.seconds) + run.compile_wait_s
                run.mfu = mfu(self.flops, median, self.peak_gflops)
            if run is reference or reference is None:
                continue
            run.equal, run.max_rel_diff = _agreement(reference.values, run.values)
            if run.error is not None:
                run.equal = False
            if run.steady_ms and reference.steady_ms:
                run.speedup = reference.steady_ms / run.steady_ms

    def tokens_per_s(self, candidate: str) -> float | None:
        run = self.runs.get(candidate)
        if run is None or not self.tokens or not run.steady_ms:
            return None
        return self.tokens / (run.steady_ms / 1e3)

    def as_dict(self) -> dict[str, Any]:
        calls = max(len(r.seconds) for r in self.runs.values())
        out: dict[str, Any] = {"what": self.what, "calls": calls,
                               "steady_calls_from": self.steady_from, "flops_per_call": self.flops,
                               "flops_error": self.flops_error}
        if self.tokens is not None:
            out["new_tokens"] = self.tokens
        candidates = {}
        for name, run in self.runs.items():
            entry = run.as_dict(with_values=self.what != "generation")
            if self.tokens is not None:
                entry["tokens_per_s"] = self.tokens_per_s(name)
            candidates[name] = entry
        out["candidates"] = candidates
        return out


def _agreement(reference: list[Any], values: list[Any]) -> tuple[bool, float | None]:
    """Whether ``values`` are the reference's, call by call (losses within LOSS_RTOL relative,
    ids exactly), and the largest relative difference of the losses."""
    pairs = list(zip(reference, values))
    if not pairs:
        return False, None
    if all(isinstance(v, float) for pair in pairs for v in pair):
        diffs = [0.0 if got == want or (math.isnan(got) and math.isnan(want)) else
                 abs(got - want) / max(abs(want), 1e-12) if math.isfinite(want) else math.inf
                 for want, got in pairs]
        worst = max(diffs)
        return worst <= LOSS_RTOL and len(values) == len(reference), worst
    return all(want == got for want, got in pairs) and len(values) == len(reference), None


@dataclasses.dataclass
class ModelResult:
    name: str
    kind: str
    size: str
    error: str | None = None
    training: Measurement | None = None
    generation: Measurement | None = None
    memory_mib: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.name, "kind": self.kind, "size": self.size, "error": self.error,
                "training": self.training.as_dict() if self.training else None,
                "generation": self.generation.as_dict() if self.generation else None,
                "peak_memory_mib": self.memory_mib}


# --------------------------------------------------------------------------------------------
# Lanes: one candidate's own copy of a workload.  ``prepare(k)`` sets up call k (draws its
# batch, seeds the RNG) outside the timed region and returns the call to time.

@dataclasses.dataclass
class Lane:
    run: CandidateRun
    prepare: Callable[[int], Callable[[], Any]]


def training_lane(model: zoo.ZooModel, size: str, candidate: str, perturbation: float = 0.0) -> Lane:
    """``perturbation``: the initial weights are scaled by 1 + it (_judge_by_sensitivity)."""
    mode = MODES[candidate]
    network = model.make(size, seed=MODEL_SEED)
    if perturbation:
        with torch.no_grad():
            for parameter in network.parameters():
                parameter.mul_(1 + perturbation)
    optimizer = zoo.optimizer_for(network, model)
    batches = torch.Generator().manual_seed(BATCH_SEED)

    def prepare(k: int) -> Callable[[], float]:
        batch = model.batch(size, batches)
        torch.manual_seed(STEP_SEED + k)

        def step() -> float:
            with mode():
                return zoo.train_step(network, model, optimizer, batch).item()
        return step
    return Lane(CandidateRun(candidate), prepare)


def generation_lane(model: zoo.ZooModel, size: str, candidate: str, tokens: int) -> Lane:
    mode = MODES[candidate]
    network = model.make(size, seed=MODEL_SEED).eval()
    prompt = model.prompt(size, torch.Generator().manual_seed(PROMPT_SEED))

    def prepare(k: int) -> Callable[[], list]:
        def call() -> list:
            with mode():
                return zoo.generate(network, prompt, tokens).tolist()
        return call
    return Lane(CandidateRun(candidate), prepare)


def interleave(lanes: list[Lane], calls: int, seed: int = ORDER_SEED) -> None:
    """Round k runs call k of every lane, in a seeded shuffle.  A lane whose call raises keeps
    its error and leaves the rounds."""
    order = random.Random(seed)
    live = list(lanes)
    gc_was_enabled = gc.isenabled()
    gc.disable()   # (a collection inside a timed call would land on whichever lane it hit)
    try:
        for k in range(calls):
            if k % GC_EVERY == 0:
                gc.collect()
            for lane in order.sample(live, len(live)):
                _run_call(lane, k)
            live = [lane for lane in live if lane.run.error is None]
            if not live:
                break
    finally:
        if gc_was_enabled:
            gc.enable()


def _run_call(lane: Lane, k: int) -> None:
    """Call k of ``lane``, timed.  deferfuse's counters are reset before a defer lane's call
    and read after it, so they count that lane's calls only.

    deferfuse compiles on a background thread while the step that needed the executable goes
    on eagerly; left alone, the compile would run on into the next lane's timed call (strict's,
    as often as not) and slow it.  So after a defer lane's call the rounds wait for pending
    compiles, untimed, and charge the wait to that lane (``compile_wait_s``, part of its
    warm-up): on its own, the compile would share the cores with its next steps."""
    run = lane.run
    counted = run.candidate in DEFER_CANDIDATES
    try:
        call = lane.prepare(k)
        if counted:
            _deferfuse().reset_stats()
        start = time.perf_counter()
        value = call()
        elapsed = time.perf_counter() - start
    except Exception as exc:   # a candidate's failure is a result, not a crash
        run.error = f"call {k}: {short_reason(exc)}"
        if _VERBOSE:
            traceback.print_exc()
        return
    finally:
        if counted:
            run.compile_wait_s += _wait_for_compiles()
            stats = _deferfuse().stats()
            run.fallbacks.update(stats["fallbacks"])
            run.compiles += stats["compiles"]
    run.seconds.append(elapsed)
    run.values.append(value)


def _wait_for_compiles() -> float:
    """Seconds spent waiting for deferfuse's background compiles (0 when none is pending)."""
    from deferfuse import engine
    if not engine.compiles_pending():
        return 0.0
    start = time.perf_counter()
    engine.wait_for_compiles(COMPILE_TIMEOUT_S)
    return time.perf_counter() - start


# --------------------------------------------------------------------------------------------
# Measuring one model.

@dataclasses.dataclass(frozen=True)
class Plan:
    size: str
    steps: int
    generate_warmup: int
    generate_calls: int
    tokens: int
    candidates: tuple[str, ...] = CANDIDATES
    peak_gflops: float | None = None    # the MFU columns' peak (harness.peak_gflops)


def build_lanes(make: Callable[[str], Lane], candidates: tuple[str, ...]) -> list[Lane]:
    """A lane per candidate; one that cannot be built keeps its error (strict's raises: with no
    reference there is nothing to compare)."""
    lanes = []
    for candidate in candidates:
        try:
            lanes.append(make(candidate))
        except Exception as exc:
            if candidate == REFERENCE:
                raise
            if _VERBOSE:
                traceback.print_exc()
            lanes.append(Lane(CandidateRun(candidate, error=f"build: {short_reason(exc)}"),
                              lambda k: None))
    return lanes


def measure(lanes: list[Lane], calls: int, what: str, steady_from: int, plan: Plan,
            count: Callable[[], int], tokens: int | None = None) -> Measurement:
    """``count()``: the matrix FLOPs of one call, counted once, strict, before the rounds (a
    failure to count leaves the MFU columns empty, with its reason in the notes)."""
    call_flops, flops_error = None, None
    try:
        call_flops = count()
    except Exception as exc:
        if _VERBOSE:
            traceback.print_exc()
        flops_error = short_reason(exc)
    interleave([lane for lane in lanes if lane.run.error is None], calls)
    measurement = Measurement(what, steady_from, {lane.run.candidate: lane.run for lane in lanes},
                              tokens, call_flops, plan.peak_gflops, flops_error)
    measurement.summarize()
    return measurement


def measure_model(model: zoo.ZooModel, plan: Plan) -> ModelResult:
    result = ModelResult(model.name, model.kind, plan.size)
    _forget_block_choices()
    try:
        lanes = build_lanes(lambda c: training_lane(model, plan.size, c), plan.candidates)
        result.training = measure(
            lanes, plan.steps, "training" if model.trains else "inference",
            steady_from=max(0, plan.steps - STEADY_STEPS), plan=plan,
            count=lambda: flops.step_flops(model, plan.size, MODEL_SEED, BATCH_SEED))
        if model.trains:
            _judge_by_sensitivity(model, plan, result.training)
        if model.generates:
            calls = plan.generate_warmup + plan.generate_calls
            lanes = build_lanes(lambda c: generation_lane(model, plan.size, c, plan.tokens),
                                plan.candidates)
            result.generation = measure(
                lanes, calls, "generation", steady_from=plan.generate_warmup, plan=plan,
                count=lambda: flops.generate_flops(model, plan.size, plan.tokens, MODEL_SEED,
                                                   PROMPT_SEED),
                tokens=plan.tokens)
    except Exception as exc:
        if _VERBOSE:
            traceback.print_exc()
        result.error = short_reason(exc)
    for measurement in (result.training, result.generation):
        strict = measurement.runs.get(REFERENCE) if measurement else None
        if strict is not None and strict.error and result.error is None:
            result.error = f"strict {measurement.what}: {strict.error}"
    return result


def _judge_by_sensitivity(model: zoo.ZooModel, plan: Plan, training: Measurement) -> None:
    """Some models' training is chaotic at these sizes: ResNet-small's losses, under strict with
    its initial weights scaled by 1 + 1e-7, differ from strict's by 1e-6 at step 3 and 3e-3 at
    step 11 (BatchNorm over 8 images, random labels).  Any two computations that round
    differently then part by as much, however exact each op is.  So where a candidate's losses
    differ by more than LOSS_RTOL, strict runs again untimed with weights scaled by 1 +
    PERTURBATION, and the candidate counts as equal if at every step its difference is within
    SENSITIVITY_FACTOR times that run's (or LOSS_RTOL); ``sensitivity_ratio`` says how close."""
    strict = training.runs.get(REFERENCE)
    suspects = [run for name, run in training.runs.items()
                if name != REFERENCE and run.equal is False and run.error is None
                and len(run.values) == len(strict.values)]
    if not suspects or strict is None or strict.error is not None:
        return
    perturbed = training_lane(model, plan.size, REFERENCE, PERTURBATION)
    for k in range(len(strict.values)):
        perturbed.run.values.append(perturbed.prepare(k)())

    def diffs(values: list[float]) -> list[float]:
        return [abs(v - w) / max(abs(w), 1e-12) for v, w in zip(values, strict.values)]
    envelope = [max(LOSS_RTOL, SENSITIVITY_FACTOR * d) for d in diffs(perturbed.run.values)]
    for run in suspects:
        ratios = [d / e for d, e in zip(diffs(run.values), envelope)]
        run.sensitivity_ratio = max(ratios) * SENSITIVITY_FACTOR if ratios else None
        run.equal = all(r <= 1.0 for r in ratios)


def _forget_block_choices() -> None:
    """Every model starts with the block tier unmeasured, as in a script of its own (all
    models share this file's two ``with`` lines)."""
    from deferfuse.exec import blocks
    blocks.forget()


# --------------------------------------------------------------------------------------------
# Peak memory: each candidate alone in a fresh process.

def child_memory(model_name: str, candidate: str, size: str) -> dict[str, Any]:
    """Run MEMORY_STEPS training steps of one candidate in this (fresh) process: its peak
    resident set, and that peak before the first step (libraries loaded, the model built)."""
    model = zoo.MODELS[model_name]
    lane = training_lane(model, size, candidate)
    before = _peak_rss_mib()
    for k in range(MEMORY_STEPS):
        lane.prepare(k)()
    return {"peak_mib": _peak_rss_mib(), "before_steps_mib": before,
            "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _peak_rss_mib() -> float:
    """This process's peak resident set, in MiB.  On Linux ``ru_maxrss`` is kept across
    execve, so a child started by this (large) process reports at least the parent's size at
    the fork: measured, 312 MiB for a child of a 312 MiB parent whose own peak was 11 MiB.
    /proc/self/status's VmHWM belongs to the new program's memory alone."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024   # (kB)
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # (KiB on Linux)


def measure_memory(model_name: str, plan: Plan, child_env: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for candidate in plan.candidates:
        command = [sys.executable, "-m", "bench.zoo", "--child-memory", model_name, candidate,
                   "--size", plan.size, "--threads", str(torch.get_num_threads())]
        done = subprocess.run(command, capture_output=True, text=True, env=child_env,
                              cwd=Path(__file__).resolve().parent.parent)
        lines = done.stdout.strip().splitlines()
        try:
            out[candidate] = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            out[candidate] = {"error": f"exit {done.returncode}: {tail[:200]}"}
    return out


# --------------------------------------------------------------------------------------------
# Report: the table, the JSON, the chart.

def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _run_of(measurement: Measurement | None, candidate: str) -> CandidateRun | None:
    return measurement.runs.get(candidate) if measurement else None


def _equal_cell(measurement: Measurement | None) -> str:
    if measurement is None:
        return "-"
    cells = []
    for candidate in DEFER_CANDIDATES:
        run = measurement.runs.get(candidate)
        cells.append("-" if run is None else "err" if run.error else "NO" if not run.equal
                     else "yes*" if run.sensitivity_ratio is not None else "yes")
    return "/".join(cells)


def _fallback_cell(measurement: Measurement | None) -> str:
    if measurement is None:
        return "-"
    return "/".join(str(r.fallback_count) if (r := measurement.runs.get(c)) else "-"
                    for c in DEFER_CANDIDATES)


def _attr(measurement: Measurement | None, candidate: str, name: str) -> Any:
    run = _run_of(measurement, candidate)
    return getattr(run, name) if run is not None else None


def table(results: list[ModelResult], with_memory: bool) -> str:
    header = ["model", "equal d/dd", "fallbacks d/dd", "strict ms", "defer x", "deferred x",
              "MFU % s/d/dd", "defer warm-up s", "deferred warm-up s", "gen equal d/dd",
              "strict tok/s", "gen defer x", "gen deferred x", "gen MFU % s/d/dd"]
    if with_memory:
        header += ["peak MiB s/d/dd"]
    rows = [header]
    for r in results:
        t, g = r.training, r.generation
        strict_ms = _attr(t, REFERENCE, "steady_ms")
        row = [r.name + ("" if r.kind != "torch-eval" else " (eval)"),
               _equal_cell(t), _fallback_cell(t),
               "-" if strict_ms is None else f"{strict_ms:.1f}",
               _x(_attr(t, "defer", "speedup")), _x(_attr(t, "deferred", "speedup")), _mfu_cell(t),
               _seconds(_attr(t, "defer", "warmup_s")), _seconds(_attr(t, "deferred", "warmup_s")),
               _equal_cell(g), "-" if g is None or g.tokens_per_s(REFERENCE) is None
               else f"{g.tokens_per_s(REFERENCE):.0f}",
               _x(_attr(g, "defer", "speedup")), _x(_attr(g, "deferred", "speedup")), _mfu_cell(g)]
        if with_memory:
            row.append("/".join(_mib(r.memory_mib, c) for c in CANDIDATES))
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |"
             for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _mfu_cell(measurement: Measurement | None) -> str:
    """Each candidate's MFU in percent, strict/defer/deferred."""
    if measurement is None:
        return "-"
    return "/".join(_percent(_attr(measurement, c, "mfu")) for c in CANDIDATES)


def _percent(fraction: float | None) -> str:
    if fraction is None:
        return "-"
    percent = 100 * fraction
    return f"{percent:.1f}" if percent >= 0.95 else f"{percent:.2g}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _mib(memory: dict[str, Any] | None, candidate: str) -> str:
    entry = (memory or {}).get(candidate) or {}
    return f"{entry['peak_mib']:.0f}" if "peak_mib" in entry else "-"


def notes(results: list[ModelResult]) -> list[str]:
    """The footnotes: errors, mismatches and fallbacks by op."""
    lines = []
    for r in results:
        if r.error:
            lines.append(f"{r.name}: ERROR {r.error}")
        for measurement in (r.training, r.generation):
            if measurement is None:
                continue
            if measurement.flops_error:
                lines.append(f"{r.name} {measurement.what}: FLOPs not counted (no MFU): "
                             f"{measurement.flops_error}")
            for run in measurement.runs.values():
                where = f"{r.name} {measurement.what} {run.candidate}"
                if run.error and run.candidate != REFERENCE:
                    lines.append(f"{where}: ERROR {run.error}")
                elif run.equal is False:
                    detail = (f" (max relative loss difference {run.max_rel_diff:.1e})"
                              if run.max_rel_diff is not None else "")
                    lines.append(f"{where}: MISMATCH with strict{detail}")
                elif run.sensitivity_ratio is not None:
                    lines.append(f"{where}: yes* - losses part from strict's by up to "
                                 f"{run.max_rel_diff:.1e} relative, within strict's own sensitivity "
                                 f"(strict with weights x (1 + {PERTURBATION:g}) parts by as much: "
                                 f"at most {run.sensitivity_ratio:.2g}x its difference)")
                if run.fallbacks:
                    ops = ", ".join(f"{op} x{n}" for op, n in run.fallbacks.most_common(6))
                    lines.append(f"{where}: fallbacks {ops}")
    return lines


def geomean_speedups(results: list[ModelResult]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for candidate in DEFER_CANDIDATES:
        values = {r.name: s for r in results
                  if (s := _attr(r.training, candidate, "speedup")) is not None}
        geomean = (math.exp(statistics.fmean(math.log(v) for v in values.values()))
                   if values else None)
        out[candidate] = {"geomean": geomean, "models": sorted(values)}
    return out


def plot(results: list[ModelResult], path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
        from matplotlib.ticker import FormatStrFormatter
    except ImportError:
        print("(matplotlib is not installed: no chart; the JSON has every number)")
        return None
    panels = [("training (inference for eval models)", [(r.name, r.training) for r in results]),
              ("generation", [(r.name, r.generation) for r in results if r.generation])]
    panels = [p for p in panels if p[1]]
    if not panels:
        return None
    figure, axes_list = plt.subplots(len(panels), 1, squeeze=False,
                                     figsize=(max(8, 0.9 * len(results) + 2), 4 * len(panels)))
    width = 0.38
    for axes, (title, entries) in zip(axes_list[:, 0], panels):
        for offset, candidate in enumerate(DEFER_CANDIDATES):
            for i, (_, measurement) in enumerate(entries):
                run = _run_of(measurement, candidate)
                speedup = run.speedup if run is not None else None
                x = i + (offset - 0.5) * width
                if speedup:
                    # (bars grow from the 1.0 line, up when faster, down when slower)
                    axes.bar(x, speedup - 1.0, width, bottom=1.0, color=f"C{offset}")
                label = ("err" if run is None or run.error else "≠" if run.equal is False
                         else f"{speedup:.2f}" if speedup else "-")
                axes.annotate(label, (x, speedup or 1.0), ha="center",
                              va="bottom" if (speedup or 1.0) >= 1.0 else "top", fontsize=7)
        axes.axhline(1.0, color="black", linewidth=0.8)
        axes.set_yscale("log")
        axes.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        axes.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
        axes.set_xlim(-0.7, len(entries) - 0.3)
        axes.set_xticks(range(len(entries)))
        axes.set_xticklabels([name for name, _ in entries], fontsize=8, rotation=30)
        axes.set_ylabel("speed-up over strict (log; higher is faster)")
        axes.set_title(title)
        axes.legend(handles=[Patch(color=f"C{i}", label=c) for i, c in enumerate(DEFER_CANDIDATES)])
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def save(results: list[ModelResult], args: argparse.Namespace, plan: Plan, elapsed: float) -> Path:
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    arguments = sys.argv[1:] if args.argv is None else args.argv
    payload = {"machine": machine_info(), "command": " ".join(["python -m bench.zoo", *arguments]),
               "plan": dataclasses.asdict(plan), "settings_off_default": _settings_off_default(),
               "elapsed_s": elapsed, "geomean_training_speedup": geomean_speedups(results),
               "models": {r.name: r.as_dict() for r in results}}
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    temporary.replace(path)
    plot(results, path.with_suffix(".png"))
    return path


def _settings_off_default() -> dict[str, Any]:
    """deferfuse settings that differ from their defaults (DEFERFUSE_* variables): the defer
    column is "default settings" only when this is empty."""
    config = _deferfuse().config
    return {name: config.get(name) for name, s in config.settings().items()
            if name != "cache_dir" and config.get(name) != s.default}


# --------------------------------------------------------------------------------------------
# Command line.

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.zoo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=zoo.SIZES, default="small")
    parser.add_argument("--only", default=None, help="comma-separated models, from: "
                        + ", ".join(zoo.MODELS))
    parser.add_argument("--steps", type=int, default=None,
                        help=f"training steps per candidate (default 24, --quick {QUICK_STEPS})")
    parser.add_argument("--json", default=str(RESULTS_DIR / "zoo.json"),
                        help="results file; the chart goes beside it (.png)")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_STEPS} steps; generation {QUICK_GENERATE_WARMUP} warm-up and "
                             f"{QUICK_GENERATE_CALLS} timed calls of {QUICK_TOKENS} tokens")
    parser.add_argument("--memory", action="store_true",
                        help=f"peak memory of {MEMORY_STEPS} steps, each candidate in a fresh "
                             "process")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads(N) first (default: torch's own choice).  On a "
                             "machine whose cores other processes load, torch's parallel ops "
                             "wait for a descheduled thread at every barrier: a tiny GPT-2 "
                             "generate took 270 ms on 2 threads and 8 ms on 1 (2-core VM, load 2)")
    parser.add_argument("--verbose", action="store_true", help="print the tracebacks of failures")
    parser.add_argument("--child-memory", nargs=2, metavar=("MODEL", "CANDIDATE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = argv
    return args


def make_plan(args: argparse.Namespace) -> Plan:
    steps = args.steps if args.steps is not None else QUICK_STEPS if args.quick else 24
    if steps < 1:
        raise SystemExit("--steps must be at least 1")
    if args.quick:
        return Plan(args.size, steps, QUICK_GENERATE_WARMUP, QUICK_GENERATE_CALLS, QUICK_TOKENS)
    return Plan(args.size, steps, GENERATE_WARMUP, GENERATE_CALLS, zoo.GENERATE_TOKENS)


def selected_models(only: str | None) -> list[zoo.ZooModel]:
    if not only:
        return list(zoo.MODELS.values())
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in zoo.MODELS]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; known: {', '.join(zoo.MODELS)}")
    return [zoo.MODELS[n] for n in names]


def main(argv: list[str] | None = None) -> int:
    global _VERBOSE
    args = parse_args(argv)
    _VERBOSE = args.verbose
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    # (taken before entering the private cache: each memory child makes one of its own, and
    # so compiles what it runs, unless the user chose a cache folder)
    child_env = dict(os.environ)
    with private_executable_cache():
        if args.child_memory:
            print(json.dumps(run_child(*args.child_memory, args.size)))
            return 0
        return run(args, child_env)


def run_child(model_name: str, candidate: str, size: str) -> dict[str, Any]:
    try:
        return child_memory(model_name, candidate, size)
    except Exception as exc:
        return {"error": short_reason(exc)}


def run(args: argparse.Namespace, child_env: dict[str, str]) -> int:
    models = selected_models(args.only)
    busy = busy_machine_warning()
    if busy:
        print(busy)
    started = time.perf_counter()
    plan = dataclasses.replace(make_plan(args), peak_gflops=peak_gflops())
    print(f"peak for MFU: {plan.peak_gflops:.1f} GFLOP/s ({PEAK_GEMM_SIZE}^3 float32 GEMM, "
          f"{torch.get_num_threads()} threads)")
    print(f"zoo, size {plan.size}: {len(models)} models, {plan.steps} steps; generation "
          f"{plan.generate_warmup} warm-up + {plan.generate_calls} timed calls of {plan.tokens} "
          f"tokens; candidates {', '.join(plan.candidates)}", flush=True)
    results = []
    for model in models:
        t0 = time.perf_counter()
        result = measure_model(model, plan)
        if args.memory and result.error is None:
            result.memory_mib = measure_memory(model.name, plan, child_env)
        results.append(result)
        status = f"ERROR {result.error}" if result.error else "done"
        print(f"  {model.name}: {status} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print()
    print(table(results, args.memory))
    print()
    for line in notes(results):
        print(line)
    geomeans = geomean_speedups(results)
    print("geometric mean of the training speed-ups: " + ", ".join(
        f"{c} {_x(g['geomean'])} over {len(g['models'])} models" for c, g in geomeans.items()))
    off = _settings_off_default()
    if off:
        print(f"note: deferfuse settings off their defaults: {off}")
    path = save(results, args, plan, time.perf_counter() - started)
    print(f"saved {path} and {path.with_suffix('.png').name} "
          f"({time.perf_counter() - started:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
