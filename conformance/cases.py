"""Run one OpInfo case -- (OpInfo, dtype, variant), aggregated over its samples -- under strict
PyTorch and under defer (always compiling), and classify it.

A case is ``lowered`` (every sample agreed with strict and nothing ran eagerly), ``fallback``
(every sample agreed, but ``stats()["fallbacks"]`` grew: some aten op ran eagerly), ``fail``
(a value, dtype, shape or exception mismatch, a crash or a timeout), or ``skip`` (nothing to
compare, e.g. the OpInfo yields no samples for this dtype; the reason says why).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import re
import signal
import time
import traceback
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import deferfuse
from deferfuse import modes as _df_modes

# --------------------------------------------------------------------------------------------
# What is swept

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "bool": torch.bool,
}
VARIANTS = ("function", "method", "inplace", "out", "grad")

# OpInfos whose outputs are drawn from torch's random generator: values are not compared (the
# brief of the sweep), only shape, dtype and sanity (finite, in range).  Whether the same seed
# gives the same values is recorded as a note (docs/semantics.md promises it does).
RANDOM_OPS = {
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial", "normal",
    "uniform", "randn", "randn_like", "rand_like", "randint", "randint_like",
    "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout",
}
# Value range of a random op's output, where it is obvious: (low, high, high inclusive).
# (op_db's "rand_like" OpInfo calls torch.randn_like, so it has no range.)
RANDOM_RANGES = {
    "bernoulli": (0, 1, True), "exponential": (0, math.inf, True),
    "geometric": (1, math.inf, True), "log_normal": (0, math.inf, True),
}

# OpInfos whose outputs hold unspecified values (torch leaves them uninitialized): only shape
# and dtype are compared.
UNSPECIFIED_VALUES = {
    "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided",
    "resize_", "resize_as_",
}

# Per-op comparison overrides; every entry says why.  Keys are OpInfo names (with ".variant"
# when the OpInfo has a variant_test_name).  Values: {"reason": str, "compare": "values_only"
# (ignore the integer index outputs) | "shape_dtype"}.
OVERRIDES: dict[str, dict[str, str]] = {
    # docs/semantics.md: unstable sort/topk with ties may return other valid indices; deferfuse
    # sorts stably.  The sorted values must still agree.
    "sort": {"compare": "values_only",
             "reason": "unstable sort with ties may return other valid indices (docs/semantics.md)"},
    "topk": {"compare": "values_only",
             "reason": "topk with ties may return other valid indices (docs/semantics.md)"},
    "argsort": {"compare": "shape_dtype",
                "reason": "unstable argsort with ties may return other valid indices (docs/semantics.md)"},
    "msort": {"compare": "values_only", "reason": "sort with ties (docs/semantics.md)"},
}

# Tolerance overrides are taken from the OpInfo's own toleranceOverride decorators for these
# test classes (None: the decorator applies to every test): TestCommon holds PyTorch's
# variant/consistency tests, TestInductorOpInfo compares a compiled backend against eager,
# which is what this sweep does.
_TOLERANCE_TEST_CLASSES = {None, "TestCommon", "TestInductorOpInfo"}


# --------------------------------------------------------------------------------------------
# Results

@dataclasses.dataclass
class CaseResult:
    op: str                      # OpInfo name, with ".variant_test_name" when it has one
    dtype: str
    variant: str
    status: str = "lowered"      # lowered | fallback | fail | skip
    reason: str = ""             # fail: the first failing sample's message; skip: why
    samples: int = 0             # samples compared
    samples_total: int = 0       # samples the OpInfo yields (before --max-samples), when known
    strict_raised: int = 0       # samples where strict raised (and defer had to raise the same type)
    fallback_ops: dict[str, int] = dataclasses.field(default_factory=dict)
    fallback_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def key(self) -> str:
        return f"{self.op}|{self.dtype}|{self.variant}"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "CaseResult":
        return cls(**data)


class Mismatch(AssertionError):
    pass


class SampleTimeout(BaseException):
    """Raised by SIGALRM when one sample runs too long (BaseException: nothing may swallow it)."""


# --------------------------------------------------------------------------------------------
# OpInfo helpers

def op_db() -> list:
    from torch.testing._internal.common_methods_invocations import op_db as db
    return db


def op_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def base_name(op) -> str:
    return op.name


def is_random(op) -> bool:
    return op.name in RANDOM_OPS and not (op.name == "nn.functional.feature_alpha_dropout"
                                         and op.variant_test_name == "without_train")


def variants_of(op, dtype: torch.dtype) -> list[str]:
    out = ["function"]
    if op.method_variant is not None:
        out.append("method")
    if op.inplace_variant is not None:
        out.append("inplace")
    if op.supports_out:
        out.append("out")
    if (dtype is torch.float64 and op.supports_autograd
            and torch.float64 in op.supported_backward_dtypes("cpu")):
        out.append("grad")
    return out


def enumerate_cases(ops: Iterable) -> list[tuple[Any, str, str]]:
    """(OpInfo, dtype name, variant) for every case of these OpInfos, in a fixed order."""
    cases = []
    for op in ops:
        supported = op.supported_dtypes("cpu")
        for dname, dtype in DTYPES.items():
            if dtype in supported:
                for variant in variants_of(op, dtype):
                    cases.append((op, dname, variant))
    return cases


def tolerance(op, dtype: torch.dtype) -> Optional[tuple[float, float]]:
    """(atol, rtol) from the OpInfo's toleranceOverride decorators that apply on CPU for this
    dtype (the loosest of them), or None for assert_close's defaults."""
    from torch.testing._internal.common_device_type import toleranceOverride
    best = None
    for info in getattr(op, "decorators", ()) or ():
        if getattr(info, "cls_name", None) not in _TOLERANCE_TEST_CLASSES:
            continue
        if getattr(info, "device_type", None) not in (None, "cpu"):
            continue
        dtypes = getattr(info, "dtypes", None)
        if dtypes is not None and dtype not in dtypes:
            continue
        for deco in getattr(info, "decorators", ()) or ():
            if isinstance(deco, toleranceOverride) and dtype in deco.d:
                tol = deco.d[dtype]
                if best is None:
                    best = (tol.atol, tol.rtol)
                else:
                    best = (max(best[0], tol.atol), max(best[1], tol.rtol))
    return best


# --------------------------------------------------------------------------------------------
# Cloning samples: fresh memory for each side, same layout (storage offset and strides), and
# tensors that shared a storage in the sample share a (new) storage in the clone.

def clone_tree(tree: Any, memo: Optional[dict] = None) -> Any:
    memo = {} if memo is None else memo
    if isinstance(tree, torch.Tensor):
        return _clone_tensor(tree, memo)
    if isinstance(tree, torch.Size):
        return tree
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(clone_tree(x, memo) for x in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(clone_tree(x, memo) for x in tree)
    if isinstance(tree, dict):
        return {k: clone_tree(v, memo) for k, v in tree.items()}
    return tree


def _clone_tensor(t: torch.Tensor, memo: dict) -> torch.Tensor:
    with torch.no_grad():
        if t.layout != torch.strided or type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            out = t.detach().clone()
        else:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr in memo:
                new = memo[ptr]
            else:
                new = storage.clone()
                if ptr:
                    memo[ptr] = new
            out = torch.empty(0, dtype=t.dtype, device=t.device)
            out.set_(new, t.storage_offset(), t.size(), t.stride())
    return out.requires_grad_(t.requires_grad)


def flatten(tree: Any) -> list:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [x for item in tree for x in flatten(item)]
    if isinstance(tree, dict):
        return [x for item in tree.values() for x in flatten(item)]
    return [tree]


def plain(t: torch.Tensor) -> torch.Tensor:
    """A plain torch tensor with the same values and layout (a DeferredTensor is materialized,
    into a copy of its storage: its sizes, strides and storage offset kept, whether or not it
    is dense)."""
    if isinstance(t, deferfuse.DeferredTensor):
        from deferfuse.capture.recorder import no_dispatch
        with no_dispatch():
            data = t._materialize().detach()
            if tuple(data.stride()) != tuple(t.stride()) or data.storage_offset() != t.storage_offset():
                raise Mismatch(f"the computed data has strides {data.stride()} (offset "
                               f"{data.storage_offset()}); the deferred tensor said {t.stride()} "
                               f"(offset {t.storage_offset()})")
            copy = torch.empty(0, dtype=data.dtype)
            copy.set_(data.untyped_storage().clone(), data.storage_offset(), data.shape, data.stride())
            if data.is_conj():
                copy = copy._conj()
            if data.is_neg():
                copy = copy._neg_view()
        return copy
    return t.detach()


def layout_differs(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether two strided tensors of one shape are laid out differently: another stride along
    a dimension of more than one element, or another storage offset (a dimension of one element
    has no stride to speak of, and a tensor of at most one element no layout)."""
    if actual.layout != torch.strided or expected.layout != torch.strided or expected.numel() <= 1:
        return False
    if actual.storage_offset() != expected.storage_offset():
        return True
    return any(a != e for a, e, n in zip(actual.stride(), expected.stride(), expected.shape) if n > 1)


def plain_tree(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return plain(tree)
    if isinstance(tree, torch.Size):
        return tree
    if isinstance(tree, (list, tuple)):
        return [plain_tree(x) for x in tree]
    if isinstance(tree, dict):
        return {k: plain_tree(v) for k, v in tree.items()}
    return tree


# --------------------------------------------------------------------------------------------
# Comparison

def _one_line(text: str, limit: int = 240) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    line = " | ".join(lines)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def compare(expected: Any, actual: Any, *, path: str, tol: Optional[tuple[float, float]],
            how: str = "values") -> None:
    """Raise Mismatch when ``actual`` (plain tensors from defer) differs from ``expected``."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise Mismatch(f"{path}: strict gave a tensor, defer gave {type(actual).__name__}")
        if actual.dtype != expected.dtype:
            raise Mismatch(f"{path}: dtype {actual.dtype} != strict {expected.dtype}")
        if actual.shape != expected.shape:
            raise Mismatch(f"{path}: shape {tuple(actual.shape)} != strict {tuple(expected.shape)}")
        if layout_differs(actual, expected):
            raise Mismatch(f"{path}: strides {actual.stride()} (offset {actual.storage_offset()}) != "
                           f"strict {expected.stride()} (offset {expected.storage_offset()}), "
                           f"shape {tuple(expected.shape)}")
        if how == "shape_dtype":
            return
        kwargs: dict[str, Any] = {}
        if tol is not None and (expected.is_floating_point() or expected.is_complex()):
            kwargs = {"atol": tol[0], "rtol": tol[1]}
        try:
            torch.testing.assert_close(actual, expected.detach(), equal_nan=True, **kwargs)
        except AssertionError as exc:
            raise Mismatch(f"{path}: {_one_line(exc)}") from None
        return
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            raise Mismatch(f"{path}: strict gave {type(expected).__name__} of {len(expected)}, "
                           f"defer gave {type(actual).__name__}"
                           f"{' of %d' % len(actual) if isinstance(actual, (list, tuple)) else ''}")
        for i, (e, a) in enumerate(zip(expected, actual)):
            sub = how
            if how == "values_only" and i > 0:
                sub = "shape_dtype"      # (values, indices): indices may differ with ties
            compare(e, a, path=f"{path}[{i}]", tol=tol, how=sub)
        return
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or set(actual) != set(expected):
            raise Mismatch(f"{path}: dict keys differ")
        for k in expected:
            compare(expected[k], actual[k], path=f"{path}[{k!r}]", tol=tol, how=how)
        return
    if isinstance(expected, float) and math.isnan(expected):
        if not (isinstance(actual, float) and math.isnan(actual)):
            raise Mismatch(f"{path}: {actual!r} != strict nan")
        return
    if type(expected) is not type(actual) or expected != actual:
        if isinstance(expected, float) and isinstance(actual, float) and math.isclose(
                expected, actual, rel_tol=1e-6, abs_tol=1e-9):
            return
        raise Mismatch(f"{path}: {actual!r} != strict {expected!r}")


def _random_sanity(name: str, expected: Any, actual: Any, inputs: Any, path: str) -> None:
    compare(expected, actual, path=path, tol=None, how="shape_dtype")
    for i, (e, a) in enumerate(zip(flatten(expected), flatten(actual))):
        if not isinstance(a, torch.Tensor) or a.numel() == 0:
            continue
        af = a.double() if a.dtype != torch.bool else a.to(torch.float64)
        e_finite = bool(torch.isfinite(e.double()).all()) if isinstance(e, torch.Tensor) else True
        if e_finite and not bool(torch.isfinite(af).all()):
            raise Mismatch(f"{path}[{i}]: defer produced non-finite values where strict did not")
        if name in RANDOM_RANGES:
            lo, hi, inclusive = RANDOM_RANGES[name]
            bad = (af < lo) | ((af > hi) if inclusive else (af >= hi))
            if bool(bad.any()):
                raise Mismatch(f"{path}[{i}]: values outside [{lo}, {hi}{']' if inclusive else ')'}: "
                               f"min {af.min().item()}, max {af.max().item()}")
        if name == "multinomial":
            n = flatten(inputs)[0].shape[-1]
            if bool(((af < 0) | (af >= n)).any()):
                raise Mismatch(f"{path}[{i}]: multinomial index outside [0, {n})")


# --------------------------------------------------------------------------------------------
# Running one side

@dataclasses.dataclass
class Side:
    result: Any = None
    inputs: Any = None          # the (cloned) argument tree after the call
    exc: Optional[BaseException] = None
    same_object: Optional[bool] = None   # in-place / out=: the result is the written tensor
    fallbacks: dict = dataclasses.field(default_factory=dict)
    fallback_reasons: dict = dataclasses.field(default_factory=dict)
    leaked: str = ""


SEED = 1234


def _run(call: Callable[[Any], Any], tree: Any, *, defer: bool) -> Side:
    side = Side(inputs=tree)
    torch.manual_seed(SEED)
    if not defer:
        try:
            side.result = call(tree)
        except Exception as exc:  # noqa: BLE001 - strict's exception is the oracle
            side.exc = exc
        return side
    deferfuse.reset_stats()
    try:
        with deferfuse.config.override(always_compile=True):
            with deferfuse.defer():
                side.result = call(tree)
        # Materialize outside the block, still inside the try: a value error raised at the
        # flush belongs to the defer side.
        side.result = _materialized(side.result)
    except Exception as exc:  # noqa: BLE001
        side.exc = exc
    finally:
        side.leaked = clean_modes()
    stats = deferfuse.stats()
    side.fallbacks = dict(stats["fallbacks"])
    side.fallback_reasons = dict(stats["fallback_reasons"])
    return side


def _materialized(tree: Any) -> Any:
    for t in flatten(tree):
        if isinstance(t, deferfuse.DeferredTensor):
            plain(t)
    return tree


def clean_modes() -> str:
    """Take any mode a defer run left behind off the stacks; say what was left."""
    left = []
    if _df_modes._stack.entries or _df_modes._stack.live:
        left.append(f"deferfuse mode stack not empty ({deferfuse.get_mode()})")
        _df_modes._stack.entries.clear()
        _df_modes._stack.live.clear()
    n = torch._C._len_torch_dispatch_stack()
    if n:
        left.append(f"{n} dispatch mode(s) left on torch's stack")
        while torch._C._len_torch_dispatch_stack():
            torch._C._pop_torch_dispatch_mode()
    return "; ".join(left)


# --------------------------------------------------------------------------------------------
# Variants

class _SkipSample(Exception):
    pass


def _call_for(op, variant: str) -> Callable[[Any], Any]:
    if variant == "function":
        return lambda t: op.op(t[0], *t[1], **t[2])
    if variant == "method":
        return lambda t: op.method_variant(t[0], *t[1], **t[2])
    if variant == "inplace":
        return lambda t: op.inplace_variant(t[0], *t[1], **t[2])
    if variant == "out":
        return lambda t: op.op(t[0], *t[1], out=t[3], **t[2])
    raise ValueError(variant)


def _out_template(op, sample) -> Any:
    """Out tensors for the out= variant, shaped like strict's functional result (zeros), or an
    empty tensor when the functional form raises (then the out= form must raise the same)."""
    tree = clone_tree((sample.input, sample.args, sample.kwargs))
    try:
        expected = op.op(tree[0], *tree[1], **tree[2])
    except Exception:  # noqa: BLE001
        first = flatten(sample.input)[0]
        dtype = first.dtype if isinstance(first, torch.Tensor) else torch.float32
        return torch.empty(0, dtype=dtype)
    if isinstance(expected, torch.Tensor):
        return torch.zeros(expected.shape, dtype=expected.dtype)
    if isinstance(expected, (list, tuple)) and all(isinstance(e, torch.Tensor) for e in expected):
        return tuple(torch.zeros(e.shape, dtype=e.dtype) for e in expected)
    raise _SkipSample(f"functional result is {type(expected).__name__}, not tensors")


def _grad_call(op, sample, cotangents: list) -> Callable[[Any], Any]:
    def call(t):
        inp, args, kwargs = t[0], t[1], t[2]
        out = op.gradcheck_wrapper(op.get_op(), inp, *args, **kwargs)
        out = sample.output_process_fn_grad(out)
        outs = [o for o in flatten(out) if isinstance(o, torch.Tensor) and o.requires_grad
                and (o.is_floating_point() or o.is_complex())]
        wrt = [x for x in flatten(t[:3]) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not outs or not wrt:
            raise _SkipSample("no differentiable outputs or inputs")
        if not cotangents:   # strict side: make them, outside any mode, from a fixed seed
            gen = torch.Generator().manual_seed(4321)
            for o in outs:
                cotangents.append(torch.randn(o.shape, dtype=o.dtype, generator=gen))
        if len(cotangents) != len(outs):
            raise Mismatch(f"{len(outs)} differentiable outputs, strict had {len(cotangents)}")
        loss = sum((o * c).sum() for o, c in zip(outs, cotangents))
        return torch.autograd.grad(loss, wrt, allow_unused=True)
    return call


def _fresh_plain_result(side: Side) -> bool:
    """Defer returned a plain torch tensor that is not a view of one of its inputs: it was
    computed eagerly."""
    ptrs = {t.untyped_storage().data_ptr() for t in flatten(side.inputs)
            if isinstance(t, torch.Tensor) and type(t) is torch.Tensor}
    return any(type(t) is torch.Tensor and t.numel() > 0 and t.untyped_storage().data_ptr() not in ptrs
               for t in flatten(side.result))


def _compare_sample(op, variant: str, strict: Side, defer: Side, tol) -> None:
    name = op_name(op)
    if defer.leaked:
        raise Mismatch(f"defer left a mode on the stack: {defer.leaked}")
    if strict.exc is not None:
        if defer.exc is None:
            raise Mismatch(f"strict raised {type(strict.exc).__name__}: {_one_line(strict.exc, 120)}; "
                           "defer did not raise")
        if type(defer.exc) is not type(strict.exc):
            raise Mismatch(f"strict raised {type(strict.exc).__name__}, defer raised "
                           f"{type(defer.exc).__name__}: {_one_line(defer.exc, 160)}")
        return
    if defer.exc is not None:
        raise Mismatch(f"defer raised {type(defer.exc).__name__}: {_one_line(defer.exc, 200)}")
    if strict.same_object is not None and strict.same_object != defer.same_object:
        raise Mismatch(f"{variant}: strict returned the written tensor itself "
                       f"({strict.same_object}), defer ({defer.same_object})")
    how = OVERRIDES.get(name, {}).get("compare", "values")
    if op.name in UNSPECIFIED_VALUES:
        how = "shape_dtype"
    actual = plain_tree(defer.result)
    if is_random(op):
        _random_sanity(op.name, strict.result, actual, strict.inputs, "result")
    else:
        compare(strict.result, actual, path="result", tol=tol, how=how)
    # Mutated (or not) inputs, and the out= tensors.
    inputs_how = "shape_dtype" if (op.name in UNSPECIFIED_VALUES or is_random(op)) else "values"
    after = plain_tree(defer.inputs)
    compare(list(strict.inputs[:3]), after[:3], path="inputs after", tol=tol, how=inputs_how)
    if variant == "out":   # the out= tensors: compared like the result
        compare(strict.inputs[3], after[3], path="out", tol=tol,
                how="shape_dtype" if is_random(op) else how)


class _Passive(TorchDispatchMode):
    """A dispatch mode that only runs each op: what strict computes when some mode is on."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _laid_out_as_under_a_mode(result: Any, call: Callable[[Any], Any], tree: Any) -> Any:
    """Strict's gradients with the strides strict gives them while any Python dispatch mode is
    on.  Some of torch's backward formulas (ormqr's) take another path, out of place, when an
    argument is subclass-like, and every tensor is while a mode is on (isTensorSubclassLike):
    ormqr's input gradient is column-major in plain strict and row-major under any mode.
    Defer mode is a mode, so that layout is the one it can give (docs/semantics.md, Known
    differences); the values stay plain strict's."""
    torch.manual_seed(SEED)
    try:
        with _Passive():
            moded = call(clone_tree(tree))
    except Exception:  # noqa: BLE001 - (strict's own result stands)
        return result

    def relaid(r: Any, m: Any) -> Any:
        if isinstance(r, torch.Tensor) and isinstance(m, torch.Tensor) and layout_differs(m, r) \
                and m.shape == r.shape and m.layout == torch.strided:
            out = torch.empty_strided(r.shape, m.stride(), dtype=r.dtype)
            with torch.no_grad():
                out.copy_(r)
            return out
        if isinstance(r, (list, tuple)) and isinstance(m, (list, tuple)) and len(r) == len(m):
            return type(r)(relaid(a, b) for a, b in zip(r, m))
        return r
    return relaid(result, moded)


def run_sample(op, variant: str, sample, tol, out_template=None) -> tuple[Side, Side]:
    tree = (sample.input, sample.args, sample.kwargs)
    if variant == "out":
        tree = tree + (out_template,)
    if variant == "grad":
        cots: list = []
        s_tree = clone_tree(tree)
        strict = _run(_grad_call(op, sample, cots), s_tree, defer=False)
        if isinstance(strict.exc, _SkipSample):
            raise strict.exc
        defer = _run(_grad_call(op, sample, cots), clone_tree(tree), defer=True)
        if strict.exc is None:
            strict.result = _laid_out_as_under_a_mode(strict.result, _grad_call(op, sample, cots), tree)
        return strict, defer
    call = _call_for(op, variant)
    sides = []
    for defer_side in (False, True):
        t = clone_tree(tree)
        side = _run(call, t, defer=defer_side)
        if side.exc is None and variant == "inplace":
            side.same_object = side.result is t[0]
        elif side.exc is None and variant == "out":
            outs = t[3]
            side.same_object = (side.result is outs if isinstance(outs, torch.Tensor) else
                                isinstance(side.result, (tuple, list)) and len(side.result) == len(outs)
                                and all(r is o for r, o in zip(side.result, outs)))
        sides.append(side)
    return sides[0], sides[1]


def _samples(op, dtype: torch.dtype, requires_grad: bool, limit: Optional[int]) -> tuple[list, Optional[int]]:
    """The first ``limit`` samples (all when None), and the total when it was counted."""
    torch.manual_seed(0)
    gen = op.sample_inputs("cpu", dtype, requires_grad=requires_grad)
    if limit is None:
        samples = list(gen)
        return samples, len(samples)
    samples = list(itertools.islice(gen, limit))
    total = None
    if len(samples) < limit:
        total = len(samples)
    else:
        try:    # counting the rest is cheap for most OpInfos; give up on slow generators
            start, extra = time.monotonic(), 0
            for _ in gen:
                extra += 1
                if time.monotonic() - start > 2.0:
                    extra = None
                    break
            total = None if extra is None else limit + extra
        except Exception:  # noqa: BLE001
            total = None
    return samples, total


def _alarm(seconds: float):
    def handler(signum, frame):
        raise SampleTimeout(f"sample ran longer than {seconds:.0f}s")
    if seconds and hasattr(signal, "SIGALRM"):
        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, seconds)


def _disarm():
    if hasattr(signal, "SIGALRM"):
        signal.setitimer(signal.ITIMER_REAL, 0)


def run_op(op, *, dtypes: Optional[Iterable[str]] = None, variants: Optional[Iterable[str]] = None,
           max_samples: Optional[int] = None, sample_timeout: float = 60.0,
           on_start: Optional[Callable[[str], None]] = None,
           skip_keys: Iterable[str] = ()) -> Iterator[CaseResult]:
    """Every case of one OpInfo, in order; one result per (dtype, variant).  ``on_start(key)``
    is called before each case runs (the driver uses it to name a case that crashed)."""
    dtypes = list(dtypes) if dtypes is not None else list(DTYPES)
    supported = op.supported_dtypes("cpu")
    for dname in dtypes:
        dtype = DTYPES[dname]
        if dtype not in supported:
            continue
        wanted = [v for v in variants_of(op, dtype) if variants is None or v in variants]
        if not wanted:
            continue
        tol = tolerance(op, dtype)
        samples = grad_samples = None
        errors: dict[bool, str] = {}
        total = grad_total = None
        for variant in wanted:
            result = CaseResult(op_name(op), dname, variant)
            if result.key in skip_keys:
                continue
            if on_start is not None:
                on_start(result.key)
            start = time.monotonic()
            need_grad = variant == "grad"
            try:
                if need_grad and grad_samples is None and True not in errors:
                    grad_samples, grad_total = _samples(op, dtype, True, max_samples)
                elif not need_grad and samples is None and False not in errors:
                    samples, total = _samples(op, dtype, False, max_samples)
            except Exception as exc:  # noqa: BLE001
                errors[need_grad] = f"sample_inputs raised {type(exc).__name__}: {_one_line(exc, 160)}"
            if need_grad in errors:
                result.status, result.reason = "skip", errors[need_grad]
                result.seconds = time.monotonic() - start
                yield result
                continue
            run_case(op, variant, grad_samples if need_grad else samples, tol, result,
                     sample_timeout=sample_timeout)
            result.samples_total = (grad_total if need_grad else total) or 0
            if tol is not None:
                result.notes.append(f"tolerance override atol={tol[0]:g} rtol={tol[1]:g}")
            result.seconds = time.monotonic() - start
            yield result


def run_case(op, variant: str, samples: list, tol, result: CaseResult,
             sample_timeout: float = 60.0) -> None:
    fallback_ops: collections.Counter = collections.Counter()
    fallback_reasons: collections.Counter = collections.Counter()
    skipped: list[str] = []
    seed_mismatch = 0
    uncounted_eager = 0     # a plain tensor came back from defer with no fallback counted
    for index, sample in enumerate(samples):
        if variant == "inplace" and getattr(sample, "broadcasts_input", False):
            pass   # strict raises; defer must raise the same type: still compared
        try:
            _alarm(sample_timeout)
            try:
                out_template = _out_template(op, sample) if variant == "out" else None
                strict, defer = run_sample(op, variant, sample, tol, out_template)
                _compare_sample(op, variant, strict, defer, tol)
                if is_random(op) and strict.exc is None:
                    try:
                        compare(strict.result, plain_tree(defer.result), path="r", tol=None)
                    except Mismatch:
                        seed_mismatch += 1
            finally:
                _disarm()
        except _SkipSample as exc:
            skipped.append(str(exc))
            continue
        except (Mismatch, SampleTimeout) as exc:
            result.status = "fail"
            result.reason = f"sample {index}: {_one_line(exc)}"
            result.samples += 1
            clean_modes()
            break
        except Exception as exc:  # noqa: BLE001 - a bug in the harness or an unexpected error
            result.status = "fail"
            tb = traceback.extract_tb(exc.__traceback__)
            where = f" at {tb[-1].name}" if tb else ""
            result.reason = f"sample {index}: comparison raised {type(exc).__name__}{where}: {_one_line(exc, 160)}"
            result.samples += 1
            clean_modes()
            break
        result.samples += 1
        if strict.exc is not None:
            result.strict_raised += 1
        elif variant in ("function", "method") and not defer.fallbacks and not is_random(op) \
                and _fresh_plain_result(defer):
            uncounted_eager += 1
        fallback_ops.update(defer.fallbacks)
        fallback_reasons.update(defer.fallback_reasons)
    result.fallback_ops = dict(fallback_ops)
    result.fallback_reasons = dict(fallback_reasons)
    if seed_mismatch:
        result.notes.append(f"{seed_mismatch} sample(s): values differ from strict under the same seed")
    if uncounted_eager:
        result.notes.append(f"{uncounted_eager} sample(s): defer returned a plain (eagerly computed) "
                            "tensor and counted no fallback")
    if skipped:
        result.notes.append(f"{len(skipped)} sample(s) skipped: {skipped[0]}")
    if result.status == "fail":
        return
    if result.samples == 0:
        result.status = "skip"
        result.reason = ("no samples" if not samples else f"no comparable samples ({skipped[0]})")
    elif fallback_ops:
        result.status = "fallback"
