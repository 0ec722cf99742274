"""Strict PyTorch is the oracle: run a function both ways and compare everything observable."""

from __future__ import annotations

from typing import Any, Callable

import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import deferfuse

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
from conformance.cases import layout_differs  # noqa: E402 - (after the path)


def _clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone().requires_grad_(tree.requires_grad)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone(x) for x in tree)
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    return tree


# Strides are observable (code branches on is_contiguous(), views of a result depend on them), so
# results' layouts are compared with strict's; ORACLE_STRIDES=0 turns that off (to see whether
# a failure is only a layout)
STRIDES = os.environ.get("ORACLE_STRIDES", "1") != "0"


def landed(t: torch.Tensor) -> torch.Tensor:
    """The memory a deferred tensor's values land in (computed now), as torch sees it."""
    if not isinstance(t, deferfuse.DeferredTensor):
        return t
    from deferfuse.capture.recorder import no_dispatch
    with no_dispatch():
        return t._materialize()


def assert_same(expected: Any, actual: Any, *, exact: bool = False, path: str = "result", **tol) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: expected a tensor, got {type(actual)}"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != strict {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {tuple(actual.shape)} != strict {tuple(expected.shape)}"
        if STRIDES:
            assert not layout_differs(actual, expected), (
                f"{path}: strides {actual.stride()} (offset {actual.storage_offset()}) != strict "
                f"{expected.stride()} (offset {expected.storage_offset()}), shape {tuple(expected.shape)}")
            data = landed(actual)
            assert not layout_differs(data, expected), (
                f"{path}: the computed data has strides {data.stride()} (offset "
                f"{data.storage_offset()}) != strict {expected.stride()} (offset {expected.storage_offset()})")
        a, e = actual.detach(), expected.detach()
        if exact or not (e.is_floating_point() or e.is_complex()):
            assert torch.equal(a, e) or (a.isnan() == e.isnan()).all() and torch.equal(
                a[~a.isnan()], e[~e.isnan()]), f"{path}: values differ\nstrict: {e}\ndefer:  {a}"
        else:
            torch.testing.assert_close(a, e, equal_nan=True, msg=lambda m: f"{path}: {m}", **tol)
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{path}: {actual!r}"
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_same(e, a, exact=exact, path=f"{path}[{i}]", **tol)
    elif isinstance(expected, float) and expected != expected:
        assert actual != actual, f"{path}: {actual} != nan"
    else:
        assert actual == expected, f"{path}: {actual!r} != strict {expected!r}"


def run_both(fn: Callable[..., Any], *inputs: Any, always_compile: bool = True) -> tuple[Any, Any, Any, Any]:
    """(strict result, defer result, strict inputs after, defer inputs after).  An exception under
    strict must be matched by the same exception type under defer; it is then re-raised."""
    strict_inputs, defer_inputs = _clone(inputs), _clone(inputs)
    strict_exc = defer_exc = None
    try:
        expected = fn(*strict_inputs)
    except Exception as exc:  # noqa: BLE001 - the oracle compares whatever strict raises
        strict_exc, expected = exc, None
    with deferfuse.config.override(always_compile=always_compile):
        try:
            with deferfuse.defer():
                actual = fn(*defer_inputs)
        except Exception as exc:  # noqa: BLE001
            defer_exc, actual = exc, None
    if strict_exc is not None:
        assert defer_exc is not None, f"strict raised {type(strict_exc).__name__}: {strict_exc}; defer did not"
        assert type(defer_exc) is type(strict_exc), (
            f"strict raised {type(strict_exc).__name__}: {strict_exc}\n"
            f"defer raised {type(defer_exc).__name__}: {defer_exc}")
    elif defer_exc is not None:
        raise AssertionError(f"defer raised but strict did not: {type(defer_exc).__name__}") from defer_exc
    return expected, actual, strict_inputs, defer_inputs


def check(fn: Callable[..., Any], *inputs: Any, exact: bool = False, **tol) -> Any:
    """Run ``fn`` under strict and defer (always compiling) and compare results and inputs."""
    expected, actual, strict_inputs, defer_inputs = run_both(fn, *inputs)
    assert_same(expected, actual, exact=exact, **tol)
    assert_same(strict_inputs, defer_inputs, exact=exact, path="inputs after", **tol)
    return actual


def lowered(fn: Callable[..., Any], *inputs: Any, compared: bool = False,
            decompositions: bool = False, **tol) -> Any:
    """check(), and assert that every op was lowered directly: nothing fell back to eager torch
    or (unless ``decompositions``) went through a torch._decomp decomposition.  ``compared``:
    also assert that strict did not raise (so values, not just exception types, were compared)."""
    deferfuse.reset_stats()
    out = check(fn, *inputs, **tol)
    if compared:
        assert out is not None, "strict raised: nothing was compared"
    stats = deferfuse.stats()
    assert not stats["fallbacks"], f"fell back: {stats['fallbacks']}"
    if not decompositions:
        assert not stats["decompositions"], f"decomposed: {stats['decompositions']}"
    return out


def grads(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The gradients of ``fn``'s (first) output with respect to the inputs that require grad, for
    a fixed, non-uniform output gradient (computed in the output's dtype)."""
    def run(*xs):
        y = fn(*xs)
        y = y[0] if isinstance(y, tuple) else y
        wanted = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
        weight = torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape).sin() + 0.5
        return torch.autograd.grad(y, wanted, weight)
    return run


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func)
        return func(*args, **(kwargs or {}))


def ops_of(fn: Callable[..., Any], *inputs: Any) -> set:
    """The aten ops ``fn`` reaches under strict (which a test of a lowering must exercise)."""
    with _Ops() as mode:
        fn(*inputs)
    return mode.seen


def seeded_randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """A normal sample of ``shape`` from its own seeded generator (the global one untouched)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
