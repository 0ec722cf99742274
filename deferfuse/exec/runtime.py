"""Run a pending subgraph: as one jitted XLA computation, or eagerly op by op.

The executable cache is keyed by a structural signature of the subgraph: for each node its
structural key (op, input metadata, static arguments) and which earlier values it reads, the
metadata of the graph inputs, and which values leave the computation.  Runtime scalars (Python
floats given to ``Scalar`` parameters) are passed in, so they never change the key.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import logging
import queue
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from .. import config, processes
from ..errors import LoweringError
from ..ir import graph
from ..ir.graph import Node, Value
from ..lower import dtypes as dtypes_
from ..lower.registry import CHECK_COLLECTORS as _CHECK_COLLECTORS, CheckCollector, RuntimeScalar
from ..lower.views import internal_rule
from ..plan import cost
from ..stats import STATS
from . import backend, diskcache, interop
from .._lazy import lazy_import

jax = lazy_import("jax", globals(), "jax")
jnp = lazy_import("jax.numpy", globals(), "jnp")
lax = lazy_import("jax.lax", globals(), "lax")

log = logging.getLogger("deferfuse")


class _Ref:
    """A reference, inside a program template, to a value (by local id) or a runtime scalar."""

    __slots__ = ("kind", "index")

    def __init__(self, kind: str, index: int) -> None:
        self.kind = kind
        self.index = index


class Step:
    """One node of a Program.  ``ordered_by``: the index of the argument through which the step
    runs after the previous ordered step (``order_compute``), or None."""

    __slots__ = ("rule", "ctx", "args", "kwargs", "outs", "out_metas", "source", "op", "ordered_by")

    def __init__(self, rule, ctx, args, kwargs, outs, out_metas, source, op, ordered_by=None) -> None:
        self.rule, self.ctx, self.args, self.kwargs = rule, ctx, args, kwargs
        self.outs, self.out_metas, self.source, self.op = outs, out_metas, source, op
        self.ordered_by = ordered_by


_aten = torch.ops.aten
# XLA's algebraic simplifier rewrites some compositions as if floats could not overflow:
# log(exp(a)) -> a, pow(exp(a), y) -> exp(a * y) and sqrt(a * a) -> |a| (exp(100.0) is inf in
# float32, so torch's log of it is inf, not 100; exp(inf) ** 0 is 1, exp(inf * 0) nan).  Where a consumer of these kinds reads a producer of these kinds, the value
# passes through an optimization barrier, which the simplifier cannot see through (the producer
# is then materialized instead of fused, only on such edges).
_LOG_OPS = frozenset({_aten.log.default, _aten.log2.default, _aten.log10.default})
_SQRT_OPS = frozenset({_aten.sqrt.default, _aten.rsqrt.default})
_POW_OPS = frozenset({_aten.pow.Tensor_Tensor, _aten.pow.Tensor_Scalar})


def _unsafe_rewrite(consumer: Any, producer: Optional["Step"]) -> bool:
    """Whether XLA would rewrite ``consumer(producer(...))`` unsafely (see above)."""
    if producer is None:
        return False
    if consumer in _LOG_OPS or consumer in _POW_OPS:
        return producer.op is _aten.exp.default
    if consumer in _SQRT_OPS:
        # a * a with both operands the same value (x ** 2 is computed otherwise: pow lowering)
        return producer.op is _aten.mul.Tensor and len(producer.args) == 2 \
            and isinstance(producer.args[0], _Ref) and isinstance(producer.args[1], _Ref) \
            and producer.args[0].kind == producer.args[1].kind == "v" \
            and producer.args[0].index == producer.args[1].index
    return False


class Program:
    """A subgraph with value identities replaced by local ids: what gets compiled."""

    def __init__(self, n_inputs: int, steps: list[Step], outputs: tuple[int, ...]) -> None:
        self.n_inputs = n_inputs
        self.steps = steps
        self.outputs = outputs
        # (step index, error type, message) of each runtime check, filled while tracing
        self.checks: list[tuple[int, type, str]] = []

    def __call__(self, inputs: Sequence[jax.Array], scalars: jax.Array) -> tuple[list[jax.Array], jax.Array, jax.Array]:
        env: list[Any] = list(inputs)
        producers: list[Optional[Step]] = [None] * len(env)   # the step that made each value
        flags: list[Any] = []
        values: list[Any] = []
        self.checks = []
        consumer: Any = None
        last_ordered: Any = None   # the result of the latest ordered step

        def resolve(a: Any) -> Any:
            if isinstance(a, _Ref):
                if a.kind != "v":
                    return scalars[a.index]
                if _unsafe_rewrite(consumer, producers[a.index]):
                    return lax.optimization_barrier(env[a.index])
                return env[a.index]
            if type(a) in (list, tuple):
                return type(a)(resolve(x) for x in a)
            return a

        for position, step in enumerate(self.steps):
            consumer = step.op
            collector = CheckCollector(step.op)
            _CHECK_COLLECTORS.append(collector)
            try:
                args = resolve(step.args)
                if step.ordered_by is not None and last_ordered is not None:
                    args = _ordered_after(args, step.ordered_by, last_ordered)
                out = step.rule(step.ctx, *args, **{k: resolve(v) for k, v in step.kwargs.items()})
            except Exception as exc:
                raise LoweringError(f"lowering {step.op} failed{_at(step.source)}: {type(exc).__name__}: {exc}") from exc
            finally:
                _CHECK_COLLECTORS.pop()
            for flag, error, message, value in collector.items:
                flags.append(flag)
                values.append(jnp.int64(0) if value is None else value)
                self.checks.append((position, error, message))
            outs = out if isinstance(out, (tuple, list)) else (out,)
            if step.ordered_by is not None:
                last_ordered = outs[0]
            for local_id, meta, arr in zip(step.outs, step.out_metas, outs):
                arr = jnp.asarray(arr)
                want = dtypes_.to_jax(meta.dtype)
                if arr.dtype != want:
                    arr = dtypes_.cast(arr, want)
                if tuple(arr.shape) != meta.shape:
                    raise LoweringError(f"lowering {step.op} gave shape {tuple(arr.shape)}, torch gives "
                                        f"{meta.shape}{_at(step.source)}")
                env.append(arr)
                producers.append(step)
                assert len(env) - 1 == local_id
        outputs = [env[i] for i in self.outputs]
        if not flags:
            # (no check: no empty flag arrays either, each an output buffer on every call)
            return outputs, None, None
        return outputs, jnp.stack(flags), jnp.stack(values)


# XLA's CPU dot (YNNPACK) reads its left-hand side row by row: a transposed one (x.t() @ g, every
# weight gradient) went to a slower Eigen kernel, at about half the speed (python -m bench.dots,
# transposed lhs), and XLA's runtime started independent products (a layer's weight and input
# gradients) together, each spread over every core already.  An optimization barrier grouping a
# product's left-hand operand with the previous product's result makes XLA materialize the
# operand row-major and ties the products in record order.  XLA drops the barrier once it has
# optimized, so its runtime may still overlap two products; measured on the GPT step, the tie
# beat materializing the operand alone (docs/performance.md, training).
def _ordered_after(args: tuple, index: int, previous: Any) -> tuple:
    """``args`` with ``args[index]`` available only once ``previous`` is computed."""
    operand, _ = lax.optimization_barrier((args[index], previous))
    return args[:index] + (operand,) + args[index + 1:]


def _at(source: Any) -> str:
    return f" (recorded at {source})" if source else ""


class _Compiled:
    __slots__ = ("executable", "n_scalars", "checks", "lowered", "signature", "relower")

    def __init__(self, executable: Any, n_scalars: int, checks: list[tuple[int, type, str]],
                 lowered: Any = None) -> None:
        self.executable = executable
        self.lowered = lowered
        self.n_scalars = n_scalars
        self.checks = checks
        # the key it is stored under: later lookups with it match by identity, where an equal
        # new Signature compares its whole key (about 1 ms for a 500-op AdamW step)
        self.signature: Any = None
        # for an executable loaded from the disk cache: lowers its program again, on demand
        # (stablehlo()), so the StableHLO text is there without keeping the graph alive
        self.relower: Optional[Callable[[], Any]] = None


# Executables by signature, least recently used first.  Bounded twice: by count
# (executable_cache_size), and by the memory mappings their JIT-compiled code holds.  Linux caps
# a process's mappings (vm.max_map_count, 65530 by default); past it LLVM cannot map the code of
# the next compile ("LLVM compilation error: Cannot allocate memory") and the process dies of
# SIGSEGV.  A small program's executable holds ~7 mappings, but a model's many more: a Llama
# training step's ~1,450, each generate() decoding step's ~200 (one per fused kernel, about), so
# the zoo bench (bench/zoo.py) crashed after nine models with fewer than 512 executables.  When
# the process holds more than MAPPING_SHARE of its limit after a store, the oldest executables go,
# a quarter of the cache at a time, until it holds less.  An evicted signature that comes back is
# loaded from the disk cache, or compiled again.
_EXECUTABLES: "collections.OrderedDict[Any, _Compiled]" = collections.OrderedDict()
MAPPING_SHARE = 0.5


def _store(sig: Any, compiled: _Compiled) -> None:
    _EXECUTABLES[sig] = compiled
    limit = config.get("executable_cache_size")
    while limit > 0 and len(_EXECUTABLES) > limit:
        _evict_oldest()
    budget = _mapping_budget()
    while budget is not None and len(_EXECUTABLES) > 1 and _mappings_in_use() > budget:
        for _ in range(max(1, len(_EXECUTABLES) // 4)):
            _evict_oldest()


def _evict_oldest() -> None:
    evicted, _ = _EXECUTABLES.popitem(last=False)
    for per_signature in (_CHOICE, _EAGER_SECONDS, _XLA_SECONDS, _EAGER_RUNS):
        per_signature.pop(evicted, None)
    STATS.executables_evicted += 1


def max_map_count() -> Optional[int]:
    """The kernel's cap on this process's memory mappings (None where there is no such file)."""
    try:
        with open("/proc/sys/vm/max_map_count", "rb") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _mapping_budget() -> Optional[int]:
    limit = max_map_count()
    return None if limit is None else int(limit * MAPPING_SHARE)


def _mappings_in_use() -> int:
    """This process's memory mappings now (a line each in /proc/self/maps; ~1 ms for 16,000)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def _bounded(per_signature: dict) -> dict:
    """``per_signature``, emptied once it holds many times the executable cache's size of
    entries (signatures that ran eagerly and never compiled: forgetting one costs it another
    eager run or measurement)."""
    if len(per_signature) > 8 * max(config.get("executable_cache_size"), 64):
        per_signature.clear()
    return per_signature


def _x64():
    return jax.enable_x64(True)


def _template(a: Any, index: dict[int, int], leaves: list[Value], scalars: list[float]) -> tuple[Any, Any]:
    """(template for the program, structural key) of one argument."""
    if isinstance(a, Value):
        local = index.get(id(a))
        if local is None:
            # a value computed earlier (or a graph input): it enters as an input
            local = len(leaves)
            index[id(a)] = local
            leaves.append(a)
        return _Ref("v", local), ("v", local)
    if isinstance(a, RuntimeScalar):
        scalars.append(a.value)
        return _Ref("s", len(scalars) - 1), "s"
    if type(a) in (list, tuple):
        parts = [_template(x, index, leaves, scalars) for x in a]
        return type(a)(p[0] for p in parts), tuple(p[1] for p in parts)
    return a, a


class Signature:
    """A subgraph's structural signature, hashed once: it keys several caches per flush, and
    hashing the tuple again would hash every op in it each time (OpOverload's hash is Python)."""

    __slots__ = ("key", "_hash")

    def __init__(self, key: tuple) -> None:
        self.key = key
        self._hash = hash(key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, Signature) and self._hash == other._hash
                                 and self.key == other.key)

    def __repr__(self) -> str:
        # (the disk cache keys by this text)
        return repr(self.key)


def build(nodes: list[Node], outputs: list[Value]):
    """Signature, program-building closure, graph inputs and runtime scalars of a subgraph.

    This is the hot path of a cache hit, so it reads only each node's precomputed key, inputs
    and scalars; the argument templates of the program are built only when it is compiled.
    Graph inputs are numbered first (in order of first use) so the program sees them as
    env[0..n); node outputs follow.
    """
    leaves: list[Value] = []
    scalars: list[float] = []
    index: dict[int, int] = {}
    in_set = {n.id for n in nodes}
    for node in nodes:
        for v in node.inputs:
            if v.node.id not in in_set and id(v) not in index:
                index[id(v)] = len(leaves)
                leaves.append(v)
    n_inputs = next_id = len(leaves)
    entries: list[Any] = []
    first_out: list[int] = []   # per node, the env slot of its first output
    slot_of = index.__getitem__
    for node in nodes:
        entries.append((node.key, tuple(map(slot_of, map(id, node.inputs)))))
        if node.scalars:
            scalars.extend(node.scalars)
        first_out.append(next_id)
        for ref in node.out_refs:
            v = ref()
            if v is not None:
                index[id(v)] = next_id
            next_id += 1
    out_ids = tuple(index[id(v)] for v in outputs)
    sig = Signature((tuple((v.meta.shape, v.meta.dtype) for v in leaves), tuple(entries), out_ids, config.compile_key()))

    def make_program() -> Program:
        steps = []
        scalar_list: list[float] = []
        ordering = config.get("order_compute") and jax.default_backend() == "cpu"
        for node, first in zip(nodes, first_out):
            args_t, _ = _template(node.args, index, leaves, scalar_list)
            kwargs_t = {k: _template(v, index, leaves, scalar_list)[0] for k, v in node.kwargs.items()}
            if isinstance(node.op, graph.InternalOp):
                rule, ctx = internal_rule(node.op), None
            else:
                rule, ctx = node.lowering.lowering.rule, node.lowering.ctx
            outs = tuple(range(first, first + len(node.out_metas)))
            ordered_by = cost.ordering_operand(node) if ordering else None
            steps.append(Step(rule, ctx, args_t, kwargs_t, outs, node.out_metas, node.source, node.op,
                              ordered_by))
        assert len(leaves) == n_inputs and scalar_list == scalars, "argument templates disagree with the signature"
        return Program(n_inputs, steps, out_ids)

    return sig, make_program, leaves, scalars


def _lower(program: Program, leaf_avals: tuple, n_scalars: int) -> Any:
    backend.prepare()
    avals = [jax.ShapeDtypeStruct(shape, dtypes_.to_jax(dtype)) for shape, dtype in leaf_avals]
    scalar_aval = jax.ShapeDtypeStruct((n_scalars,), jnp.float64)
    with _x64():
        return jax.jit(lambda ins, sc: program(ins, sc)).lower(avals, scalar_aval)


def _compile(program: Program, leaf_avals: tuple, n_scalars: int) -> _Compiled:
    with profile_range("deferfuse.compile"):
        lowered = _lower(program, leaf_avals, n_scalars)
        with _x64():
            executable = lowered.compile()
    STATS.compiles += 1
    return _Compiled(executable, n_scalars, list(program.checks), lowered)


_NO_RANGE = contextlib.nullcontext()


def profile_range(name: str):
    """A torch.profiler range named ``name`` while a profiler runs; otherwise nothing (a
    record_function costs ~11 us even with no profiler, twice per flush)."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return _NO_RANGE


def stablehlo_text(signature: Any) -> str:
    compiled = _EXECUTABLES.get(signature)
    if compiled is None:
        raise ValueError("that computation is no longer in the executable cache")
    if compiled.lowered is None and compiled.relower is not None:
        compiled.lowered = compiled.relower()
    return compiled.lowered.as_text()


_SEEN: dict[Any, int] = {}            # signature -> eager runs so far, while not compiled
_COMPILING: set[Any] = set()          # signatures queued for background compilation
_QUEUE: "queue.Queue[tuple]" = queue.Queue()
_WORKER: Optional[threading.Thread] = None
_COMPILED_ONE = threading.Condition()   # notified whenever the worker finishes a signature


def _compile_and_store(sig: Any, program: Program, avals: tuple, n_scalars: int) -> _Compiled:
    compiled = _compile(program, avals, n_scalars)
    compiled.signature = sig
    _store(sig, compiled)
    diskcache.save(sig, compiled.executable, n_scalars, compiled.checks)
    return compiled


def _background_worker() -> None:
    while True:
        item = _QUEUE.get()
        if item is None:
            return
        sig, program, avals, n_scalars, settings = item
        try:
            with config.override(**settings):
                _compile_and_store(sig, program, avals, n_scalars)
            STATS.background_compiles += 1
        except Exception as exc:  # noqa: BLE001 - the eager path keeps working
            log.warning("deferfuse: background compilation failed; this graph keeps running eagerly: %s", exc)
        finally:
            with _COMPILED_ONE:
                _COMPILING.discard(sig)
                _COMPILED_ONE.notify_all()


def compiles_pending() -> bool:
    """Whether the background thread has signatures queued or compiling."""
    return bool(_COMPILING)


def wait_for_compiles(timeout: Optional[float] = None) -> bool:
    """Wait until the background thread has compiled (or failed to compile) every signature
    queued so far, so that the next run of each runs compiled: a test then knows at which call
    a graph first runs compiled, whatever this machine's load.  False if ``timeout`` seconds
    passed first."""
    with _COMPILED_ONE:
        return _COMPILED_ONE.wait_for(
            lambda: not _COMPILING or _WORKER is None or not _WORKER.is_alive(), timeout)


def _schedule(sig: Any, make_program, avals: tuple, n_scalars: int) -> None:
    global _WORKER
    if sig in _COMPILING:
        return
    _COMPILING.add(sig)
    if _WORKER is None or not _WORKER.is_alive():
        _WORKER = threading.Thread(target=_background_worker, name="deferfuse-compile", daemon=True)
        _WORKER.start()
        atexit.register(_stop_worker)
    # The program is built here: the graph it reads is released once this flush is done.  The
    # settings go with it: config.override holds for one thread, and the compile, the executable
    # cache and the disk cache must follow the block's (its cache_dir, say), not the process's.
    settings = {name: config.get(name) for name in config.settings()}
    _QUEUE.put((sig, make_program(), avals, n_scalars, settings))


def _stop_worker() -> None:
    """At exit: drop queued compiles and let the current one finish (killing a thread inside
    XLA's compiler aborts the process)."""
    worker = _WORKER
    if worker is None or not worker.is_alive():
        return
    try:
        while True:
            _QUEUE.get_nowait()
    except queue.Empty:
        pass
    _QUEUE.put(None)
    worker.join()


def after_fork_in_child() -> None:
    """In a forked child: the compile thread did not survive the fork, and it may have held
    the queue's lock; queued compiles are forgotten (deferfuse/processes.py).  The executables
    stay: dropping them would run XLA's destructors here."""
    global _QUEUE, _WORKER, _COMPILED_ONE
    _QUEUE = queue.Queue()
    _WORKER = None
    _COMPILED_ONE = threading.Condition()
    _COMPILING.clear()


def _avals(leaves: list[Value]) -> tuple:
    return tuple((v.meta.shape, v.meta.dtype) for v in leaves)


def lookup(sig: Any, make_program, leaves: list[Value], n_scalars: int) -> Optional[_Compiled]:
    """The executable for ``sig``, or None when this run should replay eagerly instead
    (tiered execution: a new signature runs eagerly while it compiles)."""
    compiled = _EXECUTABLES.get(sig)
    if compiled is not None:
        STATS.cache_hits += 1
        _EXECUTABLES.move_to_end(sig)
        return compiled
    eager_tier = not config.get("always_compile")
    runs = _SEEN.get(sig, 0)
    first_runs = config.get("eager_first_runs")
    if eager_tier and runs < first_runs:
        # a graph seen once may never come back (a one-off script): no compile yet, and no
        # disk cache either (loading an executable means importing JAX, about a second)
        STATS.cache_misses += 1
        _bounded(_SEEN)[sig] = runs + 1
        return None
    backend.prepare()   # (before JAX's backend is first used: loading, compiling)
    loaded = diskcache.load(sig)
    if loaded is not None:
        compiled = _Compiled(*loaded)
        compiled.signature = sig
        compiled.relower = functools.partial(_lower, make_program(), _avals(leaves), n_scalars)
        _store(sig, compiled)
        return compiled
    STATS.cache_misses += 1
    if eager_tier:
        if config.get("background_compile") and first_runs > 0:
            # it came back: compile it off the critical path, keep running eagerly meanwhile
            _schedule(sig, make_program, _avals(leaves), n_scalars)
            _SEEN[sig] = runs + 1
            return None
    _SEEN.pop(sig, None)
    return _compile_and_store(sig, make_program(), _avals(leaves), n_scalars)


def execute_xla(nodes: list[Node], outputs: list[Value], group_record: Any = None) -> Optional[list[torch.Tensor]]:
    """Run the subgraph as one XLA computation; None if it should run eagerly this time."""
    sig, make_program, leaves, scalars = build(nodes, outputs)
    if group_record is not None:
        group_record.signature = sig
    compiled = lookup(sig, make_program, leaves, len(scalars))
    if compiled is None:
        return None
    sig = compiled.signature
    if group_record is not None:
        group_record.signature = sig
    if _CHOICE.get(sig) is _EAGER_IS_FASTER:
        return None
    started = time.perf_counter()
    with _x64(), profile_range("deferfuse.execute"):
        inputs = [interop.to_jax(v.result) for v in leaves]
        results, failed, details = compiled.executable(inputs, np.asarray(scalars, dtype=np.float64))
        # DLPack export does not wait for the computation: torch must not see unfinished buffers
        jax.block_until_ready(results)
    STATS.executions += 1
    if compiled.checks:
        _raise_failed_checks(np.asarray(failed), np.asarray(details), compiled.checks, nodes)
    out = [interop.to_torch(r) for r in results]
    _observe_xla_time(sig, time.perf_counter() - started)
    return out


# Engine choice per signature: XLA's fused code is usually faster, but for some graphs torch's
# hand-written kernels win (a lone softmax or layer norm on a CPU).  The eager runs of the first
# tier and the first XLA runs are timed; if eager was clearly faster, the signature stays eager.
# Timings taken while the machine was busy can mislead, so a signature kept eager is measured
# again every _RECHECK_EAGER runs: its latest eager time against fresh XLA runs.
_EAGER_IS_FASTER = object()
_EAGER_SECONDS: dict[Any, float] = {}
_XLA_SECONDS: dict[Any, list[float]] = {}
_CHOICE: dict[Any, object] = {}
_EAGER_RUNS: dict[Any, int] = {}
_XLA_SAMPLES = 3
_RECHECK_EAGER = 128


def observe_chosen_eager_time(sig: Any, seconds: float) -> None:
    """A run of a signature kept eager: every _RECHECK_EAGER runs, give XLA another hearing."""
    runs = _EAGER_RUNS.get(sig, 0) + 1
    if runs < _RECHECK_EAGER:
        _EAGER_RUNS[sig] = runs
        return
    _EAGER_RUNS.pop(sig, None)
    _EAGER_SECONDS[sig] = seconds
    _CHOICE.pop(sig, None)


def observe_eager_time(sig: Any, seconds: float) -> None:
    if sig is not None:
        _bounded(_EAGER_SECONDS)[sig] = min(seconds, _EAGER_SECONDS.get(sig, seconds))


def _observe_xla_time(sig: Any, seconds: float) -> None:
    if sig in _CHOICE or sig not in _EAGER_SECONDS or not config.get("autotune_engine") \
            or config.get("always_compile"):
        return
    samples = _XLA_SECONDS.setdefault(sig, [])
    samples.append(seconds)
    if len(samples) < _XLA_SAMPLES:
        return
    if min(samples) > 1.1 * _EAGER_SECONDS[sig]:
        _CHOICE[sig] = _EAGER_IS_FASTER
        STATS.eager_chosen += 1
        log.info("deferfuse: torch's kernels ran a graph faster than XLA (%.3f ms vs %.3f ms); "
                 "it will run eagerly", _EAGER_SECONDS[sig] * 1e3, min(samples) * 1e3)
    else:
        _CHOICE[sig] = None
    del _XLA_SECONDS[sig]


def _raise_failed_checks(failed: np.ndarray, details: np.ndarray, checks: list[tuple[int, type, str]],
                         nodes: list[Node]) -> None:
    for flag, value, (position, error, message) in zip(failed, details, checks):
        if flag:
            raise error(f"{message.replace('{value}', str(int(value)))}{_at(nodes[position].source)}")


def _naming_source(exc: Exception, source: Any) -> Exception:
    """``exc``, raised by torch's kernel while a flush replays an op, naming the line that
    recorded the op as a compiled run's checks do (the error surfaces at the flush, not on that
    line).  The same type with the longer message, or where the type takes other arguments,
    ``exc`` itself with the line as a note."""
    if not source:
        return exc
    try:
        named = type(exc)(f"{exc}{_at(source)}")
    except Exception:  # noqa: BLE001 - an exception type with its own constructor
        named = None
    if type(named) is not type(exc) or str(named) != f"{exc}{_at(source)}":
        exc.add_note(f"recorded at {source}")
        return exc
    named.__traceback__ = exc.__traceback__
    return named


def _eager_args(a: Any) -> Any:
    if isinstance(a, Value):
        return a.result
    if isinstance(a, RuntimeScalar):
        return a.value
    if type(a) in (list, tuple):
        return type(a)(_eager_args(x) for x in a)
    return a


def _eager_internal(node: Node, args: tuple) -> torch.Tensor:
    op = node.op
    if op is graph.READ_VIEW:
        flat, meta = args
        # a view of the flat contents: fine for the ops that read it next (outputs are
        # cloned by execute_eager, so no result aliases memory a write-back may change)
        return torch.as_strided(flat, meta.shape, meta.stride, meta.offset)
    if op is graph.WRITE_VIEW:
        flat, value, meta = args
        out = flat.clone()
        torch.as_strided(out, meta.shape, meta.stride, meta.offset).copy_(value)
        return out
    if op is graph.FLATTEN:
        value, meta = args
        out = torch.zeros(meta.storage_numel, dtype=meta.dtype, device=value.device)
        torch.as_strided(out, meta.shape, meta.stride, meta.offset).copy_(value)
        return out
    if op is graph.CAST:
        value, dtype = args
        return value.to(dtype)
    if op is graph.AS_REAL:
        (value,) = args
        return torch.view_as_real(value.resolve_conj()).reshape(-1)
    if op is graph.BITS:
        value, conj, neg = args
        value = value.conj_physical() if conj else value
        return -value if neg else value
    raise AssertionError(f"no eager form for {op}")


def _replay_arg(a: Any, computed: dict[int, torch.Tensor]) -> Any:
    # (a module-level function: a recursive closure is a reference cycle, which kept ``computed``,
    # every intermediate of the replay, alive until Python's cycle collector ran)
    if isinstance(a, Value):
        return a.result if a.result is not None else computed[id(a)]
    if isinstance(a, RuntimeScalar):
        return a.value
    if type(a) in (list, tuple):
        return type(a)(_replay_arg(x, computed) for x in a)
    return a


def execute_eager(nodes: list[Node], outputs: list[Value], count: bool = True) -> list[torch.Tensor]:
    """Replay the subgraph op by op with torch (no compile): for tiny one-off graphs, ops placed
    on torch's kernels, and graphs whose lowering failed."""
    computed: dict[int, torch.Tensor] = {}
    for node in nodes:
        args = _replay_arg(node.args, computed)
        kwargs = {k: _replay_arg(v, computed) for k, v in node.kwargs.items()}
        if isinstance(node.op, graph.InternalOp):
            out = _eager_internal(node, args)
        else:
            try:
                out = node.op(*args, **kwargs)
            except Exception as exc:
                raise _naming_source(exc, node.source) from None
        # a node's Values are its op's tensor outputs only (MetaEntry.tensor_outs): an output
        # torch leaves undefined (None: convolution_backward's grad_input with output_mask
        # False) or that is not a tensor has none, and zipping past it would shift the rest
        outs = [t for t in out if isinstance(t, torch.Tensor)] if isinstance(out, (tuple, list)) else (out,)
        for v, t in zip(node.outputs, outs):
            if v is not None:
                computed[id(v)] = t
    if count:
        STATS.eager_replays += 1
    for v in outputs:
        if v.result is None and v.node.op is graph.READ_VIEW:
            computed[id(v)] = computed[id(v)].clone()
    return [v.result if v.result is not None else computed[id(v)] for v in outputs]


def should_replay_eagerly(nodes: list[Node]) -> bool:
    """Scalar bookkeeping (graphs of tiny tensors) runs eagerly rather than paying a compile."""
    if config.get("always_compile"):
        return False
    limit = config.get("eager_small_flush")
    if limit and len(nodes) <= limit:
        return True
    return all(m.numel <= 1 for n in nodes for m in n.out_metas) and len(nodes) <= 64


def execute(nodes: list[Node], outputs: list[Value], reason: str = "sync",
            trigger: Optional[str] = None) -> list[torch.Tensor]:
    """Compute ``outputs``: plan the subgraph into groups, run each as one computation."""
    from ..plan.partition import Engine, SplitReason, partition
    from .. import observe
    plan = partition(nodes, outputs)
    record = observe.record_plan(plan, reason, trigger, len(outputs))
    for group in plan.groups:
        if group.engine is Engine.TORCH:
            results = execute_eager(group.nodes, group.outputs, count=False)
            record.ran(group, "torch")
            if group.reason is SplitReason.LONE_OP:
                _learn_lone(group.nodes)
        elif should_replay_eagerly(group.nodes) or processes.forked_after_xla():
            # (a child forked after JAX started: its XLA may deadlock; deferfuse/processes.py)
            results = execute_eager(group.nodes, group.outputs)
            record.ran(group, "eager replay")
        else:
            group_record = record.groups[_index_of(record, group)]
            results = _execute_xla_safely(group.nodes, group.outputs, group_record)
            if results is None:
                faster = _CHOICE.get(group_record.signature) is _EAGER_IS_FASTER
                started = time.perf_counter()
                results = execute_eager(group.nodes, group.outputs)
                if faster:
                    observe_chosen_eager_time(group_record.signature, time.perf_counter() - started)
                else:
                    observe_eager_time(group_record.signature, time.perf_counter() - started)
                record.ran(group, "eager (faster than xla)" if faster else "eager (compiling)")
            else:
                record.ran(group, "xla")
        for v, r in zip(group.outputs, results):
            v.result = r
    return [v.result for v in outputs]


def _learn_lone(nodes: list[Node]) -> None:
    """A lone op's flush ran on torch's kernel: at the place that recorded it, the recorder
    may run it at once next time (eager_lone_ops)."""
    if not config.get("eager_lone_ops"):
        return
    from ..capture import meta as meta_
    for node in nodes:
        if isinstance(node.lowering, meta_.MetaEntry) and node.source is not None:
            meta_.mark_lone(node.op, node.source)


def _index_of(record: Any, group: Any) -> int:
    return next(i for i, g in enumerate(record.groups) if g.index == group.index)


def _execute_xla_safely(nodes: list[Node], outputs: list[Value], group_record: Any) -> list[torch.Tensor]:
    if config.get("always_compile"):
        return execute_xla(nodes, outputs, group_record)
    try:
        return execute_xla(nodes, outputs, group_record)
    except LoweringError as exc:
        # A lowering bug must not cost the user a correct result: replay this graph in torch.
        STATS.lowering_failures += 1
        log.warning("deferfuse: XLA lowering failed, running this graph eagerly instead: %s", exc)
        return execute_eager(nodes, outputs)


def clear_cache() -> None:
    """Forget compiled executables held in memory (the disk cache stays)."""
    _EXECUTABLES.clear()
    _SEEN.clear()
    _CHOICE.clear()
    _EAGER_SECONDS.clear()
    _XLA_SECONDS.clear()
    _EAGER_RUNS.clear()
