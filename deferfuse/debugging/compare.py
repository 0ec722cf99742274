"""The divergence finder: where a program's values under defer part from strict's.

    report = deferfuse.compare(train_step, model, batch)    # or: python -m deferfuse --compare script.py
    print(report)

The program runs twice from the same random states (torch's, Python's and NumPy's generators;
the arguments deep-copied for each run): once in strict mode, once in a defer block.  A dispatch
mode on top of each run sees every aten op the program calls, in program order, and keys it by
(op, the user's line, how many times that op ran at that line before), so the two runs' ops pair
up even where one run calls an op the other does not (printing a tensor formats it with ops of
its own, which are left out).

Strict's run keeps a copy of each op's outputs.  Defer's run records a ``clone`` of each argument
before the op and of each output after it (snapshots: a later in-place op cannot change them),
which the flush computes with the op (they share the op's work, so the flush widens to them); an
output computed at once is copied as it is.  After every op, the snapshots computed so far are
compared with strict's copies in program order, with the contract's tolerance
(``torch.testing.assert_close``'s defaults for the dtype, NaN equal to NaN; integers and bools
exact).  An op beyond it is run again on torch over its argument snapshots: where torch then
computes what defer did, the op is faithful and its inputs carried the difference (rounding
grown through a deep network; the report notes the first such op as drift); otherwise the
program stops there and the op is reported: its op, line, module path, both values in summary,
and how defer computed it.  That path is what the engine says ran the snapshot's group
(``engine.watching``: an eager replay, XLA with an executable compiled for it, loaded from the
disk cache or held in memory, torch's kernel for a lone op), or, for an output that came back
computed, the shortcut that ran it (first sighting, lone op, host scalar, eager fallback).

Views, allocations (``empty*``: unspecified contents) and metadata changes are not compared.
The defer run turns the block and segment tiers off (``eager_blocks``, ``eager_segments``),
which would run the program at once, as strict; the other shortcuts stay as configured.  The
snapshots change the programs XLA compiles (each op's value is an output of its computation),
not the lowering rules that run.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import itertools
import random
import sys
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import config, engine, modes
from ..capture.classify import OpKind, op_info
from ..capture.dispatch_keys import no_dispatch
from ..capture.tensor import DeferredTensor, computed_data, is_materialized, pending_node_id
from ..errors import FlushReason
from ..stats import STATS
from . import scopes
from .source import is_internal, user_line

aten = torch.ops.aten
_NOT_COMPARED = frozenset({OpKind.VIEW, OpKind.ALLOCATION, OpKind.INPLACE_VIEW})
_TENSOR_STR = torch._tensor_str.__file__

# what the shortcuts that compute an op at once are called in a report
_AT_ONCE = (("unseen_ops_run", "first sighting (ran at once on torch's kernel)"),
            ("lone_ops_run", "at once on torch's kernel (a lone op's place)"),
            ("host_scalar_ops_run", "at once on torch's kernel (one-element host tensors)"))
_PATHS = {
    "xla, compiled": "compiled (XLA, the first run of an executable compiled for it)",
    "xla, disk": "disk hit (XLA, an executable loaded from the disk cache)",
    "xla, memory": "compiled (XLA, an executable held in memory)",
    "eager replay": "replay (its graph's first runs replay op by op on torch)",
    "eager (compiling)": "replay (op by op on torch while its executable compiles)",
    "eager (faster than xla)": "replay (op by op on torch, measured faster than XLA)",
    "torch": "torch's kernel (a flush of one op)",
}


@dataclasses.dataclass
class Report:
    """What ``compare`` found; ``str(report)`` says it in words (a REPL shows it as printed)."""
    agree: bool
    ops_compared: int
    op: Optional[str] = None          # the first op whose outputs differ
    line: Optional[str] = None
    module: Optional[str] = None
    path: Optional[str] = None        # how defer computed it
    index: Optional[int] = None       # its position among the ops defer ran
    strict_value: Optional[str] = None
    defer_value: Optional[str] = None
    difference: Optional[str] = None
    unmatched: int = 0                # ops of one run with no counterpart in the other
    paths: dict = dataclasses.field(default_factory=dict)   # path -> ops compared
    strict_error: Optional[str] = None
    defer_error: Optional[str] = None
    drift: Optional[str] = None       # the first op past tolerance whose own inputs explain it

    def __str__(self) -> str:
        if self.agree:
            text = (f"deferfuse.compare: strict and defer agree: {self.ops_compared} ops compared, "
                    f"outputs within torch.testing's default tolerances (integers and bools exact)")
            if self.paths:
                text += "\n  computed under defer by: " + ", ".join(
                    f"{path} x{n}" for path, n in sorted(self.paths.items(), key=lambda kv: -kv[1]))
            if self.drift:
                text += (f"\n  from {self.drift} on, some values differ from strict's beyond the tolerance, "
                         f"but each op computes, within it, what torch computes from the values defer gave "
                         f"it: rounding that grows through the program, not an op that differs")
            if self.unmatched:
                text += f"\n  {self.unmatched} op(s) of one run had no counterpart in the other (not compared)"
            if self.strict_error:
                text += f"\n  both runs raised {self.strict_error}"
            return text
        if self.op is None:
            return (f"deferfuse.compare: the runs part after {self.ops_compared} agreeing ops: strict "
                    f"{'raised ' + self.strict_error if self.strict_error else 'ended normally'}, defer "
                    f"{'raised ' + self.defer_error if self.defer_error else 'ended normally'}")
        where = self.line or "an unknown line"
        if self.module:
            where += f" in module {self.module}"
        return "\n".join([
            f"deferfuse.compare: strict and defer part at op #{self.index} ({self.ops_compared - 1} "
            f"earlier ops agreed)",
            f"  {self.op} at {where}",
            f"  computed under defer by: {self.path}",
            f"  strict: {self.strict_value}",
            f"  defer:  {self.defer_value}",
            *(f"  {line}" for line in (self.difference or "").splitlines() if line.strip()),
        ])

    __repr__ = __str__


class _Diverged(BaseException):
    """Stops the defer run at the first difference (a BaseException: the program's own
    ``except Exception`` does not catch it)."""

    def __init__(self, report: Report) -> None:
        super().__init__(str(report))
        self.report = report


# -- what the two runs see -------------------------------------------------------------------------
def _compared(func: Any) -> bool:
    return op_info(func).kind not in _NOT_COMPARED and not _formatting()


def _formatting() -> bool:
    """Whether the op comes from printing a tensor (torch/_tensor_str.py), under the user's line."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_filename == _TENSOR_STR:
            return True
        if not is_internal(code):
            return False
        frame = frame.f_back
    return False


def _outputs(out: Any) -> list:
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [x for x in items if isinstance(x, (torch.Tensor, bool, int, float, complex))]


class _Place:
    """An op's key in its run, and where it ran."""

    __slots__ = ("op", "line", "scope", "index")

    def __init__(self, op: Any, line: Any, scope: Any, index: int) -> None:
        self.op, self.line, self.scope, self.index = op, line, scope, index


class _Run(TorchDispatchMode):
    """Numbers the ops of one run by (op, line, occurrence)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter = collections.Counter()
        self.count = 0

    def place(self, func: Any) -> tuple[tuple, _Place]:
        line = user_line()
        # (by file and line number: the two runs can reach one op from two instructions of a
        # line, as when defer computes ``loss.item()`` inside the ``print`` that reads it)
        where = (line.code.co_filename, line.line) if line is not None else None
        occurrence = self.seen[(func, where)]
        self.seen[(func, where)] = occurrence + 1
        self.count += 1
        return (func, where, occurrence), _Place(func, line, scopes.current(), self.count)


class _StrictRun(_Run):
    """Keeps a copy of each compared op's outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[tuple, list] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _compared(func):
            key, _ = self.place(func)
            self.values[key] = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in _outputs(out)]
        return out


class _Pending:
    """One op of the defer run, waiting for its values: (snapshot or value, path) per output,
    and its arguments, flat, with each tensor as a snapshot taken before the op ran."""

    __slots__ = ("key", "place", "outputs", "func", "inputs", "spec")

    def __init__(self, key: tuple, place: _Place, outputs: list, func: Any, inputs: list, spec: Any) -> None:
        self.key, self.place, self.outputs = key, place, outputs
        self.func, self.inputs, self.spec = func, inputs, spec

    def computed(self) -> bool:
        return all(not isinstance(v, DeferredTensor) or is_materialized(v)
                   for v in itertools.chain((v for v, _ in self.outputs), self.inputs))


def _snapshot(x: torch.Tensor, always: bool) -> tuple[torch.Tensor, Optional[int]]:
    """(a copy of ``x``'s value now, the id of the node that will compute it, or None where it
    is computed already).  Called inside the finder's dispatch mode: the ``clone`` goes to the
    defer mode below, which records it (or runs it at once, as it would any op); ``always``:
    clone even a tensor that looks computed (a written plain tensor may hold pending contents)."""
    if always or not is_materialized(x):
        x = aten.clone.default(x)
        node_id = pending_node_id(x)
        if node_id is not None:
            return x, node_id
    with no_dispatch():
        return computed_data(x).detach().clone(), None


class _DeferRun(_Run):
    """Snapshots each compared op's arguments and outputs and compares them, in program order,
    as they are computed."""

    def __init__(self, strict: dict[tuple, list]) -> None:
        super().__init__()
        self.strict = strict
        self.queue: collections.deque[_Pending] = collections.deque()
        self.paths: dict[int, str] = {}         # snapshot node id -> how its group ran
        self.compared = 0
        self.unmatched = 0
        self.drift: Optional[str] = None        # the first op beyond tolerance that its inputs explain
        self.path_counts: collections.Counter = collections.Counter()

    def watch(self, nodes: list, how: str) -> None:
        for node in nodes:
            self.paths[node.id] = how

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        compared = _compared(func)
        if compared:
            flat, spec = tree_flatten((args, kwargs))
            # (the values the op reads, before it runs: an in-place op overwrites its own)
            inputs = [_snapshot(x, True)[0] if isinstance(x, torch.Tensor) else x for x in flat]
            before = [getattr(STATS, name) for name, _ in _AT_ONCE] + [sum(STATS.fallbacks.values())]
        out = func(*args, **kwargs)
        if compared:
            key, place = self.place(func)
            at_once = _at_once_path(before)
            writes = bool(op_info(func).written)
            outputs = []
            for x in _outputs(out):
                if isinstance(x, torch.Tensor):
                    value, node_id = _snapshot(x, writes)
                    outputs.append((value, at_once if node_id is None else node_id))
                else:
                    outputs.append((x, at_once))
            self.queue.append(_Pending(key, place, outputs, func, inputs, spec))
        self.compare_ready()
        return out

    def compare_ready(self) -> None:
        """Compare the ops at the front of the queue whose values are all computed."""
        queue = self.queue
        while queue and queue[0].computed():
            pending = queue.popleft()
            expected = self.strict.pop(pending.key, None)
            if expected is None or len(expected) != len(pending.outputs):
                self.unmatched += 1
                continue
            if expected:
                self.compared += 1
            with no_dispatch():
                got = [computed_data(v) if isinstance(v, torch.Tensor) else v for v, _ in pending.outputs]
                differences = [_difference(g, w) for g, w in zip(got, expected)]
                if any(d is not None for d in differences):
                    self.differs(pending, got, expected, differences)
            if pending.outputs:
                self.path_counts[self.path_of(pending.outputs[0][1])] += 1

    def path_of(self, path: Any) -> str:
        if isinstance(path, int):   # (a snapshot's node: how its group ran)
            how = self.paths.get(path)
            return _PATHS.get(how, how or "unknown")
        return path

    def differs(self, pending: _Pending, got: list, expected: list, differences: list) -> None:
        """An op whose outputs are not strict's: stop here, unless torch, given the values defer
        gave the op, computes what defer did (then its inputs' rounding explains the difference,
        as it grows through a deep network, and the op itself is faithful)."""
        local = _on_torch(pending)
        faithful = local is not None and all(
            _difference(g, w) is None for g, w in zip(got, _outputs(local)))
        position = next(i for i, d in enumerate(differences) if d is not None)
        if faithful:
            if self.drift is None:
                self.drift = f"op #{pending.place.index} ({pending.place.op} at {pending.place.line})"
            return
        place = pending.place
        label = f"output {position}: " if len(pending.outputs) > 1 else ""
        detail = differences[position]
        if local is None:
            detail += ("\n(torch could not run this op again on defer's inputs to tell whether they "
                       "explain the difference)")
        else:
            detail += ("\ntorch, given the values defer gave this op, computes what strict did: the op "
                       "itself differs under defer")
        raise _Diverged(Report(
            False, self.compared, op=str(place.op), line=str(place.line) if place.line else None,
            module=str(place.scope) if place.scope is not None else None,
            path=self.path_of(pending.outputs[position][1]), index=place.index,
            strict_value=label + _summary(expected[position]), defer_value=label + _summary(got[position]),
            difference=detail, unmatched=self.unmatched, paths=dict(self.path_counts)))


def _on_torch(pending: _Pending) -> Optional[Any]:
    """The op run on torch over the values its defer run read (None where it cannot be run
    again: a random op draws other numbers)."""
    if op_info(pending.func).random:
        return None
    flat = [computed_data(v).clone() if isinstance(v, torch.Tensor) else v for v in pending.inputs]
    args, kwargs = tree_unflatten(flat, pending.spec)
    try:
        return pending.func(*args, **kwargs)
    except Exception:  # noqa: BLE001 - reported as "could not run again"
        return None


def _at_once_path(before: list) -> str:
    for (name, label), was in zip(_AT_ONCE, before):
        if getattr(STATS, name) != was:
            return label
    if sum(STATS.fallbacks.values()) != before[-1]:
        return "eager fallback (stats()['fallbacks'] says why)"
    return "at once on torch's kernel (its inputs were computed)"


# -- comparing and summarizing values -------------------------------------------------------------
def _difference(got: Any, want: Any) -> Optional[str]:
    """Why ``got`` (defer's) is not ``want`` (strict's) within the contract; None if it is."""
    if isinstance(want, torch.Tensor) != isinstance(got, torch.Tensor):
        return f"strict gave a {type(want).__name__}, defer a {type(got).__name__}"
    if isinstance(want, torch.Tensor):
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"shape or dtype differ: strict {_shape(want)}, defer {_shape(got)}"
        got, want = got.detach(), want.detach()
    try:
        torch.testing.assert_close(got, want, equal_nan=True, check_device=False, check_stride=False,
                                   check_layout=False)
    except AssertionError as exc:
        return str(exc)
    return None


def _shape(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _summary(v: Any) -> str:
    if not isinstance(v, torch.Tensor):
        return repr(v)
    with no_dispatch():
        text = _shape(v)
        if v.numel() == 0:
            return text
        values = v.detach()
        if values.is_complex():
            values = values.abs()
        if values.dtype == torch.bool:
            return f"{text} true={int(values.sum())}"
        if not values.is_floating_point():
            return f"{text} min={int(values.min())} max={int(values.max())}"
        finite = values[torch.isfinite(values)].double()
        nan, inf = int(torch.isnan(values).sum()), int(torch.isinf(values).sum())
        if finite.numel():
            text += f" min={finite.min().item():.6g} max={finite.max().item():.6g} mean={finite.mean().item():.6g}"
        if nan or inf:
            text += f" nan={nan} inf={inf}"
        first = values.reshape(-1)[:4].tolist()
        return text + f" first={[round(x, 6) for x in first]}"


# -- the two runs -----------------------------------------------------------------------------------
def _random_states() -> tuple:
    numpy = sys.modules.get("numpy")
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return (torch.random.get_rng_state(), cuda, random.getstate(),
            numpy.random.get_state() if numpy is not None else None)


def _restore(states: tuple) -> None:
    cpu, cuda, python, numpy_state = states
    torch.random.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(python)
    if numpy_state is not None:
        sys.modules["numpy"].random.set_state(numpy_state)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def compare(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Report:
    """Run ``fn(*args, **kwargs)`` in strict mode and in a defer block, from the same random
    states (the arguments deep-copied for each run), and report the first op whose outputs
    differ beyond the contract's tolerance (``torch.testing``'s defaults for the dtype; integers
    and bools exact): its op, line, module path, both values in summary, and how defer computed
    it.  The defer run stops there.  ``print(report)`` says it in words; ``report.agree``.

    ``fn`` should make its state or take it as arguments (state it reaches otherwise, a global
    model, is changed by the first run).  Inside ``fn``, entering ``strict()`` or ``debug()``
    blocks is not supported (the finder's dispatch mode sits on top of the defer block's)."""
    states = _random_states()
    strict_inputs, defer_inputs = copy.deepcopy((args, kwargs)), copy.deepcopy((args, kwargs))
    scopes.hold()
    try:
        strict_run = _StrictRun()
        strict_error = None
        with modes.strict():
            with strict_run:
                try:
                    fn(*strict_inputs[0], **strict_inputs[1])
                except Exception as exc:  # noqa: BLE001 - compared with defer's outcome below
                    strict_error = _error(exc)
        _restore(states)
        defer_run = _DeferRun(strict_run.values)
        defer_error = None
        try:
            with engine.watching(defer_run.watch):
                with config.override(eager_blocks=False, eager_segments=False), modes.defer():
                    with defer_run:
                        try:
                            fn(*defer_inputs[0], **defer_inputs[1])
                        except Exception as exc:  # noqa: BLE001 - reported below
                            defer_error = _error(exc)
                    # (the block's end computes every snapshot left; inside a default defer
                    # mode the block pushed nothing, and its end computes nothing)
                    recorder = modes.active_recorder()
                    if recorder is not None:
                        with no_dispatch():
                            recorder.flush_all(FlushReason.SYNC)
                defer_run.compare_ready()
        except _Diverged as diverged:
            return diverged.report
    finally:
        scopes.release()
    unmatched = defer_run.unmatched + len(defer_run.queue) + len(defer_run.strict)
    same_outcome = (strict_error is None) == (defer_error is None) and (
        strict_error is None or strict_error.split(":")[0] == defer_error.split(":")[0])
    return Report(same_outcome, defer_run.compared, unmatched=unmatched, paths=dict(defer_run.path_counts),
                  strict_error=strict_error, defer_error=defer_error, drift=defer_run.drift)
