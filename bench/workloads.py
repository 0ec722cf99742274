"""The benchmark workloads, each as plain torch ops, and the candidates that run them.

A workload is a ``Spec``: the torch function, a factory for its inputs, the equivalent JAX
function (our ceiling: the same computation written for XLA directly), and tolerances.
``candidates(spec)`` turns it into the six columns: strict eager, defer (deferfuse's default
settings), deferred (defer with the block tier, ``eager_blocks``, off: every block recorded and
fused, whatever it costs), jax.jit, torch.compile (Inductor) and the memory floor (one
``copy_`` of as many bytes as the inputs).

Inputs come from a seeded generator, so every candidate starts from equal values; a workload
that mutates its inputs (the optimizer step) builds a separate set for each candidate, and its
output check runs on yet another fresh set after warm-up.

``run_cold_start`` is the odd one out: it times fresh interpreters, launch to first result.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch._dynamo
import torch.nn.functional as F

from bench.harness import Budget, Candidate, Result, Timing, compare, short_reason

REPO_ROOT = Path(__file__).resolve().parent.parent
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


# --------------------------------------------------------------------------------------------
# The workloads, in torch and in JAX.

def gelu_tanh(x):
    return x * 0.5 * (1.0 + torch.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)))


def gelu_tanh_jax(x):
    import jax.numpy as jnp
    return x * 0.5 * (1.0 + jnp.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)))


def layer_norm(x, weight, bias):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps=1e-5)


def layer_norm_jax(x, weight, bias):
    import jax.numpy as jnp
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * (1.0 / jnp.sqrt(var + 1e-5)) * weight + bias


def layer_norm_block(x, weight, bias):
    """A transformer block's memory-bound tail: x + GELU(LayerNorm(x))."""
    return x + F.gelu(F.layer_norm(x, (x.shape[-1],), weight, bias, eps=1e-5))


def layer_norm_block_jax(x, weight, bias):
    import jax
    return x + jax.nn.gelu(layer_norm_jax(x, weight, bias), approximate=False)


def softmax(x):
    return torch.softmax(x, dim=-1)


def softmax_jax(x):
    import jax
    return jax.nn.softmax(x, axis=-1)


def rmsnorm_swiglu(x, norm_weight, w_gate, w_up, w_down):
    """A transformer MLP block: x + W_down(silu(W_gate h) * W_up h), h = RMSNorm(x)."""
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight
    return x + (F.silu(h @ w_gate) * (h @ w_up)) @ w_down


def rmsnorm_swiglu_jax(x, norm_weight, w_gate, w_up, w_down):
    import jax
    import jax.numpy as jnp
    h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * norm_weight
    return x + (jax.nn.silu(h @ w_gate) * (h @ w_up)) @ w_down


def causal_attention(q, k, v):
    """Attention forward with the masked softmax written out op by op."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    seq = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * scale
    mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    scores = scores - scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights @ v


def causal_attention_jax(q, k, v):
    import jax.numpy as jnp
    scale = 1.0 / math.sqrt(q.shape[-1])
    seq = q.shape[-2]
    scores = (q @ jnp.swapaxes(k, -2, -1)) * scale
    mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(mask, scores, -jnp.inf)
    scores = scores - jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights @ v


ADAMW = dict(lr=1e-3, weight_decay=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


class StepCounter:
    """The optimizer's step count, a plain Python int as in a hand-written training loop.

    With ``advance`` each call moves to the next step, so the bias corrections (Python floats)
    change every call, as in real training; without it they stay fixed.
    """

    def __init__(self, start: int, advance: bool) -> None:
        self.value = start
        self.advance = advance

    def next_bias_corrections(self) -> tuple[float, float]:
        if self.advance:
            self.value += 1
        return 1 - ADAMW["beta1"] ** self.value, 1 - ADAMW["beta2"] ** self.value


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, step: StepCounter):
    """One AdamW update, in place, over lists of tensors (the shape of a for-loop optimizer)."""
    lr, wd, b1, b2, eps = (ADAMW[k] for k in ("lr", "weight_decay", "beta1", "beta2", "eps"))
    bias_correction1, bias_correction2 = step.next_bias_corrections()
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        p.mul_(1 - lr * wd)
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        p.addcdiv_(m / bias_correction1, (v / bias_correction2).sqrt().add_(eps), value=-lr)
    return params, exp_avgs, exp_avg_sqs


def adamw_step_jax(params, grads, exp_avgs, exp_avg_sqs, bias_correction1, bias_correction2):
    """The functional twin: returns the new state; bias corrections are runtime scalars, so a
    new step does not recompile."""
    import jax.numpy as jnp
    lr, wd, b1, b2, eps = (ADAMW[k] for k in ("lr", "weight_decay", "beta1", "beta2", "eps"))
    new_params, new_ms, new_vs = [], [], []
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        p = p * (1 - lr * wd)
        m = m * b1 + g * (1 - b1)
        v = v * b2 + g * g * (1 - b2)
        p = p - lr * (m / bias_correction1) / (jnp.sqrt(v / bias_correction2) + eps)
        new_params.append(p)
        new_ms.append(m)
        new_vs.append(v)
    return new_params, new_ms, new_vs


@functools.cache
def _adamw_step_jitted():
    import jax
    return jax.jit(adamw_step_jax, donate_argnums=(0, 2, 3))


def adamw_jax_runner(inputs: tuple) -> Callable[[], Any]:
    """jax.jit of the AdamW step, the state donated back so XLA may update it in place."""
    import jax
    import jax.numpy as jnp
    params, grads, exp_avgs, exp_avg_sqs, step = inputs
    jitted = _adamw_step_jitted()
    convert = lambda tensors: [jnp.asarray(t.numpy()) for t in tensors]  # noqa: E731
    state = {"params": convert(params), "m": convert(exp_avgs), "v": convert(exp_avg_sqs)}
    jax_grads = convert(grads)

    def run():
        bias_correction1, bias_correction2 = step.next_bias_corrections()
        new = jitted(state["params"], jax_grads, state["m"], state["v"],
                     jnp.float32(bias_correction1), jnp.float32(bias_correction2))
        state["params"], state["m"], state["v"] = jax.block_until_ready(new)
        return new

    return run


def chained_ops(x, count: int = 200):
    """``count`` tiny dependent ops: what one eager op costs when it does almost no work."""
    for _ in range(count // 2):
        x = x + 0.5
        x = x * 0.5
    return x


# --------------------------------------------------------------------------------------------
# Specs and candidates.

@dataclasses.dataclass
class Spec:
    name: str
    size: str
    torch_fn: Callable[..., Any]
    make_inputs: Callable[[], tuple]  # seeded: equal values on every call
    jax_fn: Callable[..., Any] | None = None
    # For a stateful workload: makes the JAX call from that candidate's own torch inputs.
    jax_runner: Callable[[tuple], Callable[[], Any]] | None = None
    mutates_inputs: bool = False  # then each candidate gets its own make_inputs()
    rtol: float = 1e-4
    atol: float = 1e-5
    columns: tuple[str, ...] = ("strict", "defer", "deferred", "jax", "compile", "floor")
    left_out: dict[str, str] = dataclasses.field(default_factory=dict)  # column -> why
    ops_per_call: int | None = None  # when set, the notes give microseconds per op


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _randn(generator, *shape, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=generator) * scale


def _input_bytes(inputs: tuple) -> int:
    total = 0
    pending = list(inputs)
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return total


def _inputs_for(spec: Spec, shared: tuple) -> tuple:
    # make_inputs is seeded, so a fresh call gives every candidate equal starting values.
    return spec.make_inputs() if spec.mutates_inputs else shared


class DeferProbe:
    """Counts the calls of the two deferfuse candidates (defer, deferred), so their
    deferfuse.stats() (one set of counters for both) can be read per call."""

    def __init__(self) -> None:
        self.calls = 0
        self.deferred_calls = 0
        self._misses_seen = 0
        self.module = None
        self.unavailable: str | None = None
        try:
            import deferfuse
            for name in ("defer", "stats", "reset_stats"):
                if not hasattr(deferfuse, name):
                    raise AttributeError(f"deferfuse has no attribute {name!r} yet")
            self.module = deferfuse
        except Exception as exc:
            self.unavailable = "deferfuse not usable: " + short_reason(exc)

    def reset(self) -> None:
        """Zero the counters, and forget the block tier's choices: every workload is timed as
        if it had its own ``with`` line (the candidates share one), from its own measurements."""
        self.calls = 0
        self.deferred_calls = 0
        self._misses_seen = 0
        if self.module is not None:
            self.module.reset_stats()
            try:
                from deferfuse.exec import blocks
            except ImportError:
                return
            blocks.forget()

    def is_warm(self) -> bool:
        """True when no executable-cache miss happened since the last poll: every graph of
        the last call ran from the cache (or needed no XLA), the steady state we time."""
        return self.cache_is_warm() and not self._blocks_measuring()

    def cache_is_warm(self) -> bool:
        """is_warm for the deferred candidate, whose blocks are never chosen for (and the defer
        candidate's place cannot finish measuring while another candidate warms up)."""
        misses = self.module.stats().get("cache_misses", 0)
        warm = misses == self._misses_seen
        self._misses_seen = misses
        return warm

    def _blocks_measuring(self) -> bool:
        """Whether a defer block's place is still timing its two ways (eager_blocks): warm-up
        goes on until it has chosen."""
        try:
            from deferfuse.exec import blocks
        except ImportError:
            return False
        return any(c.phase in (blocks.Phase.MEASURE_DEFERRED, blocks.Phase.MEASURE_AT_ONCE)
                   for c in blocks.choices())

    def per_call(self) -> dict[str, Any]:
        if self.module is None or self.calls == 0:
            return {}
        stats = self.module.stats()
        flushes = stats.get("flushes", {}) or {}
        calls = self.calls + self.deferred_calls
        return {
            "calls": self.calls,
            "deferred_calls": self.deferred_calls,
            "blocks_run_at_once_per_call": stats.get("blocks_run_at_once", 0) / self.calls,
            "ops_recorded_per_call": stats.get("ops_recorded", 0) / calls,
            "executions_per_call": stats.get("executions", 0) / calls,
            "flushes_per_call": sum(flushes.values()) / calls,
            "flush_reasons": dict(flushes),
            "compiles": stats.get("compiles"),
            "cache_hits": stats.get("cache_hits"),
            "cache_misses": stats.get("cache_misses"),
            "fallbacks": dict(stats.get("fallbacks", {}) or {}),
            "all": stats,
        }


def _candidate(name: str, spec: Spec, shared: tuple,
               make_runner: Callable[[tuple], Callable[[], Any]], **options) -> Candidate:
    """A candidate whose timed call runs ``make_runner(inputs)``; for a workload that updates
    its inputs in place, the output check runs on fresh inputs (equal to the first call's)."""
    run = make_runner(_inputs_for(spec, shared))
    check_run = (lambda: make_runner(spec.make_inputs())()) if spec.mutates_inputs else None
    return Candidate(name, run, check_run=check_run, **options)


def strict_candidate(spec: Spec, shared: tuple) -> Candidate:
    return _candidate("strict", spec, shared, lambda inputs: lambda: spec.torch_fn(*inputs))


def defer_candidate(spec: Spec, shared: tuple, probe: DeferProbe) -> Candidate:
    if probe.module is None:
        return Candidate("defer", None, unavailable=probe.unavailable)
    deferfuse = probe.module

    def make_runner(inputs):
        def run():
            probe.calls += 1
            with deferfuse.defer():
                out = spec.torch_fn(*inputs)
            return out
        return run

    return _candidate("defer", spec, shared, make_runner, is_warm=probe.is_warm)


def deferred_candidate(spec: Spec, shared: tuple, probe: DeferProbe) -> Candidate:
    """defer with the block tier off: every block is recorded, fused and flushed."""
    if probe.module is None:
        return Candidate("deferred", None, unavailable=probe.unavailable)
    deferfuse = probe.module
    if "eager_blocks" not in deferfuse.config.settings():
        return Candidate("deferred", None, unavailable="this deferfuse has no eager_blocks")

    def make_runner(inputs):
        def run():
            probe.deferred_calls += 1
            with deferfuse.config.override(eager_blocks=False), deferfuse.defer():
                out = spec.torch_fn(*inputs)
            return out
        return run

    return _candidate("deferred", spec, shared, make_runner, is_warm=probe.cache_is_warm)


def jax_candidate(spec: Spec, shared: tuple) -> Candidate:
    if spec.jax_fn is None and spec.jax_runner is None:
        return Candidate("jax", None, unavailable="no JAX version of this workload")
    try:
        import jax
        import jax.numpy as jnp
    except Exception as exc:
        return Candidate("jax", None, unavailable=short_reason(exc))
    if spec.jax_runner is not None:
        return _candidate("jax", spec, shared, spec.jax_runner)
    jitted = jax.jit(spec.jax_fn)

    def make_runner(inputs):
        jax_inputs = [jnp.asarray(t.numpy()) for t in inputs]  # once, outside the timed call
        return lambda: jax.block_until_ready(jitted(*jax_inputs))

    return _candidate("jax", spec, shared, make_runner)


def compile_candidate(spec: Spec, shared: tuple) -> Candidate:
    try:
        torch._dynamo.reset()
        compiled = torch.compile(spec.torch_fn, dynamic=False)
    except Exception as exc:
        return Candidate("compile", None, unavailable=short_reason(exc))
    return _candidate("compile", spec, shared, lambda inputs: lambda: compiled(*inputs),
                      failure_label="unavailable")


def floor_candidate(spec: Spec, shared: tuple) -> Candidate:
    nbytes = _input_bytes(shared)
    source = torch.empty(nbytes, dtype=torch.uint8).fill_(1)  # touch every page
    target = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    return Candidate("floor", lambda: target.copy_(source), check=False)


def candidates(spec: Spec, probe: DeferProbe) -> list[Candidate]:
    shared = spec.make_inputs()
    builders = {
        "strict": lambda: strict_candidate(spec, shared),
        "defer": lambda: defer_candidate(spec, shared, probe),
        "deferred": lambda: deferred_candidate(spec, shared, probe),
        "jax": lambda: jax_candidate(spec, shared),
        "compile": lambda: compile_candidate(spec, shared),
        "floor": lambda: floor_candidate(spec, shared),
    }
    return [Candidate(column, None, unavailable=spec.left_out[column])
            if column in spec.left_out else builders[column]() for column in spec.columns]


def run_spec(spec: Spec, budget: Budget, probe: DeferProbe, verbose: bool = False) -> Result:
    def on_first_call(name: str) -> None:
        if name == "defer" or name == "deferred" and probe.calls == 0:
            probe.reset()

    timings = compare(candidates(spec, probe), budget, rtol=spec.rtol, atol=spec.atol,
                      on_first_call=on_first_call, verbose=verbose)
    result = Result(spec.name, spec.size, timings)
    first_calls = {name: t.first_ms for name, t in timings.items() if t.first_ms is not None}
    result.notes["first_call_ms"] = first_calls
    if "defer" in timings and probe.calls:
        result.notes["defer_stats"] = probe.per_call()
    if spec.ops_per_call:
        result.notes["us_per_op"] = {name: t.median_ms * 1e3 / spec.ops_per_call
                                     for name, t in timings.items() if t.median_ms is not None}
    torch._dynamo.reset()  # drop this workload's compiled code before the next one
    return result


# --------------------------------------------------------------------------------------------
# The catalogue.

def gelu_spec(log2_size: int) -> Spec:
    def make_inputs():
        return (_randn(_generator(), 1 << log2_size),)
    return Spec("gelu-tanh", f"2^{log2_size}", gelu_tanh, make_inputs, gelu_tanh_jax)


def layer_norm_spec() -> Spec:
    def make_inputs():
        g = _generator()
        return (_randn(g, 4096, 1024), 1 + _randn(g, 1024, scale=0.1), _randn(g, 1024, scale=0.1))
    return Spec("layernorm", "4096x1024", layer_norm, make_inputs, layer_norm_jax,
                rtol=1e-4, atol=1e-4)


def layer_norm_block_spec() -> Spec:
    def make_inputs():
        g = _generator()
        return (_randn(g, 512, 2048), 1 + _randn(g, 2048, scale=0.1), _randn(g, 2048, scale=0.1))
    return Spec("layernorm-gelu-residual", "512x2048", layer_norm_block, make_inputs,
                layer_norm_block_jax, rtol=1e-4, atol=1e-4)


def softmax_spec() -> Spec:
    def make_inputs():
        return (_randn(_generator(), 4096, 1024),)
    return Spec("softmax", "4096x1024", softmax, make_inputs, softmax_jax, atol=1e-6)


def mlp_spec() -> Spec:
    batch, d, hidden = 512, 512, 1376

    def make_inputs():
        g = _generator()
        return (_randn(g, batch, d), 1 + _randn(g, d, scale=0.1),
                _randn(g, d, hidden, scale=d ** -0.5), _randn(g, d, hidden, scale=d ** -0.5),
                _randn(g, hidden, d, scale=hidden ** -0.5))
    return Spec("rmsnorm-swiglu", f"{batch}x{d}->{hidden}", rmsnorm_swiglu, make_inputs,
                rmsnorm_swiglu_jax, rtol=1e-3, atol=1e-3)


def attention_spec() -> Spec:
    batch, heads, seq, head_dim = 4, 8, 256, 64

    def make_inputs():
        g = _generator()
        return tuple(_randn(g, batch, heads, seq, head_dim) for _ in range(3))
    return Spec("attention", f"b{batch} h{heads} s{seq} d{head_dim}", causal_attention,
                make_inputs, causal_attention_jax, rtol=1e-3, atol=1e-4)


def adamw_spec(count: int = 50, advance_step: bool = False) -> Spec:
    shape = (64, 1024)

    def make_inputs():
        g = _generator()
        params = [_randn(g, *shape) for _ in range(count)]
        grads = [_randn(g, *shape, scale=1e-2) for _ in range(count)]
        exp_avgs = [_randn(g, *shape, scale=1e-3) for _ in range(count)]
        exp_avg_sqs = [_randn(g, *shape, scale=1e-3).abs() for _ in range(count)]
        return (params, grads, exp_avgs, exp_avg_sqs, StepCounter(10, advance_step))
    left_out = {}
    if advance_step:
        # Dynamo guards on the Python int step, so every call recompiles (about 10 s each on
        # 2 cores): too slow to time here, and not what torch.compile users do (they keep the
        # step in a tensor).
        left_out["compile"] = "left out: recompiles on every new Python-int step"
    name = "adamw-stepping" if advance_step else "adamw"
    return Spec(name, f"{count}x64x1024", adamw_step, make_inputs,
                jax_runner=adamw_jax_runner, mutates_inputs=True, rtol=1e-4, atol=1e-6,
                left_out=left_out)


def per_op_spec() -> Spec:
    def make_inputs():
        return (_randn(_generator(), 64, 64),)
    return Spec("per-op", "200 ops 64x64", chained_ops, make_inputs,
                columns=("strict", "defer", "deferred"), ops_per_call=200)


GELU_SIZES_FULL = (10, 14, 16, 18, 20, 22, 24)
GELU_SIZES_QUICK = (14, 22)


def all_specs(quick: bool) -> list[Spec]:
    sizes = GELU_SIZES_QUICK if quick else GELU_SIZES_FULL
    return ([gelu_spec(s) for s in sizes]
            + [layer_norm_spec(), layer_norm_block_spec(), softmax_spec(), mlp_spec(), attention_spec(), adamw_spec(),
               adamw_spec(advance_step=True), per_op_spec()])


# --------------------------------------------------------------------------------------------
# Cold start: a fresh interpreter, imports, one GELU on 2^20 floats, one printed number.

_COLD_SCRIPT = """
import json, math, time
start = time.perf_counter()
import torch
{import_line}
imported = time.perf_counter()
x = torch.linspace(-3.0, 3.0, 1 << 20)
{block_line}
    y = x * 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
total = float(y.sum())
done = time.perf_counter()
report = {{"result": total, "import_ms": (imported - start) * 1e3,
          "compute_ms": (done - imported) * 1e3}}
{stats_line}
print(json.dumps(report), flush=True)
"""


def _cold_script(defer: bool) -> str:
    if defer:
        return _COLD_SCRIPT.format(
            import_line="import deferfuse", block_line="with deferfuse.defer():",
            stats_line="report['stats'] = {k: v for k, v in deferfuse.stats().items() "
                       "if isinstance(v, int) and v}")
    return _COLD_SCRIPT.format(import_line="", block_line="if True:", stats_line="")


@dataclasses.dataclass
class ColdRun:
    first_result_ms: float  # from launching the interpreter to reading its printed result
    report: dict[str, Any]
    exit_problem: str = ""  # the process misbehaved after printing its result


def _cold_run(defer: bool, cache_dir: str | None, **settings: str) -> ColdRun:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if cache_dir is not None:
        env["DEFERFUSE_CACHE_DIR"] = cache_dir
    env.update({"DEFERFUSE_" + name.upper(): value for name, value in settings.items()})
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-c", _cold_script(defer)], cwd=REPO_ROOT,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    line = process.stdout.readline()  # the script prints exactly one line, its result
    first_result_ms = (time.perf_counter() - start) * 1e3
    try:
        rest, stderr = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        process.kill()
        rest, stderr = process.communicate()
    last_error = (stderr.strip().splitlines() or ["(no stderr)"])[-1][:200]
    if not line.strip():
        raise RuntimeError(f"exit {process.returncode} with no result: {last_error}")
    problem = f"exit {process.returncode} after the result: {last_error}" \
        if process.returncode != 0 else ""
    return ColdRun(first_result_ms, json.loads(line), problem)


def _byte_compile(module: Any) -> None:
    """Write the bytecode of ``module``'s package, as ``pip install`` does for an installed
    package (torch's is written at its install).  An editable install under
    PYTHONDONTWRITEBYTECODE=1 would otherwise compile deferfuse's sources in every fresh
    process (~0.15 s here), a cost no installed copy has."""
    import compileall

    package = Path(module.__file__).parent
    compileall.compile_dir(str(package), quiet=1)


def run_cold_start(repeats: int, probe: DeferProbe) -> list[Result]:
    """Time to first result in a fresh process, strict vs defer, interleaved; defer both with
    an empty executable cache and with the one an earlier process left on disk."""
    import tempfile

    if probe.module is not None:
        _byte_compile(probe.module)

    variants = {"empty cache": "defer-empty", "warm disk cache": "defer-warm"}
    timings = {name: Timing(name, "ok") for name in ("strict", *variants.values())}
    if probe.module is None:
        for name in variants.values():
            timings[name] = Timing(name, "unavailable", probe.unavailable or "")
    reports: dict[str, list[dict]] = {name: [] for name in timings}
    with tempfile.TemporaryDirectory(prefix="deferfuse-bench-") as scratch:
        warm_dir = os.path.join(scratch, "warm")
        if probe.module is not None:
            # Untimed: fills the warm cache.  It compiles at first sight and in the foreground,
            # so the executable is on disk before the process ends.
            try:
                priming = _cold_run(True, warm_dir, background_compile="0",
                                    eager_first_runs="0")
                if not priming.report.get("stats", {}).get("disk_cache_writes"):
                    timings["defer-warm"].warning = (
                        "the priming process wrote nothing to the disk cache: "
                        f"{priming.report.get('stats')}")
            except Exception as exc:
                timings["defer-warm"] = Timing("defer-warm", "failed", short_reason(exc))
        for repeat in range(repeats):
            for name, timing in timings.items():
                if timing.status != "ok":
                    continue
                cache_dir = {"defer-empty": os.path.join(scratch, f"empty-{repeat}"),
                             "defer-warm": warm_dir}.get(name)
                try:
                    run = _cold_run(name != "strict", cache_dir)
                except Exception as exc:
                    timing.status, timing.reason = "failed", short_reason(exc)
                    continue
                timing.samples_ms.append(run.first_result_ms)
                reports[name].append(run.report)
                if run.exit_problem and run.exit_problem not in timing.warning:
                    timing.warning = "; ".join(filter(None, (timing.warning, run.exit_problem)))

    results = []
    strict_sums = {r["result"] for r in reports["strict"]}
    for label, name in variants.items():
        defer = dataclasses.replace(timings[name], name="defer")
        for report in reports[name]:
            if strict_sums and not math.isclose(next(iter(strict_sums)), report["result"],
                                                rel_tol=1e-4, abs_tol=1e-2):
                defer.status = "mismatch"
                defer.reason = f"sum {report['result']} vs strict {next(iter(strict_sums))}"
        result = Result("cold-start", f"new process, {label}",
                        {"strict": timings["strict"], "defer": defer})
        for key, runs in (("strict", reports["strict"]), ("defer", reports[name])):
            if runs:
                result.notes[f"{key}_import_ms"] = min(r["import_ms"] for r in runs)
                result.notes[f"{key}_compute_ms"] = min(r["compute_ms"] for r in runs)
        if reports[name]:
            result.notes["defer_process_stats"] = reports[name][-1].get("stats", {})
        results.append(result)
    return results
