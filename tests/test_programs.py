"""Random programs: defer mode must be observationally equivalent to strict PyTorch.

Hypothesis generates small eager programs as data (a list of `Step`s over numbered values),
runs each one twice -- under strict PyTorch and under ``deferfuse.defer()`` with
``always_compile=True`` -- and requires the same values, dtypes and shapes for every value the
program made, the same final state of every input tensor (and of the hidden storage behind
non-contiguous inputs), the same observations taken mid-program (``tolist()``, ``item()``), and
the same exception type at the same step when strict raises.

A program is generated step by step against meta tensors, so each op is chosen knowing the
shapes and dtypes of what exists; a step whose meta run raises ends the program (strict will
most likely raise there too, and then defer must raise the same way).  A program prints as the
Python it runs, and a failure prints a standalone reproduction.

Profiles (tests/conftest.py): ``default`` runs 5 x 70 programs, ``HYPOTHESIS_PROFILE=deep`` 5 x 1100.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import Phase, event, given, settings

import deferfuse
from program_gen import FAMILIES, OPS, programs
from program_model import Program, compiled

# --------------------------------------------------------------------------- interpreter

@dataclasses.dataclass
class Outcome:
    values: dict  # "v<k>" -> tensor, in the namespace at the end of the run
    bases: list  # the storage behind each input
    observed: list  # (python value, dtype)
    error: tuple | None  # (step index, exception type, message)


def execute(program: Program, defer: bool) -> Outcome:
    built = [spec.build() for spec in program.inputs]
    observed: list = []

    def observe(t: torch.Tensor, how: str) -> None:
        value = t.tolist() if how == "tolist" else t.item() if how == "item" else bool(t)
        observed.append((value, t.dtype))

    namespace: dict = {"torch": torch, "_observe": observe}
    namespace.update({f"v{i}": tensor for i, (tensor, _) in enumerate(built)})
    error = None
    if defer:
        with deferfuse.config.override(always_compile=True):
            with deferfuse.defer():
                error = _run_steps(program.steps, namespace)
    else:
        error = _run_steps(program.steps, namespace)
    values = {k: v for k, v in namespace.items() if k.startswith("v")}
    return Outcome(values, [base for _, base in built], observed, error)


def _run_steps(steps: tuple, namespace: dict) -> tuple | None:
    for index, step in enumerate(steps):
        try:
            exec(compiled(step.source()), namespace)
        except Exception as exc:  # the oracle decides which exceptions are right
            return index, type(exc), str(exc).splitlines()[0][:200] if str(exc) else ""
    return None


def _tensor_mismatch(name: str, expected: torch.Tensor, actual: Any) -> str | None:
    if not isinstance(actual, torch.Tensor):
        return f"{name}: expected a tensor, got {type(actual).__name__}"
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return (f"{name}: expected {expected.dtype}{list(expected.shape)}, "
                f"got {actual.dtype}{list(actual.shape)}")
    try:
        if expected.dtype.is_floating_point:
            torch.testing.assert_close(actual, expected, equal_nan=True, check_stride=False)
        elif not torch.equal(actual, expected):
            return f"{name}: values differ\n  expected {expected}\n  actual   {actual}"
    except AssertionError as exc:
        return f"{name}: {exc}\n  expected {expected}\n  actual   {actual}"
    return None


def _describe(error: tuple | None) -> str:
    if error is None:
        return "nothing"
    step, kind, message = error
    return f"{kind.__name__} at step {step} ({message})"


def compare(expected: Outcome, actual: Outcome) -> list[str]:
    problems = []
    if expected.error is not None or actual.error is not None:
        e_step, e_type = expected.error[:2] if expected.error else (None, None)
        a_step, a_type = actual.error[:2] if actual.error else (None, None)
        if (e_step, e_type) != (a_step, a_type):
            # the runs stopped at different steps, so the values cannot be compared
            return [f"exception: strict raised {_describe(expected.error)}, "
                    f"defer raised {_describe(actual.error)}"]
    for name, tensor in expected.values.items():
        if isinstance(tensor, torch.Tensor) and name in actual.values:  # else the error differs
            problems.append(_tensor_mismatch(name, tensor, actual.values[name]))
    for i, (e_base, a_base) in enumerate(zip(expected.bases, actual.bases)):
        problems.append(_tensor_mismatch(f"storage of input v{i}", e_base, a_base))
    if len(expected.observed) != len(actual.observed):
        problems.append(f"observations: {len(expected.observed)} in strict, "
                        f"{len(actual.observed)} in defer")
    for k, ((e_val, e_dtype), (a_val, a_dtype)) in enumerate(zip(expected.observed, actual.observed)):
        if type(e_val) is not type(a_val) or e_dtype != a_dtype:
            problems.append(f"observation {k}: strict {e_val!r} ({e_dtype}), defer {a_val!r} ({a_dtype})")
            continue
        problems.append(_tensor_mismatch(f"observation {k}", torch.tensor(e_val, dtype=e_dtype),
                                         torch.tensor(a_val, dtype=a_dtype)))
    return [p for p in problems if p]


def check_program(program: Program) -> None:
    expected = execute(program, defer=False)
    event(f"strict raised {expected.error[1].__name__}" if expected.error else "strict ran to the end")
    try:
        actual = execute(program, defer=True)
        problems = compare(expected, actual)
    except Exception as exc:
        raise AssertionError(f"defer run failed outside a step: {type(exc).__name__}: {exc}\n\n"
                             f"repro:\n{program.repro()}") from exc
    if problems:
        raise AssertionError("defer differs from strict:\n" + "\n".join(problems)
                             + f"\n\nrepro:\n{program.repro()}")


# --------------------------------------------------------------------------- the tests

@given(programs("pointwise"))
def test_pointwise_programs(program: Program) -> None:
    check_program(program)


@given(programs("reductions"))
def test_reduction_programs(program: Program) -> None:
    check_program(program)


@given(programs("mutation"))
def test_view_and_mutation_programs(program: Program) -> None:
    check_program(program)


@given(programs("promotion"))
def test_scalar_and_promotion_programs(program: Program) -> None:
    check_program(program)


@given(programs("mixed"))
def test_mixed_programs(program: Program) -> None:
    check_program(program)


def test_every_op_is_in_some_family() -> None:
    used = {name for family in FAMILIES.values() for name in family.ops}
    assert set(OPS) <= used, sorted(set(OPS) - used)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generated_programs_mostly_run_under_strict(family: str) -> None:
    """The generator is meant to produce well-typed programs; if most of them raise, the suite
    checks error paths instead of values."""
    ran = []

    @settings(max_examples=60, database=None, phases=[Phase.generate])
    @given(programs(family))
    def record(program: Program) -> None:
        ran.append(execute(program, defer=False).error is None)

    record()
    assert sum(ran) >= 0.6 * len(ran), f"{family}: only {sum(ran)}/{len(ran)} programs ran cleanly"
