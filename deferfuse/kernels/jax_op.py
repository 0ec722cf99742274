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
import marshal
import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from ..debugging.source import user_source
from ..errors import DeferfuseError
from ..exec import interop
from ..exec.executables import x64
from ..lower import dtypes as dtypes_
from ..lower.registry import lowering
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
    except (ImportError, TypeError):   # (JAX's internals moved: a float64 scalar)
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
        return tuple(results) if spec.tuple_return else results[0]

    def fake(self, args: Sequence[Any], kwargs: dict) -> Any:
        """The fake kernel: empty tensors of the shapes and dtypes jax.eval_shape gives."""
        spec = self.spec
        values = spec.bind(args, kwargs)
        dynamic, static = spec.split(values, _shape_key, scalar=lambda v: _FLOAT)
        key = (static, dynamic)
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
        return tuple(results) if spec.tuple_return else results[0]

    def rule(self, ctx: Any, *args: Any, **kwargs: Any) -> Any:
        """The lowering: the function itself, traced into the fused computation."""
        spec = self.spec
        values = spec.bind(args, kwargs)
        dynamic, static = spec.split(values, lambda a: a, scalar=_weak)
        device = ctx.out[0].device if ctx is not None and ctx.out else "cpu"
        with _OnPlatform(device):
            outs = self._bound(static, values)(dynamic)
        return tuple(outs) if spec.tuple_return else outs[0]


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
    memory, or another result's, is copied (a custom op's results never alias)."""
    taken = {t.data_ptr() for t in _tensors(values) if t.numel()}
    results = []
    for a in outs:
        t = interop.to_torch(a)
        if t.numel():
            if t.data_ptr() in taken:
                t = t.clone()
            taken.add(t.data_ptr())
        results.append(t)
    return results


def fingerprint(fn: Callable, bwd: Optional[Callable], version: Any) -> str:
    """What identifies the code of a kernel: ``version`` when given, else a hash of the source
    files defining ``fn`` and ``bwd`` (so an edit of a helper in the same file counts), or of
    their byte code where there is no file."""
    if version is not None:
        return f"v{version}"
    digest = hashlib.sha256()
    for f in (fn, bwd):
        if f is None:
            continue
        digest.update(getattr(f, "__qualname__", repr(type(f))).encode())
        try:
            path = inspect.getsourcefile(f)
            with open(path, "rb") as source:
                digest.update(source.read())
        except (OSError, TypeError):
            code = getattr(f, "__code__", None)
            digest.update(marshal.dumps(code) if code is not None else repr(f).encode())
    return digest.hexdigest()[:16]


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
        if spec.tensor_slots:
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
        text = str(self.op._schema)
        arguments = text[text.index("(") + 1:text.rindex(") ->")]
        cotangents = ", ".join(f"Tensor _ct{i}" for i in range(spec.n_outputs))
        n = len(spec.tensor_slots)
        returns = "Tensor" if n == 1 else "(" + ", ".join(["Tensor"] * n) + ")"
        vjp_schema = f"({cotangents}{', ' if arguments else ''}{arguments}) -> {returns}"
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

    def _vjp_fn(self, *values: Any) -> tuple:
        """The input cotangents, in JAX: ``values`` are the output cotangents, then the forward's
        arguments in schema order."""
        spec = self.spec
        cotangents, forward = values[:spec.n_outputs], list(values[spec.n_outputs:])
        slots = spec.tensor_slots
        if self.bwd is not None:
            g = tuple(cotangents) if spec.tuple_return else cotangents[0]
            positional = [v for v, k in zip(forward, spec.kwarg_only) if not k]
            keywords = {n: v for n, v, k in zip(spec.names, forward, spec.kwarg_only) if k}
            grads = self.bwd(g, *positional, **keywords)
            grads = tuple(grads) if isinstance(grads, (tuple, list)) else (grads,)
            if len(grads) != len(slots):
                raise TypeError(f"bwd returned {len(grads)} cotangents; {self.name} has {len(slots)} "
                                "tensor arguments (give None for one that needs none)")
            by_slot = dict(zip(slots, grads))
        else:
            differentiable = [i for i in slots if jnp.issubdtype(forward[i].dtype, jnp.inexact)]

            def primal(*xs: Any) -> tuple:
                vals = list(forward)
                for i, x in zip(differentiable, xs):
                    vals[i] = x
                return spec.outputs(spec.call(self.fn, vals), self.name)
            try:
                outs, pull = jax.vjp(primal, *[forward[i] for i in differentiable])
                grads = pull(tuple(_cotangent(c, o) for c, o in zip(cotangents, outs)))
            except Exception as error:  # noqa: BLE001 - reverse-mode AD of pallas_call, ...
                raise KernelError(
                    f"JAX cannot differentiate {self.name} ({type(error).__name__}: {error}); give its "
                    f"backward with deferfuse.jax_op({self.name!r}, bwd=...)") from error
            by_slot = dict(zip(differentiable, grads))
        results = []
        for i in slots:
            x, g = forward[i], by_slot.get(i)
            if not jnp.issubdtype(x.dtype, jnp.inexact):
                results.append(jnp.zeros((0,), x.dtype))   # (no gradient: autograd gets None)
            elif g is None:
                results.append(jnp.zeros(x.shape, x.dtype))
            else:
                results.append(jnp.asarray(g).astype(x.dtype))
        return tuple(results)

    def _setup_context(self, ctx: Any, inputs: tuple, output: Any, keyword_only_inputs: Optional[dict] = None) -> None:
        spec = self.spec
        values = spec.bind(inputs, keyword_only_inputs or {})
        slots = spec.tensor_slots
        ctx.save_for_backward(*[values[i] for i in slots])
        ctx.jax_values = [None if i in slots else v for i, v in enumerate(values)]
        ctx.n_inputs = len(inputs)
        outs = output if spec.tuple_return else (output,)
        ctx.out_metas = [(o.shape, o.dtype, o.device) for o in outs]
        integer = [o for o in outs if not (o.is_floating_point() or o.is_complex())]
        if integer:
            ctx.mark_non_differentiable(*integer)

    def _backward(self, ctx: Any, *grads: Any) -> tuple:
        spec = self.spec
        values = list(ctx.jax_values)
        saved = ctx.saved_tensors
        for i, t in zip(spec.tensor_slots, saved):
            values[i] = t
        cotangents = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                      for g, (shape, dtype, device) in zip(grads, ctx.out_metas)]
        positional = [v for v, k in zip(values, spec.kwarg_only) if not k]
        keywords = {n: v for n, v, k in zip(spec.names, values, spec.kwarg_only) if k}
        results = self._vjp_custom(*cotangents, *positional, **keywords)
        results = results if isinstance(results, (tuple, list)) else (results,)
        by_slot = dict(zip(spec.tensor_slots, results))
        out = []
        for i in range(ctx.n_inputs):
            g = by_slot.get(i)
            differentiable = g is not None and (values[i].is_floating_point() or values[i].is_complex())
            out.append(g if differentiable else None)
        return tuple(out)


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
