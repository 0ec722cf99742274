"""The executable cache: compiled programs by signature, in memory, with a background compiler.

``lookup`` answers whether a signature runs compiled this time: from memory, from the disk cache
(``diskcache.py``), or compiled now; under tiered execution a new signature runs eagerly first and
compiles on the background thread when it comes back.  ``clear``, ``size``, ``contains``,
``snapshot``, ``compiles_pending`` and ``wait_for_compiles`` are the state API that tests and
benchmarks use.
"""

from __future__ import annotations

import atexit
import collections
import functools
import logging
import queue
import threading
import time
from typing import Any, Callable, Iterable, Optional

import numpy as np

from .. import config
from ..ir.graph import Value
from ..lower import dtypes as dtypes_
from ..native import hostkernels
from ..stats import STATS
from . import autotune, backend, diskcache
from .profiling import profile_range
from .program import Program, leaf_avals
from .._lazy import lazy_import

jax = lazy_import("jax", globals(), "jax")
jnp = lazy_import("jax.numpy", globals(), "jnp")

log = logging.getLogger("deferfuse")


class Compiled:
    """A compiled program: its executable, how many runtime scalars it takes, and its checks.
    The executable is called ``(inputs, scalars) -> (results, failed, details)``: a JAX
    ``Compiled``, or one loaded from the disk cache (entryformat.LoadedProgram)."""

    __slots__ = ("executable", "n_scalars", "checks", "lowered", "signature", "relower", "nbytes", "origin",
                 "runs", "targets", "hosted", "served", "no_scalars")

    def __init__(self, executable: Any, n_scalars: int, checks: list[tuple[int, type, str]],
                 lowered: Any = None, targets: Iterable[str] = ()) -> None:
        self.executable = executable
        self.targets = tuple(targets)    # the custom-call targets it calls
        # whether the host kernels are among them: its runs are then served (run())
        self.hosted = any(t.startswith(hostkernels.TARGET_PREFIX) for t in self.targets)
        self.served = False   # whether its runs are served (run())
        # an empty scalar vector on the device it runs on, once it has run (run(): putting
        # NumPy's empty vector there costs ~15-20 us a call)
        self.no_scalars: Any = None
        self.lowered = lowered
        self.n_scalars = n_scalars
        self.checks = checks
        # the key it is stored under: later lookups with it match by identity, where an equal
        # new Signature compares its whole key (about 1 ms for a 500-op AdamW step)
        self.signature: Any = None
        # for an executable loaded from the disk cache: lowers its program again, on demand
        # (stablehlo()), so the StableHLO text is there without keeping the graph alive
        self.relower: Optional[Callable[[], Any]] = None
        self.nbytes = KERNEL_BYTES   # its resident size, estimated (_store's byte bound)
        self.origin = "compiled"     # or "disk": loaded from the disk cache
        self.runs = 0                # how many times a flush ran it (exec/runner.py counts)


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
#
# And bounded in bytes (executable_cache_bytes).  What an executable holds resident is mostly
# per kernel, not its code: a GPT-2 training step's executable maps 369 anonymous code regions
# (1.5 MB of code; its serialized form is 0.9 MB) and freeing it returned 47 MB, ~128 KiB a
# kernel.  So an executable's size is taken as its kernels (the code regions its compile or
# load mapped, counted in /proc/self/maps) times KERNEL_BYTES.
_EXECUTABLES: "collections.OrderedDict[Any, Compiled]" = collections.OrderedDict()
MAPPING_SHARE = 0.5
KERNEL_BYTES = 128 << 10
_HELD_BYTES = [0]   # the sizes of the executables in _EXECUTABLES, summed


def _store(sig: Any, compiled: Compiled) -> None:
    old = _EXECUTABLES.pop(sig, None)
    if old is not None:
        _HELD_BYTES[0] -= old.nbytes
    _EXECUTABLES[sig] = compiled
    _HELD_BYTES[0] += compiled.nbytes
    limit = config.get("executable_cache_size")
    while limit > 0 and len(_EXECUTABLES) > limit:
        _evict_oldest()
    bound = config.get("executable_cache_bytes")
    while bound > 0 and len(_EXECUTABLES) > 1 and _HELD_BYTES[0] > bound:
        _evict_oldest()
    budget = _mapping_budget()
    while budget is not None and len(_EXECUTABLES) > 1 and _mappings_in_use() > budget:
        for _ in range(max(1, len(_EXECUTABLES) // 4)):
            _evict_oldest()


def _evict_oldest() -> None:
    evicted, compiled = _EXECUTABLES.popitem(last=False)
    _HELD_BYTES[0] -= compiled.nbytes
    autotune.forget(evicted)
    STATS.executables_evicted += 1


def held_bytes() -> int:
    """The estimated resident size of the executables held in memory (see KERNEL_BYTES)."""
    return _HELD_BYTES[0]


def _code_regions() -> int:
    """Anonymous executable regions mapped in this process (XLA's JIT-compiled kernels)."""
    count = 0
    try:
        with open("/proc/self/maps", "rb") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 5 and parts[1] == b"r-xp":
                    count += 1
    except OSError:
        pass
    return count


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


def x64():
    """JAX with 64-bit types on, as torch's float64 and int64 need, while tracing and running."""
    return jax.enable_x64(True)


def lower_program(program: Program, input_avals: tuple, n_scalars: int) -> Any:
    backend.prepare()
    avals = [jax.ShapeDtypeStruct(shape, dtypes_.to_jax(dtype)) for shape, dtype in input_avals]
    scalar_aval = jax.ShapeDtypeStruct((n_scalars,), jnp.float64)
    with x64():
        # (keep_unused: the executable takes every input, whether read or not, so the disk
        # cache can call it without JAX's record of which it kept: exec/entryformat.py)
        return jax.jit(lambda ins, sc: program(ins, sc), keep_unused=True).lower(avals, scalar_aval)


# Wall seconds spent lowering and compiling, on any thread, and the ops of the programs compiled:
# their ratio estimates a new program's compile time before it is queued (allow_compiles)
_COMPILE_SECONDS = [0.0]
_COMPILED_NODES = [0]
COMPILE_S_PER_NODE = 3e-3   # the estimate before this process compiled enough to measure (a
                            # GPT-2 training step: 1,274 ops in 3.9 s on a 2-core EPYC)


def compile_seconds() -> float:
    """Wall seconds this process has spent lowering and compiling programs (the block tier
    charges a share of them to the places whose deferred runs queued them)."""
    return _COMPILE_SECONDS[0]


def compile_estimate(n_nodes: int) -> float:
    """The seconds compiling a program of ``n_nodes`` ops is expected to take."""
    nodes = _COMPILED_NODES[0]
    rate = _COMPILE_SECONDS[0] / nodes if nodes >= 500 else COMPILE_S_PER_NODE
    return n_nodes * rate


class _Allowance(threading.local):
    seconds: Optional[float] = None


_ALLOWANCE = _Allowance()


def allow_compiles(seconds: Optional[float]) -> None:
    """How many seconds of compiling the flushes of this thread may start from now (None: no
    limit).  The block tier (exec/blocks.py) sets it from its exploration budget before a
    deferred run: a compile that does not fit is put off, and the graph replays eagerly."""
    _ALLOWANCE.seconds = seconds


# the runtime scalars of a program that takes none
NO_SCALARS = np.zeros((0,), dtype=np.float64)


def run(compiled: Compiled, inputs: list, scalars: np.ndarray) -> tuple[list, Any, Any]:
    """Run ``compiled`` on JAX arrays and wait for it: ``(results, failed, details)``.

    A program that calls the host kernels runs served once XLA has called one of them on a
    thread of its own (this thread then runs its kernels on its own OpenMP team while a driver
    thread runs the program: native/hostkernels.served).  A small program, which XLA runs
    thunk after thunk on the calling thread, never needs it, and handing a run to the driver
    and back costs ~70 µs (a 64x64 product and its ReLU: 400 -> 470 µs a block)."""
    empty = not scalars.size

    def call() -> tuple[list, Any, Any]:
        with x64():
            out = compiled.executable(inputs, compiled.no_scalars if empty and compiled.no_scalars is not None
                                      else scalars)
            # (DLPack export does not wait for the computation: torch must not see unfinished buffers)
            jax.block_until_ready(out[0])
            if empty and compiled.no_scalars is None and out[0]:
                compiled.no_scalars = jax.device_put(scalars, out[0][0].sharding)
            return out
    if not compiled.hosted or not config.get("host_kernel_serving"):
        return call()
    if compiled.served:
        return hostkernels.served(call)
    guests = hostkernels.guest_calls()
    out = call()
    if hostkernels.guest_calls() != guests:
        compiled.served = True
    return out


def compile_program(program: Program, input_avals: tuple, n_scalars: int, n_nodes: int = 0) -> Compiled:
    started = time.perf_counter()
    with profile_range("deferfuse.compile"):
        lowered = lower_program(program, input_avals, n_scalars)
        with x64():
            executable = lowered.compile()
    _COMPILE_SECONDS[0] += time.perf_counter() - started
    _COMPILED_NODES[0] += n_nodes
    # (the compiler's working memory, hundreds of MB for a model's step, goes back to the
    # system: malloc_tuning keeps freed memory mapped, for the executions' buffers)
    backend.release_free_memory()
    STATS.compiles += 1
    return Compiled(executable, n_scalars, list(program.checks), lowered,
                    diskcache.custom_call_targets(executable))


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


def _compile_and_store(sig: Any, program: Program, avals: tuple, n_scalars: int, n_nodes: int = 0) -> Compiled:
    regions = _code_regions()
    compiled = compile_program(program, avals, n_scalars, n_nodes)
    compiled.nbytes = max(1, _code_regions() - regions) * KERNEL_BYTES
    compiled.signature = sig
    _store(sig, compiled)
    diskcache.save(sig, compiled.executable, n_scalars, compiled.checks, compiled.targets)
    return compiled


def _background_worker() -> None:
    while True:
        item = _QUEUE.get()
        if item is None:
            return
        sig, program, avals, n_scalars, n_nodes, settings = item
        try:
            with config.override(**settings):
                _compile_and_store(sig, program, avals, n_scalars, n_nodes)
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


def _schedule(sig: Any, make_program, avals: tuple, n_scalars: int, n_nodes: int) -> None:
    global _WORKER
    if sig in _COMPILING:
        return
    _COMPILING.add(sig)
    if _WORKER is None or not _WORKER.is_alive():
        _WORKER = threading.Thread(target=_background_worker, name="deferfuse-compile", daemon=True)
        _WORKER._deferfuse_internal = True   # (started mid-flush: processes._computing_start)
        _WORKER.start()
        atexit.register(_stop_worker)
    # The program is built here: the graph it reads is released once this flush is done.  The
    # settings go with it: config.override holds for one thread, and the compile, the executable
    # cache and the disk cache must follow the block's (its cache_dir, say), not the process's.
    settings = {name: config.get(name) for name in config.settings()}
    _QUEUE.put((sig, make_program(), avals, n_scalars, n_nodes, settings))


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


def lookup(sig: Any, make_program, leaves: list[Value], n_scalars: int, n_nodes: int = 0) -> Optional[Compiled]:
    """The executable for ``sig``, or None when this run should replay eagerly instead
    (tiered execution: a new signature runs eagerly while it compiles, or until compiling it
    fits this thread's allowance: ``allow_compiles``)."""
    compiled = _EXECUTABLES.get(sig)
    if compiled is not None:
        STATS.cache_hits += 1
        _EXECUTABLES.move_to_end(sig)
        return compiled
    shortcuts = config.shortcuts()
    runs = _SEEN.get(sig, 0)
    if runs < shortcuts.eager_first_runs:
        # a graph seen once may never come back (a one-off script): no compile yet, and no
        # disk cache either (loading an executable means importing JAX, about a second)
        STATS.cache_misses += 1
        autotune.bounded(_SEEN)[sig] = runs + 1
        return None
    backend.prepare()   # (before JAX's backend is first used: loading, compiling)
    compiled = load_from_disk(sig, make_program, leaf_avals(leaves), n_scalars)
    if compiled is not None:
        return compiled
    STATS.cache_misses += 1
    allowance = _ALLOWANCE.seconds
    if allowance is not None and sig not in _COMPILING:
        estimate = compile_estimate(n_nodes)
        if estimate > allowance:
            STATS.compiles_put_off += 1
            return None
        _ALLOWANCE.seconds = allowance - estimate
    if shortcuts.background_compile:
        # it came back: compile it off the critical path, keep running eagerly meanwhile
        _schedule(sig, make_program, leaf_avals(leaves), n_scalars, n_nodes)
        _SEEN[sig] = runs + 1
        return None
    _SEEN.pop(sig, None)
    return _compile_and_store(sig, make_program(), leaf_avals(leaves), n_scalars, n_nodes)


def load_from_disk(sig: Any, make_program, avals: tuple, n_scalars: int) -> Optional[Compiled]:
    """The executable saved on disk for ``sig``, now also held in memory; None on a miss.  Its
    program is lowered again only if its StableHLO text is asked for."""
    regions = _code_regions()
    loaded = diskcache.load(sig, len(avals), n_scalars)
    if loaded is None:
        return None
    executable, n_scalars, checks, targets = loaded
    compiled = Compiled(executable, n_scalars, checks, None, targets)
    compiled.nbytes = max(1, _code_regions() - regions) * KERNEL_BYTES
    compiled.signature = sig
    compiled.origin = "disk"
    # (the program is made now, while the graph it reads is alive; tracing it waits)
    compiled.relower = functools.partial(lower_program, make_program(), avals, n_scalars)
    _store(sig, compiled)
    return compiled


def get_or_compile(sig: Any, make_program, avals: tuple, n_scalars: int) -> Compiled:
    """The executable for ``sig`` from memory, from the disk cache, or compiled now (on this
    thread, then saved to both): for front ends that compile ahead, such as the torch.compile
    backend, with no eager tier.  ``avals``: (shape, dtype) of each program input."""
    compiled = _EXECUTABLES.get(sig)
    if compiled is not None:
        STATS.cache_hits += 1
        _EXECUTABLES.move_to_end(sig)
        return compiled
    backend.prepare()
    compiled = load_from_disk(sig, make_program, avals, n_scalars)
    if compiled is not None:
        return compiled
    STATS.cache_misses += 1
    return _compile_and_store(sig, make_program(), avals, n_scalars)


def contains(sig: Any) -> bool:
    """Whether an executable for ``sig`` is held in memory."""
    return sig in _EXECUTABLES


def size() -> int:
    """How many executables are held in memory."""
    return len(_EXECUTABLES)


def snapshot() -> list[Compiled]:
    """The executables held in memory, least recently used first."""
    return list(_EXECUTABLES.values())


def clear() -> None:
    """Forget the executables held in memory and the eager runs counted toward compiling."""
    _EXECUTABLES.clear()
    _HELD_BYTES[0] = 0
    _SEEN.clear()
