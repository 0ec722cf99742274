"""``jax_op``: a JAX function (a Pallas kernel included) as a PyTorch custom op.

    @deferfuse.jax_op("mylib::gated")
    def gated(x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
        return x * jax.nn.sigmoid(y) * scale      # on jax.Arrays

    out = gated(a, b, 0.5)                        # or torch.ops.mylib.gated(a, b, 0.5)

The op is a ``torch.library.custom_op`` (functional: ``mutates_args=()``) with

- an implementation (strict mode, debug mode, and defer mode's calls run at once): the function
  under ``jax.jit`` on DLPack views of the input tensors, results handed back through DLPack;
- a fake kernel (meta tensors, ``FakeTensorMode``, ``torch.compile`` tracing, defer mode's
  metadata): ``jax.eval_shape`` of the function, cached per input metadata, never running it;
- a lowering in deferfuse's table whose rule is the function itself, so in defer mode it is
  inlined into the fused XLA computation with the ops around it;
- autograd (``register_autograd``): the backward is a second custom op, ``<name>_jaxvjp``, that
  recomputes the forward under ``jax.vjp`` (or calls the user's ``bwd=``), so it too runs in
  every mode and fuses in defer mode.

Everything runs with JAX's 64-bit types on, as deferfuse's own computations do, so float64 and
int64 tensors keep their dtypes.  An error the function raises (a shape it rejects) is raised
again with the op's name and the user's line, with its own type where that type takes a message.
"""

from __future__ import annotations

import hashlib
import inspect
import threading
import warnings
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from ..debugging.source import user_source
from ..errors import DeferfuseError
from ..exec import backend, interop
from ..exec.executables import x64
from ..lower import dtypes as dtypes_
from ..lower.registry import lowering
from ..stats import STATS
from .._lazy import lazy_import
from .calls import CallSpec

jax = lazy_import("jax", globals(), "jax")
jnp = lazy_import("jax.numpy", globals(), "jnp")


class KernelError(DeferfuseError):
    """A ``jax_op`` could not run: its function raised an exception with no plain message, or
    JAX cannot differentiate it and it has no ``bwd=``."""


# the platform the kernel being traced will run on (see pallas_interpret)
_CALL = threading.local()


def pallas_interpret() -> bool:
    """Whether a Pallas kernel traced now should run in interpret mode (``interpret=True``):
    True when the ``jax_op`` call being traced runs on the CPU, the only way Pallas runs
    there; False on an accelerator, where ``pallas_call`` compiles the kernel.  Outside a
    ``jax_op`` call, from JAX's default backend."""
    platform = getattr(_CALL, "platform", None) or jax.default_backend()
    return platform == "cpu"


class _OnPlatform:
    """While tracing: the platform of the call, for pallas_interpret."""

    def __init__(self, device: Any) -> None:
        kind = getattr(device, "type", device) or "cpu"
        self.platform = "cpu" if kind in ("cpu", "meta") else kind

    def __enter__(self) -> None:
        self.saved = getattr(_CALL, "platform", None)
        _CALL.platform = self.platform

    def __exit__(self, *exc: Any) -> None:
        _CALL.platform = self.saved


def _first_device(values: Sequence[Any]) -> Optional[torch.device]:
    for v in values:
        if isinstance(v, torch.Tensor):
            return v.device
        if isinstance(v, (list, tuple)):
            found = _first_device(v)
            if found is not None:
                return found
    return None


_warned_forked = False


def _warn_forked(name: str) -> None:
    """Once per process: a jax_op runs XLA in a child forked after JAX started.  (deferfuse
    silences JAX's own warning at every fork, which its own work never needs: exec/backend.py.)"""
    global _warned_forked
    if not _warned_forked:
        _warned_forked = True
        where = user_source()
        warnings.warn(
            f"{name} runs XLA in a process forked after JAX started"
            + (f" (called at {where})" if where else "") + ": XLA's threads did not survive the "
            "fork, and it may deadlock here. Start such workers with the 'spawn' or 'forkserver' "
            "method (multiprocessing.get_context('spawn'), DataLoader(multiprocessing_context='spawn')).",
            RuntimeWarning, stacklevel=3)


def _named(name: str, error: Exception) -> Exception:
    """``error`` again, its message naming the op and the user's line (its own type where the
    type takes one message; a KernelError otherwise)."""
    text = str(error)
    if text.startswith(name + ":"):
        return error
    where = user_source()
    message = f"{name}: {type(error).__name__}: {text}" + (f" (called at {where})" if where else "")
    try:
        named = type(error)(message)
        if str(named) == message:
            return named
    except Exception:  # noqa: BLE001 - a type with another constructor: ours carries the message
        pass
    return KernelError(message)


def _weak(x: Any) -> Any:
    """A runtime scalar (a 0-d float64 array in a fused computation) as the weakly typed value
    a Python float is in JAX: ``x * scale`` keeps x's dtype, as it does under ``jax.jit``."""
    if isinstance(x, (int, float)):
        return float(x)
    try:
        from jax._src.lax.lax import _convert_element_type
        return _convert_element_type(x, weak_type=True)
    except (ImportError, AttributeError, TypeError):   # (JAX's internals moved: a float64 scalar)
        return x


_FLOAT = "float"   # a runtime float's place in a metadata key


class _Body:
    """One op's JAX function and the three ways it runs: jitted (the implementation),
    shape-evaluated (the fake kernel) and inlined (the lowering rule)."""

    def __init__(self, name: str, spec: CallSpec, fn: Callable[..., Any], positional: bool = False) -> None:
        self.name, self.spec, self.fn = name, spec, fn
        self.positional = positional     # fn takes every value positionally, in schema order
        self._jitted: dict = {}
        self._shapes: dict = {}

    def _bound(self, static: tuple, values: Sequence[Any]) -> Callable[[tuple], tuple]:
        spec, fn, name, positional = self.spec, self.fn, self.name, self.positional
        # (only the static values: the closure outlives the call, and must not keep its tensors)
        statics = [v if type(k) is tuple and k[0] == "s" else None for k, v in zip(static, values)]

        def run(dynamic: tuple) -> tuple:
            joined = spec.join(dynamic, static, statics)
            result = fn(*joined) if positional else spec.call(fn, joined)
            return spec.outputs(result, name)
        return run

    def run(self, args: Sequence[Any], kwargs: dict) -> Any:
        """The implementation: the function jitted, on DLPack views of the tensors."""
        if backend.forked_after_xla:
            _warn_forked(self.name)
        spec = self.spec
        values = spec.bind(args, kwargs)
        with x64():
            dynamic, static = spec.split(values, interop.to_jax)
            jitted = self._jitted.get(static)
            if jitted is None:
                jitted = self._jitted[static] = jax.jit(self._bound(static, values))
            try:
                with _OnPlatform(_first_device(values)):
                    outs = jitted(dynamic)
            except Exception as error:  # noqa: BLE001 - re-raised naming the op and the line
                raise _named(self.name, error) from error
            results = _to_torch(outs, values)
        return spec.pack(results)

    def fake(self, args: Sequence[Any], kwargs: dict) -> Any:
        """The fake kernel: empty tensors of the shapes and dtypes jax.eval_shape gives."""
        spec = self.spec
        values = spec.bind(args, kwargs)
        dynamic, static = spec.split(values, _shape_key, scalar=lambda v: _FLOAT)
        key = (static, tuple(tuple(p) if isinstance(p, list) else p for p in dynamic))
        found = self._shapes.get(key)
        device = _first_device(values)
        if found is None:
            avals = _avals(dynamic)
            try:
                with x64(), _OnPlatform(device):
                    outs = jax.eval_shape(self._bound(static, values), avals)
            except Exception as error:  # noqa: BLE001 - re-raised naming the op and the line
                raise _named(self.name, error) from error
            found = self._shapes[key] = tuple((tuple(o.shape), dtypes_.to_torch(o.dtype)) for o in outs)
        like = next((v for v in _tensors(values)), None)
        if like is None:
            results = [torch.empty(shape, dtype=dtype) for shape, dtype in found]
        else:
            results = [like.new_empty(shape, dtype=dtype) for shape, dtype in found]
        return spec.pack(results)

    def rule(self, ctx: Any, *args: Any, **kwargs: Any) -> Any:
        """The lowering: the function itself, traced into the fused computation."""
        spec = self.spec
        values = spec.bind(args, kwargs)
        dynamic, static = spec.split(values, lambda a: a, scalar=_weak)
        device = ctx.out[0].device if ctx is not None and ctx.out else "cpu"
        with _OnPlatform(device):
            outs = self._bound(static, values)(dynamic)
        return spec.pack(outs)


def _shape_key(t: torch.Tensor) -> tuple:
    return (tuple(int(s) for s in t.shape), t.dtype)


def _avals(dynamic: tuple) -> tuple:
    def aval(part: Any) -> Any:
        if part == _FLOAT:
            return 0.0
        if isinstance(part, list):
            return [aval(p) for p in part]
        shape, dtype = part
        return jax.ShapeDtypeStruct(shape, dtypes_.to_jax(dtype))
    return tuple(aval(p) for p in dynamic)


def _tensors(values: Sequence[Any]):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)


def _to_torch(outs: Sequence[Any], values: Sequence[Any]) -> list[torch.Tensor]:
    """The results as torch tensors over XLA's buffers (DLPack); a result that is an input's
    memory, or another result's, is copied (a custom op's results never alias), and the copy
    counted in ``stats()["dlpack_copies"]``."""
    taken = {t.data_ptr() for t in _tensors(values) if t.numel()}
    results = []
    for a in outs:
        t = interop.to_torch(a)
        if t.numel():
            if t.data_ptr() in taken:
                STATS.dlpack_copies += 1
                t = t.clone()
            taken.add(t.data_ptr())
        results.append(t)
    return results


def fingerprint(fn: Callable, bwd: Optional[Callable], version: Any) -> str:
    """What identifies the code of a kernel: ``version`` when given, else a hash of the source
    files defining ``fn`` and ``bwd`` (so an edit of a helper in the same file counts), or of
    their byte code where there is no file, and of the simple values (numbers, strings, tuples
    of them) their closures hold: a kernel made by a factory is another kernel for another
    value."""
    if version is not None:
        return f"v{version}"
    digest = hashlib.sha256()
    for f in (fn, bwd):
        if f is None:
            continue
        digest.update(getattr(f, "__qualname__", type(f).__qualname__).encode())
        code = getattr(f, "__code__", None)
        try:
            path = inspect.getsourcefile(f)
            with open(path, "rb") as source:
                digest.update(source.read())
        except (OSError, TypeError):
            digest.update(_code_text(code).encode() if code is not None else repr(f).encode())
        for cell in getattr(f, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:   # (an empty cell)
                continue
            digest.update(repr(value).encode() if _simple(value) else type(value).__qualname__.encode())
    return digest.hexdigest()[:16]


def _simple(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return True
    return isinstance(value, (tuple, frozenset)) and all(_simple(v) for v in value)


def _code_text(code: Any) -> str:
    """A stable text of a code object (marshal's bytes depend on reference counts)."""
    consts = tuple(_code_text(c) if hasattr(c, "co_code") else repr(c) for c in code.co_consts)
    return repr((code.co_code, consts, code.co_names, code.co_varnames, code.co_freevars))


class JaxOp:
    """A JAX function registered as the torch op ``name``; calling it calls the op."""

    def __init__(self, name: str, fn: Callable[..., Any], *, schema: Optional[str] = None,
                 bwd: Optional[Callable[..., Any]] = None, static_argnames: Sequence[str] = (),
                 version: Any = None) -> None:
        if "::" not in name:
            raise ValueError(f"jax_op needs a qualified name, 'namespace::name', got {name!r}")
        self.name, self.fn, self.bwd = name, fn, bwd
        if schema is None:
            schema = torch.library.infer_schema(fn, mutates_args=())
        self.fingerprint = fingerprint(fn, bwd, version)
        self._custom = torch.library.custom_op(name, self._impl, mutates_args=(), schema=schema)
        self.op: torch._ops.OpOverload = self._custom._opoverload
        self.spec = spec = CallSpec(self.op._schema, static_argnames)
        self._forward = _Body(name, spec, fn)
        self._custom.register_fake(self._fake)
        lowering(self.op, fingerprint=self.fingerprint, runtime_floats=spec.runtime_floats)(self._forward.rule)
        self.vjp_op: Optional[torch._ops.OpOverload] = None
        if spec.grad_slots:
            self._register_vjp(static_argnames)
        self.__name__ = getattr(fn, "__name__", name)
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__wrapped__ = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._custom(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<deferfuse.jax_op {self.name}: {self.op._schema}>"

    def _impl(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward.run(args, kwargs)

    def _fake(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward.fake(args, kwargs)

    # -- autograd ------------------------------------------------------------------------------
    def _register_vjp(self, static_argnames: Sequence[str]) -> None:
        spec = self.spec
        if spec.returns == "list":
            raise TypeError(f"{self.name} returns a list: jax_op differentiates ops that return a Tensor "
                            "or a tuple of Tensors")
        text = str(self.op._schema)
        arguments = text[text.index("(") + 1:text.rindex(") ->")]
        cotangents = ", ".join(f"Tensor _ct{i}" for i in range(spec.n_outputs))
        # (the cotangent of each tensor argument, flattened: one per Tensor and Tensor? argument,
        # one per element of a Tensor[] argument; an empty one where there is none)
        vjp_schema = f"({cotangents}{', ' if arguments else ''}{arguments}) -> Tensor[]"
        vjp_name = self.name + "_jaxvjp"
        self._vjp_custom = torch.library.custom_op(vjp_name, self._vjp_impl, mutates_args=(), schema=vjp_schema)
        self.vjp_op = self._vjp_custom._opoverload
        self._vjp_spec = CallSpec(self.vjp_op._schema, static_argnames)
        self._vjp = _Body(vjp_name, self._vjp_spec, self._vjp_fn, positional=True)
        self._vjp_custom.register_fake(lambda *a, **k: self._vjp.fake(a, k))
        lowering(self.vjp_op, fingerprint=self.fingerprint,
                 runtime_floats=self._vjp_spec.runtime_floats)(self._vjp.rule)
        self._custom.register_autograd(self._backward, setup_context=self._setup_context)

    def _vjp_impl(self, *args: Any, **kwargs: Any) -> Any:
        return self._vjp.run(args, kwargs)

    def _leaves(self, values: Sequence[Any]) -> list[tuple[int, Optional[int]]]:
        """(argument index, element index or None) of each tensor that may have a gradient."""
        found = []
        for i in self.spec.grad_slots:
            if isinstance(values[i], (list, tuple)):
                found.extend((i, j) for j in range(len(values[i])))
            else:
                found.append((i, None))
        return found

    def _vjp_fn(self, *values: Any) -> tuple:
        """The input cotangents, in JAX, flattened (``_leaves``): ``values`` are the output
        cotangents, then the forward's arguments in schema order."""
        spec = self.spec
        cotangents, forward = values[:spec.n_outputs], list(values[spec.n_outputs:])
        leaves = self._leaves(forward)

        def get(vals: Sequence[Any], leaf: tuple) -> Any:
            i, j = leaf
            return vals[i] if j is None else vals[i][j]

        if self.bwd is not None:
            g = spec.pack(cotangents)
            positional = [v for v, k in zip(forward, spec.kwarg_only) if not k]
            keywords = {n: v for n, v, k in zip(spec.names, forward, spec.kwarg_only) if k}
            grads = self.bwd(g, *positional, **keywords)
            grads = _per_argument(grads, [forward[i] for i in spec.grad_slots])
            if len(grads) != len(spec.grad_slots):
                raise TypeError(f"bwd returned {len(grads)} cotangents; {self.name} has {len(spec.grad_slots)} "
                                "tensor arguments (give None for one that needs none)")
            by_leaf = {}
            for i, g_i in zip(spec.grad_slots, grads):
                if isinstance(forward[i], (list, tuple)):
                    by_leaf.update(((i, j), g_ij) for j, g_ij in enumerate(g_i or [None] * len(forward[i])))
                else:
                    by_leaf[(i, None)] = g_i
        else:
            differentiable = [leaf for leaf in leaves if get(forward, leaf) is not None
                              and jnp.issubdtype(get(forward, leaf).dtype, jnp.inexact)]

            def primal(*xs: Any) -> tuple:
                vals = [list(v) if isinstance(v, (list, tuple)) else v for v in forward]
                for (i, j), x in zip(differentiable, xs):
                    if j is None:
                        vals[i] = x
                    else:
                        vals[i][j] = x
                return spec.outputs(spec.call(self.fn, vals), self.name)
            try:
                outs, pull = jax.vjp(primal, *[get(forward, leaf) for leaf in differentiable])
                grads = pull(tuple(_cotangent(c, o) for c, o in zip(cotangents, outs)))
            except Exception as error:  # noqa: BLE001 - reverse-mode AD of pallas_call, ...
                raise KernelError(
                    f"JAX cannot differentiate {self.name} ({type(error).__name__}: {error}); give its "
                    f"backward with deferfuse.jax_op({self.name!r}, bwd=...)") from error
            by_leaf = dict(zip(differentiable, grads))
        results = []
        for leaf in leaves:
            x, g = get(forward, leaf), by_leaf.get(leaf)
            if x is None:
                results.append(jnp.zeros((0,), jnp.float32))
            elif not jnp.issubdtype(x.dtype, jnp.inexact):
                results.append(jnp.zeros((0,), x.dtype))   # (no gradient: autograd gets None)
            elif g is None:
                results.append(jnp.zeros(x.shape, x.dtype))
            else:
                results.append(jnp.asarray(g).astype(x.dtype))
        return tuple(results)

    def _setup_context(self, ctx: Any, inputs: tuple, output: Any, keyword_only_inputs: Optional[dict] = None) -> None:
        spec = self.spec
        values = spec.bind(inputs, keyword_only_inputs or {})
        leaves = self._leaves(values)
        saved = [values[i] if j is None else values[i][j] for i, j in leaves]
        ctx.save_for_backward(*saved)
        ctx.jax_leaves = leaves
        ctx.jax_values = [None if i in spec.grad_slots else v for i, v in enumerate(values)]
        ctx.jax_lengths = {i: len(values[i]) for i, j in leaves if j is not None}
        ctx.n_inputs = len(inputs)
        outs = output if spec.returns == "tuple" else (output,)
        ctx.out_metas = [(o.shape, o.dtype, o.device) for o in outs]
        integer = [o for o in outs if not (o.is_floating_point() or o.is_complex())]
        if integer:
            ctx.mark_non_differentiable(*integer)

    def _backward(self, ctx: Any, *grads: Any) -> tuple:
        spec = self.spec
        values = list(ctx.jax_values)
        for i, n in ctx.jax_lengths.items():
            values[i] = [None] * n
        for (i, j), t in zip(ctx.jax_leaves, ctx.saved_tensors):
            if j is None:
                values[i] = t
            else:
                values[i][j] = t
        cotangents = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                      for g, (shape, dtype, device) in zip(grads, ctx.out_metas)]
        positional = [v for v, k in zip(values, spec.kwarg_only) if not k]
        keywords = {n: v for n, v, k in zip(spec.names, values, spec.kwarg_only) if k}
        flat = self._vjp_custom(*cotangents, *positional, **keywords)
        result: list[Any] = [None] * len(values)
        for (i, j), g, x in zip(ctx.jax_leaves, flat, ctx.saved_tensors):
            g = g if x is not None and (x.is_floating_point() or x.is_complex()) else None
            if j is None:
                result[i] = g
            else:
                if result[i] is None:
                    result[i] = [None] * ctx.jax_lengths[i]
                result[i][j] = g
        return tuple(result[:ctx.n_inputs])


def _per_argument(grads: Any, arguments: list) -> tuple:
    """What ``bwd`` returned as one entry per tensor argument: a lone cotangent (one argument)
    may come bare or in a tuple of one."""
    if len(arguments) != 1:
        return tuple(grads) if isinstance(grads, (tuple, list)) else (grads,)
    is_list = isinstance(arguments[0], (list, tuple))
    if isinstance(grads, (tuple, list)) and len(grads) == 1 and \
            (not is_list or isinstance(grads[0], (tuple, list)) or grads[0] is None):
        return tuple(grads)
    return (grads,)


def _cotangent(c: Any, out: Any) -> Any:
    """A cotangent for ``out`` as jax.vjp takes it: its dtype; float0 for integer outputs."""
    if not jnp.issubdtype(out.dtype, jnp.inexact):
        return np.zeros(out.shape, dtype=jax.dtypes.float0)
    return jnp.asarray(c).astype(out.dtype)


def jax_op(name: str, *, schema: Optional[str] = None, bwd: Optional[Callable[..., Any]] = None,
           static_argnames: Sequence[str] = (), version: Any = None) -> Callable[[Callable[..., Any]], JaxOp]:
    """Register a JAX function as the PyTorch op ``name`` ("namespace::name").

    The function's parameters are annotated with torch types (``torch.Tensor``, ``float``,
    ``int``, ``bool``, lists, ``Optional``), as for ``torch.library.custom_op``; it receives
    ``jax.Array``s for the tensors and returns a ``jax.Array`` or a tuple of them (annotated
    ``tuple[torch.Tensor, ...]``).  ``schema``: the op's schema, when the annotations cannot say
    it.  ``bwd``: ``bwd(g, *args, **kwargs)`` gives the cotangent of each tensor argument (in
    order; None for one without), from the output cotangent ``g`` (a tuple for several outputs)
    and the forward's arguments, for functions JAX cannot differentiate (``pallas_call``).
    ``static_argnames``: float arguments to compile in rather than pass at run time (other
    non-tensor arguments are always compiled in).  ``version``: identifies the function's code
    in the executable caches; by default a hash of the file defining it.
    """
    def register(fn: Callable[..., Any]) -> JaxOp:
        return JaxOp(name, fn, schema=schema, bwd=bwd, static_argnames=static_argnames, version=version)
    return register
