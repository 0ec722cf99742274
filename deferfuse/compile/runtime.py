"""A compiled fx graph: its plans by concrete input shape, and how one call runs.

``CompiledGraph`` is what the backend returns for each graph AOTAutograd hands it (forward,
backward or inference), in the boxed calling convention: one list of inputs, cleared once read.
A call looks up the plan for its inputs' shapes, strides and dtypes (and the values of its size
inputs under dynamic shapes), making it at first sight (``plan.make_plan``): at most
``compile_max_specializations`` are kept per graph, the least recently used dropped past it
with a warning.  Then it runs the plan's units in order: random draws with torch, the XLA
partitions (each one executable, found in memory, on disk, or compiled), the ops torch runs
between them, and last the write-backs into mutated inputs.  Outputs have the strides the
graph's metadata says.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import weakref
from typing import Any, Optional

import numpy as np
import torch
import torch.fx
from torch._ops import _len_torch_dispatch_stack_pre_dispatch
from torch.utils._python_dispatch import _disable_current_modes

from .. import config
from ..exec import executables, interop
from ..lower import host_products
from ..stats import STATS
from .._lazy import lazy_import
from . import checks as checks_
from . import plan as plan_
from .plan import Draw, OnTorch, Partition, Plan, WriteBack, slot_of_arg

jax = lazy_import("jax", globals(), "jax")

log = logging.getLogger("deferfuse")

# every graph compiled in this process, oldest first, for explain() (weakly: Dynamo owns them)
GRAPHS: "list[weakref.ref[CompiledGraph]]" = []


def _is_symbolic(v: Any) -> bool:
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if isinstance(v, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in (*v.shape, *v.stride())) \
            or isinstance(v.storage_offset(), torch.SymInt)
    if isinstance(v, (tuple, list)):
        return any(_is_symbolic(x) for x in v)
    return False


def spec_key(inputs: list) -> tuple:
    """What a plan is specialized for: each input's shape, strides and dtype, or its value.
    (Made on every call, over every input: a decoder's step has ~55, so it stays one pass.)"""
    return tuple([(x.shape, x.stride(), x.dtype) if isinstance(x, torch.Tensor)
                  else (type(x).__name__, x) if isinstance(x, (bool, int, float))
                  else ("other", type(x).__name__) for x in inputs])


class _LastSpec:
    """The plan of a graph's last call, and a check that a call's inputs have the shapes,
    strides and dtypes (and values, for numbers) that found it: Dynamo's own tensor check
    (``TensorGuards``, the C++ check its guards run), ~4 us for a decoding step's 55 inputs
    where ``spec_key`` takes ~20 (~50 inside generate(), where the inputs' metadata is no
    longer in the caches).  It checks more than the key holds (requires_grad, dispatch keys):
    a call it turns away is keyed as before."""

    __slots__ = ("plan", "n", "tensors", "numbers", "guards")

    def __init__(self, plan: Plan, n: int, tensors: list, numbers: list, guards: Any) -> None:
        self.plan, self.n, self.tensors, self.numbers, self.guards = plan, n, tensors, numbers, guards

    @staticmethod
    def of(inputs: list, plan: Plan) -> "Optional[_LastSpec]":
        tensors, numbers = [], []
        for i, x in enumerate(inputs):
            if isinstance(x, torch.Tensor):
                tensors.append(i)
            elif type(x) in (bool, int, float):
                numbers.append((i, type(x), x))
            else:
                return None
        if _TensorGuards is None:
            return None
        ts = [inputs[i] for i in tensors]
        try:
            guards = _TensorGuards(*ts, dynamic_dims_sizes=[list(t.shape) for t in ts],
                                   dynamic_dims_strides=[list(t.stride()) for t in ts])
            if not guards.check(*ts):
                return None
        except Exception:  # noqa: BLE001 - a torch whose check differs: keyed every call
            return None
        return _LastSpec(plan, len(inputs), tensors, numbers, guards)

    def matches(self, inputs: list) -> bool:
        if len(inputs) != self.n:
            return False
        for i, kind, value in self.numbers:
            x = inputs[i]
            if type(x) is not kind or x != value:
                return False
        return self.guards.check(*[inputs[i] for i in self.tensors])


try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:   # (a torch without Dynamo's C++ guards: every call is keyed)
    _TensorGuards = None


class CompiledGraph:
    """One post-AOT fx graph as a boxed callable over XLA executables."""

    def __init__(self, gm: torch.fx.GraphModule, kind: str, settings: dict) -> None:
        # (in the instance's dict: AOTAutograd wraps the backward in torch._dynamo.disable,
        # whose functools.wraps copies the dict, not class attributes)
        self._boxed_call = True
        plan_.unroll_foreach_nodes(gm)
        self.gm = gm
        self.kind = kind
        self.settings = dict(settings)
        self.code = gm.code
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        # (where a call's inputs and the graph's constants go, made once: a call reads them all)
        self.input_slots = [(n.name, None) for n in self.placeholders]
        self.input_slot_set = frozenset(self.input_slots)
        self.attrs = [((n.name, None), n.target) for n in gm.graph.nodes if n.op == "get_attr"]
        self.output = next(n for n in gm.graph.nodes if n.op == "output")
        self.static = not any(_is_symbolic(n.meta.get("val")) for n in gm.graph.nodes) and all(
            "val" in n.meta for n in gm.graph.nodes if n.op == "call_function")
        self.plans: "collections.OrderedDict[tuple, Plan]" = collections.OrderedDict()
        self.last: Optional[_LastSpec] = None   # (the last call's plan, and how to see a call like it)
        self.warned = False
        STATS.compiled_graphs += 1
        GRAPHS[:] = [r for r in GRAPHS if r() is not None]
        GRAPHS.append(weakref.ref(self))

    # -- specializations -------------------------------------------------------------------

    def _values(self, inputs: list) -> dict:
        """Each node's value (fake tensors, sizes) at the inputs' concrete shapes."""
        if self.static:
            values = {}
            for n in self.gm.graph.nodes:
                if n.op == "get_attr":
                    values[n] = getattr(self.gm, n.target)
                elif n.op != "output":
                    values[n] = n.meta["val"]
            return values
        from torch._subclasses.fake_tensor import FakeTensorMode
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        fakes = [fake_mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x
                 for x in inputs]
        interpreter = torch.fx.Interpreter(self.gm, garbage_collect_values=False)
        with fake_mode:
            interpreter.run(*fakes)
        return dict(interpreter.env)

    def plan_for(self, inputs: list) -> Plan:
        last = self.last
        if last is not None and last.matches(inputs):
            return last.plan
        key = spec_key(inputs)
        found = self.plans.get(key)
        if found is not None:
            self.plans.move_to_end(key)
            if found.spec is None or not found.spec.matches(inputs):
                found.spec = _LastSpec.of(inputs, found)   # (made once per plan, unless its calls differ in requires_grad)
            self.last = found.spec
            return found
        made = plan_.make_plan(self.gm, self._values(inputs), self.code, key)
        STATS.compiled_specializations += 1
        self.plans[key] = made
        self.last = made.spec = _LastSpec.of(inputs, made)
        limit = config.get("compile_max_specializations")
        while limit > 0 and len(self.plans) > limit:
            self.plans.popitem(last=False)
            if not self.warned:
                self.warned = True
                log.warning("deferfuse: a compiled graph met more than %d input shapes "
                            "(compile_max_specializations); the least recently used are dropped and "
                            "compiled again (or loaded from the disk cache) when they come back. "
                            "Padding inputs to a few sizes avoids this.", limit)
        return made

    # -- a call ----------------------------------------------------------------------------

    def __call__(self, args: list) -> list:
        inputs = [x if type(x) in _PLAIN else _plain(x) for x in args]
        args.clear()
        settings = self.settings
        if "host_kernel_min_flops" not in settings and config.get("host_kernel_min_flops") < 0:
            # (left at its default: a compiled graph's small products are XLA's dots, which
            # torch.compile's closeness allows; defer mode's are all torch's kernels)
            settings = {**settings, "host_kernel_min_flops": host_products.COMPILED_MIN_FLOPS}
        context = config.override(**settings) if settings else contextlib.nullcontext()
        # (the graph's own torch calls are real work on plain tensors: under an eager mode, such
        # as a backward called in a defer block, they must not be recorded)
        modes = _disable_current_modes() if _modes_active() else contextlib.nullcontext()
        with context, modes:
            return self.run(inputs)

    def run(self, inputs: list) -> list:
        plan = self.plan_for(inputs)
        return _Run(self, plan, inputs).outputs(self.output)


def _schedule(plan: Plan) -> tuple[list, list]:
    """``plan``'s units as (method, unit) in order, and its write-backs as (input's slot, value
    node, the write's own slot), made at its first call: each later call only runs them."""
    runs = {Partition: _Run._run_partition, Draw: _Run._draw, OnTorch: _Run._on_torch}
    steps = [(runs[type(unit)], unit) for unit in plan.units if not isinstance(unit, WriteBack)]
    writes = [(slot_of_arg(unit.node.args[0]), unit.node.args[1], (unit.node.name, None))
              for unit in plan.units if isinstance(unit, WriteBack)]
    plan.schedule = (steps, writes)
    return plan.schedule


def _forgetting(memo: list, i: int):
    def forget(ref: Any) -> None:
        entry = memo[i]
        if type(entry) is tuple and entry[0] is ref:   # (not an entry made since for another tensor)
            memo[i] = _GONE if entry[3] else _GONE_ONCE
    return forget


# A graph input's memo (``_Run._imported``): (weak reference to the tensor, its data pointer, its
# JAX view, whether a later call reused the view), or a _Staged
_NEVER = (None, 0, None, True)        # before the input's first call
_GONE = (None, -1, None, True)        # the tensor it held died, after its view served two calls or more
_GONE_ONCE = (None, -1, None, False)  # the tensor it held died after one call
STAGED_BYTES = 1 << 16      # the largest input copied into a staging buffer (_Staged)


class _Staged:
    """A small graph input that is a new tensor at every call (a decoding step's token, its
    position, its mask), copied into a buffer of its own whose JAX view was made once: a
    DLPack import and the release of the last call's view cost ~14 us a tensor (~40 us of
    a decoding call's ~100 in a loop, more inside generate()), the copy ~1.  The buffer is
    this thread's: another thread calling the graph imports as before (``take`` is None).
    CPU tensors only."""

    __slots__ = ("buffer", "array", "thread")

    def __init__(self, buffer: torch.Tensor, array: Any) -> None:
        self.buffer, self.array, self.thread = buffer, array, threading.get_ident()

    @staticmethod
    def make(v: torch.Tensor) -> "Optional[_Staged]":
        if v.device.type != "cpu" or v.requires_grad or v.is_conj() or v.is_neg() \
                or v.numel() * v.element_size() > STAGED_BYTES:
            return None   # (on an accelerator, torch's copy and XLA's read would be on two streams)
        buffer = torch.empty(v.shape, dtype=v.dtype)
        array = interop.to_jax(buffer)
        return _Staged(buffer, array) if interop.is_view(array, buffer) else None

    def take(self, v: torch.Tensor) -> Any:
        """The view of ``v``'s values (the plan fixed its shape and dtype), or None."""
        if v.requires_grad or threading.get_ident() != self.thread:
            return None
        self.buffer.copy_(v)
        return self.array


def _modes_active() -> bool:
    """Whether a torch dispatch mode is on (user, infra or pre-dispatch): a call then runs with
    them off (``_disable_current_modes``, whose set-up costs ~20 us a call)."""
    return torch._C._len_torch_dispatch_stack() > 0 or _len_torch_dispatch_stack_pre_dispatch() > 0


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain(x: Any) -> Any:
    """A tensor subclass that can stand for a plain tensor (AOTAutograd's tangent hook: defer
    mode's tensors compute their data) as that plain tensor; anything else as it is."""
    if isinstance(x, torch.Tensor) and type(x) is not torch.Tensor \
            and not isinstance(x, torch.nn.Parameter) and hasattr(x, "__coerce_same_metadata_as_tangent__"):
        plain = x.__coerce_same_metadata_as_tangent__(None, torch.Tensor)
        return x if plain is None else plain
    return x


class _Run:
    """The values of one call, by slot: torch tensors or JAX arrays, converted when asked."""

    def __init__(self, graph: CompiledGraph, plan: Plan, inputs: list) -> None:
        gm = self.gm = graph.gm
        self.plan = plan
        self.graph_inputs = graph.input_slot_set
        self.env = dict(zip(graph.input_slots, inputs))
        for slot, target in graph.attrs:
            self.env[slot] = getattr(gm, target)
        steps, writes = plan.schedule or _schedule(plan)
        for run, unit in steps:
            run(self, unit)
        env = self.env
        for target_slot, src, out_slot in writes:
            target = env[target_slot]   # (a graph input's tensor)
            target.copy_(self.torch_value(src))
            env[out_slot] = target

    # -- values --------------------------------------------------------------------------

    def torch_value(self, n: Any) -> Any:
        if not isinstance(n, torch.fx.Node):
            return n
        if self.plan.where.get(n.name) == "host":
            return plan_.concrete(self.plan.values[n])
        slot = slot_of_arg(n)
        v = self.env[slot]
        if type(v) is not torch.Tensor and isinstance(v, jax.Array):
            v = self._to_torch(slot, v)
            self.env[slot] = v
        return v

    def _to_torch(self, slot: tuple, arr: Any) -> torch.Tensor:
        t = interop.to_torch(arr)
        meta = self.plan.slot_meta.get(slot)
        if meta is not None and t.numel() > 1 and tuple(t.stride()) != meta.stride:
            out = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype)
            src, dst = t, out
            # an expanded layout (stride 0) is written through one element of each such dim
            for d, (size, stride) in enumerate(zip(meta.shape, meta.stride)):
                if stride == 0 and size > 1:
                    src, dst = src.narrow(d, 0, 1), dst.narrow(d, 0, 1)
            try:
                dst.copy_(src)
            except RuntimeError:   # a layout whose elements overlap otherwise: XLA's is returned
                return t
            t = out
        return t

    def _imported(self, p: Partition) -> list:
        """``p``'s inputs as JAX arrays.  A graph input that is the same tensor at the same
        address as at the last call reuses that call's view without looking at its shape and
        strides: the plan was found by them (``spec_key``).  A decoding step reads ~55 inputs
        whose memory is cold after the model's Python ran, and each check touches it.  A small
        input that is a new tensor at each call (one whose last tensor served one call) is
        copied into a staging buffer (``_Staged``); one renewed less often (a KV cache, new at
        each generate()) is imported when it is new."""
        memo = p.imports
        if memo is None:
            memo = p.imports = [_NEVER if s in self.graph_inputs else None for s in p.inputs]
        env = self.env
        out = []
        for i, slot in enumerate(p.inputs):
            v = env[slot]
            known = memo[i]
            if known is None or not isinstance(v, torch.Tensor):
                out.append(interop.to_jax(v) if isinstance(v, torch.Tensor) else v)
                continue
            if type(known) is _Staged:
                array = known.take(v)
                out.append(interop.to_jax(v) if array is None else array)
                continue
            ref, pointer, array, reused = known
            if ref is not None and ref() is v and interop.data_ptr(v) == pointer:
                if not reused:
                    memo[i] = (ref, pointer, array, True)
                out.append(array)
                continue
            if known is _GONE_ONCE or (ref is not None and not reused and ref() is not v):
                # (a new tensor where the last one served one call: it is new at each call)
                staged = _Staged.make(v)
                if staged is not None:
                    memo[i] = staged
                    out.append(staged.take(v))
                    continue
            array = interop.to_jax(v)
            # (the view holds the tensor's memory: the entry goes when the tensor does)
            memo[i] = (weakref.ref(v, _forgetting(memo, i)), interop.data_ptr(v), array, False) \
                if interop.is_view(array, v) else _GONE
            out.append(array)
        return out

    def _args(self, node: torch.fx.Node, leaf) -> tuple[tuple, dict]:
        return tuple(plan_.map_nodes(node.args, leaf)), plan_.map_nodes(dict(node.kwargs), leaf)

    def _store(self, node: torch.fx.Node, out: Any) -> None:
        if isinstance(out, (tuple, list)):
            for i, o in enumerate(out):
                self.env[(node.name, i)] = o
        self.env[(node.name, None)] = out

    # -- units ---------------------------------------------------------------------------

    def _draw(self, unit: Draw) -> None:
        node = unit.node

        def placeholder(n: torch.fx.Node) -> Any:
            v = self.plan.values[n]
            if isinstance(v, torch.Tensor):
                return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype)
            return plan_.concrete(v)
        args, kwargs = self._args(node, placeholder)
        out = node.target(*args, **kwargs)
        self._store(node, out)

    def _on_torch(self, unit: OnTorch) -> None:
        node = unit.node
        args, kwargs = self._args(node, self.torch_value)
        out = self._run_node(node, args, kwargs)
        self._store(node, out)
        if unit.fallback:
            STATS.compiled_fallbacks[str(node.target)] += 1

    def _run_node(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
        """``node`` on torch: an error torch raises names the user's line; with check_nans, so
        does a NaN or Inf the op makes from finite inputs."""
        try:
            out = node.target(*args, **kwargs)
        except Exception as exc:
            checks_.annotate(exc, node)
            raise
        if config.get("check_nans") and checks_.has_nonfinite(out if isinstance(out, (tuple, list)) else [out]) \
                and not checks_.has_nonfinite([*args, *kwargs.values()]):
            raise checks_.nonfinite_error(node)
        return out

    def _run_partition(self, p: Partition) -> None:
        compiled = p.compiled
        if compiled is None and not p.failed:
            try:
                compiled = p.compiled = executables.get_or_compile(p.signature, p.make_program, p.avals, 0)
            except Exception as exc:  # noqa: BLE001 - a rule that fails on this graph: torch runs it
                p.failed = f"{type(exc).__name__}: {exc}"
                log.warning("deferfuse: a compiled graph's XLA partition could not be lowered or "
                            "compiled; torch runs its %d ops instead (counted in "
                            "stats()['compiled_fallbacks']): %s", len(p.nodes), p.failed)
        if compiled is None:
            self._partition_on_torch(p)
            return
        inputs = self._imported(p)
        check_nans = config.get("check_nans")
        finite_inputs = check_nans and not checks_.has_nonfinite(inputs)
        results, failed, details = executables.run(compiled, inputs, executables.NO_SCALARS)
        STATS.executions += 1
        if compiled.checks:
            for flag, value, (position, error, message) in zip(np.asarray(failed), np.asarray(details), compiled.checks):
                if flag:
                    raise error(message.replace("{value}", str(int(value))) + checks_.suffix(p.nodes[position]))
        if finite_inputs and checks_.has_nonfinite(results):
            self._find_nonfinite(p)
        for slot, r in zip(p.outputs, results):
            self.env[slot] = r

    def _find_nonfinite(self, p: Partition) -> None:
        """Run ``p``'s nodes again on torch (its results are not stored) and raise at the first
        that makes NaN or Inf from finite inputs."""
        env = self.env
        self.env = dict(env)
        try:
            self._partition_on_torch(p, counted=False)
        finally:
            self.env = env
        raise checks_.nonfinite_error(None, ", ".join(sorted({str(n.target) for n in p.nodes})))

    def _partition_on_torch(self, p: Partition, counted: bool = True) -> None:
        """Run a partition that could not compile op by op with torch (its draws are made)."""
        for node in p.nodes:
            args, kwargs = self._args(node, self.torch_value)
            if node.target is torch.ops.aten.native_dropout.default:
                p1m = 1.0 - args[1]
                mask = self.env[(node.name, 1)]
                out = (args[0] * mask * (0.0 if p1m == 0 else 1.0 / p1m), mask)
            else:
                out = self._run_node(node, args, kwargs)
            self._store(node, out)
            if counted:
                STATS.compiled_fallbacks[str(node.target)] += 1

    def outputs(self, output_node: torch.fx.Node) -> list:
        outs = output_node.args[0]
        return list(plan_.map_nodes(outs, self.torch_value)) if isinstance(outs, (tuple, list)) \
            else [self.torch_value(outs)]


def compiled_graphs() -> list[CompiledGraph]:
    """The graphs this process compiled that are still alive, oldest first."""
    return [g for g in (r() for r in GRAPHS) if g is not None]


def forget(graph: Optional[CompiledGraph] = None) -> None:
    """Drop the plans of ``graph`` (or of every graph): the next call plans again."""
    for g in ([graph] if graph is not None else compiled_graphs()):
        g.plans.clear()
        g.last = None
