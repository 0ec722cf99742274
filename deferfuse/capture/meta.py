"""Output metadata of an aten call, from meta tensors, cached by (op, input metadata).

The cache key holds the op, each tensor's ``TensorMeta`` and every static argument; a Python float
passed to a ``Scalar`` parameter enters the key by type only, since it is a runtime input of the
compiled computation and cannot change an output's shape or dtype.  Running the op on meta tensors
also raises torch's own shape and dtype errors, at record time, on the user's line.

Where meta kernels cannot say what the CPU kernel does, ``infer`` raises ``NoMeta`` and the
recorder runs the op eagerly (a counted fallback): an op with no meta kernel (geqrf, histogram,
the backward of multi_margin_loss), or a call the meta kernel rejects while the CPU kernel runs
it (``addbmm_`` on a ``self`` that broadcasts, which the CPU kernel resizes).  Meta kernels that
run but give other metadata than the CPU kernel are corrected by ``_CPU_CORRECTIONS``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Optional

import torch

from ..ir.graph import RuntimeScalar
from ..ir.meta import TensorMeta
from ..lower import dtypes as _dtypes
from ..lower.registry import Lowering, LoweringContext, OnTorch, raises_on_values
from ..lower.table import get_lowering, get_shape_rule
from ..stats import STATS, one_off
from .dynamo_free import no_dynamo_import


@dataclasses.dataclass(frozen=True)
class MetaEntry:
    outs: tuple[Optional[TensorMeta], ...]   # None for an output that is not a tensor
    tensor_outs: tuple[TensorMeta, ...]      # the tensor outputs
    lowering: Optional[Lowering]              # None: no usable lowering
    reason: Optional[str]                     # why there is none
    ctx: LoweringContext
    # whether the lowering checks values at run time (an index out of range: it may raise
    # there), lower/registry.raises_on_values
    raises: bool = False

    @property
    def on_torch(self) -> bool:
        """Whether the call is recorded all the same, to run on torch's kernel inside the
        deferred graph (its checker answered ``OnTorch``: lower/registry.py)."""
        return self.lowering is None and isinstance(self.reason, OnTorch)


_CACHE: dict[Any, Any] = {}   # key -> MetaEntry, or _NO_META
# (a program whose shapes never repeat would grow it without end: past this many keys it is
# emptied, which costs the keys still in use one inference each)
CACHE_LIMIT = 1 << 16


def _remember(key: Any, entry: Any) -> None:
    if len(_CACHE) >= CACHE_LIMIT:
        _CACHE.clear()
    _CACHE[key] = entry


class NoMeta(Exception):
    """Meta tensors cannot give this call's output metadata; run it eagerly."""


_NO_META = object()


def to_meta_tensor(m: TensorMeta) -> torch.Tensor:
    """A meta tensor with ``m``'s layout inside a storage of ``m.storage_numel`` elements."""
    base = torch.empty((m.storage_numel,), dtype=m.dtype, device="meta")
    return base.as_strided(m.shape, m.stride, m.offset)


def _to_meta(a: Any) -> Any:
    if isinstance(a, TensorMeta):
        return to_meta_tensor(a)
    if isinstance(a, RuntimeScalar):
        return a.value
    if isinstance(a, (list, tuple)):
        return type(a)(_to_meta(x) for x in a)
    if isinstance(a, torch.device):
        return torch.device("meta")
    return a


def _first_device(args: tuple, kwargs: dict) -> torch.device:
    stack = list(args) + list(kwargs.values())
    while stack:
        a = stack.pop(0)
        if isinstance(a, TensorMeta):
            return a.device
        if isinstance(a, (list, tuple)):
            stack[:0] = list(a)
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device)
    return torch.get_default_device()


def _to_meta_device(kwargs: dict) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "meta"


def _meta_of_output(out: Any, device: torch.device) -> Optional[TensorMeta]:
    if isinstance(out, torch.Tensor):
        return TensorMeta.of(out, device)
    return None


# id() of the ops that have had a lone flush (eager_lone_ops): the recorder looks for a lone
# place only for these
LONE_OPS: set = set()
# (id(op), place in the user's code) where the op's last flush was lone: one op, run on
# torch's kernel anyway; the recorder runs it at once there (eager_lone_ops).  Keyed by the
# place, not by the call's metadata: asking is then one lookup before any argument is looked
# at, and running an op at once is right for any shapes (it only decides where the op runs).
LONE_PLACES: set = set()
LONE_PLACES_LIMIT = 1 << 14


def mark_lone(op: Any, site: Any) -> None:
    """``op``'s flush recorded at ``site`` ran alone (on torch's kernel)."""
    if len(LONE_PLACES) >= LONE_PLACES_LIMIT:
        LONE_PLACES.clear()   # (places that stopped being lone: forgetting costs a lone flush)
    LONE_PLACES.add((id(op), site))
    LONE_OPS.add(id(op))


def unmark_lone(op: Any, site: Any) -> None:
    """A result of ``op`` run at once at ``site`` fed a recorded op: record it there again."""
    LONE_PLACES.discard((id(op), site))


def cached(key: Any) -> Optional[MetaEntry]:
    """The cached metadata for ``key``, counted as a hit; None if it is not cached or meta
    tensors could not give it (``infer`` says which)."""
    entry = _CACHE.get(key)
    if entry is None or entry is _NO_META:
        return None
    STATS.meta_cache_hits += 1
    return entry


_SIGHTED: set = set()   # (site, key) of calls run eagerly at their first sighting
SIGHTED_LIMIT = 1 << 16


def first_sighting(key: Any, site: Any) -> bool:
    """True the first time ``key`` is asked about from ``site`` (a place in the user's code),
    while its metadata has never been inferred: the recorder then runs the call eagerly
    instead.  A call that comes back to a site (a loop, a function called again) is inferred,
    and from then on ``key`` is cached wherever it is called from."""
    if key in _CACHE:
        return False
    sighting = (site, key)
    if sighting in _SIGHTED:
        return False
    if len(_SIGHTED) >= SIGHTED_LIMIT:
        # (a program whose shapes never repeat: forgetting costs each place one more eager run)
        _SIGHTED.clear()
    _SIGHTED.add(sighting)
    return True


_FIRST = [True]   # no inference has run in this process yet


def infer(op: torch._ops.OpOverload, key: Any, args: tuple, kwargs: dict) -> MetaEntry:
    """``_infer``; the process's first one (which loads the lowering table and whatever torch's
    meta kernels import, sympy: ~0.3 s) counted as a one-off cost (stats.one_off)."""
    if not _FIRST[0]:
        return _infer(op, key, args, kwargs)
    _FIRST[0] = False
    with one_off():
        return _infer(op, key, args, kwargs)


def _infer(op: torch._ops.OpOverload, key: Any, args: tuple, kwargs: dict) -> MetaEntry:
    """Metadata of ``op(*args, **kwargs)``, where tensors are given as TensorMeta.

    Raises NoMeta for a call the meta kernel rejects, and for one with no meta kernel: the
    recorder then runs it at once, where torch raises its own error for an invalid call.
    """
    try:
        entry = _CACHE.get(key)
    except TypeError as unhashable:   # (symbolic sizes: code that traces with fake tensors)
        raise NoMeta(str(op)) from unhashable
    if entry is not None:
        STATS.meta_cache_hits += 1
        if entry is _NO_META:
            raise NoMeta(str(op))
        return entry
    STATS.meta_cache_misses += 1
    device = _first_device(args, kwargs)
    if device.type == "meta" or _to_meta_device(kwargs):
        # meta tensors hold no data: their ops cost nothing at once, and a deferred one would
        # stand for memory that never exists (``model.to("meta")`` then re-pointed parameters
        # at it through ``.data``)
        _remember(key, _NO_META)
        raise NoMeta(str(op))
    meta_args = tuple(_to_meta(a) for a in args)
    meta_kwargs = {k: _to_meta(v) for k, v in kwargs.items()}
    if "device" in kwargs and kwargs["device"] is not None:
        meta_kwargs["device"] = torch.device("meta")
    try:
        with warnings.catch_warnings(), no_dynamo_import():
            # an out= tensor of the wrong size: the recorder resizes the real one and warns
            # then, as torch's kernel does, whether or not this inference is cached
            warnings.filterwarnings("ignore", message="An output with one or more elements was resized")
            # (whether the metadata comes from Python, not from the C++ code the CPU kernel
            # shares: a torch meta function or our shape rule, which may lay results out
            # otherwise than the kernel)
            from_python = _meta_kernel_is_python(op)
            try:
                result = op(*meta_args, **meta_kwargs)
            except NotImplementedError:
                rule = _shape_rule(op)
                if rule is None:
                    raise
                result, from_python = rule(*meta_args, **meta_kwargs), True
            except Exception:
                # A meta kernel written for another device rejects what the CPU kernel runs
                # (_grouped_mm's wants bfloat16): our shape rule, where we have one, decides
                # (and raises, as the kernel does, for calls it rejects)
                rule = get_shape_rule(op)
                if rule is None:
                    raise
                result, from_python = rule(*meta_args, **meta_kwargs), True
    except NotImplementedError as meta_error:
        # No meta kernel and no shape rule (or a data-dependent op, nonzero): only the real
        # kernel can say, and it raises the user's errors itself when it runs.
        _remember(key, _NO_META)
        raise NoMeta(str(op)) from meta_error
    except Exception as meta_error:
        # A call the meta kernel rejects: a user's error (shapes that do not multiply), or a
        # meta kernel stricter than the CPU kernel (pack_padded_sequence's wants its lengths on
        # the CPU, and meta tensors are not).  Only the real kernel can say which: the call runs
        # at once (the recorder's fallback), raising strict's own error, message and type, on
        # the user's line, or computing what strict computes.
        _remember(key, _NO_META)
        raise NoMeta(str(op)) from meta_error
    if device.type == "cpu" and _writes_overlapping_memory(op, args, kwargs):
        _raise_as_the_cpu_kernel_does(op, args, kwargs)
    results = result if isinstance(result, (tuple, list)) else (result,)
    outs = tuple(_meta_of_output(r, device) for r in results)
    lowering = get_lowering(op)
    reason: Optional[str] = None
    correction = _CPU_CORRECTIONS.get(op)
    if correction is not None and device.type == "cpu":
        # (lowerings compute what the CPU kernel does, so they follow the corrected metadata)
        outs = correction(outs, args, kwargs)
    elif device.type == "cpu" and from_python:
        outs = _fresh_outputs_as_cpu_lays_them(op, outs, args, kwargs)
    if device.type == "cpu" and any(o is not None and 0 in o.shape for o in outs):
        outs = _empty_outputs_as_cpu_lays_them(op, outs, args, kwargs)
    tensor_outs = tuple(o for o in outs if o is not None)
    ctx = LoweringContext(op, args, kwargs, tensor_outs)
    if lowering is None:
        reason = reason or "no lowering"
    elif not all(_dtypes.is_supported(m.dtype) for m in (*ctx.tensor_args(), *tensor_outs)):
        # (complex32 and friends: no rule can compute them; torch's kernel raises or runs)
        reason, lowering = NO_JAX_DTYPE, None
    elif lowering.check is not None:
        reason = lowering.check(ctx)
        if reason is not None:
            lowering = None
    entry = MetaEntry(outs, tensor_outs, lowering, reason, ctx,
                      lowering is not None and raises_on_values(lowering.rule))
    _remember(key, entry)
    return entry


def _shape_rule(op: torch._ops.OpOverload):
    """The registered shape rule of ``op``; for an ``out=`` overload without one, a rule derived
    from its functional twin's: the out tensors, resized to the functional outputs' shapes as
    torch's kernels resize them (None where there is neither)."""
    rule = get_shape_rule(op)
    if rule is not None:
        return rule
    from .classify import functional_variant, op_info  # (classify imports nothing of ours)
    functional = functional_variant(op)
    written = op_info(op).written
    base_rule = get_shape_rule(functional) if functional is not None and written else None
    if base_rule is None or torch.Tag.inplace in op.tags:
        return None

    def out_rule(*args, **kwargs):
        outs = [kwargs.pop(name) for name in written]
        results = base_rule(*args, **kwargs)
        results = results if isinstance(results, (tuple, list)) else (results,)
        for out, result in zip(outs, results):
            if out.dtype != result.dtype:
                raise NotImplementedError("out= of another dtype: the kernel decides")
            if out.numel() == 0:
                # an empty out= takes the result's layout (geqrf's column-major matrices);
                # the recorder lays the real tensor out the same way
                out.set_(result)
            elif out.shape != result.shape:
                out.resize_(result.shape)
        return outs[0] if len(outs) == 1 else tuple(outs)

    return out_rule


_SMALL = 1 << 16

# the reason of calls with a dtype JAX lacks: they run torch's own kernel, not a decomposition
# (whose parts would meet the same dtype, or compute what torch's kernel refuses to)
NO_JAX_DTYPE = "a dtype with no JAX equivalent"


def _small_real_inputs(args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
    """``args`` and ``kwargs`` with zero-filled CPU tensors of each TensorMeta's layout, or None
    where they would hold more than ``_SMALL`` elements."""
    tensors = [a for a in _walk(args, kwargs) if isinstance(a, TensorMeta)]
    if sum(t.storage_numel for t in tensors) > _SMALL:
        return None
    return _with_tensors(args, kwargs, _zeros_as)


def _zeros_as(m: TensorMeta) -> torch.Tensor:
    return torch.zeros((m.storage_numel,), dtype=m.dtype).as_strided(m.shape, m.stride, m.offset)


def _with_tensors(args: tuple, kwargs: dict, make) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with ``make(m)`` for each TensorMeta ``m``, and a generator of
    their own for the user's (a kernel run to learn metadata must not advance theirs)."""
    def real(a: Any) -> Any:
        if isinstance(a, TensorMeta):
            return make(a)
        if isinstance(a, RuntimeScalar):
            return a.value
        if isinstance(a, torch.Generator):
            return torch.Generator(a.device)
        if type(a) in (list, tuple):
            return type(a)(real(x) for x in a)
        return a

    return real(args), {k: real(v) for k, v in kwargs.items()}


def _empty_outputs_as_cpu_lays_them(op, outs: tuple, args: tuple, kwargs: dict) -> tuple:
    """Meta kernels and the CPU kernel may lay out an empty result differently (``x + 1`` on a
    0x1 tensor: strides (1, 1) on meta, (1, 0) on the CPU), and strides are observable.  For
    small inputs, run the op on zero-filled CPU tensors and take the strides and offset of each
    empty result from it; ops that draw random numbers are left alone (the real kernel would
    draw from the user's generator), as is any call the real kernel rejects."""
    if torch.Tag.nondeterministic_seeded in op.tags:
        return outs
    real = _small_real_inputs(args, kwargs)
    if real is None:
        return outs
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = op(*real[0], **real[1])
    except Exception:  # noqa: BLE001 - the meta kernel's metadata stands
        return outs
    results = result if isinstance(result, (tuple, list)) else (result,)
    if len(results) != len(outs):
        return outs
    corrected = []
    for meta, r in zip(outs, results):
        if meta is not None and isinstance(r, torch.Tensor) and 0 in meta.shape and tuple(r.shape) == meta.shape:
            meta = meta._replace(stride=tuple(r.stride()), offset=r.storage_offset())
        corrected.append(meta)
    return tuple(corrected)


_PYTHON_META: dict = {}   # op -> whether the kernel torch runs for it on meta tensors is Python


def _meta_kernel_is_python(op: torch._ops.OpOverload) -> bool:
    """Whether meta tensors run a Python function for ``op`` (a meta function of
    torch._meta_registrations or a reference from torch._refs, registered over the C++ meta
    function where there is one) rather than C++ code the CPU kernel shares (a structured
    kernel's meta function, a kernel for every device).  Python ones are written for every
    device and lay some results out otherwise than the CPU kernel: div(rounding_mode="floor")'s
    reference is a chain of ops whose last one orders its operands otherwise than the CPU
    kernel's TensorIterator, all.dims's keeps its input's strides where the CPU's reduction
    makes a contiguous result, and _fft_r2c's lays out its result as MKL's and cuFFT's plans
    do, not as pocketfft's contiguous one.  Asked once per op (the dispatcher's table, read
    from its dump, names the file that registered the active meta kernel)."""
    known = _PYTHON_META.get(op)
    if known is None:
        active = [line for line in torch._C._dispatch_dump(op.name()).splitlines() if line.startswith("Meta:")]
        known = bool(active) and ".py:" in active[0]
        _PYTHON_META[op] = known
    return known


def _fresh_positions(op: torch._ops.OpOverload, count: int) -> list[bool]:
    """For each of ``count`` outputs, whether the schema says it is new memory (not a view or
    an in-place or out= argument, whose layout is the argument's)."""
    returns = op._schema.returns
    if len(returns) == 1 and count != 1:   # (one Tensor[] return)
        return [returns[0].alias_info is None] * count
    return [r.alias_info is None for r in returns][:count] + [False] * max(0, count - len(returns))


def _fresh_outputs_as_cpu_lays_them(op, outs: tuple, args: tuple, kwargs: dict) -> tuple:
    """Where a Python meta function gave the metadata (``_meta_kernel_is_python``), the layout
    of each new, dense result as the CPU kernel makes it: the kernel itself is run on
    zero-filled CPU tensors of the call's layouts (the same sizes and strides) and says.  This
    runs where an inference misses its cache, and costs ~15 us for a small call (a meta
    function costs 0.2-5 ms).  An elementwise call too large to run is run on a miniature of
    itself (``_miniature_inputs``): each dimension cut to two elements, the strides in the same
    order, and the layout it gives (the order of its result's dimensions in memory) carried
    over to the call's own sizes.  Where the kernel rejects zeros (a linear solve) or the miniature, or
    gives a result that is not plain dense memory of its own, the meta function's layout
    stands."""
    if op.namespace != "aten":   # (another library's op may count its calls, or print)
        return outs
    fresh = [f and o is not None and o.numel > 1 for f, o in zip(_fresh_positions(op, len(outs)), outs)]
    if not any(fresh):
        return outs
    # (plain CPU tensors, whatever mode is on)
    with torch.utils._python_dispatch._disable_current_modes(), no_dynamo_import():
        return _as_probed(op, outs, fresh, args, kwargs)


def _as_probed(op, outs: tuple, fresh: list, args: tuple, kwargs: dict) -> tuple:
    small = sum(o.numel for o in outs if o is not None) <= _SMALL
    real = _small_real_inputs(args, kwargs) if small else None
    miniature = real is None
    if miniature:
        real = _miniature_inputs(op, args, kwargs, outs)
        if real is None:
            return outs
    results = _run_for_layout(op, real[0], real[1])
    if results is None or len(results) != len(outs):
        return outs
    inputs = {t.untyped_storage().data_ptr() for t in _walk(*real) if isinstance(t, torch.Tensor)}
    corrected = []
    for meta, r, wanted in zip(outs, results, fresh):
        if wanted and _owns_dense_memory(r, inputs) and r.dtype == meta.dtype:
            layout = _carried_over(r, meta) if miniature else (
                TensorMeta.of(r, meta.device) if tuple(r.shape) == meta.shape else None)
            meta = layout if layout is not None else meta
        corrected.append(meta)
    return tuple(corrected)


def _run_for_layout(op, args: tuple, kwargs: dict) -> Optional[tuple]:
    """``op``'s results on the CPU kernel, or None where it raises (an op that draws random
    numbers draws them with the default generator's state restored after)."""
    seeded = torch.Tag.nondeterministic_seeded in op.tags
    try:
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[], enabled=seeded):
            warnings.simplefilter("ignore")
            result = op(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the meta function's metadata stands
        return None
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _owns_dense_memory(r: Any, inputs: set) -> bool:
    """Whether ``r`` is a dense tensor over the whole of a storage of its own."""
    if not isinstance(r, torch.Tensor) or r.layout != torch.strided or r.is_nested:
        return False
    m = TensorMeta.of(r)
    return m.is_dense and m.offset == 0 and m.storage_numel == m.numel and \
        r.untyped_storage().data_ptr() not in inputs


def _miniature(m: TensorMeta) -> Optional[torch.Tensor]:
    """Zeros standing for ``m`` in a call too large to run: each dimension cut to at most two
    elements (a dimension of one, or none, kept), with strides in ``m``'s order, its equal and
    zero (broadcast) strides kept equal and zero and its gaps (a slice's step) kept as gaps,
    which is what layout rules read (TensorIterator's order of dimensions, memory formats);
    None for overlapping memory."""
    sizes = [min(n, 2) for n in m.shape]
    strides = [0] * len(sizes)
    step, real_extent, previous = 1, 1, None
    for d in sorted((d for d in range(len(sizes)) if m.stride[d] != 0), key=lambda d: (m.stride[d], -d)):
        if previous is not None and m.stride[d] == m.stride[previous]:
            strides[d] = strides[previous]
        else:
            if m.stride[d] < real_extent and m.shape[d] > 1:
                return None
            strides[d] = step * 2 if m.stride[d] > real_extent else step
        step = max(step, strides[d] * sizes[d])
        real_extent = max(real_extent, m.stride[d] * m.shape[d])
        previous = d
    numel = 1 + sum((n - 1) * st for n, st in zip(sizes, strides)) if all(sizes) else 0
    return torch.zeros((numel,), dtype=m.dtype).as_strided(sizes, strides)


# Ops whose results' sizes follow from their one tensor's sizes alone and whose CPU kernels
# take any sizes: a miniature of a call is a consistent call of its own (an FFT of signals of
# two elements; no signal size among the arguments: _fft_c2r's last_dim_size is left out)
_SIZES_FROM_INPUT = frozenset({torch.ops.aten._fft_r2c.default, torch.ops.aten._fft_c2c.default})


def _miniature_inputs(op, args: tuple, kwargs: dict, outs: tuple) -> Optional[tuple[tuple, dict]]:
    """The call's arguments with ``_miniature`` tensors, or None where a miniature could not
    stand for the call: only calls whose tensors all broadcast to the one shape of their
    results are cut down (elementwise kernels, and those that keep their input's shape), since
    cutting every dimension to two elements keeps those shapes consistent, and the ops of
    ``_SIZES_FROM_INPUT``; a kernel given sizes that disagree may abort the process instead of
    raising.  An op with sizes among its arguments (``new_zeros``) is left alone: its result
    would keep them."""
    if any("SymInt" in str(a.type) for a in op._schema.arguments):
        return None
    tensors = [a for a in _walk(args, kwargs) if isinstance(a, TensorMeta)]
    shapes = {o.shape for o in outs if o is not None}
    if not tensors or len(shapes) != 1:
        return None
    (shape,) = shapes
    if op in _SIZES_FROM_INPUT:
        if len(tensors) != 1 or len(tensors[0].shape) != len(shape):
            return None
    elif any(len(t.shape) > len(shape) or any(a not in (b, 1) for a, b in zip(reversed(t.shape), reversed(shape)))
             for t in tensors):
        return None
    miniatures = {}
    for t in tensors:
        if id(t) not in miniatures:
            made = _miniature(t)
            if made is None:
                return None
            miniatures[id(t)] = made
    return _with_tensors(args, kwargs, lambda m: miniatures[id(m)])


def _carried_over(r: torch.Tensor, meta: TensorMeta) -> Optional[TensorMeta]:
    """``meta`` laid out as the miniature's result ``r`` is: its dimensions in the same order
    in memory (dense), or None where ``r``'s dimensions do not stand for ``meta``'s (another
    number of them, or a dimension of one element where the other has more)."""
    if r.dim() != len(meta.shape) or any((a == 1) != (b == 1) for a, b in zip(r.shape, meta.shape)):
        return None
    strides = [0] * len(meta.shape)
    step, previous = 1, None
    for d in sorted(range(len(meta.shape)), key=lambda d: r.stride(d)):
        strides[d] = strides[previous] if previous is not None and r.stride(d) == r.stride(previous) else step
        step = max(step, strides[d] * meta.shape[d])
        previous = d
    return meta._replace(stride=tuple(strides), offset=0, storage_numel=meta.numel)


def _has_internal_overlap(m: TensorMeta) -> bool:
    """Whether two elements of ``m`` are one memory location: a dim of more than one element
    with stride 0 (an expanded tensor), the case torch's kernels detect."""
    return any(size > 1 and stride == 0 for size, stride in zip(m.shape, m.stride))


def _writes_overlapping_memory(op, args: tuple, kwargs: dict) -> bool:
    """Whether the call writes a tensor whose elements overlap (``x.expand(3, 2).add_(1)``)."""
    schema = op._schema
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = kwargs.get(argument.name) if argument.kwarg_only or i >= len(args) else args[i]
        if isinstance(value, TensorMeta) and _has_internal_overlap(value):
            return True
    return False


def _raise_as_the_cpu_kernel_does(op, args: tuple, kwargs: dict) -> None:
    """Meta kernels do not check what a write into overlapping memory does; torch's CPU kernels
    raise for most ops (``add_``, ``copy_``, ``exp_``, ``out=``) and run others (``fill_``,
    ``index_put_``).  Run the op on zero-filled CPU tensors of the same layout and raise what
    it raises (with the random number generator's state restored: an op that draws numbers must
    not advance the user's)."""
    real = _small_real_inputs(args, kwargs)
    if real is None:
        return
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.simplefilter("ignore")
        op(*real[0], **real[1])


def raise_as_torch_would(op, args: tuple, kwargs: dict, meta_error: Exception) -> bool:
    """Meta kernels sometimes raise another exception type than the real kernel (RuntimeError
    for IndexError), or reject a call the real kernel runs.  For small inputs, run the op on
    zero-filled CPU tensors of the same metadata and raise what it raises; True when it raised
    nothing (the meta kernel is wrong about this call).  Otherwise let the meta error stand."""
    real = _small_real_inputs(args, kwargs)
    if real is None:
        return False
    try:
        op(*real[0], **real[1])
    except Exception as real_error:  # noqa: BLE001 - re-raised with torch's own type
        if type(real_error) is not type(meta_error):
            raise real_error from None
        return False
    return True


def _no_saved_stats_in_eval(outs: tuple, args: tuple, kwargs: dict) -> tuple:
    """Batch norm in eval mode: the CPU kernel saves no statistics (empty save_mean and
    save_invstd); the meta kernel gives them one element per channel."""
    training = args[5] if len(args) > 5 else kwargs.get("training", False)
    if training:
        return outs
    return (outs[0],) + tuple(o._replace(shape=(0,), stride=(1,), offset=0, storage_numel=0) for o in outs[1:])


def _eval_batch_norm(outs: tuple, args: tuple, kwargs: dict) -> tuple:
    return _no_saved_stats_in_eval(outs, args[:5] + (False,), {})


def _no_weights_unless_needed(outs: tuple, args: tuple, kwargs: dict) -> tuple:
    """Native multi-head attention without ``need_weights``: the CPU kernel returns None for
    the weights; the meta kernel an empty tensor."""
    need_weights = args[10] if len(args) > 10 else kwargs.get("need_weights", True)
    return outs if need_weights else (outs[0], None)


def _lstm_workspace(outs: tuple, args: tuple, kwargs: dict) -> tuple:
    """An LSTM layer (mkldnn_rnn_layer): outside grad mode the CPU kernel gives no workspace
    (None); under it a uint8 buffer whose size oneDNN decides from the call's shapes and flags,
    where the meta kernel gives an empty one.  That size is read off the kernel itself, run once
    on zeros of the call's shapes (this metadata is cached per call signature).  (The recorder
    keys this op by grad mode.)"""
    if not torch.is_grad_enabled():
        return outs[:3] + (None,)
    # (under grad mode, as the call: the kernel gives no workspace without it; no input
    # requires grad, so no autograd graph is made)
    with torch.utils._python_dispatch._disable_current_modes():
        zeros = [torch.zeros(a.shape, dtype=a.dtype) if isinstance(a, TensorMeta) else a for a in args]
        workspace = torch.ops.aten.mkldnn_rnn_layer.default(*zeros, **kwargs)[3]
    return outs[:3] + (TensorMeta.of(workspace, outs[3].device),)


def _from_shape_rule(op: torch._ops.OpOverload):
    """The metadata our shape rule gives: for a meta kernel written for another device, which
    runs for some calls (the rest reach the rule when it raises) but lays out its output as
    that device's kernel does."""
    def correct(outs: tuple, args: tuple, kwargs: dict) -> tuple:
        result = get_shape_rule(op)(*_to_meta(args), **{k: _to_meta(v) for k, v in kwargs.items()})
        results = result if isinstance(result, (tuple, list)) else (result,)
        device = next(o.device for o in outs if o is not None)
        return tuple(_meta_of_output(r, device) for r in results)
    return correct


def _memory_format(m: TensorMeta) -> torch.memory_format:
    """torch's ``suggest_memory_format`` of a tensor laid out as ``m`` (channels-last strides,
    ambiguous ones of size-1 dimensions included, as the convolution kernels read them)."""
    from torch._prims_common import suggest_memory_format
    return suggest_memory_format(torch.empty_strided(m.shape, m.stride, device="meta"))


def _in_format(m: TensorMeta, fmt: torch.memory_format) -> TensorMeta:
    """``m`` laid out in ``fmt``, as a fresh tensor would be."""
    t = torch.empty(m.shape, device="meta", memory_format=fmt)   # (ambiguous strides as torch makes them)
    return m._replace(stride=tuple(t.stride()), offset=0)


# The convolution backends whose outputs take the channels-last layout of their input or weight
# (torch's _determine_backend_memory_format: oneDNN's, and the 2-D slow paths'); every other CPU
# backend (the 3-D slow paths, ...) writes them contiguous.
_LAYOUT_KEEPING_BACKENDS = frozenset({"Mkldnn", "MkldnnTranspose", "Slow2d", "SlowDilated2d", "SlowTranspose2d"})


def _convolution_format(x: TensorMeta, w: TensorMeta, params: tuple) -> torch.memory_format:
    """The layout the CPU kernel gives a convolution's output and gradients: channels-last where
    the input or the weight is and the backend torch picks for the call keeps it.  The backend
    depends on sizes, dtype and threads (oneDNN's 1x1 filters on one small image go to the slow
    path), so torch picks it here, on fake tensors of the call's metadata
    (``_select_conv_backend``)."""
    fmt = _memory_format(x)
    if fmt == torch.contiguous_format:
        fmt = _memory_format(w)
    if fmt == torch.contiguous_format:
        return fmt
    from torch._subclasses.fake_tensor import FakeTensorMode
    stride, padding, dilation, transposed, output_padding, groups = params
    with FakeTensorMode():
        fx, fw = (torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=m.device) for m in (x, w))
        backend = torch._C._select_conv_backend(fx, fw, None, stride, padding, dilation, transposed,
                                                output_padding, groups, None)
    return fmt if str(backend).rsplit(".", 1)[-1] in _LAYOUT_KEEPING_BACKENDS else torch.contiguous_format


def _laid_out(o: Optional[TensorMeta], fmt: torch.memory_format, ndim: int) -> Optional[TensorMeta]:
    if o is None or len(o.shape) != ndim or o.numel <= 1:
        return o
    return _in_format(o, fmt)


def _convolution_layout(outs: tuple, args: tuple, kwargs: dict) -> tuple:
    """A convolution's output, laid out as the CPU kernel lays it (``_convolution_format``); the
    meta kernel's differs (``y.permute(0, 2, 3, 1).view(-1, C)`` of a channels-last model's
    activations raised under defer)."""
    x, w = args[0], args[1]
    if not (isinstance(x, TensorMeta) and isinstance(w, TensorMeta)) or len(x.shape) not in (4, 5):
        return outs
    fmt = _convolution_format(x, w, tuple(args[3:9]))
    return tuple(_laid_out(o, fmt, len(x.shape)) for o in outs)


def _convolution_backward_layout(outs: tuple, args: tuple, kwargs: dict) -> tuple:
    """convolution_backward's gradients of the input and the weight, laid out as the forward's
    output (the layout of grad_output does not matter: the kernel converts it)."""
    x, w = args[1], args[2]
    if not all(isinstance(t, TensorMeta) for t in (x, w)) or len(x.shape) not in (4, 5):
        return outs
    fmt = _convolution_format(x, w, tuple(args[4:10]))
    fixed = list(outs)
    for i in (0, 1):   # (grad_input, grad_weight; the bias's gradient is 1-D)
        if i < len(fixed):
            fixed[i] = _laid_out(fixed[i], fmt, len(x.shape))
    return tuple(fixed)


# Meta kernels that run but disagree with the CPU kernel on output metadata, keyed by op, with
# the function that gives the CPU kernel's.  torch says nothing about these in schemas or tags,
# so they are listed; each was found by the OpInfo sweep (docs/conformance.md) or the model zoo
# (nn.MultiheadAttention's fast path).
_CPU_CORRECTIONS = {
    torch.ops.aten.native_batch_norm.default: _no_saved_stats_in_eval,
    torch.ops.aten._native_batch_norm_legit_no_training.default: _eval_batch_norm,
    torch.ops.aten._native_batch_norm_legit.default: _no_saved_stats_in_eval,
    torch.ops.aten._native_multi_head_attention.default: _no_weights_unless_needed,
    torch.ops.aten.mkldnn_rnn_layer.default: _lstm_workspace,
    # (CUDA's: bfloat16 only, a contiguous output; the CPU kernel pads its output's rows to 16
    # bytes, and runs float32 and float16 too: lower/grouped_mm.py)
    torch.ops.aten._grouped_mm.default: _from_shape_rule(torch.ops.aten._grouped_mm.default),
    torch.ops.aten.convolution.default: _convolution_layout,
    torch.ops.aten.convolution_backward.default: _convolution_backward_layout,
}


def _walk(args: tuple, kwargs: dict):
    stack = list(args) + list(kwargs.values())
    while stack:
        a = stack.pop()
        if type(a) in (list, tuple):
            stack.extend(a)
        else:
            yield a


def cache_size() -> int:
    """How many calls' metadata (or its absence) is cached now."""
    return len(_CACHE)


def sighted_count() -> int:
    """How many (place, call) sightings are remembered now."""
    return len(_SIGHTED)


@contextlib.contextmanager
def separate_sightings():
    """Inside, sightings start from none; at the exit the ones from before come back (tests of
    the bound on sightings)."""
    saved = set(_SIGHTED)
    _SIGHTED.clear()
    try:
        yield
    finally:
        _SIGHTED.clear()
        _SIGHTED.update(saved)


def clear_cache() -> None:
    """Forget all inferred metadata, and with it what was learned per call: which calls were
    sighted (a call is a first sighting only while its metadata has never been inferred) and
    which places' flushes were lone."""
    _CACHE.clear()
    _SIGHTED.clear()
    LONE_PLACES.clear()
    LONE_OPS.clear()
