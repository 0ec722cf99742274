"""A GPT training step, side by side: strict PyTorch, defer, torch.compile and JAX.

    python -m bench.train_gpt                    # 10 timed steps per candidate
    python -m bench.train_gpt --quick            # fewer steps, shorter warm-up
    python -m bench.train_gpt --only strict,defer

The workload (issue 6): a small GPT in plain torch.nn -- token and position embeddings (vocab
512), 4 pre-LayerNorm blocks (d_model 256, 8 heads, causal attention with the masked softmax
written out, GELU MLP 4x), final LayerNorm, untied LM head, cross-entropy on next tokens;
batch 8 x 128 tokens; AdamW (lr 3e-4, weight decay 0.1, torch's default for CPU: the
single-tensor loop).  One step is ``zero_grad; loss = model(x, y); backward; step; item``.

Candidates, each with its own deep copy of the same initial model, run interleaved round by
round through bench.harness (one step per call):
  strict          eager torch
  defer           the same, each step inside ``with deferfuse.defer():`` (default settings: a
                  step that runs faster at once than deferred runs at once, eager_blocks)
  deferred        the same with eager_blocks off: every step recorded, fused and flushed
  compile         torch.compile (Inductor) of the model (forward + loss); AdamW eager
  compile-opt     the same, and torch.compile(opt.step) too
  jax             the same model and AdamW in JAX, value_and_grad + update under one jax.jit,
                  initialised from the torch weights
  defer-mm-torch  deferred with compute_engine="torch" (matmuls on torch's kernels): not a
                  default setting, an experiment on where defer's time goes
and ``defer-loop``: one ``defer()`` context around a block of steps, the way a training script
is written.  It cannot be interleaved step by step (a dispatch mode left open would capture the
other candidates), so blocks of 5 steps alternate with blocks of 5 strict steps; each step is
timed on its own, the flush at the block's end added to the block's last step.

Correctness: the harness's one-output check does not fit a training step (state changes every
call, and candidates warm up for different numbers of steps), so every candidate logs each
step's loss, and afterwards a fresh strict run from the same initial weights goes to each
candidate's step count: the first-step loss and the losses of steps 1-5 must agree within 1e-4
relative, and the distance from strict's parameters must stay under 5% of how far strict's
parameters moved.  A failing candidate is reported as a mismatch, not as a speed-up.
Then each of strict, defer, deferred and jax alone in a fresh process (``--rounds``, default 5:
one process per candidate per round, the order rotating): candidates sharing a process share
its allocator and XLA's CPU client, and after the JAX candidate's steps the defer step
page-faults ~24k times a step, which a user running one of them never sees.  A "strict-malloc"
process runs strict with the malloc thresholds deferfuse sets in its own processes
(malloc_tuning), so the allocator's share of the difference shows.  The target is judged on
both tables.
Also: deferfuse.stats() of one steady-state step, a torch.profiler breakdown of a strict step
and a wall-clock split (plus cProfile) of a defer step.  Results: bench/results/train_gpt.json.
"""

from __future__ import annotations

import argparse
import copy
import contextlib
import cProfile
import json
import math
import os
import pstats
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.harness import (Budget, Candidate, Result, Timing, busy_machine_warning, compare,
                           machine_info, private_executable_cache, save_results, short_reason)

VOCAB, D_MODEL, HEADS, LAYERS = 512, 256, 8, 4
BATCH, SEQ = 8, 128
LR, WEIGHT_DECAY, BETAS, EPS = 3e-4, 0.1, (0.9, 0.999), 1e-8
N_BATCHES = 4
CHECK_STEPS = 3
COLUMNS = ("strict", "defer", "deferred", "compile", "jax")


# --------------------------------------------------------------------------------------------
# The model, in plain torch.nn.

class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.register_buffer("causal", torch.ones(SEQ, SEQ, dtype=torch.bool).tril(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        head_dim = c // HEADS
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, HEADS, head_dim).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head_dim))
        scores = scores.masked_fill(~self.causal[:t, :t], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        y = (weights @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.attn = CausalSelfAttention()
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.fc = nn.Linear(D_MODEL, 4 * D_MODEL)
        self.gelu = nn.GELU()
        self.fc2 = nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(self.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(SEQ, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        for module in self.modules():  # GPT-2 style initialisation
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT()


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed random token data: ``N_BATCHES`` (inputs, next-token targets) pairs."""
    g = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(N_BATCHES):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return batches


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS,
                             eps=EPS)


# --------------------------------------------------------------------------------------------
# Trainers: one object per candidate, its own model copy, optimizer and step counter; step()
# runs the next step on batch ``steps % N_BATCHES`` and returns the loss as a Python float.

class TorchTrainer:
    def __init__(self, initial: GPT, batches, forward: Callable | None = None,
                 context: Callable | None = None) -> None:
        self.model = copy.deepcopy(initial)
        self.opt = make_optimizer(self.model)
        self.batches = batches
        self.forward = forward or self.model
        self.context = context
        self.steps = 0
        self.loss_log: list[float] = []  # every step's loss, for check_trajectories()

    def raw_step(self) -> float:
        x, y = self.batches[self.steps % len(self.batches)]
        self.steps += 1
        self.opt.zero_grad(set_to_none=True)
        loss = self.forward(x, y)
        loss.backward()
        self.opt.step()
        value = loss.item()
        self.loss_log.append(value)
        return value

    def step(self) -> float:
        if self.context is None:
            return self.raw_step()
        with self.context():
            return self.raw_step()

    def params(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}


# --------------------------------------------------------------------------------------------
# The same model and AdamW in JAX.

def jax_loss(params: dict, idx, targets):
    import jax
    import jax.numpy as jnp

    def linear(x, prefix, bias=True):
        y = x @ params[prefix + ".weight"].T
        return y + params[prefix + ".bias"] if bias else y

    def layer_norm(x, prefix):
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        return ((x - mean) * jax.lax.rsqrt(var + 1e-5) * params[prefix + ".weight"]
                + params[prefix + ".bias"])

    b, t = idx.shape
    head_dim = D_MODEL // HEADS
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    x = params["tok.weight"][idx] + params["pos.weight"][jnp.arange(t)]
    for i in range(LAYERS):
        p = f"blocks.{i}."
        h = layer_norm(x, p + "ln1")
        q, k, v = jnp.split(linear(h, p + "attn.qkv"), 3, axis=-1)
        q, k, v = (z.reshape(b, t, HEADS, head_dim).transpose(0, 2, 1, 3) for z in (q, k, v))
        scores = (q @ jnp.swapaxes(k, -2, -1)) * (1.0 / math.sqrt(head_dim))
        scores = jnp.where(mask, scores, -jnp.inf)
        y = (jax.nn.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(b, t, D_MODEL)
        x = x + linear(y, p + "attn.proj")
        h = jax.nn.gelu(linear(layer_norm(x, p + "ln2"), p + "fc"), approximate=False)
        x = x + linear(h, p + "fc2")
    logits = linear(layer_norm(x, "ln_f"), "head", bias=False).reshape(-1, VOCAB)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets.reshape(-1, 1), axis=-1))


def jax_train_step(params, m, v, step, idx, targets):
    """value_and_grad of the loss, then torch's AdamW (decoupled decay, bias-corrected)."""
    import jax
    import jax.numpy as jnp
    loss, grads = jax.value_and_grad(jax_loss)(params, idx, targets)
    step = step + 1
    b1, b2 = BETAS
    bias_correction1 = 1 - b1 ** step.astype(jnp.float32)
    bias_correction2_sqrt = jnp.sqrt(1 - b2 ** step.astype(jnp.float32))
    new_p, new_m, new_v = {}, {}, {}
    for name, p in params.items():
        g = grads[name]
        p = p * (1 - LR * WEIGHT_DECAY)
        new_m[name] = m[name] + (g - m[name]) * (1 - b1)
        new_v[name] = v[name] * b2 + g * g * (1 - b2)
        denom = jnp.sqrt(new_v[name]) / bias_correction2_sqrt + EPS
        new_p[name] = p - (LR / bias_correction1) * new_m[name] / denom
    return new_p, new_m, new_v, step, loss


class JaxTrainer:
    def __init__(self, initial: GPT, batches) -> None:
        import jax
        import jax.numpy as jnp
        self.jax = jax
        self.params = {name: jnp.asarray(p.detach().numpy().copy())
                       for name, p in initial.named_parameters()}
        self.m = {name: jnp.zeros_like(p) for name, p in self.params.items()}
        self.v = {name: jnp.zeros_like(p) for name, p in self.params.items()}
        self.step_count = jnp.zeros((), jnp.int32)
        self.batches = [(jnp.asarray(x.numpy()), jnp.asarray(y.numpy())) for x, y in batches]
        self.jitted = jax.jit(jax_train_step, donate_argnums=(0, 1, 2))
        self.steps = 0
        self.loss_log: list[float] = []

    def step(self) -> float:
        x, y = self.batches[self.steps % len(self.batches)]
        self.steps += 1
        self.params, self.m, self.v, self.step_count, loss = self.jitted(
            self.params, self.m, self.v, self.step_count, x, y)
        value = float(loss)
        self.loss_log.append(value)
        return value

    def params_torch(self) -> dict[str, torch.Tensor]:
        import numpy as np
        return {name: torch.from_numpy(np.array(p)) for name, p in self.params.items()}


# --------------------------------------------------------------------------------------------
# Candidates.

def _trainer_candidate(name: str, trainer: Any, **options) -> Candidate:
    # check=False: a training step changes its state, and candidates warm up for different
    # numbers of steps, so the harness's one-output check does not fit; check_trajectories()
    # compares every candidate's losses and final parameters with strict's instead.
    return Candidate(name, trainer.step, check=False, **options)


_ENGINE_COUNTERS = ("executions", "eager_replays", "cache_misses", "compiles", "eager_chosen",
                    "lowering_failures")


def _logging_engines(run: Callable[[], Any], trainer: Any, deferfuse) -> Callable[[], Any]:
    """``run``, keeping in ``trainer.engine_log`` what each call did (XLA executions, eager
    replays, ...): the autotuner may move the step's graph from XLA to torch mid-run."""
    trainer.engine_log = []

    def logged():
        before = deferfuse.stats()
        out = run()
        after = deferfuse.stats()
        delta = {k: after[k] - before[k] for k in _ENGINE_COUNTERS}
        delta["fallbacks"] = sum(after["fallbacks"].values()) - sum(before["fallbacks"].values())
        trainer.engine_log.append(delta)
        return out
    return logged


def build_candidates(wanted: list[str], initial: GPT, batches, probe) -> tuple[list[Candidate],
                                                                                 dict[str, Any]]:
    candidates: list[Candidate] = []
    trainers: dict[str, Any] = {}
    for name in wanted:
        try:
            if name == "strict":
                trainers[name] = TorchTrainer(initial, batches)
                candidates.append(_trainer_candidate(name, trainers[name]))
            elif name == "defer":
                if probe.module is None:
                    candidates.append(Candidate(name, None, unavailable=probe.unavailable))
                    continue
                trainer = TorchTrainer(initial, batches, context=probe.module.defer)
                trainers[name] = trainer

                def run(trainer=trainer):
                    probe.calls += 1
                    return trainer.step()
                candidates.append(Candidate(name, _logging_engines(run, trainer, probe.module),
                                            check=False, is_warm=probe.is_warm))
            elif name == "deferred":
                # defer with the block tier off (eager_blocks=False): every step is recorded,
                # fused and flushed even where running it at once is faster
                if probe.module is None:
                    candidates.append(Candidate(name, None, unavailable=probe.unavailable))
                    continue
                deferfuse = probe.module

                @contextlib.contextmanager
                def always_deferred():
                    with deferfuse.config.override(eager_blocks=False), deferfuse.defer():
                        yield
                trainers[name] = TorchTrainer(initial, batches, context=always_deferred)
                candidates.append(Candidate(name, _logging_engines(trainers[name].step,
                                                                   trainers[name], deferfuse),
                                            check=False, is_warm=type(probe)().cache_is_warm))
            elif name == "defer-mm-torch":
                # not default settings: compute_engine="torch" keeps matmuls on torch's
                # kernels between XLA groups (an experiment on where defer's time goes)
                if probe.module is None:
                    candidates.append(Candidate(name, None, unavailable=probe.unavailable))
                    continue
                deferfuse = probe.module
                own_probe = type(probe)()

                @contextlib.contextmanager
                def mm_on_torch():
                    with deferfuse.config.override(compute_engine="torch", eager_blocks=False), \
                            deferfuse.defer():
                        yield
                trainers[name] = TorchTrainer(initial, batches, context=mm_on_torch)
                candidates.append(Candidate(name, _logging_engines(trainers[name].step,
                                                                   trainers[name], deferfuse),
                                            check=False, is_warm=own_probe.cache_is_warm))
            elif name in ("compile", "compile-opt"):
                torch._dynamo.reset()
                trainer = TorchTrainer(initial, batches)
                trainer.forward = torch.compile(trainer.model, dynamic=False)
                if name == "compile-opt":
                    trainer.opt.step = torch.compile(trainer.opt.step)
                trainers[name] = trainer
                candidates.append(_trainer_candidate(name, trainer, failure_label="unavailable"))
            elif name == "jax":
                trainers[name] = JaxTrainer(initial, batches)
                candidates.append(_trainer_candidate(name, trainers[name]))
            else:
                raise ValueError(f"unknown candidate {name!r}")
        except Exception as exc:
            candidates.append(Candidate(name, None, unavailable=short_reason(exc)))
    return candidates, trainers


# --------------------------------------------------------------------------------------------
# defer-loop: one defer() context around a block of steps.  Strict and defer-loop blocks
# alternate; each step is timed on its own, and the flush at the block's end (the last step's
# pending optimizer update) is added to the block's last step.

class LoopTrainer(TorchTrainer):
    def block(self, steps: int) -> list[float]:
        times = []
        with self.context():
            for _ in range(steps):
                start = time.perf_counter()
                self.raw_step()
                times.append((time.perf_counter() - start) * 1e3)
            exit_start = time.perf_counter()
        times[-1] += (time.perf_counter() - exit_start) * 1e3
        return times


def time_defer_loop(initial: GPT, batches, strict: TorchTrainer, probe, steps: int,
                    warmup: int, max_warmup_seconds: float, block: int = 5) -> dict[str, Any]:
    trainer = LoopTrainer(initial, batches, context=probe.module.defer)
    probe.reset()
    start = time.perf_counter()
    first = trainer.block(1)[0]
    warm_blocks = 0
    trainer.block(warmup)
    while not probe.is_warm() and time.perf_counter() - start < max_warmup_seconds:
        trainer.block(block)
        warm_blocks += 1
    warm = probe.is_warm()
    warm_steps = trainer.steps
    strict_ms: list[float] = []
    loop_ms: list[float] = []
    while len(loop_ms) < steps:
        for _ in range(block):
            t0 = time.perf_counter()
            strict.step()
            strict_ms.append((time.perf_counter() - t0) * 1e3)
        loop_ms.extend(trainer.block(block))
    misses_after = probe.module.stats().get("cache_misses", 0)
    return {"trainer": trainer, "first_ms": first, "warmup_steps": warm_steps, "warm": warm,
            "strict_ms": strict_ms, "loop_ms": loop_ms,
            "cache_misses_total": misses_after, "stats_total": probe.module.stats()}


# --------------------------------------------------------------------------------------------
# Correctness: every candidate's losses and final parameters against strict's, trained for the
# same number of steps on the same batches from the same initial weights.

def check_trajectories(initial: GPT, batches,
                       losses: dict[str, list[float]], params: dict[str, dict]) -> dict:
    reference = TorchTrainer(initial, batches)
    init_params = reference.params()
    wanted = sorted({len(v) for v in losses.values()})
    ref_losses: list[float] = []
    ref_params: dict[int, dict] = {}
    for target in wanted:
        while reference.steps < target:
            ref_losses.append(reference.step())
        ref_params[target] = reference.params()
    report = {}
    for name, trail in losses.items():
        n = len(trail)
        rel = [abs(a - b) / abs(b) for a, b in zip(trail, ref_losses)]
        got, want = params[name], ref_params[n]
        diff_sq = sum(float((got[k] - want[k]).double().pow(2).sum()) for k in want)
        moved_sq = sum(float((want[k] - init_params[k]).double().pow(2).sum()) for k in want)
        max_abs = max(float((got[k] - want[k]).abs().max()) for k in want)
        worst = max(want, key=lambda k: float((got[k] - want[k]).abs().max()))
        entry = {
            "steps": n,
            "first_loss": trail[0], "strict_first_loss": ref_losses[0],
            "first_loss_rel_diff": rel[0],
            "max_loss_rel_diff_first5": max(rel[:5]),
            "max_loss_rel_diff_all": max(rel),
            "losses_first5": trail[:5], "strict_losses_first5": ref_losses[:5],
            "param_max_abs_diff": max_abs, "param_worst_tensor": worst,
            # the distance to strict's parameters over the distance strict's moved from init
            "param_diff_over_movement": math.sqrt(diff_sq / moved_sq) if moved_sq else 0.0,
        }
        problems = []
        if entry["first_loss_rel_diff"] > 1e-4:
            problems.append(f"first-step loss {trail[0]:.7g} vs strict {ref_losses[0]:.7g}")
        if entry["max_loss_rel_diff_first5"] > 1e-4:
            problems.append(f"losses of steps 1-5 differ by up to "
                            f"{entry['max_loss_rel_diff_first5']:.2g} relative")
        if entry["param_diff_over_movement"] > 0.05:
            problems.append(f"parameters after {n} steps: |p - p_strict| is "
                            f"{entry['param_diff_over_movement']:.2g} of strict's movement")
        entry["problems"] = problems
        report[name] = entry
    return report


# --------------------------------------------------------------------------------------------
# Where the time goes.

def profile_strict_step(trainer: TorchTrainer) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.step()
    wall_ms = (time.perf_counter() - start) * 1e3
    events = prof.key_averages()
    self_us = {e.key: e.self_cpu_time_total for e in events}
    total = sum(self_us.values())
    matmul = {k: self_us.get(k, 0.0) / 1e3 for k in ("aten::mm", "aten::addmm", "aten::bmm")}
    top = sorted(self_us.items(), key=lambda kv: -kv[1])[:12]
    return {"wall_ms_with_profiler": wall_ms, "self_cpu_total_ms": total / 1e3,
            "matmul_self_ms": matmul,
            "matmul_fraction_of_self_cpu": sum(matmul.values()) * 1e3 / total if total else None,
            "top_self_cpu_ms": [(k, v / 1e3) for k, v in top]}


class _Timers:
    """Inclusive wall time and call counts of some deferfuse functions, by wrapping them for
    the duration of a block (nothing in deferfuse is changed on disk)."""

    TARGETS = (
        ("deferfuse.capture.flush", "materialize_states", "flush (all, inclusive)"),
        ("deferfuse.capture.flush", "_widen", "  widen to what shares work"),
        ("deferfuse.capture.flush", "write_back", "  write-back into memory (copies)"),
        ("deferfuse.capture.flush", "_release", "  release computed nodes"),
        ("deferfuse.plan.partition", "partition", "  plan (partition)"),
        ("deferfuse.exec.replay", "execute_eager", "  eager replay"),
        ("deferfuse.exec.runner", "execute_xla", "  xla (inclusive)"),
        ("deferfuse.exec.program", "build", "    build graph + signature"),
        ("deferfuse.exec.executables", "lookup", "    executable cache lookup"),
        ("deferfuse.exec.interop", "to_jax", "    torch->jax (dlpack)"),
        ("deferfuse.exec.interop", "to_torch", "    jax->torch (dlpack)"),
    )

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> "_Timers":
        import importlib
        for module_name, attr, label in self.TARGETS:
            module = importlib.import_module(module_name)
            original = getattr(module, attr)
            self.saved.append((module, attr, original))
            self.seconds[label] = 0.0
            self.calls[label] = 0
            depth = [0]

            def wrapper(*args, __original=original, __label=label, __depth=depth, **kwargs):
                __depth[0] += 1
                start = time.perf_counter()
                try:
                    return __original(*args, **kwargs)
                finally:
                    __depth[0] -= 1
                    if __depth[0] == 0:  # count nested calls once
                        self.seconds[__label] += time.perf_counter() - start
                    self.calls[__label] += 1
            setattr(module, attr, wrapper)
        return self

    def __exit__(self, *exc) -> None:
        for module, attr, original in reversed(self.saved):
            setattr(module, attr, original)


def profile_defer_step(step: Callable[[], Any]) -> dict[str, Any]:
    """Wall-clock split of one steady-state defer step (wrapped timers), then a cProfile of
    another step grouped by library."""
    with _Timers() as timers:
        start = time.perf_counter()
        step()
        total = time.perf_counter() - start
    ms = {label: s * 1e3 for label, s in timers.seconds.items()}
    flush = ms["flush (all, inclusive)"]
    xla = ms["  xla (inclusive)"]
    xla_run = xla - sum(ms[k] for k in ("    build graph + signature", "    executable cache lookup",
                                        "    torch->jax (dlpack)", "    jax->torch (dlpack)"))
    split = {"step_ms": total * 1e3,
             "outside flushes (recording: model code, autograd, dispatch mode, graph nodes)":
                 total * 1e3 - flush,
             **ms, "    XLA executable run (xla minus the rows above)": xla_run,
             "calls": dict(timers.calls)}

    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    step()
    profiler.disable()
    wall = (time.perf_counter() - start) * 1e3
    stats = pstats.Stats(profiler)
    by_library: dict[str, float] = {}
    rows = []
    for (filename, line, func), (cc, nc, tottime, cumtime, _) in stats.stats.items():
        if "deferfuse/" in filename:
            library = "deferfuse." + filename.split("deferfuse/")[-1].replace("/", ".")[:-3]
        elif "/torch/" in filename:
            library = "torch (python)"
        elif "/jax/" in filename or "/jaxlib/" in filename:
            library = "jax (python)"
        elif filename == "~":
            library = "builtins/C: " + func.split(" of ")[0][:60]
        else:
            library = "other: " + filename.rsplit("/", 1)[-1]
        by_library[library] = by_library.get(library, 0.0) + tottime * 1e3
        rows.append((tottime * 1e3, cumtime * 1e3, nc, f"{filename.rsplit('/', 1)[-1]}:{line}"
                     f"({func})"))
    rows.sort(reverse=True)
    libraries = sorted(by_library.items(), key=lambda kv: -kv[1])
    return {"wrapped_timers_ms": split, "cprofile_wall_ms": wall,
            "cprofile_tottime_by_library_ms": libraries[:15],
            "cprofile_top_tottime": [{"tottime_ms": r[0], "cumtime_ms": r[1], "calls": r[2],
                                      "function": r[3]} for r in rows[:15]]}


# --------------------------------------------------------------------------------------------
# Each candidate in its own process.  Candidates sharing a process share its allocator and
# XLA's CPU client: after the JAX candidate's steps (~200 MB of fresh buffers each) the defer
# step page-faults ~24k times a step, which no user running one of them would see.  So the
# step is also timed with every candidate alone in a fresh process, processes alternating
# round by round (the machine's drift then falls on all of them alike).

PER_PROCESS = ("strict", "defer", "deferred", "jax")   # (+ strict-malloc: strict with the
# malloc thresholds deferfuse sets, malloc_tuning, so that the allocator's share is visible)


def own_process_steps(name: str, steps: int, warmup: int) -> dict[str, Any]:
    """Warm up, then time ``steps`` steps of one candidate; run inside the child process."""
    initial, batches = make_model(), make_batches()
    if name == "jax":
        trainer: Any = JaxTrainer(initial, batches)
    elif name in ("strict", "strict-malloc"):
        if name == "strict-malloc":   # strict with the malloc thresholds deferfuse sets
            from deferfuse.exec import backend
            backend.tune_malloc()
        trainer = TorchTrainer(initial, batches)
    else:
        import deferfuse
        from deferfuse import config
        if name == "deferred":
            config.set("eager_blocks", False)
        trainer = TorchTrainer(initial, batches, context=deferfuse.defer)
    for _ in range(warmup):
        trainer.step()
    if name == "defer":
        from deferfuse.exec import blocks
        for _ in range(60):   # until the step's place has chosen (eager_blocks)
            if not any(c.phase in (blocks.Phase.MEASURE_DEFERRED, blocks.Phase.MEASURE_AT_ONCE)
                       for c in blocks.choices()):
                break
            trainer.step()
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.step()
        samples.append((time.perf_counter() - start) * 1e3)
    out: dict[str, Any] = {"samples_ms": samples, "losses": trainer.loss_log[-steps:]}
    if name == "defer":
        from deferfuse.exec import blocks
        out["choice"] = [c.phase.name for c in blocks.choices()]
    return out


def time_per_process(names: list[str], rounds: int, steps: int, warmup: int,
                     cache_dir: str) -> dict[str, Any]:
    """``rounds`` rounds of one fresh process per candidate (the order rotating by a place each
    round), each timing ``steps`` steps after ``warmup``; samples pooled per candidate."""
    env = dict(os.environ, DEFERFUSE_CACHE_DIR=cache_dir)
    pooled: dict[str, list[float]] = {n: [] for n in names}
    choices: dict[str, list] = {}
    failures: dict[str, str] = {}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            if name in failures:
                continue
            command = [sys.executable, "-m", "bench.train_gpt", "--own-process", name,
                       "--steps", str(steps), "--warmup", str(warmup)]
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
            lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
            if done.returncode != 0 or not lines:
                failures[name] = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
                continue
            got = json.loads(lines[-1])
            pooled[name].extend(got["samples_ms"])
            if "choice" in got:
                choices.setdefault(name, []).append(got["choice"])
    medians = {n: statistics.median(v) for n, v in pooled.items() if v}
    # (a fresh process on these VMs runs fast or ~20% slow as a whole, recording and XLA alike:
    # the per-round medians show it, the pooled median averages over it)
    per_round = {n: [statistics.median(v[i:i + steps]) for i in range(0, len(v), steps)]
                 for n, v in pooled.items()}
    return {"rounds": rounds, "steps_per_round": steps, "samples_ms": pooled, "median_ms": medians,
            "per_round_median_ms": per_round, "defer_choices": choices, "failures": failures}


def format_per_process(found: dict[str, Any]) -> str:
    medians = found["median_ms"]
    strict = medians.get("strict")
    lines = [f"each candidate alone in a fresh process ({found['rounds']} rounds x "
             f"{found['steps_per_round']} steps, processes alternating):",
             "  candidate      median ms  min ms  max ms   n  strict/this"]
    for name, samples in found["samples_ms"].items():
        if not samples:
            lines.append(f"  {name:13s}  failed: {found['failures'].get(name, '?')}")
            continue
        lines.append(f"  {name:13s}  {_fmt(medians[name]):>9s}  {_fmt(min(samples)):>6s}  "
                     f"{_fmt(max(samples)):>6s}  {len(samples):2d}  "
                     f"{_ratio(strict, medians[name]):>11s}   per process: "
                     + " ".join(_fmt(m) for m in found["per_round_median_ms"][name]))
    if found["defer_choices"]:
        lines.append(f"  defer's step place chose, per round: {found['defer_choices']['defer']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Report.

def _fmt(ms: float | None) -> str:
    if ms is None:
        return "-"
    return f"{ms:.1f}" if ms < 1000 else f"{ms:.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def format_table(timings: dict[str, Timing], loop: dict[str, Any] | None) -> str:
    rows = [("candidate", "status", "median ms", "min ms", "max ms", "n", "warm-up",
             "first ms", "strict/this")]
    strict = timings.get("strict")
    strict_median = strict.median_ms if strict else None
    for name, t in timings.items():
        samples = t.samples_ms
        rows.append((name, t.status + ("*" if t.warning else ""), _fmt(t.median_ms),
                     _fmt(t.min_ms), _fmt(max(samples) if samples else None), str(len(samples)),
                     str(t.warmup_calls), _fmt(t.first_ms),
                     _ratio(strict_median, t.median_ms)))
    if loop:
        for name, samples in (("strict (vs loop)", loop["strict_ms"]),
                              ("defer-loop", loop["loop_ms"])):
            median = statistics.median(samples)
            rows.append((name, "ok", _fmt(median), _fmt(min(samples)), _fmt(max(samples)),
                         str(len(samples)), str(loop["warmup_steps"]) if name == "defer-loop"
                         else "-", _fmt(loop["first_ms"]) if name == "defer-loop" else "-",
                         _ratio(statistics.median(loop["strict_ms"]), median)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for i, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if j < 2 else c.rjust(w)
                               for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.train_gpt", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per candidate (default 10, --quick 5)")
    parser.add_argument("--quick", action="store_true",
                        help="5 timed steps, 5 warm-up steps; leaves out defer-loop, "
                             "defer-mm-torch and compile-opt")
    parser.add_argument("--only", default=None,
                        help="comma-separated candidates (strict is always run as the "
                             "reference); from: strict, defer, defer-loop, compile, "
                             "compile-opt, jax, defer-mm-torch")
    parser.add_argument("--name", default="train_gpt", help="results file name")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiles")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of the per-process timing (0 skips it; default 5)")
    parser.add_argument("--own-process", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


ALL = ("strict", "defer", "deferred", "compile", "compile-opt", "jax", "defer-mm-torch", "defer-loop")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.own_process:
        print(json.dumps(own_process_steps(args.own_process, args.steps or 10, args.warmup or 10)))
        return 0
    with private_executable_cache() as cache_dir:
        return run(args, cache_dir)


def run(args: argparse.Namespace, cache_dir: str) -> int:
    from bench.workloads import DeferProbe

    steps = args.steps or (5 if args.quick else 10)
    warmup = 5 if args.quick else 10
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        unknown = [w for w in wanted if w not in ALL]
        if unknown:
            raise SystemExit(f"unknown candidates {unknown}; known: {', '.join(ALL)}")
        wanted = ["strict"] + [w for w in wanted if w != "strict"]
    else:
        wanted = [w for w in ALL
                  if not (args.quick and w in ("compile-opt", "defer-loop", "defer-mm-torch"))]
    busy = busy_machine_warning()
    if busy:
        print(busy)
    machine_at_start = machine_info()
    started = time.perf_counter()

    initial, batches = make_model(), make_batches()
    probe = DeferProbe()
    interleaved = [w for w in wanted if w != "defer-loop"]
    candidates, trainers = build_candidates(interleaved, initial, batches, probe)
    # exactly ``steps`` timed rounds: an unbounded time budget, capped by max_rounds
    budget = Budget(seconds=1e9, warmup=warmup, min_rounds=steps, max_rounds=steps,
                    max_warmup_seconds=300.0)

    def on_first_call(name: str) -> None:
        print(f"  {name}: first call + warm-up ...", flush=True)
        if name == "defer":
            probe.reset()

    print(f"GPT training step, batch {BATCH}x{SEQ}, {steps} timed steps per candidate, "
          f"interleaved: {', '.join(interleaved)}", flush=True)
    timings = compare(candidates, budget, on_first_call=on_first_call, verbose=args.verbose)
    notes: dict[str, Any] = {"first_call_ms": {n: t.first_ms for n, t in timings.items()}}
    if "defer" in trainers and probe.calls and "defer-mm-torch" not in trainers:
        notes["defer_stats_warmup_and_timed"] = probe.per_call()
    for name in ("defer", "deferred", "defer-mm-torch"):
        log = getattr(trainers.get(name), "engine_log", None)
        if log:
            timed = log[-len(timings[name].samples_ms):] if timings[name].samples_ms else []
            notes[f"{name}_per_call_counters"] = log
            notes[f"{name}_timed_steps_counters"] = {k: sum(d[k] for d in timed) for k in log[0]}
    for name in ("compile", "compile-opt"):
        if name in timings:
            notes[f"{name}_what"] = ("torch.compile(model) (forward + loss; backward through "
                                     "AOTAutograd); AdamW step eager" if name == "compile" else
                                     "torch.compile(model) and torch.compile(opt.step)")
    try:
        notes["dynamo_counters"] = {k: dict(v) for k, v in torch._dynamo.utils.counters.items()
                                    if k in ("stats", "frames", "recompiles", "graph_break")}
    except Exception:
        pass

    loop = None
    if "defer-loop" in wanted and probe.module is not None and "strict" in trainers:
        print("  defer-loop: one defer() around blocks of steps, alternating with strict ...",
              flush=True)
        try:
            loop = time_defer_loop(initial, batches, trainers["strict"], probe, steps, warmup,
                                   300.0)
            trainers["defer-loop"] = loop.pop("trainer")
        except Exception as exc:
            notes["defer_loop_failure"] = short_reason(exc)
            print(f"  defer-loop failed: {short_reason(exc)}")

    # stats of one steady-state defer step
    for name in ("defer", "defer-mm-torch"):
        if name in trainers and timings[name].status == "ok":
            probe.module.reset_stats()
            t0 = time.perf_counter()
            trainers[name].step()
            notes[f"{name.replace('-', '_')}_steady_step"] = {"ms": (time.perf_counter() - t0) * 1e3,
                                            "stats": probe.module.stats()}
    if "defer-loop" in trainers:
        loop_trainer = trainers["defer-loop"]
        probe.module.reset_stats()
        times = loop_trainer.block(3)
        notes["defer_loop_steady_3_steps"] = {"ms": times, "stats": probe.module.stats()}

    profiles: dict[str, Any] = {}
    if not args.no_profile:
        print("  profiles ...", flush=True)
        if "strict" in trainers:
            profiles["strict_torch_profiler"] = profile_strict_step(trainers["strict"])
        for name in ("defer", "deferred"):
            if name in trainers and timings[name].status == "ok":
                profiles[name] = profile_defer_step(trainers[name].step)

    print("  correctness: a fresh strict run to every candidate's step count ...", flush=True)
    losses, params = {}, {}
    for name, trainer in trainers.items():
        if name in timings and timings[name].status not in ("ok", "mismatch"):
            continue
        losses[name] = trainer.loss_log
        params[name] = (trainer.params_torch() if isinstance(trainer, JaxTrainer)
                        else trainer.params())
    losses = {k: v for k, v in losses.items() if v}
    params = {k: params[k] for k in losses}
    checks = check_trajectories(initial, batches, losses, params)
    for name, entry in checks.items():
        if entry["problems"] and name in timings:
            timings[name].status = "mismatch"
            timings[name].reason = "; ".join(entry["problems"])

    per_process = None
    alone = [n for n in PER_PROCESS if n in wanted]
    if "strict" in alone and any(n in alone for n in ("defer", "deferred")):
        alone.insert(1, "strict-malloc")
    if args.rounds > 0 and "strict" in alone and len(alone) > 1:
        print(f"  each of {', '.join(alone)} alone in a fresh process, {args.rounds} rounds ...",
              flush=True)
        per_process = time_per_process(alone, args.rounds, steps, warmup, cache_dir)
        notes["per_process"] = per_process

    result = Result("gpt-train-step", f"{LAYERS}L d{D_MODEL} h{HEADS} b{BATCH}x{SEQ}", timings,
                    notes)
    print()
    print(format_table(timings, loop))
    print()
    if per_process:
        print(format_per_process(per_process))
        print()
    strict_med = timings["strict"].median_ms if "strict" in timings else None
    defer_med = timings["defer"].median_ms if "defer" in timings else None
    jax_med = timings["jax"].median_ms if "jax" in timings else None
    summary = {"strict_over_defer": strict_med / defer_med if strict_med and defer_med else None,
               "defer_over_jax": defer_med / jax_med if defer_med and jax_med else None,
               "target_defer_1.2x_faster_than_strict":
                   bool(strict_med and defer_med and strict_med / defer_med >= 1.2)}
    if per_process:
        alone_ms = per_process["median_ms"]
        for name in alone[1:]:
            if name in alone_ms and "strict" in alone_ms:
                summary[f"per_process_strict_over_{name}"] = alone_ms["strict"] / alone_ms[name]
        if "defer" in alone_ms and "strict" in alone_ms:
            summary["per_process_target_defer_1.2x_faster_than_strict"] = \
                alone_ms["strict"] / alone_ms["defer"] >= 1.2
    if loop:
        summary["strict_over_defer_loop"] = (statistics.median(loop["strict_ms"])
                                             / statistics.median(loop["loop_ms"]))
    print(f"speed-up strict/defer = {_ratio(strict_med, defer_med)} (target >= 1.2x), "
          f"defer/jax = {_ratio(defer_med, jax_med)}"
          + (f", strict/defer-loop = {summary['strict_over_defer_loop']:.2f}x" if loop else ""))
    if per_process and "defer" in per_process["median_ms"]:
        alone_ms = per_process["median_ms"]
        print(f"alone in a process: speed-up strict/defer = "
              f"{_ratio(alone_ms.get('strict'), alone_ms['defer'])} (target >= 1.2x), "
              f"defer/jax = {_ratio(alone_ms['defer'], alone_ms.get('jax'))}")
    for name, t in timings.items():
        if t.status != "ok" or t.warning:
            print(f"  {name} {t.status}: {t.reason} {t.warning}")
    print("correctness (vs a fresh strict run of the same steps):")
    for name, entry in checks.items():
        print(f"  {name:11s} {entry['steps']:3d} steps: first loss {entry['first_loss']:.6f} "
              f"(rel {entry['first_loss_rel_diff']:.1e}), max loss rel diff "
              f"{entry['max_loss_rel_diff_all']:.1e}, params max |diff| "
              f"{entry['param_max_abs_diff']:.1e} ({entry['param_diff_over_movement']:.1e} of "
              f"movement){'  PROBLEM: ' + '; '.join(entry['problems']) if entry['problems'] else ''}")
    for name in ("defer", "deferred", "defer-mm-torch"):
        if f"{name}_timed_steps_counters" in notes:
            print(f"{name}: over its {len(timings[name].samples_ms)} timed steps: "
                  f"{notes[f'{name}_timed_steps_counters']}")
    for key in ("defer", "defer_mm_torch"):
        steady = notes.get(f"{key}_steady_step")
        if not steady:
            continue
        s = steady["stats"]
        print(f"{key} steady-state step: {steady['ms']:.0f} ms, {s['ops_recorded']} ops recorded, "
              f"flushes {s['flushes']}, executions {s['executions']}, compiles {s['compiles']}, "
              f"cache hits {s['cache_hits']}, misses {s['cache_misses']}, eager replays "
              f"{s['eager_replays']}, fallbacks {s['fallbacks'] or 'none'}")
    if profiles.get("strict_torch_profiler"):
        p = profiles["strict_torch_profiler"]
        print(f"strict profile: matmuls (mm/addmm/bmm) {100 * p['matmul_fraction_of_self_cpu']:.0f}% "
              f"of {p['self_cpu_total_ms']:.0f} ms self CPU time "
              f"({', '.join(f'{k} {v:.0f}' for k, v in p['matmul_self_ms'].items())} ms)")
    for name in ("defer", "deferred"):
        if not profiles.get(name):
            continue
        split = profiles[name]["wrapped_timers_ms"]
        print(f"{name} step, wall-clock split (ms; calls):")
        for label, value in split.items():
            if label != "calls":
                calls = split["calls"].get(label)
                print(f"  {label:72s} {value:8.1f}" + ("" if calls is None else f"  {calls:5d}"))
        print(f"{name} step, cProfile self time by library (ms): " + ", ".join(
            f"{k} {v:.0f}" for k, v in profiles[name]["cprofile_tottime_by_library_ms"][:8]))
    path = save_results(args.name, [result], {
        "elapsed_s": time.perf_counter() - started, "machine_at_start": machine_at_start,
        "deferfuse_cache_dir": cache_dir, "summary": summary, "correctness": checks,
        "defer_loop": loop, "profiles": profiles,
        "workload": {"vocab": VOCAB, "d_model": D_MODEL, "heads": HEADS, "layers": LAYERS,
                     "batch": BATCH, "seq": SEQ, "optimizer": "AdamW lr 3e-4 wd 0.1 "
                     "(torch default on CPU: single-tensor loop, foreach=False)",
                     "parameters": sum(p.numel() for p in initial.parameters())}})
    print(f"\nsaved {path.relative_to(path.parent.parent.parent)} "
          f"({time.perf_counter() - started:.0f}s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
