"""Pointwise lowerings (deferfuse/lower/pointwise.py and activation.py) against strict PyTorch.

Each check runs a function under strict and under defer (always compiling) and compares dtype,
shape and values (integers and bools exactly), then asserts that nothing fell back to eager torch
or went through a decomposition: the ops were lowered.  To keep compiles few, many ops share one
program (``lowered_each``); a failure names the op.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

import deferfuse
from oracle import assert_same, check, grads, lowered, run_both

aten = torch.ops.aten
NAN, INF = math.nan, math.inf


@pytest.fixture(autouse=True)
def _no_disk_cache():
    # compile what the rules say now: the disk cache's key does not cover the lowering code
    with deferfuse.config.override(cache_dir=""):
        yield


def _runs(fn, *args) -> bool:
    try:
        fn(*args)
        return True
    except Exception:  # noqa: BLE001
        return False


def raises_like_strict(fn, *inputs):
    """strict raises; defer must raise the same exception type (the oracle checks that)."""
    assert not _runs(fn, *inputs), "strict did not raise"
    check(fn, *inputs)


def lowered_each(fns: dict, *inputs, **tol):
    """All of ``fns`` in one deferred program (one compile); those that strict rejects for these
    inputs must raise alike under defer, one by one (at record time, so nothing compiles)."""
    accepted = {}
    for name, fn in fns.items():
        if _runs(fn, *inputs):
            accepted[name] = fn
        else:
            try:
                raises_like_strict(fn, *inputs)
            except AssertionError as exc:
                raise AssertionError(f"{name}: {exc}") from None
    names = list(accepted)
    try:
        lowered(lambda *xs: tuple(accepted[n](*xs) for n in names), *inputs, **tol)
    except AssertionError as exc:
        found = re.search(r"result\[(\d+)\]", str(exc))
        raise AssertionError(f"{names[int(found.group(1))] if found else names}: {exc}") from None


# -- inputs ----------------------------------------------------------------------------------------
def special_floats(dtype=torch.float32):
    """A non-contiguous (transposed) tensor with NaN, +-Inf, +-0 and ordinary values."""
    values = torch.tensor([[0.5, -1.5, 2.25, NAN], [-0.0, 0.0, 3.0, -7.5], [INF, -INF, 1e-3, 100.0]])
    return values.to(dtype).t()


def ordinary_floats(dtype=torch.float32, shape=(3, 4), low=-3.0, high=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g, dtype=torch.float64) * (high - low) + low).to(dtype)


def ints(dtype=torch.int64, shape=(3, 4), low=-9, high=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g).to(dtype)


def bools(shape=(3, 4), seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) > 0.5


# -- unary -----------------------------------------------------------------------------------------
UNARY_INPUTS = {
    "f32_special": lambda: special_floats(),
    "f64": lambda: ordinary_floats(torch.float64),
    "f16": lambda: ordinary_floats(torch.float16),
    "bf16_sliced": lambda: ordinary_floats(torch.bfloat16, shape=(4, 6))[::2, 1::2],
    "i64": lambda: ints(),
    "u8": lambda: ints(torch.uint8, low=0, high=255),
    "bool": lambda: bools(),
    "0dim": lambda: torch.tensor(0.75),
    "0size": lambda: torch.empty(0, 3),
}
FLOAT_UNARY = [torch.exp, torch.exp2, torch.expm1, torch.log, torch.log2, torch.log10, torch.log1p,
               torch.sqrt, torch.rsqrt, torch.reciprocal, torch.sin, torch.cos, torch.tan, torch.atan,
               torch.sinh, torch.cosh, torch.tanh, torch.asinh, torch.acosh, torch.erf, torch.erfc,
               torch.sigmoid, torch.i0, torch.special.i0e, torch.special.i1, torch.special.i1e,
               torch.special.log_ndtr, torch.angle]
# mostly inside [-1, 1] for these, and looser: XLA's approximations differ by a few ulps
NARROW_DOMAIN_UNARY = [torch.asin, torch.acos, torch.atanh, torch.erfinv, torch.lgamma, torch.digamma,
                       lambda x: torch.special.ndtri(x + 0.5)]
SAME_DTYPE_UNARY = [torch.neg, torch.abs, torch.sign, torch.sgn, torch.floor, torch.ceil, torch.trunc,
                    torch.round, torch.frac, torch.bitwise_not, torch.isnan, torch.isinf, torch.isposinf,
                    torch.isneginf, torch.isfinite, torch.signbit, torch.nan_to_num, torch.logical_not,
                    torch.relu, torch.square]


# torch evaluates these series in float16/bfloat16 arithmetic, a few ulps off a float32 evaluation
BESSEL = (torch.i0, torch.special.i0e, torch.special.i1, torch.special.i1e)


@pytest.mark.parametrize("input_name", list(UNARY_INPUTS))
def test_unary(input_name):
    x = UNARY_INPUTS[input_name]()
    reduced = x.dtype in (torch.float16, torch.bfloat16)
    lowered_each({f.__name__: f for f in FLOAT_UNARY + SAME_DTYPE_UNARY if not (reduced and f in BESSEL)}, x)
    narrow = x / 10 if x.is_floating_point() else x
    lowered_each({getattr(f, "__name__", "ndtri"): f for f in NARROW_DOMAIN_UNARY}, narrow, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_round_to_decimals_gives_stricts_bits(dtype):
    # (XLA rewrote the division by 10^d as a product with its rounded reciprocal: 2.675 rounded
    # to 2 decimals was 2.6799998 where torch's quotient is 2.6800001; found by a client program)
    x = torch.tensor([2.675, 0.285, 1.115, -2.675, 1.005, 0.125, 3.14159, -12.345, 1234.5, 0.0, -0.0,
                      1e-3, 7.77e4, NAN, INF, -INF], dtype=dtype)
    lowered(lambda x: tuple(x.round(decimals=d) for d in (1, 2, 3, 4, -1, -2)), x, exact=True)


@pytest.mark.parametrize("n", [1, 16], ids=["scalar-kernel", "vector-kernel"])
def test_relu_clamp_and_hardtanh_keep_the_inputs_zero(n):
    # (torch's kernels keep x where it equals the bound: relu(-0.0) is -0.0, which prints as
    # "-0." and turns 1/x into -inf; XLA's max gave +0.0; found by a client program)
    x = torch.tensor([0.0, -0.0, 1.5, -2.0, NAN, 0.0, -0.0, 6.0]).repeat(n)
    programs = (torch.relu, lambda t: t.clamp(min=0.0), lambda t: t.clamp(min=-0.0), lambda t: t.clamp(max=0.0),
                lambda t: t.clamp(max=-0.0), lambda t: t.clamp(-0.0, 0.0), lambda t: torch.clamp_min(t, 0.0),
                lambda t: F.hardtanh(t, -0.0, 0.0), F.relu6, lambda t: F.relu(t.double()))
    for program in programs:
        expected, actual, _, _ = run_both(program, x)
        assert_same(expected, actual, exact=True)
        assert torch.equal(torch.signbit(actual), torch.signbit(expected)), (actual, expected)


def test_unary_special_cases():
    lowered(lambda x: (x.round(), x.round(decimals=2), x.round(decimals=-1), x.round(decimals=0), x.sign(),
                       x.exp2(), torch.nan_to_num(x, nan=1.5, posinf=2.0, neginf=-3.0)),
            torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 2.4999, 1.005, 2.675, -12.345, 1234.5, NAN, INF, -INF,
                          -0.0, 100.0, -100.0, 127.5, -149.0]))
    lowered(lambda x: (x.round(decimals=1), torch.nan_to_num(x)), special_floats(torch.float16))
    raises_like_strict(lambda x: x.round(decimals=1), ints())
    lowered(lambda x: (x.logit(), x.logit(eps=0.1), x.logit(eps=-1.0)),
            torch.tensor([0.0, 0.05, 0.5, 0.97, 1.0, 1.2, -0.1, NAN]))
    lowered(lambda x: x.logit(eps=1e-3), torch.tensor([1.0, 0.9995, 0.0], dtype=torch.bfloat16))
    lowered(lambda x: (x.abs(), -x), torch.tensor([-128, 127, 0], dtype=torch.int8))
    lowered(lambda x: x.digamma(), torch.tensor([0.0, -0.0, -1.0, -2.5, 1.0]))


# -- binary ----------------------------------------------------------------------------------------
BINARY_PAIRS = {
    "f32_f32": lambda: (special_floats(), ordinary_floats(shape=(4, 3))),
    "f32_bcast": lambda: (ordinary_floats(shape=(2, 3, 4)), ordinary_floats(shape=(3, 1), seed=5)),
    "f32_0dim": lambda: (ordinary_floats(), torch.tensor(-1.25)),
    "f16_f16": lambda: (ordinary_floats(torch.float16), ordinary_floats(torch.float16, seed=3)),
    "f16_f64_0dim": lambda: (ordinary_floats(torch.float16), torch.tensor(0.1, dtype=torch.float64)),
    "bf16_f32": lambda: (ordinary_floats(torch.bfloat16), ordinary_floats(seed=4)),
    "i64_i32": lambda: (ints(), ints(torch.int32, seed=7)),
    "i64_f32": lambda: (ints(), ordinary_floats(seed=8)),
    "i32_0dim_f64": lambda: (ints(torch.int32), torch.tensor(2.5, dtype=torch.float64)),
    "u8_i8": lambda: (ints(torch.uint8, low=0, high=255), ints(torch.int8, low=-100, high=100)),
    "bool_bool": lambda: (bools(), bools(seed=9)),
    "bool_i64": lambda: (bools(), ints()),
    "0size": lambda: (torch.empty(0, 4), torch.ones(1, 4)),
}
BINARY = {
    "add": torch.add, "add_alpha": lambda a, b: torch.add(a, b, alpha=2), "sub": torch.sub,
    "sub_alpha": lambda a, b: torch.sub(a, b, alpha=3), "rsub": torch.rsub, "mul": torch.mul,
    "div": torch.div, "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"), "floor_divide": torch.floor_divide,
    "remainder": torch.remainder, "fmod": torch.fmod, "pow": torch.pow, "atan2": torch.atan2,
    "hypot": torch.hypot, "copysign": torch.copysign, "xlogy": torch.xlogy, "logaddexp": torch.logaddexp,
    "logaddexp2": torch.logaddexp2, "maximum": torch.maximum, "minimum": torch.minimum, "fmax": torch.fmax,
    "fmin": torch.fmin, "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt,
    "ge": torch.ge, "logical_and": torch.logical_and, "logical_or": torch.logical_or,
    "logical_xor": torch.logical_xor, "bitwise_and": torch.bitwise_and, "bitwise_or": torch.bitwise_or,
    "bitwise_xor": torch.bitwise_xor, "heaviside": torch.heaviside, "nextafter": torch.nextafter,
}
INTEGER_DIVISIONS = ("div_trunc", "div_floor", "floor_divide", "remainder", "fmod")


@pytest.mark.parametrize("pair_name", list(BINARY_PAIRS))
def test_binary(pair_name):
    a, b = BINARY_PAIRS[pair_name]()
    fns = dict(BINARY)
    if not b.is_floating_point():
        b_nonzero = torch.where(b == 0, torch.ones_like(b), b)   # integer division by zero raises
        for name in INTEGER_DIVISIONS:
            fns[name] = lambda a, b, fn=BINARY[name], d=b_nonzero: fn(a, d)
        if not a.is_floating_point():
            fns["pow"] = lambda a, b: torch.pow(a, b.abs() % 5)
    lowered_each(fns, a, b)


SCALARS = [2, 0.1, -2.5, True]
SCALAR_OPS = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "div_floor": BINARY["div_floor"],
    "remainder": torch.remainder, "fmod": torch.fmod, "pow": torch.pow, "clamp_min": torch.clamp_min,
    "eq": torch.eq, "lt": torch.lt, "ge": torch.ge, "bitwise_and": torch.bitwise_and,
    "copysign": torch.copysign, "xlogy": torch.xlogy,
}
SCALAR_FIRST_OPS = ("add", "sub", "mul", "div", "remainder", "pow", "bitwise_and", "xlogy")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int8, torch.bool], ids=str)
def test_binary_with_python_scalars(dtype):
    x = bools() if dtype == torch.bool else ordinary_floats(dtype) if dtype.is_floating_point else ints(dtype)
    fns = {}
    for name, fn in SCALAR_OPS.items():
        if name == "pow" and dtype == torch.bool:
            continue    # torch's meta function says pow(bool, True) is int64, its kernel bool
        for s in SCALARS:
            fns[f"{name}(x, {s!r})"] = lambda a, fn=fn, s=s: fn(a, s)
            if name in SCALAR_FIRST_OPS:
                fns[f"{name}({s!r}, x)"] = lambda a, fn=fn, s=s: fn(s, a)
    lowered_each(fns, x)


def test_half_rounding_of_scalars():
    # comparisons, add and remainder round a scalar to float16 first; mul and div do not
    h = torch.tensor([0.0999755859375, 0.1, 0.10003662109375, 65504.0, -2.5], dtype=torch.float16)
    for x in (h, h.to(torch.bfloat16)):
        lowered(lambda x: (x < 0.1, x == 0.1, x >= 0.1, x.clamp(max=0.1), x > 65519.0, x + 0.1, x - 0.1,
                           torch.add(x, 1.0, alpha=0.1), x % 0.1, torch.fmod(x, 0.1), x * 0.1, x / 0.1,
                           0.1 ** x.clamp(max=4)), x, rtol=0, atol=0)


@pytest.mark.parametrize("make", [lambda a: (lambda t, u: torch.add(t, u, alpha=a)),
                                  lambda a: (lambda t, u: t.lerp(u, a)),
                                  lambda a: (lambda t, u: F.leaky_relu(t, a))], ids=["alpha", "weight", "slope"])
def test_runtime_scalar_does_not_recompile(make):
    # Scalar parameters are runtime inputs: a new value reuses the compiled program
    x, y = ordinary_floats(), ordinary_floats(seed=3)
    lowered(make(0.5), x, y)
    lowered(make(0.7), x, y)
    assert deferfuse.stats()["cache_misses"] == 0


# -- integer semantics -----------------------------------------------------------------------------
def test_integer_division_and_remainder_signs():
    a = torch.tensor([7, -7, 7, -7, 0, 5, -5, 9223372036854775807])
    b = torch.tensor([2, 2, -2, -2, 3, -1, 1, -1])
    lowered(lambda x, y: (torch.div(x, y, rounding_mode="trunc"), torch.div(x, y, rounding_mode="floor"),
                          x // y, x % y, torch.fmod(x, y), x / y, x // -3, x % -3, torch.fmod(x, -3),
                          torch.remainder(-3, y), x.to(torch.int8) // y.to(torch.int8)), a, b)


def test_float_division_modes():
    a = torch.tensor([7.5, -7.5, 1.0, -1.0, 0.0, -0.0, INF, NAN, 1e30, 5.0, -3.0, -0.0, 0.6, 0.9])
    b = torch.tensor([2.0, 2.0, 0.0, 0.0, 0.0, 3.0, 2.0, 1.0, 1e-30, INF, INF, -2.0, 0.2, 0.3])
    lowered(lambda x, y: (torch.div(x, y, rounding_mode="trunc"), torch.div(x, y, rounding_mode="floor"),
                          x // y, x % y, torch.fmod(x, y)), a, b, rtol=0, atol=0)
    # XLA would multiply by the reciprocal of a broadcast divisor: trunc(0.6 / 0.2) must stay 2
    for dtype in (torch.float32, torch.float64):
        x = torch.tensor([0.6, 0.9, 1.2, 0.3, -0.6, 7.0], dtype=dtype)
        lowered(lambda t, d: (t / 0.2, torch.div(t, 0.2, rounding_mode="trunc"), t / 0.3,
                              torch.div(t, d, rounding_mode="trunc"), t / d, torch.div(t, 0.3, rounding_mode="floor")),
                x, torch.tensor(0.1, dtype=dtype), rtol=0, atol=0)
    lowered(lambda x: (torch.div(x, 0.3, rounding_mode="floor"), x % 0.3, x % -0.3, x // 0.7),
            ordinary_floats(torch.float16))


def test_integer_pow():
    base = torch.tensor([0, 1, -1, 2, -2, 3, 7, -3])
    exponent = torch.tensor([-1, -5, -3, -1, 63, 40, 0, 5])
    lowered(lambda x, e: (x ** e, torch.pow(2, e.clamp(min=0)), torch.pow(-1, e), x ** 3, x ** 0,
                          x.to(torch.int8) ** 7, x ** 2.0, x ** -1.0, x ** 0.5, 2.5 ** x), base, exponent)
    raises_like_strict(lambda x: x ** -1, base)
    raises_like_strict(lambda x: x ** x, bools())


def test_float_pow():
    x = torch.tensor([-2.0, -0.5, 0.0, -0.0, 0.5, 2.0, INF, -INF, NAN, 1.0, 3.0, 10.0])
    lowered(lambda t: (t ** 2, t ** 3, t ** -1, t ** -2, t ** 0.5, t ** -0.5, t ** 2.0, t ** 1.5, t ** 0,
                       1.0 ** t, 2 ** t, t ** t, t ** 30.5), x)
    lowered(lambda t, e: t ** e, ordinary_floats(torch.float16, low=0.1), ordinary_floats(torch.float16, seed=3))


def test_a_float_exponent_is_compiled_in():
    """autograd's pow_backward computes x ** (e - 1.0) times e as floats: a power's exponent is
    part of the program, not a runtime input, so x ** 1.0 and x ** 2.0 lower to a copy and a
    product (as torch computes them), not to the general float64 power with its NaN rules (an
    RMSNorm backward took ~7 ms a layer that way against strict's ~0.3)."""
    from deferfuse.exec import executables
    x = torch.tensor([-2.0, -0.5, 0.0, -0.0, 0.5, 2.0, INF, -INF, NAN, 1.0, 3.0, 10.0])
    exponents = (0.0, 1.0, 2.0, 3.0, 0.5, -0.5, -1.0, -2.0)
    lowered(lambda t: tuple(t ** e for e in exponents), x, rtol=0, atol=0)
    lowered(lambda t: tuple(t.to(dtype) ** e for e in exponents for dtype in (torch.float64, torch.bfloat16)), x)
    executables.clear()
    w = torch.randn(16, 32, requires_grad=True)
    lowered(lambda t: torch.autograd.grad((t.pow(2).mean(-1) + 1e-6).rsqrt().sum(), t)[0], w)
    texts = [c.lowered.as_text() for c in executables.snapshot() if c.lowered is not None]
    assert texts and not any("stablehlo.power" in t for t in texts)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_a_held_value_keeps_its_bits(dtype):
    """The materialization above passes every value through unchanged, bit for bit."""
    import jax
    from deferfuse.exec.executables import x64
    from deferfuse.exec.program import _held
    x = torch.tensor([-0.0, 0.0, NAN, -NAN, INF, -INF, 1e-30, -3.5, 65504.0], dtype=torch.float64).to(dtype)
    with x64():
        got = torch.from_dlpack(jax.jit(_held)(jax.numpy.from_dlpack(x)))
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    assert got.dtype == dtype and torch.equal(got.view(bits), x.view(bits))


def test_a_sine_or_cosine_read_through_a_view_is_computed_once():
    """Defer mode reads every view through deferfuse's ``read_view``; RoPE's
    ``cos(emb).unsqueeze(1)`` was one, and the mark that makes a broadcast sine or cosine computed
    once (exec/program.py, ``_TRANSCENDENTAL``) did not pass through it: the deferred Llama step
    evaluated its angles inside 32 fusions over the queries and keys.  Forward and backward, a
    slice and an expanding view of the angles too; strict's values and gradients."""
    from hlo_text import trig_evaluations

    from deferfuse.exec import executables
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 32, 2, 16, generator=g).transpose(1, 2).requires_grad_()
    emb = torch.randn(1, 32, 16, generator=g) * 10

    def rope(q, emb):
        cos, sin = (emb.cos() * 0.5).unsqueeze(1), emb.sin().unsqueeze(1)
        half = q.shape[-1] // 2
        rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        shifted = emb.cos()[:, 1:].expand(4, 2, 31, 16)
        return (q * cos + rotated * sin)[:, :, 1:] + shifted

    executables.clear()
    lowered(grads(rope), q, emb, decompositions=True)   # (slice_backward: a decomposition)
    texts = [c.executable.as_text() for c in executables.snapshot() if hasattr(c.executable, "as_text")]
    evaluations = [e for t in texts for e in trig_evaluations(t)]
    assert evaluations, "the program evaluates no sine or cosine"
    assert all(fused <= own for own, fused in evaluations), evaluations


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64], ids=str)
def test_shifts_beyond_width(dtype):
    info = torch.iinfo(dtype)
    x = torch.tensor([1, -1 if info.min < 0 else 255, 5, info.min, info.max], dtype=dtype)
    nbits = info.bits
    amounts = torch.tensor([0, 1, nbits - 1, nbits, nbits + 3], dtype=dtype if nbits > 8 else torch.int64)
    negative = (lambda t: t << -1, lambda t: t >> -1) if info.min < 0 else ()
    lowered(lambda t, s: (t << s, t >> s, t << 1, t >> (nbits - 1), t << nbits, t >> 200,
                          torch.bitwise_left_shift(t, s), torch.bitwise_right_shift(t, s),
                          3 << t.clamp(0, 5), torch.bitwise_right_shift(1000, t.clamp(0, 5)),
                          *(f(t) for f in negative)), x, amounts)


def test_shift_and_bitwise_of_floats_raise():
    for fn in (lambda t: t << 1, lambda t: t & t, lambda t: ~t):
        raises_like_strict(fn, ordinary_floats())


def test_bool_and_int_scalars_do_not_share_metadata():
    lowered(lambda b: (b + True, b + 1), bools())


def test_bool_arithmetic_promotes():
    b, c = bools(), bools(seed=5)
    lowered(lambda x, y: (x + y, x * y, x + 2, x * 2.5, x / (y | x), x & y, x | y, x ^ y, ~x, x < y,
                          torch.maximum(x, y), x + torch.tensor(3, dtype=torch.int8)), b, c)
    raises_like_strict(lambda x, y: x - y, b, c)
    raises_like_strict(lambda x: -x, b)


# -- clamp, where, lerp, addcmul -------------------------------------------------------------------
def test_clamp():
    x = special_floats()
    lo, hi = ordinary_floats(shape=(4, 3), seed=3), torch.tensor([NAN, 1.0, 2.0])
    lowered(lambda t, a, b: (t.clamp(-1, 1), t.clamp(min=0.5), t.clamp(max=-0.5), t.clamp(2, -2), t.clip(0, 1),
                             torch.clamp_min(t, 0.1), torch.clamp_max(t, 0.1), t.clamp(min=NAN),
                             t.clamp(a, b), t.clamp(min=a), t.clamp(max=b), torch.clamp_min(t, a),
                             torch.clamp_max(t, b)), x, lo, hi)
    lowered(lambda t, s: (t.clamp(-3, 4), t.clamp(min=0.5), t.clamp(max=2.5), s.clamp(t[0], 3)),
            ints(), ints(torch.int8, shape=(4,)))
    lowered(lambda t: (t.clamp(-0.3, 0.2), t.t().clamp_(-1, 1)), ordinary_floats(torch.float16))


def test_where():
    c, a, b = bools(), ordinary_floats(), ints()
    lowered(lambda c, a, b: (torch.where(c, a, b), torch.where(c, b, 0.5), torch.where(c, 1.0, a),
                             torch.where(c[0], a, a.t()[:, :1].t()), torch.where(c, b, b.to(torch.int8)),
                             torch.where(c[0, 0], a, NAN)), c, a, b)


def test_lerp_addcmul_addcdiv():
    a, b = ordinary_floats(), ordinary_floats(seed=3)
    w = torch.tensor([0.0, 0.25, 0.5, 1.0])
    lowered(lambda a, b, w: (a.lerp(b, 0.3), a.lerp(b, 0.7), a.lerp(b, 1.0), a.lerp(b, w), a.lerp(b, -2.0),
                             torch.addcmul(a, b, w), torch.addcmul(a, b, w, value=-0.5), torch.addcdiv(a, b, w),
                             torch.addcdiv(a, b, w, value=2)), a, b, w)
    lowered(lambda a, b: (a.lerp(b, 0.6), a.lerp(b, b), torch.addcmul(a, b, b, value=0.1)),
            a.to(torch.bfloat16), b.to(torch.bfloat16), rtol=1e-2, atol=1e-2)
    lowered(lambda a, b: torch.addcmul(a, b, b, value=3), ints(), ints(torch.int32))
    raises_like_strict(lambda a: torch.addcdiv(a, a, a), ints())


# -- casts and copies ------------------------------------------------------------------------------
CAST_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
               torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("src", CAST_DTYPES, ids=str)
def test_to_dtype(src):
    if src.is_floating_point:
        # out-of-range and NaN casts to integers follow torch's results on x86
        x = torch.tensor([[0.0, -0.0, 1.7, -1.7, 200.0, 300.0, -129.0, 70000.0],
                          [1e10, -1e10, NAN, INF, 2.0 ** 31, -(2.0 ** 31), 2.0 ** 63, 65504.0]]).to(src)
    else:
        x = ints(low=-200, high=300).to(src)
    lowered(lambda t: tuple(t.t().to(d) for d in CAST_DTYPES), x)


def test_clone_copy_fill_zero():
    x = ordinary_floats(shape=(4, 6))
    lowered(lambda t: (t[:, ::2].clone(), t.t().clone(memory_format=torch.contiguous_format)), x)
    lowered(lambda t, s: t.copy_(s), x, ordinary_floats(shape=(6,), seed=3))          # broadcast src
    lowered(lambda t, s: t[1:].copy_(s), ints(shape=(4, 6)), ordinary_floats(shape=(3, 6)) * 50)
    lowered(lambda t, s: t.t().copy_(s), x, ints(torch.int32, shape=(6, 4)))
    lowered(lambda i, h, b, u: (i.fill_(2.7), i.clone().fill_(-3), h[::2].fill_(0.1), b.fill_(0.5), u.fill_(-1)),
            ints(torch.int32), ordinary_floats(torch.float16), bools(), ints(torch.uint8, low=0, high=9))
    lowered(lambda t, v, i, w: (t.fill_(v), i.fill_(w)), ordinary_floats(), torch.tensor(4.5, dtype=torch.float64),
            ints(), torch.tensor(-4.5))
    lowered(lambda t: t[1].zero_(), ordinary_floats())
    for dtype, value in ((torch.int8, 200), (torch.int8, 127.5), (torch.uint8, -1.0), (torch.int32, NAN),
                         (torch.float16, 70000.0), (torch.float32, 1e300)):
        raises_like_strict(lambda t, v=value: t.fill_(v), torch.zeros(3, dtype=dtype))
    lowered(lambda t, u: (t.fill_(-128.0), u.fill_(INF)), torch.zeros(3, dtype=torch.int8), torch.zeros(2, dtype=torch.float16))


def test_integer_division_by_zero_raises():
    a, b = ints(), torch.tensor([1, 0, 2, 3])
    for fn in (lambda x, y: x // y, lambda x, y: x % y, lambda x, y: torch.fmod(x, y),
               lambda x, y: torch.div(x, y, rounding_mode="trunc"), lambda x, y: torch.div(x, y, rounding_mode="floor")):
        raises_like_strict(fn, a, b)
    lowered(lambda x, y: (x / y, x.double() // y), a, b)    # true and floating division give inf/nan


# -- activations -----------------------------------------------------------------------------------
ACTIVATIONS = {
    "relu": F.relu, "relu6": F.relu6, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu, "mish": F.mish, "hardtanh": lambda x: F.hardtanh(x, -0.5, 2.0),
    "hardsigmoid": F.hardsigmoid, "hardswish": F.hardswish, "leaky_relu": lambda x: F.leaky_relu(x, 0.2),
    "elu": lambda x: F.elu(x, alpha=1.3), "selu": F.selu, "celu": lambda x: F.celu(x, alpha=0.7),
    "softplus": lambda x: F.softplus(x, beta=2.0, threshold=3.0), "threshold": lambda x: F.threshold(x, 0.1, -2.0),
    "glu": lambda x: F.glu(x, dim=0), "hardshrink": lambda x: F.hardshrink(x, 0.6),
    "softshrink": lambda x: F.softshrink(x, 0.4), "logsigmoid": F.logsigmoid, "sigmoid": torch.sigmoid,
    "tanh": torch.tanh, "logit": lambda x: torch.sigmoid(x).logit(eps=1e-3),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_activations_forward_and_backward(dtype):
    # values straddle every kink (-3, 0, +-lambda, thresholds), rounded to the dtype as in torch;
    # no +-inf: torch's vectorized and scalar CPU kernels disagree there (gelu(inf) is nan or inf)
    x = torch.tensor([[-4.0, -3.0, -2.9, -0.6, -0.5, -0.4, -0.0, 0.0],
                      [0.05, 0.1, 0.4, 0.6, 1.5, 2.0, 3.0, 25.0]], dtype=dtype).t()
    g = ordinary_floats(dtype, shape=(8, 2), seed=11)
    reduced = {"rtol": 1e-2, "atol": 1e-2} if dtype in (torch.float16, torch.bfloat16) else {}

    def forward_backward(act):
        def run(x, g):
            x = x.detach().requires_grad_(True)
            y = act(x)
            (grad,) = torch.autograd.grad(y, x, g[:y.shape[0]])
            return y, grad
        return run

    lowered_each({name: forward_backward(act) for name, act in ACTIVATIONS.items()}, x, g, **reduced)
    nonfinite = special_floats(dtype)[:, :2]
    lowered_each({name: act for name, act in ACTIVATIONS.items() if name != "gelu"}, nonfinite, **reduced)


def test_activations_float16_integer_inputs_and_inplace():
    lowered_each(ACTIVATIONS, ordinary_floats(torch.float16, shape=(4, 4)))
    lowered(lambda t: (F.relu(t), F.hardtanh(t), F.threshold(t, 1, 5), F.relu6(t)), ints())
    lowered(lambda t, u: (F.relu(t.t()[1:], inplace=True), F.leaky_relu_(u[::2])),
            ordinary_floats(shape=(4, 4)), ordinary_floats(shape=(4, 4), seed=3))
    lowered(lambda t: torch.ops.aten.log_sigmoid_forward(t), ordinary_floats())
    for fn in (F.gelu, F.silu, F.softplus, F.hardsigmoid, F.mish, F.hardswish, F.logsigmoid, F.leaky_relu):
        raises_like_strict(fn, ints())
    raises_like_strict(F.relu, bools())


def test_silu_backward_in_float16_uses_its_lowering():
    x = torch.tensor([8.375, 7.2656, 4.8594, 4.0938], dtype=torch.float16)
    g = torch.tensor([1.4893, 1.4922, 1.2432, 1.2607], dtype=torch.float16)
    lowered(lambda g, x: (aten.silu_backward(g, x), aten.mish_backward(g, x)), g, x)


def test_backward_ops_directly():
    x, g = special_floats()[:, :2].contiguous(), ordinary_floats(shape=(4, 2), seed=12)
    y = torch.tensor([[0.1, 0.5], [0.9, -0.5], [2.0, 0.0], [1.0, NAN]])
    lowered(lambda g, x, y: (
        aten.threshold_backward(g, x, 0.5), aten.sigmoid_backward(g, y), aten.tanh_backward(g, y),
        aten.hardtanh_backward(g, x, -1.0, 1.0), aten.leaky_relu_backward(g, x, 0.3, False),
        aten.elu_backward(g, 1.5, 1.1, 0.9, False, x), aten.elu_backward(g, 1.5, 1.1, 0.9, True, y),
        aten.softplus_backward(g, x, 1.0, 20.0), aten.gelu_backward(g, x),
        aten.gelu_backward(g, x, approximate="tanh"), aten.silu_backward(g, x), aten.mish_backward(g, x),
        aten.hardsigmoid_backward(g, x), aten.hardswish_backward(g, x), aten.logit_backward(g, y),
        aten.logit_backward(g, y, 0.2), aten.softshrink_backward(g, x, 0.5), aten.hardshrink_backward(g, x, 0.5),
        aten.hardswish_backward(g, torch.tensor([-3.0, 3.0])), aten.hardsigmoid_backward(g, torch.tensor([-3.0, 3.0])),
    ), g, x, y)


# -- complex casts and the prims that torch._refs decompositions emit ------------------------------
COMPLEX_VALUES = torch.tensor([[0.5, -1.5, NAN], [INF, -0.0, 3.0]])


@pytest.mark.parametrize("src", [torch.float32, torch.float64, torch.int64, torch.bool])
def test_casts_to_and_from_complex(src):
    x = (COMPLEX_VALUES if src.is_floating_point else COMPLEX_VALUES.nan_to_num().clamp(-9, 9)).to(src).t()
    z = torch.complex(x.double(), -x.double())
    lowered(lambda x, z: (x.cdouble(), x.cfloat(), x.to(torch.complex64).cdouble(), z.to(torch.float32),
                          z.bool(), z.cfloat().long(), z.t().cfloat(), z.clone()), x, z)


def test_prims_lower_through_the_aten_rules():
    prims = torch.ops.prims
    x, y = ordinary_floats(), special_floats()
    i, j = ints(), ints(seed=5)
    z = torch.complex(x, y.t().nan_to_num())
    fns = {
        "convert": lambda x, y, i, j, z: prims.convert_element_type(x, torch.int32),
        "convert_complex": lambda x, y, i, j, z: prims.convert_element_type(z, torch.float64),
        "clone": lambda x, y, i, j, z: prims.clone(y),
        "add": lambda x, y, i, j, z: prims.add(x, y.t()),
        "mul_complex": lambda x, y, i, j, z: prims.mul(z, z),
        "add_complex": lambda x, y, i, j, z: prims.add(z, z.conj_physical()),
        "sub_int": lambda x, y, i, j, z: prims.sub(i, j),
        "div_int_truncates": lambda x, y, i, j, z: prims.div(i, j.masked_fill(j == 0, 3)),
        "div_float": lambda x, y, i, j, z: prims.div(x, y.t()),
        "neg_complex": lambda x, y, i, j, z: prims.neg(z),
        "abs_complex": lambda x, y, i, j, z: prims.abs(z),
        "conj": lambda x, y, i, j, z: prims.conj_physical(z),
        "exp": lambda x, y, i, j, z: prims.exp(y),
        "remainder": lambda x, y, i, j, z: prims.remainder(i, j.masked_fill(j == 0, 2)),
        "where": lambda x, y, i, j, z: prims.where(x > 0, x, y.t()),
    }
    lowered_each(fns, x, y, i, j, z)


def test_conj_physical_of_complex():
    z = torch.complex(ordinary_floats(dtype=torch.float64), special_floats(torch.float64).t())
    lowered(lambda z: (aten._conj_physical(z), aten._conj_physical(z.t()), aten._conj_physical(z.real)), z)


def test_unsupported_dtype_is_a_lowering_error():
    # complex32 has no JAX type: a clean LoweringError (eager replay outside always_compile),
    # never a KeyError
    from deferfuse.errors import LoweringError
    from deferfuse.lower import dtypes
    with pytest.raises(LoweringError, match="complex32"):
        dtypes.to_jax(torch.complex32)


# -- polygamma, zeta, incomplete gamma, gcd and lcm ------------------------------------------------
SPECIAL_ARGS = torch.tensor([-8.3156849, -3.5, -2.0, -1.5, -0.5, -0.0, 0.0, 1e-3, 0.3, 1.0, 2.5, 10.0,
                             100.0, NAN, INF, -INF])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_polygamma(dtype):
    x = SPECIAL_ARGS.to(dtype)
    lowered(lambda x: tuple(torch.polygamma(n, x) for n in range(5)) + (torch.polygamma(2, x[::2]),), x,
            rtol=1e-5 if dtype == torch.float32 else 1e-7, atol=1e-5)


def test_polygamma_of_integers_and_bools():
    lowered(lambda i, b: (torch.polygamma(1, i), torch.polygamma(3, i), torch.special.polygamma(0, b)),
            ints(low=1), bools())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zeta_and_incomplete_gamma(dtype):
    a = SPECIAL_ARGS.to(dtype)[:, None]
    b = SPECIAL_ARGS.to(dtype).flip(0)[None, :]
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}
    lowered(lambda a, b: (torch.special.zeta(a, b), torch.igamma(a.abs(), b.abs()),
                          torch.igammac(a.abs(), b.abs()), torch.igamma(a, b), torch.igammac(a, b)),
            a, b, **tol)
    # 0-dim operands (the decomposition's meta inference used to reject them), Python scalars
    lowered(lambda a, b: (torch.special.zeta(a[3, 0], b[0]), torch.igamma(a[9, 0], b[0].abs()),
                          torch.igammac(a[:, 0].abs(), b[0, 9]), torch.special.zeta(2.0, b[0]),
                          torch.special.zeta(a[:, 0], 3.0)), a, b, **tol)


def test_zeta_of_integers():
    lowered(lambda i, j: (torch.special.zeta(i, j), torch.special.zeta(i.abs() + 2, 1.5)), ints(), ints(seed=4))


def test_gcd_lcm():
    i, j = ints(low=-30, high=30), ints(low=-30, high=30, seed=6)
    big = torch.tensor([2 ** 40, -(2 ** 40), 0, 12], dtype=torch.int64)
    lowered(lambda i, j, big: (torch.gcd(i, j), torch.lcm(i, j), torch.gcd(i, j[0]), torch.lcm(i.t(), j[0, 0]),
                               torch.gcd(i.to(torch.int32), j.to(torch.int16)), torch.gcd(big, big.flip(0)),
                               torch.lcm(big, 6 + big.flip(0) * 0), torch.gcd(i[:0], j[:0])), i, j, big)
    raises_like_strict(lambda x: torch.gcd(x, x), ordinary_floats())
