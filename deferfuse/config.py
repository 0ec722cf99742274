"""Typed settings, declared once.

Each setting has a name, a type, a default and help text.  Its initial value is read once from
the environment variable ``DEFERFUSE_<NAME>``; code may change it globally with
``config.set(name, value)`` or for a block with ``with config.override(name=value):``.
Settings that change the code we compile carry ``affects_compile=True`` and enter the
executable cache key (see ``compile_key()``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from typing import Any, Callable, Iterator


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {text!r}")


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    type: type
    default: Any
    help: str
    affects_compile: bool = False

    @property
    def env_var(self) -> str:
        return "DEFERFUSE_" + self.name.upper()

    def parse(self, text: str) -> Any:
        parser: Callable[[str], Any] = _parse_bool if self.type is bool else self.type
        if self.type is str and self.name == "compute_engine" and text not in ("xla", "torch"):
            raise ValueError(f"{self.env_var}={text!r}: expected 'xla' or 'torch'")
        try:
            return parser(text)
        except ValueError as exc:
            raise ValueError(f"{self.env_var}={text!r}: {exc}") from None


_SETTINGS: dict[str, Setting] = {}


def _declare(name: str, type_: type, default: Any, help: str, affects_compile: bool = False) -> None:
    if name in _SETTINGS:
        raise RuntimeError(f"setting {name!r} declared twice")
    _SETTINGS[name] = Setting(name, type_, default, help, affects_compile)


_declare("always_compile", bool, False,
         "Send every flushed op through XLA, with no eager shortcut (tests and conformance runs).")
_declare("max_pending_nodes", int, 10_000,
         "Flush when this many ops are pending, so a program that never observes stays bounded.")
_declare("step_boundaries", bool, True,
         "End a deferred program where the user's step ends, whenever values are read: at the "
         "end of an optimizer's step(), and, in a loop with no optimizer, where the loop comes "
         "round once program_nodes ops are pending (capture/steps.py).  A "
         "`with deferfuse.defer(span='block'):` block is one program however many steps it holds.")
_declare("program_nodes", int, 512,
         "With step_boundaries: how many ops a deferred program with no step boundary may hold "
         "before the loop recording it is cut (then cut wherever it comes round); 0 turns loop "
         "cuts off.  Chosen from XLA's compile time and memory (docs/architecture.md).")
_declare("record_source", bool, True,
         "Record the user's file:line for each deferred op, for errors and explain().")
_declare("eager_small_flush", int, 0,
         "Run a flush eagerly op by op when its graph has at most this many nodes and has not been "
         "compiled before (0 disables; always_compile overrides).")
_declare("memory_bandwidth_gbs", float, 20.0,
         "Memory bandwidth of the machine in GB/s, for the cost model (default: a 2-core CPU VM).")
_declare("peak_gflops", float, 100.0,
         "Peak FLOP rate in GFLOP/s, for the cost model (default: a 2-core AVX2 CPU VM).")
_declare("compute_engine", str, "xla",
         "Where compute-bound ops (matmul, conv) run: 'xla' fuses them with their neighbours, "
         "'torch' runs them on torch's kernels between XLA groups.", affects_compile=True)
_declare("order_compute", bool, True,
         "On a CPU, tie each matrix product and convolution of an XLA computation to the previous "
         "one in record order, through its left-hand operand (an optimization barrier): XLA then "
         "keeps that operand row-major, where its CPU dot is fastest (a transposed one, as in "
         "every weight gradient, runs at about half speed), and orders the products as eager "
         "does.  See docs/architecture.md.",
         affects_compile=True)
_declare("host_kernels", bool, True,
         "On the CPU, run the matrix products and convolutions of XLA programs (mm, addmm, bmm, "
         "baddbmm, matmul and linear through them, convolution and its backward) on torch's own kernels, as XLA FFI custom calls inside "
         "the program: strict's speed and bits, operands' transposes passed as strides.  The "
         "handlers are compiled at first use (a C++ compiler is needed; without one XLA's dots "
         "run, with one warning).  See deferfuse/native/hostkernels.py.", affects_compile=True)
_declare("host_kernel_serving", bool, True,
         "With host_kernels: the thread that runs a program runs the host kernels the program "
         "calls, on its own OpenMP team (as strict's kernels run), while a driver thread runs the "
         "program; off, a kernel XLA calls on one of its own threads runs on a thread made for "
         "the call (1.8x strict's time on a training step's products).  Same bits either way.  "
         "See deferfuse/native/host_kernels.cc, \"Serving\".")
_declare("host_kernel_team_release_us", int, 1000,
         "With host_kernel_serving: when no kernel follows within this many microseconds, the "
         "serving thread releases its OpenMP team, whose idle workers would otherwise spin for "
         "~3 ms on the cores where XLA runs the program's fusions; the next kernel makes the "
         "team again (a fresh team costs its first products ~0.7 ms), with the same thread "
         "count: the same bits.  -1: never.  See docs/performance.md and "
         "deferfuse/native/host_kernels.cc.")
_declare("host_kernel_min_flops", int, -1,
         "With host_kernels: a matrix product or an attention goes to torch's kernel only when "
         "it has at least this many FLOPs (2*M*N*K, times the batch; an attention's two "
         "products, its backward's five); a smaller one (a decode step's one-row products and "
         "attention) is XLA's own, where one FFI call costs more than the product, but whose "
         "bits are not torch's.  Decided by shapes alone, so the same program routes the same "
         "way on every run; 0 sends every product to the host kernels.  -1 (the default): by "
         "front end, 0 in defer mode (strict's bits, whichever way a product runs: eagerly on a "
         "first sighting, in a program from the disk cache) and 2^24 under torch.compile (which "
         "promises Inductor's closeness, not bits).  See docs/performance.md.", affects_compile=True)
_declare("lone_op_on_torch", bool, True,
         "Run a flush of a single op (nothing to fuse) on torch's own kernel instead of XLA "
         "(always_compile overrides).")
_declare("fusion_fuel", int, -1,
         "Stop fusing after this many node merges per flush (-1: no limit); bisect a bad fusion "
         "by lowering it until the problem goes away.", affects_compile=True)
_declare("cache_dir", str,
         os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "deferfuse"),
         "Folder of the on-disk executable cache; empty turns it off.")
_declare("cache_max_bytes", int, 1 << 30,
         "Bound on the on-disk executable cache's folder, in bytes (0: no bound).  Past it, the "
         "least recently used entries are deleted after a write.  See deferfuse/exec/diskcache.py.")
_declare("cache_trust_shared", bool, False,
         "Use a disk cache folder that others can write (owned by another user, or writable by "
         "its group or by everyone, or under such a folder).  An entry of the cache is code this "
         "process runs (XLA's machine code), so anyone who can write the folder can run code in "
         "every process that uses it: turn this on only for a folder shared by a team whose "
         "every member is trusted.  Off, such a folder turns the disk cache off with a warning.  "
         "See docs/architecture.md, \"Security\".")
_declare("executable_cache_size", int, 512,
         "How many compiled executables to keep in memory, least recently used dropped first "
         "(each holds ~1.6 MB of compiled code on the CPU); 0 keeps all.  A dropped one that "
         "comes back is loaded from the disk cache or compiled again.")
_declare("executable_cache_bytes", int, 256 << 20,
         "Bound on the resident memory of the executables kept in memory, estimated at 128 KiB "
         "per compiled kernel (what freeing them returns); least recently used dropped first "
         "past it; 0: no bound.  See deferfuse/exec/executables.py.")
_declare("eager_first_runs", int, 1,
         "Run a new graph signature eagerly (op by op in torch) this many times before its XLA "
         "executable is used; 0 compiles at first sight.  always_compile overrides.")
_declare("eager_unseen_ops", bool, True,
         "Run an op this process has not seen with these input shapes, dtypes and layouts at "
         "once on torch's kernel when its inputs are computed already, as strict does (it returns "
         "a plain tensor); from its second sighting it is deferred.  A one-off script then never "
         "asks torch's meta kernels, whose first use imports sympy (~0.5 s), and its results are "
         "plain tensors.  always_compile and eager_first_runs=0 turn it off.")
_declare("eager_lone_ops", bool, True,
         "Run an op at once on torch's kernel, when its inputs are computed, at a place in the "
         "code where its last flush was lone (one op, which runs on torch's kernel anyway): "
         "recording it and flushing would only add their cost.  Once its result feeds a "
         "recorded op, the place is recorded again.  Needs lone_op_on_torch; always_compile "
         "turns it off.")
_declare("host_scalars_at_once", bool, True,
         "Run a pointwise op at once on torch's kernel when every tensor it reads or writes is a "
         "plain CPU tensor of at most one element whose value is computed (an optimizer's step "
         "counter, `step += 1`): its result is strict's, and a later `.item()` of it needs no "
         "flush.  Pending ops that read a tensor it overwrites keep the old value.  always_compile "
         "turns it off.")
_declare("eager_blocks", bool, True,
         "Time each place in the code where a `with deferfuse.defer():` block starts, deferred "
         "against at once (as strict: no mode, plain tensors), and run its blocks the faster way; "
         "measured again from time to time and when a run's time drifts.  Only outermost defer "
         "blocks; always_compile turns it off.  See deferfuse/exec/blocks.py.")
_declare("eager_segments", bool, True,
         "Under a default defer mode (TORCHTPU_MODE=defer, set_mode('defer')), where no `with` "
         "block marks the work, time what runs between two reads of a value (`.item()`, "
         "`bool()`) by the place of the read that starts it, deferred against at once, and run "
         "it the faster way, as eager_blocks does for `with` blocks.  always_compile overrides.")
_declare("explore_share", float, 0.05,
         "eager_blocks and eager_segments: the share of a place's running time that trying the "
         "deferred way may cost over running at once (its first recordings, replays and "
         "compiles); a place starts at once and tries deferred runs as this budget allows, so "
         "a loop where deferring does not pay costs at most about this much over strict.  1 "
         "or more: no budget (deferred runs are tried from the first run).")
_declare("remember_blocks", bool, True,
         "Keep eager_blocks' choice for each place in the disk cache (cache_dir) and start a "
         "later process's place from it, checked again as any choice: a warm start runs a block "
         "that chose at once as strict from its first call.  See deferfuse/exec/blocks.py.")
_declare("background_compile", bool, True,
         "Compile new signatures on a background thread, so an eager run never waits for XLA.")
_declare("xla_cpu_async_dispatch", bool, False,
         "Keep JAX's asynchronous dispatch on its CPU client.  Off by default: deferfuse waits for "
         "every computation it starts, so async dispatch only adds a thread hand-off per flush "
         "(~0.1 ms on a 2-core VM).  A process-wide JAX setting: deferfuse turns it off before "
         "it first uses JAX's backend, unless this is on, JAX_CPU_ENABLE_ASYNC_DISPATCH is set, or "
         "JAX's CPU client exists already.")
_declare("malloc_tuning", bool, True,
         "On Linux with glibc, before deferfuse first uses XLA: raise malloc's mmap threshold to "
         "256 MiB and its trim threshold to 1 GiB (mallopt, process-wide, once), so XLA's "
         "per-execution buffers are reused from the heap instead of mapped and faulted in afresh "
         "(a GPT training step: 24k page faults, ~30 ms a step, in some processes).  Freed memory "
         "then stays mapped.  Skipped where MALLOC_*_ variables or GLIBC_TUNABLES set malloc's "
         "thresholds.  See deferfuse/exec/backend.py.")
_declare("autotune_engine", bool, True,
         "Time a new graph's eager runs against its first XLA runs and keep it eager when torch's "
         "kernels are faster (always_compile overrides).")
_declare("gc_freeze", bool, True,
         "While a defer block runs, keep the objects that existed before it out of Python's full "
         "garbage collections (gc.freeze; undone when the outermost block ends).  torch and JAX "
         "leave ~400k objects that a full collection rescans (~200 ms on a 2-core VM), and "
         "recording allocates enough to trigger one every few thousand ops.")
_declare("gc_young_threshold", int, 70_000,
         "While a defer block runs, Python's youngest-generation collection threshold (the first "
         "value of gc.set_threshold) is raised to this, and restored when the outermost block "
         "ends (0, or a lower value, leaves it alone).  The pending graph holds no reference "
         "cycles, so recording needs no collections; at the default 700, every few dozen ops "
         "rescanned the graph's live objects (~5 ms of a 60 ms AdamW step).")
_declare("compile_max_specializations", int, 16,
         "torch.compile(backend='deferfuse'): how many concrete input shapes one graph keeps "
         "planned and compiled; past it the least recently used goes (and a warning says so, once "
         "per graph).  See docs/compile.md.")
_declare("explain_history", int, 16, "How many recent flush plans deferfuse.explain() keeps.")
_declare("check_nans", bool, False,
         "In debug mode, raise at the first op whose output holds a NaN or Inf that its inputs "
         "did not (costs one pass over every floating-point output).  Graphs compiled by "
         "torch.compile(backend='deferfuse') check each XLA partition's outputs and each op run "
         "on torch the same way, naming the fx node's line (deferfuse/compile/checks.py).")
_declare("check_uninitialized", bool, True,
         "In debug mode, track memory allocated without values (empty*, new_empty*, what resize_ "
         "or an out= resize adds) per element until it is written, and raise at an op that reads "
         "an element nothing wrote, naming the allocation's line (deferfuse/debugging/uninit.py; "
         "an op costs one dictionary test while nothing is tracked).")


class _State(threading.local):
    def __init__(self) -> None:
        self.overrides: list[dict[str, Any]] = []
        self.shortcuts: tuple = (None, None)   # ((settings generation, deterministic), Shortcuts) last derived here


_global_values: dict[str, Any] = {}
_state = _State()
_generation = 0   # bumped by every set() and override (in any thread): derived values go stale


def _initial(setting: Setting) -> Any:
    text = os.environ.get(setting.env_var)
    return setting.default if text is None else setting.parse(text)


for _s in _SETTINGS.values():
    _global_values[_s.name] = _initial(_s)


def _setting(name: str) -> Setting:
    try:
        return _SETTINGS[name]
    except KeyError:
        raise KeyError(f"unknown deferfuse setting {name!r}; known: {sorted(_SETTINGS)}") from None


def get(name: str) -> Any:
    # (read several times per flush and per recorded op: the common case, no override, is one
    # dictionary lookup)
    overrides = _state.overrides
    if overrides:
        for layer in reversed(overrides):
            if name in layer:
                return layer[name]
    try:
        return _global_values[name]
    except KeyError:
        _setting(name)   # raises the helpful error
        raise


def _checked(name: str, value: Any) -> Any:
    setting = _setting(name)
    if setting.type is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if setting.type is int and isinstance(value, bool) or not isinstance(value, setting.type):
        raise TypeError(f"setting {name!r} takes a {setting.type.__name__}, got {value!r}")
    return value


def set(name: str, value: Any) -> None:  # noqa: A001 - mirrors get()
    global _generation
    _global_values[name] = _checked(name, value)
    _generation += 1


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    global _generation
    layer = {name: _checked(name, value) for name, value in values.items()}
    _state.overrides.append(layer)
    _generation += 1
    try:
        yield
    finally:
        _state.overrides.remove(layer)
        _generation += 1


def settings() -> dict[str, Setting]:
    return dict(_SETTINGS)


@dataclasses.dataclass(frozen=True)
class Shortcuts:
    """The eager shortcuts in force: where work runs at once in torch, replays eagerly, or waits
    for XLA.  Derived from the settings in one place, with their "X overrides Y" rules applied
    (``always_compile`` turns every shortcut off; ``eager_first_runs=0`` turns off running
    unseen ops at once, which only pays while a graph's first runs are eager anyway;
    ``eager_lone_ops`` needs ``lone_op_on_torch``, since a lone flush runs on torch's kernel
    only then).  Nothing else combines shortcut settings."""
    always_compile: bool
    unseen_ops_at_once: bool      # eager_unseen_ops
    lone_ops_at_once: bool        # eager_lone_ops
    host_scalars_at_once: bool    # host_scalars_at_once
    blocks_timed: bool            # eager_blocks
    segments_timed: bool          # eager_segments
    lone_op_on_torch: bool        # a one-op flush on torch's kernel (the planner's policy)
    small_flush_nodes: int        # eager_small_flush (0: off)
    tiny_graphs_replay: bool      # graphs of one-element tensors replay eagerly
    eager_first_runs: int         # runs of a new signature replayed before XLA (0: compile at once)
    background_compile: bool      # compile off the critical path while runs replay
    autotune_engine: bool         # keep a graph on torch's kernels when they measured faster


def shortcuts() -> Shortcuts:
    """The shortcuts the settings now in force (this thread's overrides too) give; derived again
    only after a setting changed (asked several times per flush).

    ``torch.use_deterministic_algorithms(True)`` asks for the same bits on every run: every
    shortcut is then off, as under ``always_compile``.  Where the work runs would otherwise
    depend on timings (the block and segment tiers), on what the disk cache holds (a cold
    process replays a new graph on torch's kernels, a warm one runs XLA's executable) and on
    when a background compile finishes, and torch's kernels and XLA round differently
    (docs/semantics.md, "Reproducibility")."""
    generation, derived = _state.shortcuts
    current = (_generation, _deterministic())   # (read before deriving: a change meanwhile makes the next call derive again)
    if generation != current:
        derived = _derive_shortcuts(current[1])
        _state.shortcuts = (current, derived)
    return derived


def _deterministic() -> bool:
    import torch
    return torch.are_deterministic_algorithms_enabled()


def _derive_shortcuts(deterministic: bool = False) -> Shortcuts:
    if get("always_compile") or deterministic:
        return Shortcuts(True, False, False, False, False, False, False, 0, False, 0, False, False)
    first_runs = get("eager_first_runs")
    lone_on_torch = get("lone_op_on_torch")
    return Shortcuts(
        always_compile=False,
        unseen_ops_at_once=get("eager_unseen_ops") and first_runs > 0,
        lone_ops_at_once=get("eager_lone_ops") and lone_on_torch,
        host_scalars_at_once=get("host_scalars_at_once"),
        blocks_timed=get("eager_blocks"),
        segments_timed=get("eager_segments"),
        lone_op_on_torch=lone_on_torch,
        small_flush_nodes=get("eager_small_flush"),
        tiny_graphs_replay=True,
        eager_first_runs=first_runs,
        background_compile=get("background_compile") and first_runs > 0,
        autotune_engine=get("autotune_engine"))


def compile_key() -> tuple:
    """The values of every setting that changes compiled code, for the executable cache key."""
    return tuple(get(s.name) for s in _SETTINGS.values() if s.affects_compile)


def choice_key() -> tuple:
    """The values of every setting but the disk cache's own, for the key of a block choice
    remembered on disk (exec/diskcache.py): a choice made under other settings is not reused."""
    return tuple((s.name, get(s.name)) for s in _SETTINGS.values()
                 if s.name not in ("cache_dir", "cache_max_bytes", "cache_trust_shared"))


# -- the rest of the environment -----------------------------------------------------------------
# Variables that are not deferfuse settings but that deferfuse reads (or, for TORCHTPU_MODE,
# passes on to child processes).  They are read here only, at the moment they are asked for:
# each belongs to another program (the product's mode switch, XLA, JAX, glibc), which reads it
# at its own time.

MODE_VARIABLE = "TORCHTPU_MODE"
# glibc's own malloc variables: when the user set any, deferfuse leaves malloc's thresholds alone
_MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def requested_mode() -> str | None:
    """The eager mode ``TORCHTPU_MODE`` asks for (strict, debug, defer), or None when it is
    unset or blank."""
    value = os.environ.get(MODE_VARIABLE)
    return None if value is None or value.strip() == "" else value


def pass_mode_to_children(mode: str) -> None:
    """Set ``TORCHTPU_MODE`` for this process's children (``python -m deferfuse`` does, so a
    subprocess the script starts runs under the same mode)."""
    os.environ[MODE_VARIABLE] = mode


def xla_flags() -> str:
    """``XLA_FLAGS`` as the environment holds it now (XLA reads it once, when its backend
    starts)."""
    return os.environ.get("XLA_FLAGS", "")


def cxx_compiler() -> str:
    """The C++ compiler that builds the host kernels (deferfuse/native/hostkernels.py): ``CXX``,
    as make and setuptools read it, else ``g++``."""
    return os.environ.get("CXX") or "g++"


def user_tuned_malloc() -> bool:
    """Whether the user chose glibc malloc's behaviour in the environment (its ``MALLOC_*_``
    variables or a ``glibc.malloc`` tunable)."""
    return any(v in os.environ for v in _MALLOC_VARIABLES) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")


def jax_flag_in_environment(flag: str) -> bool:
    """Whether JAX's flag ``flag`` is set through its environment variable (the flag's name in
    upper case), which JAX honours over anything deferfuse would choose."""
    return flag.upper() in os.environ
