"""Random programs: defer mode must be observationally equivalent to strict PyTorch.

Hypothesis generates small eager programs as data (a list of `Step`s over numbered values) and
runs each one under strict PyTorch and under ``deferfuse.defer()`` with ``always_compile=True``.
They must agree on the values, dtypes and shapes of everything the program made, on the final
state of every input tensor (and of the hidden storage behind non-contiguous inputs), on the
observations taken mid-program (``tolist()``, ``item()``, ``numpy()``, ``bool()``), and on the
exception (same type, same step) when strict raises.  Integers and bools must match exactly;
floats within torch.testing's default tolerances, widened only by how far strict itself moves
when its transcendental and reducing ops are nudged by a few ulps (`UlpNoise`), so that an
ill-conditioned program such as exp(exp(x)) does not fail on XLA's differently rounded exp.

Programs are generated step by step against meta tensors (program_gen.py), so each op is chosen
knowing the shapes and dtypes of what exists.  A program prints as the Python it runs, and a
failure prints a standalone reproduction with literal inputs.

Profiles (tests/conftest.py): ``default`` runs 6 x 70 programs, ``HYPOTHESIS_PROFILE=deep`` 6 x 1100.
One of the six (``test_mixed_programs_through_the_tiers``) runs each program three times with the
default tiers instead of ``always_compile``: ops at once, an eager replay, a compiled run.
With ``DEFERFUSE_PROGRAM_LOG=path`` each program's reproduction is written there before its defer
run, so a crash that takes the process down (a segfault inside XLA) leaves its program behind
(``{worker}`` in the path becomes the pytest-xdist worker's name).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, currently_in_test_context, event, given, settings
from torch.utils._python_dispatch import TorchDispatchMode

import deferfuse
from deferfuse.capture import meta
from deferfuse import engine
import oracle
from program_gen import FAMILIES, OPS, programs
from program_model import InputSpec, Lit, Program, Step, compiled, observe_value
from user_defaults import forget_what_was_learned

# --------------------------------------------------------------------------- interpreter

@dataclasses.dataclass
class Outcome:
    values: dict  # "v<k>" -> tensor, in the namespace at the end of the run
    bases: list  # the storage behind each input
    observed: list  # (python value, dtype)
    error: tuple | None  # (step index, exception type, message)

    def tensors(self) -> dict:
        """Everything to compare, by name: the values, the inputs' storage, the observations."""
        named = {k: v for k, v in self.values.items() if isinstance(v, torch.Tensor)}
        named.update({f"storage of input v{i}": base for i, base in enumerate(self.bases)})
        named.update({f"observation {k}": torch.tensor(value, dtype=dtype)
                      for k, (value, dtype) in enumerate(self.observed)})
        return named


# Ops whose results XLA may round differently from torch's: transcendental functions (a few ulps
# apart between implementations), and sums and products of several terms (reassociated, so
# off by a few ulps of the sum of the terms' magnitudes, which can dwarf a cancelled result).
TRANSCENDENTAL_OPS = frozenset({"exp", "log", "sin", "cos", "tanh", "sigmoid", "pow", "prod",
                                "_softmax", "_log_softmax"})
SUMMING_OPS = frozenset({"sum", "mean", "cumsum", "mm", "bmm", "dot", "mv", "addmm"})
NOISE_ULPS = 4


class UlpNoise(TorchDispatchMode):
    """Strict PyTorch with each rounding op's floating-point result nudged by a few ulps.

    A run under this mode shows how far the program's results move when its ops round a little
    differently, as XLA's may: a defer result that differs from strict by no more than that (plus
    the default tolerance) is explained by the program's conditioning, exp(exp(x)) say, not by
    a bug.  Elements that the nudge turns nan or moves by more than 1e-4 of their size, or that
    it changes in an exact result (a comparison of nearly equal floats), are not compared."""

    def __init__(self, seed: int, direction: int = 1) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(seed)
        self.direction = direction  # runs with opposite directions nudge each element both ways

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__.rstrip("_")
        if name not in TRANSCENDENTAL_OPS | SUMMING_OPS:
            return out
        if name in ("_softmax", "_log_softmax") and out.is_floating_point():
            out.copy_(self._softmax_of_a_recomputed_input(name, args[0], args[1], out.dtype))
        for tensor in (out if isinstance(out, (tuple, list)) else (out,)):
            if not (isinstance(tensor, torch.Tensor) and tensor.is_floating_point()):
                continue
            eps = torch.finfo(tensor.dtype).eps
            sign = torch.randint(0, 2, tensor.shape, generator=self.generator) * 2 - 1
            sign = (sign * self.direction).to(tensor.dtype)
            if name in SUMMING_OPS:
                # the same op over the terms' magnitudes bounds what reordering can change
                # (integer terms too, summed into a float result: mean(int64, dtype=float32);
                # in float64, where abs of the most negative integer does not wrap)
                terms = [a.abs() if isinstance(a, torch.Tensor) and a.is_floating_point()
                         else a.double().abs() if isinstance(a, torch.Tensor) and a.dtype != torch.bool
                         else a for a in args]
                magnitude = func(*terms, **kwargs).abs().to(tensor.dtype)
                tensor.add_(sign * 2 * NOISE_ULPS * eps * magnitude.nan_to_num(0.0, 0.0))
                # where the terms overflow, the order of summation decides between inf and nan:
                # flip the nudged result between nan and a number so that it is not compared
                overflow = magnitude.isposinf()
                if bool(overflow.any()):
                    flipped = torch.where(tensor.isnan(), 0.0, math.nan).to(tensor.dtype)
                    tensor.copy_(torch.where(overflow, flipped, tensor))
            else:
                ulps = NOISE_ULPS + (_pow_log_magnitude(*args[:2], tensor) if name == "pow" else 0)
                tensor.mul_(1 + sign * ulps * eps)
        return out

    def _softmax_of_a_recomputed_input(self, name: str, x: torch.Tensor, dim: int, dtype: torch.dtype):
        """Softmax with the input nudged by an ulp after its maximum was taken.  XLA fuses the
        op that made the input into both the maximum's loop and the loop that subtracts it, and
        may contract a product there into a fused multiply-add: the element that is the maximum
        then need not subtract to 0 (for products near 1e30, exp of the difference is 0 and the
        softmax nan)."""
        x = x.to(dtype)
        eps = torch.finfo(dtype).eps
        sign = (torch.randint(0, 2, x.shape, generator=self.generator) * 2 - 1) * self.direction
        shifted = x * (1 + sign.to(dtype) * eps) - x.amax(dim, keepdim=True)
        if name == "_softmax":
            e = shifted.exp()
            return e / e.sum(dim, keepdim=True)
        return shifted - shifted.exp().sum(dim, keepdim=True).log()


def _pow_log_magnitude(base: Any, exponent: Any, out: torch.Tensor) -> Any:
    """|exponent * log(base)|: XLA computes a float power as exp(exponent * log(base)), so the
    rounding of that product costs about this many ulps of the result."""
    as_tensor = [torch.as_tensor(x, dtype=out.dtype) for x in (base, exponent)]
    magnitude = (as_tensor[1] * as_tensor[0].abs().log()).abs()
    return torch.nan_to_num(magnitude, nan=0.0, posinf=0.0).clamp(max=1e6)


# The default tiers, made deterministic: first sightings and ops whose flushes were lone run at
# once, a graph's first sighting replays eagerly, its second compiles in the foreground (no
# background thread to race).
TIERED = dict(always_compile=False, eager_unseen_ops=True, eager_lone_ops=True,
              lone_op_on_torch=True, eager_first_runs=1, background_compile=False,
              autotune_engine=False)


def execute(program: Program, defer: bool = False, noise: int = 0, tiered: bool = False,
            flush_subnormals: bool = False, tiers: Any = None) -> Outcome:
    """Run `program` on fresh inputs: under strict PyTorch, under strict with `UlpNoise` in
    direction `noise` (+1 or -1), under strict with the CPU flushing subnormal floats to zero
    (``flush_subnormals``), or under defer mode (``tiered``: with the default tiers, see
    ``TIERED``, or with ``tiers``, the user_defaults fixture's settings, instead of compiling
    every flush)."""
    built = [spec.build() for spec in program.inputs]
    observed: list = []

    def observe(t: torch.Tensor, how: str) -> None:
        observed.append((observe_value(t, how), t.dtype))

    namespace: dict = {"torch": torch, "_observe": observe}
    namespace.update({f"v{i}": tensor for i, (tensor, _) in enumerate(built)})
    if defer:
        # every program is new, so the on-disk executable cache would only cost writes
        settings = (tiers.settings if tiers else TIERED) if tiered else dict(always_compile=True)
        with deferfuse.config.override(**{"cache_dir": "", **settings}):
            with deferfuse.defer():
                error = _run_steps(program.steps, namespace)
    elif noise:
        with UlpNoise(seed=1, direction=noise):
            error = _run_steps(program.steps, namespace)
    elif flush_subnormals:
        with _subnormals_flushed():
            error = _run_steps(program.steps, namespace)
    else:
        error = _run_steps(program.steps, namespace)
    values = {k: v for k, v in namespace.items() if k.startswith("v")}
    return Outcome(values, [base for _, base in built], observed, error)


@contextlib.contextmanager
def _subnormals_flushed():
    """Strict with subnormal floats flushed to zero, as XLA's CPU client runs every computation
    (docs/semantics.md)."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals to zero")
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def _run_steps(steps: tuple, namespace: dict) -> tuple | None:
    for index, step in enumerate(steps):
        try:
            exec(compiled(step.source()), namespace)
        except Exception as exc:  # the oracle decides which exceptions are right
            return index, type(exc), str(exc).splitlines()[0][:200] if str(exc) else ""
    return None


def _mismatch(name: str, expected: torch.Tensor, actual: Any, nudged: list) -> str | None:
    """Why `actual` (defer) is not `expected` (strict), or None.  Exact for integers and bool,
    torch.testing's default tolerances for floats, widened by how far `nudged` (strict runs
    under UlpNoise) moved from strict."""
    if not isinstance(actual, torch.Tensor):
        return f"{name}: expected a tensor, got {type(actual).__name__}"
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return (f"{name}: expected {expected.dtype}{list(expected.shape)}, "
                f"got {actual.dtype}{list(actual.shape)}")
    for which, got in (("", actual), (" (computed data)", oracle.landed(actual))) if oracle.STRIDES else ():
        if oracle.layout_differs(got, expected):
            return (f"{name}{which}: strides {got.stride()} (offset {got.storage_offset()}), strict "
                    f"{expected.stride()} (offset {expected.storage_offset()}), shape {list(expected.shape)}")
    expected, actual = expected.detach(), actual.detach().clone()  # a plain tensor from here on
    nudged = [n for n in nudged if isinstance(n, torch.Tensor) and n.shape == expected.shape
              and n.dtype == expected.dtype]
    unstable = torch.zeros(expected.shape, dtype=torch.bool)
    if expected.dtype.is_floating_point:
        rtol, atol = {torch.float64: (1e-7, 1e-7)}.get(expected.dtype, (1.3e-6, 1e-5))
        slack = torch.zeros(expected.shape, dtype=expected.dtype)
        for other in nudged:
            moved = (other - expected).abs()
            # a nudge of a few ulps turned it nan or moved it by more than 1e-4 of itself: the
            # value is noise (cos of 1e30, fmod of 1e36 by 2) and says nothing about defer
            unstable |= (other.isnan() != expected.isnan()) | (moved > 1e-4 * expected.abs().clamp(min=1))
            slack = torch.maximum(slack, torch.where(moved.isnan(), 0, moved))
        close = torch.isclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True)
        # (where strict is finite: an infinite one would make the bound infinite, and isclose
        # already says that only the same infinity is close to it)
        close |= expected.isfinite() & ((actual - expected).abs() <= atol + rtol * expected.abs() + 2 * slack)
        same = close | unstable
    else:
        for other in nudged:
            unstable |= other != expected
        same = (actual == expected) | unstable
    if bool(same.all()):
        return None
    where = tuple(int(i) for i in (~same).nonzero()[0])
    return (f"{name}: {int((~same).sum())} of {same.numel()} elements differ, first at {where}: "
            f"strict {expected[where].item()!r}, defer {actual[where].item()!r}"
            f"\n  strict {expected}\n  defer  {actual}")


def _describe(error: tuple | None) -> str:
    if error is None:
        return "nothing"
    step, kind, message = error
    return f"{kind.__name__} at step {step} ({message})"


def compare(expected: Outcome, actual: Outcome, nudged: list[Outcome] = ()) -> list[str]:
    if expected.error is not None or actual.error is not None:
        e_step, e_type = expected.error[:2] if expected.error else (None, None)
        a_step, a_type = actual.error[:2] if actual.error else (None, None)
        if (e_step, e_type) != (a_step, a_type):
            # the runs stopped at different steps, so the values cannot be compared
            return [f"exception: strict raised {_describe(expected.error)}, "
                    f"defer raised {_describe(actual.error)}"]
    problems = []
    if len(expected.observed) != len(actual.observed):
        problems.append(f"observations: {len(expected.observed)} in strict, "
                        f"{len(actual.observed)} in defer")
    for (e_val, _), (a_val, _) in zip(expected.observed, actual.observed):
        if type(e_val) is not type(a_val):
            problems.append(f"observation: strict {e_val!r}, defer {a_val!r}")
    nudged_tensors = [n.tensors() for n in nudged if n.error == expected.error]
    actual_tensors = actual.tensors()
    for name, tensor in expected.tensors().items():
        if name in actual_tensors:
            problems.append(_mismatch(name, tensor, actual_tensors[name],
                                      [n.get(name) for n in nudged_tensors]))
    return [p for p in problems if p]


def _raised_at_the_flush(expected: Outcome, exc: Exception) -> bool:
    """docs/semantics.md: an error whose cause is a value (an index out of range: a fuzzed
    operand can be one) is raised when the flush runs, naming the line that recorded the op,
    not on that line.  Strict raised an error of that type at one of the steps; the values
    are not compared (defer ran the steps after it and wrote nothing back)."""
    if expected.error is None or not isinstance(exc, expected.error[1]) or "(recorded at " not in str(exc):
        return False
    if currently_in_test_context():
        event(f"a value error raised at the flush ({type(exc).__name__})")
    return True


def _differences(program: Program, expected: Outcome, actual: Outcome, nudged: list) -> list[str]:
    """``compare``, accepting the one documented difference in values (docs/semantics.md): XLA's
    CPU client flushes subnormal floats to zero, so a program whose floats pass through the
    subnormal range (``1.17e-38 / 4`` on float32) may give what strict gives with the CPU
    flushing them too, and only then."""
    problems = compare(expected, actual, nudged)
    if problems and compare(execute(program, flush_subnormals=True), actual, nudged) == []:
        if currently_in_test_context():
            event("subnormal floats flushed to zero, as strict with flush_denormal gives")
        return []
    return problems


def check_program(program: Program, tiered_runs: int = 0, tiers: Any = None) -> None:
    """Run `program` under strict and under defer and require the same observable outcome
    (``tiered_runs``: run it that many times under the default tiers instead, each compared;
    ``tiers``: under the user_defaults fixture's settings, a fresh start for each program)."""
    expected = execute(program)
    if currently_in_test_context():
        event(f"strict raised {expected.error[1].__name__}" if expected.error else "strict ran to the end")
    nudged = [execute(program, noise=direction) for direction in (1, -1)]
    if tiers:
        forget_what_was_learned()   # (each program from its first sighting, shrunk ones too)
    for run in (tiers.calls(tiered_runs) if tiers else range(1, tiered_runs + 1)):
        try:
            actual = execute(program, defer=True, tiered=True, tiers=tiers)
        except Exception as exc:
            if _raised_at_the_flush(expected, exc):
                return
            raise
        problems = _differences(program, expected, actual, nudged)
        if problems:
            raise AssertionError(f"defer differs from strict in tiered run {run}:\n"
                                 + "\n".join(problems) + f"\n\nrepro:\n{program.repro()}")
    if tiered_runs:
        return
    log = os.environ.get("DEFERFUSE_PROGRAM_LOG", "").replace("{worker}", os.environ.get("PYTEST_XDIST_WORKER", "main"))
    if log:
        # (a crash inside XLA takes the process down before hypothesis can print the program:
        # the last one written here is the culprit)
        with open(log, "w") as f:
            f.write(program.repro())
    try:
        actual = execute(program, defer=True)
        problems = _differences(program, expected, actual, nudged)
    except Exception as exc:
        if _raised_at_the_flush(expected, exc):
            return
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


@given(programs("mixed"))
def test_mixed_programs_through_the_tiers(program: Program) -> None:
    """The same program three times with the default tiers, as a loop would run it: its ops run
    at once where first seen (eager_unseen_ops) or where their flushes were lone
    (eager_lone_ops), then its graph replays eagerly, then it runs compiled; every run must
    match strict."""
    check_program(program, tiered_runs=3)


# (fewer programs: each runs four times, and the fixture's settings are a superset of TIERED's)
@pytest.mark.parametrize("user_defaults", ["deferred"], indirect=True)
@settings(max_examples=max(25, settings.default.max_examples // 4),
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=programs("mixed"))
def test_mixed_programs_with_the_default_settings(user_defaults, program: Program) -> None:
    """The same program four times with every setting at its default, as a user's loop runs it
    (tests/user_defaults.py): its ops at once at their first sighting, its graph replayed, replayed
    while the background thread compiles it, then compiled."""
    check_program(program, tiered_runs=4, tiers=user_defaults)


def test_programs_really_run_through_xla() -> None:
    """Guard the suite against comparing strict with strict: a program's defer run records its
    ops and executes them as a compiled XLA computation."""
    program = Program(inputs=(InputSpec((2, 3), torch.float32, "permuted", "uniform", 7),),
                      steps=(Step("exp", (0,), out=1), Step("add_", (0, 1))))
    deferfuse.reset_stats()
    assert compare(execute(program), execute(program, defer=True)) == []
    stats = deferfuse.stats()
    assert stats["ops_recorded"] >= 2 and stats["compiles"] >= 1 and stats["eager_replays"] == 0


def test_tiered_runs_go_through_every_tier() -> None:
    """Guard the tiered test likewise: its first run runs ops at once, its second replays the
    recorded graph eagerly, its third runs it compiled.  (From a clean slate: the programs
    generated before it, in a deep run, may have made the same calls from the same lines.)"""
    program = Program(inputs=(InputSpec((3, 5), torch.float32, "permuted", "uniform", 11),),
                      steps=(Step("sin", (0,), out=1), Step("mul_", (0, 1))))
    meta.clear_cache()
    engine.clear_cache()
    expected = execute(program)
    seen, runs = [], []
    for _ in range(3):
        deferfuse.reset_stats()
        assert compare(expected, execute(program, defer=True, tiered=True)) == []
        stats = deferfuse.stats()
        seen.append((stats["unseen_ops_run"] > 0, stats["eager_replays"] > 0, stats["executions"] > 0))
        runs.append({k: v for k, v in stats.items() if v})
    # (the first run's mul_ is recorded, in place ops never run at once, and replays eagerly)
    assert seen == [(True, True, False), (False, True, False), (False, False, True)], (seen, runs)


@pytest.mark.parametrize("user_defaults", ["deferred"], indirect=True)
def test_default_settings_runs_go_through_every_tier(user_defaults) -> None:
    """Guard test_mixed_programs_with_the_default_settings likewise: ops at once, then an eager
    replay, then a replay while the background thread compiles, then a compiled run."""
    program = Program(inputs=(InputSpec((3, 5), torch.float32, "permuted", "uniform", 11),),
                      steps=(Step("sin", (0,), out=1), Step("mul_", (0, 1))))
    expected = execute(program)
    seen = []
    for _ in user_defaults.calls(4):
        if seen:
            seen[-1] += (deferfuse.stats()["background_compiles"] > 0,)
        deferfuse.reset_stats()
        assert compare(expected, execute(program, defer=True, tiered=True, tiers=user_defaults)) == []
        stats = deferfuse.stats()
        seen.append((stats["unseen_ops_run"] > 0, stats["eager_replays"] > 0, stats["executions"] > 0))
    seen[-1] += (deferfuse.stats()["background_compiles"] > 0,)
    assert seen == [(True, True, False, False), (False, True, False, False), (False, True, False, True),
                    (False, False, True, False)], seen


def test_a_value_error_raised_at_the_flush_is_what_strict_raised() -> None:
    """Found by the deep suite: a fuzzed operand made ``v0[v0]`` an int64 index out of range.
    Strict raises on that line.  The programs run each step inside a ``try`` (``_run_steps``),
    which catches the error: so does defer mode, on the same step (capture/handlers.py).
    Outside any handler defer raises it when the block's flush runs (docs/semantics.md); the
    oracle accepts that, and only for the exception type strict raised."""
    program = Program(inputs=(InputSpec((1,), torch.int64, "contiguous", "int", 0),),
                      steps=(Step("masked_read", (0, 0), out=1),))
    assert execute(program).error[:2] == (0, IndexError)
    assert execute(program, defer=True).error[:2] == (0, IndexError)
    namespace = {"torch": torch, "v0": torch.zeros(1, dtype=torch.int64) + 5}
    with pytest.raises(IndexError, match=r"\(recorded at "):
        with deferfuse.config.override(cache_dir="", always_compile=True), deferfuse.defer():
            exec(compiled(Step("masked_read", (0, 0), out=1).source()), namespace)
    check_program(program)
    check_program(program, tiered_runs=2)
    wrong_type = Outcome({}, [], [], (0, KeyError, ""))
    assert not _raised_at_the_flush(wrong_type, IndexError("index 4 is out of bounds (recorded at x:1)"))


def test_subnormals_flushed_by_xla_are_what_strict_gives_when_it_flushes_them() -> None:
    """Found by the deep suite: ``1.17e-38 / v0`` with an int64 4 is a float32 subnormal, which
    XLA's CPU client flushes to zero, so its log is -inf where strict gives -88.7
    (docs/semantics.md).  The oracle accepts that as strict under flush_denormal gives it, and
    nothing else: it still reports the difference from plain strict, and a wrong value."""
    program = Program(inputs=(InputSpec((), torch.int64, "contiguous", "int", 0),),
                      steps=(Step("/", (Lit(1.1754943508222875e-38), 0), out=1),
                             Step("log", (1,), out=2)))
    expected, actual = execute(program), execute(program, defer=True)
    assert compare(expected, actual) != []
    assert execute(program, flush_subnormals=True).tensors()["v2"].item() == float("-inf")
    assert _differences(program, expected, actual, []) == []
    check_program(program)
    actual.values["v2"] = torch.tensor(0.0)
    assert _differences(program, expected, actual, []) != []


def test_the_oracle_holds_infinities_to_themselves() -> None:
    """A finite value where strict gave an infinity differs, whatever the tolerances: the
    bound ``atol + rtol * |strict|`` is infinite there (it let 0.0 pass for -inf before)."""
    inf = float("inf")
    expected = torch.tensor([-inf, inf, inf, 1.0])
    assert _mismatch("v", expected, torch.tensor([-inf, inf, inf, 1.0]), []) is None
    for wrong in ([0.0, inf, inf, 1.0], [-inf, -inf, inf, 1.0], [-inf, inf, 3e38, 1.0]):
        assert _mismatch("v", expected, torch.tensor(wrong), []) is not None, wrong
    # (and a nudge that moved a finite value keeps widening its bound)
    assert _mismatch("v", torch.tensor([1.0]), torch.tensor([1.01]), [torch.tensor([1.01])]) is None


def test_a_sum_of_integers_into_floats_is_nudged_by_its_terms() -> None:
    """Found by the deep suite: mean(v2, dim=0, dtype=float32) over int64 values near +-2**63
    cancels to -0.2 in strict's order of summation and 0.0 in XLA's.  The nudged strict runs
    must bound such a result by its terms' magnitudes, integer terms included (they were
    skipped, so the oracle compared a value that the order of summation decides)."""
    big = 2 ** 63 - 1
    program = Program(inputs=(InputSpec((5, 2), torch.int64, "contiguous", "int", 0),),
                      steps=(Step("mean", (0,), (("dim", 0), ("keepdim", False), ("dtype", torch.float32)), out=1),))
    terms = torch.tensor([[0, 1], [-big - 1, 1], [0, 1], [-1, 1], [big, 1]])
    nudged = []
    for direction in (1, -1):
        with UlpNoise(seed=1, direction=direction):
            nudged.append(torch.mean(terms, dim=0, dtype=torch.float32))
    expected = torch.mean(terms, dim=0, dtype=torch.float32)
    assert _mismatch("v1", expected, torch.tensor([expected[0] + 0.2, 1.0]), nudged) is None
    assert _mismatch("v1", expected, torch.tensor([expected[0], 1.5]), nudged) is not None
    assert execute(program).error is None


def test_a_softmax_of_huge_products_is_not_compared() -> None:
    """Found by the deep suite: softmax(v0 @ v0.mT, dim=0) with v0 = [[1e30], [1.16], [-3.9]]
    is nan in a column under XLA and 1.0 in strict: XLA recomputes the (K=1) product in the
    maximum's loop and in the loop that subtracts it, contracting the latter into a fused
    multiply-add, so the maximum does not subtract to 0.  The nudged strict runs model that
    (an ulp on the input after its maximum), which makes such values unstable, not compared;
    on ordinary inputs the softmax stays compared."""
    huge = torch.tensor([[1e30], [1.16], [-3.9]])
    scores = huge @ huge.mT
    nudged = []
    for direction in (1, -1):
        with UlpNoise(seed=1, direction=direction):
            nudged.append(torch.softmax(scores, dim=0))
    expected = torch.softmax(scores, dim=0)
    defer_like = expected.clone()
    defer_like[:, 1] = math.nan
    assert _mismatch("v", expected, defer_like, nudged) is None
    ordinary = torch.tensor([[0.5, -1.0], [2.0, 0.25]])
    with UlpNoise(seed=1, direction=1):
        nudged = [torch.softmax(ordinary, dim=0)]
    wrong = torch.softmax(ordinary, dim=0) * 1.01
    assert _mismatch("v", torch.softmax(ordinary, dim=0), wrong, nudged) is not None


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
