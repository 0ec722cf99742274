"""Reductions and normalizations under defer match strict PyTorch, and are lowered, not run eagerly.

Each test runs ops on awkward inputs (0-dim, empty, transposed, sliced, NaN/Inf, integer, bool,
half precision) through the oracle.  The functions under test use only this family's ops and
views, so any fallback or decomposition counted means a lowering was missing or declined.
"""

from __future__ import annotations

import math

import pytest
import torch

import deferfuse
from oracle import check, lowered

aten = torch.ops.aten
nan, inf = math.nan, math.inf

# torch warns about correction >= n; those cases are tested on purpose
pytestmark = pytest.mark.filterwarnings("ignore:.*degrees of freedom")


def lowered_all(fns, *inputs, **tol):
    """lowered() on all of ``fns`` at once: one graph, one compile, for a fast test."""
    fns = list(fns.values()) if isinstance(fns, dict) else list(fns)
    lowered(lambda *xs: tuple(f(*xs) for f in fns), *inputs, **tol)


def no_fallback_of(fn, *inputs, names=(), **tol):
    """check(), asserting only that ops whose names contain one of ``names`` ran lowered: for
    paths that go through decompositions whose sub-ops belong to other families."""
    deferfuse.reset_stats()
    check(fn, *inputs, **tol)
    fallbacks = deferfuse.stats()["fallbacks"]
    assert not [op for op in fallbacks if any(n in op for n in names)], fallbacks


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _floats():
    g = _gen()
    return {
        "2d": torch.randn(3, 4, generator=g),
        "0d": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "transposed": torch.randn(4, 3, generator=g).t(),
        "3d_f64": torch.randn(2, 3, 4, generator=g, dtype=torch.float64),
        "nan_inf": torch.tensor([[1.0, nan, 2.0, 2.0], [inf, -inf, 0.0, 5.0], [-inf, -inf, -inf, -inf]]),
        "f16": torch.randn(3, 4, generator=g).half(),
        "bf16": torch.randn(3, 4, generator=g).bfloat16(),
    }


def _ints():
    g = _gen(1)
    return {
        "i64": torch.randint(-5, 6, (3, 4), generator=g),
        "i32_big": torch.tensor([[2**30, 2**30, 7], [-1, 0, 3]], dtype=torch.int32),
        "bool": torch.randint(0, 2, (3, 4), generator=g).bool(),
        "u8": torch.randint(0, 4, (2, 5), generator=g).to(torch.uint8),
        "i64_0d": torch.tensor(-3),
    }


FLOATS, INTS = _floats(), _ints()
ALL = {**FLOATS, **INTS}


def _sliced(fn):
    """fn applied to a non-contiguous slice of the input (every other column)."""
    return lambda x: fn(x[..., ::2]) if x.dim() else fn(x)


# -- sum, mean, prod, count_nonzero --------------------------------------------------------------

SUM_LIKE = {
    "sum": lambda x: x.sum(),
    "sum_last": lambda x: x.sum(-1),
    "sum_first_keep": lambda x: x.sum(0, keepdim=True),
    "sum_none": lambda x: torch.sum(x, dim=None),
    "sum_empty_list": lambda x: aten.sum.dim_IntList(x, []),
    "sum_f64": lambda x: x.sum(dtype=torch.float64),
    "sum_i32": lambda x: x.sum(-1, dtype=torch.int32),
    "prod": lambda x: x.prod(),
    "prod_dim": lambda x: x.prod(-1, keepdim=True),
    "prod_i64": lambda x: x.prod(0, dtype=torch.int64),
    "nansum": lambda x: x.nansum(-1),
    "count_nonzero": lambda x: torch.count_nonzero(x),
    "count_nonzero_dim": lambda x: torch.count_nonzero(x, dim=-1),
    "count_nonzero_dims": lambda x: aten.count_nonzero.dim_IntList(x, [0, -1] if x.dim() > 1 else [0]),
}


@pytest.mark.parametrize("name", list(ALL))
def test_sum_prod_count(name):
    x = ALL[name]
    fns = [fn for op_name, fn in SUM_LIKE.items()
           # casting inf/nan to int is undefined behaviour in torch
           if not (op_name in ("sum_i32", "prod_i64") and x.is_floating_point() and not x.isfinite().all())]
    lowered_all(fns + [_sliced(SUM_LIKE["sum_last"])], x)


MEANS = {
    "mean": lambda x: x.mean(),
    "mean_dim": lambda x: x.mean(-1),
    "mean_dims_keep": lambda x: x.mean((0, -1), keepdim=True) if x.dim() > 1 else x.mean(0, keepdim=True),
    "mean_empty_list": lambda x: aten.mean.dim(x, []),
    "mean_dtype": lambda x: x.mean(0, dtype=torch.float64),
}


@pytest.mark.parametrize("name", list(FLOATS))
def test_mean(name):
    lowered_all(list(MEANS.values()) + [_sliced(MEANS["mean_dim"])], FLOATS[name])


def test_mean_of_integers():
    x = INTS["i64"]
    lowered(lambda x: x.mean(dtype=torch.float32), x)
    lowered(lambda x: x.mean(), x)            # strict raises; so must defer


def test_complex_sums():
    z = torch.randn(3, 4, dtype=torch.complex64, generator=_gen(8))
    lowered_all([lambda z: z.sum(), lambda z: z.sum(1, keepdim=True), lambda z: z.t().mean(0),
                 lambda z: z.cumsum(1), lambda z: z.sum(0, dtype=torch.complex128)], z)


def test_integer_sums_wrap_like_torch():
    x = torch.tensor([2**62, 2**62, 2**62], dtype=torch.int64)
    lowered(lambda x: (x.sum(), x.prod(), x.cumsum(0), x.cumprod(0)), x)


# -- max, min, argmax, argmin, aminmax -----------------------------------------------------------

EXTREMES = {
    "amax": lambda x: x.amax(),
    "amin_dim": lambda x: x.amin(-1),
    "amax_keep": lambda x: x.amax(0, keepdim=True),
    "amin_list": lambda x: aten.amin(x, [0, -1]) if x.dim() > 1 else aten.amin(x, [0]),
    "max": lambda x: x.max(),
    "min": lambda x: x.min(),
    "max_dim": lambda x: tuple(x.max(-1)),
    "min_dim_keep": lambda x: tuple(x.min(0, keepdim=True)),
    "argmax": lambda x: x.argmax(),
    "argmin_keep": lambda x: x.argmin(keepdim=True),
    "argmax_dim": lambda x: x.argmax(-1),
    "argmin_dim_keep": lambda x: x.argmin(0, keepdim=True),
    "aminmax": lambda x: tuple(torch.aminmax(x)),
    "aminmax_dim": lambda x: tuple(torch.aminmax(x, dim=-1, keepdim=True)),
}
# torch's meta kernels raise RuntimeError where the CPU kernels raise IndexError (reducing a dim of
# size 0); the recorder runs the meta kernel first.  See the report for the repro.
_META_ERROR_TYPE = {("empty", "amax_keep"), ("empty", "amin_list"), ("empty", "argmax"),
                    ("empty", "argmin_keep"), ("empty", "argmin_dim_keep")}


@pytest.mark.parametrize("name", [n for n in ALL if n != "empty"])
def test_max_min(name):
    x = ALL[name]
    if x.dtype == torch.bool:   # CPU's argmax/argmin reject bool; the meta kernels do not
        for op_name in [n for n in EXTREMES if n.startswith("arg")]:
            lowered(EXTREMES[op_name], x)
    fns = [fn for op_name, fn in EXTREMES.items() if not (x.dtype == torch.bool and op_name.startswith("arg"))]
    lowered_all(fns + [_sliced(EXTREMES["max_dim"])], x)


def test_max_min_of_empty():
    x = FLOATS["empty"]
    for op_name, fn in EXTREMES.items():
        if ("empty", op_name) not in _META_ERROR_TYPE:
            lowered(fn, x)


def test_amax_of_empty_dim_raises_index_error():
    lowered(EXTREMES["amax_keep"], FLOATS["empty"])


def test_ties_pick_first_index():
    x = torch.tensor([[3, 1, 3, 1], [2, 2, 2, 2]])
    lowered(lambda x: (tuple(x.max(1)), tuple(x.min(1)), x.argmax(1), x.argmin(1), x.argmax()), x)
    f = torch.tensor([[0.0, -0.0, nan, nan], [-inf, -inf, -inf, -inf]])
    lowered(lambda x: (tuple(x.max(1)), tuple(x.min(1)), x.argmax(1), x.argmin(1)), f)


# -- var, std ------------------------------------------------------------------------------------

VARS = {
    "var": lambda x: x.var(),
    "std_dim": lambda x: x.std(-1),
    "var_c0_keep": lambda x: torch.var(x, 0, correction=0, keepdim=True),
    "std_c2": lambda x: torch.std(x, correction=2),
    "var_float_c": lambda x: torch.var(x, -1, correction=0.5),
    "var_empty_list": lambda x: aten.var.correction(x, []),
    "var_mean": lambda x: tuple(torch.var_mean(x, -1)),
    "std_mean_keep": lambda x: tuple(torch.std_mean(x, 0, correction=0, keepdim=True)),
    "std_mean": lambda x: tuple(torch.std_mean(x)),
    "var_none_correction": lambda x: aten.var.correction(x, None, correction=None),
}


@pytest.mark.parametrize("name", list(FLOATS))
def test_var_std(name):
    lowered_all(list(VARS.values()) + [_sliced(VARS["var_mean"])], FLOATS[name])


def test_var_mean_with_infinities_follows_welford():
    x = torch.tensor([[1.0, inf], [inf, 1.0], [inf, inf], [-inf, 2.0], [3.0, -inf], [nan, inf]])
    lowered(lambda x: (tuple(torch.var_mean(x, 1)), tuple(torch.std_mean(x, 1, keepdim=True))), x)


def test_var_small_counts_give_nan_or_inf():
    x = torch.tensor([[1.0], [2.0]])
    lowered(lambda x: (x.var(1), x.std(1), x.var(0, correction=2), x.var(0, correction=3)), x)


def test_var_of_integers_raises_like_cpu():
    lowered(lambda x: x.var(), INTS["i64"])


def test_float_correction_is_a_runtime_input():
    x = FLOATS["2d"]
    for c in (0.5, 1.5, 7.0):
        lowered(lambda x: x.var(-1, correction=c), x)
    assert deferfuse.stats()["cache_hits"] >= 1


# -- any, all ------------------------------------------------------------------------------------

ANY_ALL = {
    "any": lambda x: x.any(),
    "all": lambda x: x.all(),
    "any_dim": lambda x: x.any(-1),
    "all_dim_keep": lambda x: x.all(0, keepdim=True),
    "any_dims": lambda x: x.any((0, -1)) if x.dim() > 1 else x.any((0,)),
    "all_dims_empty": lambda x: aten.all.dims(x, []),
    "any_dims_none": lambda x: aten.any.dims(x, None, True),
}


@pytest.mark.parametrize("name", list(ALL))
def test_any_all(name):
    lowered_all(ANY_ALL, ALL[name])


# -- logsumexp -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(ALL))
def test_logsumexp(name):
    lowered_all([lambda x: x.logsumexp(-1),
                 lambda x: x.logsumexp((0, -1) if x.dim() > 1 else 0, keepdim=True)], ALL[name])


def test_logsumexp_infinite_rows():
    x = torch.tensor([[-inf, -inf], [inf, 1.0], [-inf, 2.0], [nan, 1.0], [1e30, 1e30]])
    lowered(lambda x: x.logsumexp(1), x)


def test_logsumexp_empty_dim_list_raises():
    lowered(lambda x: aten.logsumexp(x, []), FLOATS["2d"])


# -- cumsum, cumprod -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(ALL))
def test_cumulative(name):
    x = ALL[name]
    fns = [lambda x: x.cumsum(-1), lambda x: x.cumprod(0), lambda x: x.cumsum(0, dtype=torch.float64),
           _sliced(lambda x: x.cumsum(-1))]
    if not x.is_floating_point():
        fns.append(lambda x: x.cumprod(0, dtype=torch.int32))
    lowered_all(fns, x)


# -- softmax, log_softmax and their backward -----------------------------------------------------

SOFTMAX_INPUTS = {k: v for k, v in FLOATS.items()}
SOFTMAX_INPUTS["rows"] = torch.tensor([[-inf, -inf, -inf], [inf, 0.0, 1.0], [nan, 0.0, 1.0], [1e30, 0.0, -1e30]])


@pytest.mark.parametrize("name", list(SOFTMAX_INPUTS))
def test_softmax(name):
    lowered_all([lambda x: (x.softmax(-1), x.log_softmax(-1)),
                 lambda x: (torch.softmax(x, 0), torch.log_softmax(x, 0)),
                 _sliced(lambda x: x.softmax(-1))], SOFTMAX_INPUTS[name])


def test_softmax_half_to_float_raises_on_cpu():
    lowered(lambda x: aten._softmax(x, 1, True), FLOATS["f16"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_softmax_backward(dtype):
    g = _gen(3)
    x = torch.randn(3, 5, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(3, 5, generator=g).to(dtype)

    def f(x, grad):
        y, z = x.softmax(-1), x.log_softmax(0)
        return torch.autograd.grad((y, z), x, (grad, grad))

    lowered(f, x, grad)
    lowered_all([lambda grad, out: aten._softmax_backward_data(grad, out, 1, dtype),
                 lambda grad, out: aten._log_softmax_backward_data(grad, out, 0, dtype)], grad, x.detach())


def test_softmax_backward_mixed_dtypes_raise_like_cpu():
    x = torch.randn(2, 3)
    lowered(lambda a, b: aten._softmax_backward_data(a, b, 1, torch.float16), x, x)
    lowered(lambda a, b: aten._log_softmax_backward_data(a, b, 1, torch.float16), x, x)


@pytest.mark.xfail(strict=True, reason="core: meta infers float64 where CPU returns float32")
def test_softmax_backward_mixed_dtypes_cpu_accepts():
    x = torch.randn(2, 3)
    check(lambda a, b: aten._log_softmax_backward_data(a, b, 1, torch.float64), x, x)


# -- layer norm ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape,normalized", [((3, 4), (4,)), ((2, 3, 4), (3, 4)), ((0, 5), (5,)), ((4,), (4,))])
def test_layer_norm(dtype, shape, normalized):
    g = _gen(4)
    x = torch.randn(shape, generator=g).to(dtype)
    w = torch.randn(normalized, generator=g).to(dtype)
    b = torch.randn(normalized, generator=g).to(dtype)
    fns = [lambda x, w, b: torch.nn.functional.layer_norm(x, normalized, w, b, 1e-3),
           lambda x, w, b: torch.nn.functional.layer_norm(x, normalized)]
    if dtype != torch.bfloat16:  # CPU returns bf16 mean/rstd, meta says float32: see report
        fns.append(lambda x, w, b: aten.native_layer_norm(x, list(normalized), w, None, 1e-5))
    lowered_all(fns, x, w, b)


def test_layer_norm_empty_normalized_shape():
    lowered(lambda x: aten.native_layer_norm(x, [0], None, None, 1e-5), torch.empty(3, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_layer_norm_backward(dtype):
    g = _gen(5)
    x = torch.randn(2, 3, 4, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(4, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(4, generator=g, dtype=dtype).requires_grad_()
    grad = torch.randn(2, 3, 4, generator=g, dtype=dtype)

    def f(x, w, b, grad):
        y = torch.nn.functional.layer_norm(x, (4,), w, b)
        return torch.autograd.grad(y, (x, w, b), grad)

    lowered(f, x, w, b, grad)


def test_layer_norm_backward_without_weight_uses_decomposition():
    x = torch.randn(3, 4).requires_grad_()
    grad = torch.randn(3, 4)
    no_fallback_of(lambda x, g: torch.autograd.grad(torch.nn.functional.layer_norm(x, (4,)), x, g),
                   x, grad, names=("layer_norm",))


# -- batch norm ----------------------------------------------------------------------------------

def _bn_inputs(shape, dtype=torch.float32, seed=6):
    g = _gen(seed)
    c = shape[1]
    x = torch.randn(shape, generator=g).to(dtype)
    return (x, torch.randn(c, generator=g), torch.randn(c, generator=g),
            torch.randn(c, generator=g), torch.rand(c, generator=g) + 0.5)


@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 5), (2, 3, 2, 2)])
def test_batch_norm_eval_and_training_without_stats(shape):
    x, w, b, rm, rv = _bn_inputs(shape)
    F = torch.nn.functional
    lowered_all([
        lambda x, w, b, rm, rv: F.batch_norm(x, rm, rv, w, b, training=False, eps=1e-3),
        lambda x, w, b, rm, rv: F.batch_norm(x, None, None, w, b, training=True),
        lambda x, w, b, rm, rv: tuple(aten.native_batch_norm(x, None, None, None, None, True, 0.1, 1e-5)),
        lambda x, w, b, rm, rv: tuple(aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-5)),
        lambda x, w, b, rm, rv: aten._native_batch_norm_legit_no_training(x, w, b, rm, rv, 0.1, 1e-5)[0],
    ], x, w, b, rm, rv)


def test_batch_norm_half_input():
    x, w, b, rm, rv = _bn_inputs((4, 3, 2), torch.float16)
    F = torch.nn.functional
    lowered(lambda x, w, b, rm, rv: F.batch_norm(x, rm, rv, w, b, training=False), x, w, b, rm, rv)
    lowered(lambda x: F.batch_norm(x, None, None, training=True), x)
    # all-half parameters: torch keeps the statistics in half
    lowered(lambda x, w, b, rm, rv: F.batch_norm(x, rm, rv, w, b, training=False), x, *(t.half() for t in (w, b, rm, rv)))
    lowered(lambda x, w, b: tuple(aten.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5))[0], x, w.half(), b.half())


def test_batch_norm_functional_updates_running_stats():
    x, w, b, rm, rv = _bn_inputs((4, 3, 2))
    lowered(lambda x, w, b, rm, rv: tuple(aten._native_batch_norm_legit_functional(x, w, b, rm, rv, True, 0.1, 1e-5)),
            x, w, b, rm, rv)


def test_batch_norm_training_updates_running_stats_in_place():
    x, w, b, rm, rv = _bn_inputs((4, 3, 2))
    F = torch.nn.functional
    no_fallback_of(lambda x, w, b, rm, rv: F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.3),
                   x, w, b, rm, rv, names=("batch_norm", "var_mean"))


@pytest.mark.parametrize("train", [True, False])
def test_batch_norm_backward(train):
    x, w, b, rm, rv = _bn_inputs((4, 3, 2), torch.float64)
    x, w, b = x.requires_grad_(), w.double().requires_grad_(), b.double().requires_grad_()
    grad = torch.randn(4, 3, 2, generator=_gen(7), dtype=torch.float64)

    def f(x, w, b, rm, rv, grad):
        if train:
            out = torch.nn.functional.batch_norm(x, None, None, w, b, training=True)
        else:
            out = torch.nn.functional.batch_norm(x, rm, rv, w, b, training=False)
        return torch.autograd.grad(out, (x, w, b), grad)

    lowered(f, x, w, b, rm.double(), rv.double(), grad)


# -- vector norms --------------------------------------------------------------------------------

NORMS = {
    "default": lambda x: torch.linalg.vector_norm(x),
    "ord1_dim": lambda x: torch.linalg.vector_norm(x, 1, -1),
    "ord0": lambda x: torch.linalg.vector_norm(x, 0, 0, keepdim=True),
    "ord3": lambda x: torch.linalg.vector_norm(x, 3, -1),
    "ord-1": lambda x: torch.linalg.vector_norm(x, -1, -1),
    "inf": lambda x: torch.linalg.vector_norm(x, inf, -1),
    "-inf": lambda x: torch.linalg.vector_norm(x, -inf, -1),
    "float2": lambda x: torch.linalg.vector_norm(x, 2.0, -1),
    "float1": lambda x: torch.linalg.vector_norm(x, 1.0),
    "float0": lambda x: torch.linalg.vector_norm(x, 0.0, -1),
    "float2.5": lambda x: torch.linalg.vector_norm(x, 2.5, -1, keepdim=True),
    "float-0.5": lambda x: torch.linalg.vector_norm(x, -0.5),
    "dtype": lambda x: torch.linalg.vector_norm(x, 2, dtype=torch.float64),
    "tensor.norm": lambda x: x.norm(),
    "norm_dim": lambda x: torch.norm(x, dim=-1),
}


@pytest.mark.parametrize("name", [n for n in FLOATS if n != "empty"])
def test_vector_norm(name):
    # a float ord is a runtime input that compiles every case, so only some inputs try them all
    all_ords = name in ("2d", "nan_inf", "0d", "f16")
    lowered_all([fn for key, fn in NORMS.items() if all_ords or not key.startswith("float")], FLOATS[name])


def test_vector_norm_of_empty():
    x = FLOATS["empty"]
    lowered_all([NORMS[key] for key in ("default", "ord1_dim", "ord3", "float2", "float0", "float-0.5", "-inf")], x)
    lowered(lambda x: torch.linalg.vector_norm(x, inf), x)     # strict raises


def test_norm_overloads_decompose_to_vector_norm():
    x = FLOATS["2d"]
    no_fallback_of(lambda x: (aten.norm.Scalar(x, 3), aten.norm.ScalarOpt_dim(x, 1.5, [1])), x,
                   names=("norm",))


# -- several reductions in one graph -------------------------------------------------------------

def test_fused_reductions_in_one_graph():
    x = FLOATS["2d"]

    def f(x):
        s = x.softmax(-1)
        return s.sum(0), s.amax(-1), s.cumsum(0).logsumexp(0), torch.var_mean(s, 0)

    lowered(f, x)


# -- scans and selections with indices: cummax/cummin, median, mode, kthvalue --------------------
# torch's CPU kernels decide which index wins among tied values; the inputs are small integers
# (many ties), with NaN, -0.0 next to 0.0, infinities and all-NaN rows.

def _ties():
    g = _gen(3)
    x = torch.randint(0, 3, (6, 9), generator=g).double()
    x[0, 2] = x[1, ::2] = nan
    x[2] = nan
    x[3, 1], x[3, 5], x[4, 4], x[4, 6] = -0.0, -0.0, inf, -inf
    return {
        "f64": x,
        "f32_t": x.float().t(),
        "i64": torch.randint(-2, 3, (5, 7), generator=g),
        "bool": torch.randint(0, 2, (4, 6), generator=g).bool(),
        "0d": torch.tensor(1.5),
        "empty": torch.empty(0, 4),
        "nan16": torch.where(torch.rand(8, 16, generator=g) < 0.3, nan,
                             torch.randint(0, 3, (8, 16), generator=g).float()),
        "f16": torch.randint(0, 3, (4, 5), generator=g).half(),
    }


TIES = _ties()
SELECTIONS = {
    "cummax": lambda x: (torch.cummax(x, 0), torch.cummax(x, -1)),
    "cummin": lambda x: (torch.cummin(x, 0), torch.cummin(x, -1)),
    "median_dim": lambda x: (torch.median(x, 0), torch.median(x, -1, keepdim=True)),
    "nanmedian_dim": lambda x: (torch.nanmedian(x, 0, keepdim=True), torch.nanmedian(x, -1)),
    "mode": lambda x: (torch.mode(x, 0), torch.mode(x, -1, keepdim=True)),
    "kthvalue": lambda x: tuple(torch.kthvalue(x, k, d, keepdim=k == 1)
                                for d in (0, -1) for k in sorted({1, 2, x.shape[d] if x.ndim else 1})
                                if k <= (x.shape[d] if x.ndim else 1)),
}


@pytest.mark.parametrize("op", list(SELECTIONS))
@pytest.mark.parametrize("name", list(TIES))
def test_selection_ties_match_torch(op, name):
    x = TIES[name]
    if name == "empty" and op in ("median_dim", "nanmedian_dim", "mode", "kthvalue"):
        lowered(lambda x: SELECTIONS[op](x.t()), x, exact=True)    # reduce the non-empty dim
        lowered(SELECTIONS[op], x, exact=True)                     # strict raises for dim 0
        return
    if name == "bool" and op in ("median_dim", "nanmedian_dim", "kthvalue"):
        lowered(SELECTIONS[op], x)                                 # strict raises: not for Bool
        return
    lowered(SELECTIONS[op], x, exact=True)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 16, 40])
def test_selections_random_ties(n):
    g = _gen(n)
    x = torch.randint(0, 4, (12, n), generator=g).float()
    x = torch.where(torch.rand(12, n, generator=g) < 0.2, nan, x)
    x[::4] = torch.where(x[::4] == 1, -0.0, x[::4])
    ks = sorted({1, (n + 1) // 2, n})
    fns = [lambda x: torch.cummax(x, 1), lambda x: torch.cummin(x, 1),
           lambda x: torch.median(x, 1), lambda x: torch.nanmedian(x, 1),
           lambda x: [torch.kthvalue(x, k, 1) for k in ks]]
    if n <= 16:
        fns.append(lambda x: torch.mode(x, 1))
    lowered_all(fns, x, exact=True)


def test_full_median_and_logcumsumexp():
    fns = [torch.median, torch.nanmedian]
    for name in ("f64", "f32_t", "i64", "0d", "nan16", "f16"):
        lowered_all(fns, TIES[name], exact=True)
    x = FLOATS["nan_inf"]
    lowered_all([torch.median, torch.nanmedian], x[2:], exact=True)   # all -inf
    lowered_all([torch.median, torch.nanmedian], torch.full((3,), nan), exact=True)
    lowered_all([torch.median, torch.nanmedian], FLOATS["empty"])      # nan
    lowered_all([torch.median, torch.nanmedian], torch.empty(0, dtype=torch.int64))
    lowered(torch.median, INTS["bool"])                                # strict raises
    for name in ("2d", "0d", "empty", "transposed", "3d_f64", "nan_inf", "f16", "bf16"):
        lowered_all([lambda x: torch.logcumsumexp(x, 0), lambda x: torch.logcumsumexp(x, -1)],
                    FLOATS[name], **({"rtol": 1e-2, "atol": 1e-2} if name in ("f16", "bf16") else {}))
    big = torch.tensor([[1e30, -1e30, inf, 3.0, -inf, nan, 2.0], [-inf, -inf, 0.0, inf, inf, 1.0, -inf]])
    lowered(lambda x: torch.logcumsumexp(x, 1), big)
    lowered(lambda x: torch.logcumsumexp(x, 0), INTS["i64"])          # strict raises for Long


def test_long_rows_decline_mode_and_kthvalue():
    # mode over > 16 elements (std::sort is unstable there) and kthvalue over > 1024 elements
    # run torch's kernels: counted fallbacks with the same results
    x = torch.randint(0, 3, (2, 17), generator=_gen(5)).float()
    deferfuse.reset_stats()
    check(lambda x: torch.mode(x, 1), x, exact=True)
    assert deferfuse.stats()["fallbacks"] == {"aten.mode.default": 1}
    deferfuse.reset_stats()
    y = torch.randint(0, 3, (2, 1025), generator=_gen(6))
    check(lambda y: torch.kthvalue(y, 7, 1), y, exact=True)
    assert deferfuse.stats()["fallbacks"] == {"aten.kthvalue.default": 1}


# -- segment_reduce ------------------------------------------------------------------------------

_SEGMENT_KINDS = ("sum", "mean", "max", "min", "prod")


def _segment_data(dtype=torch.float32, shape=(8, 3)):
    x = torch.randn(*shape, generator=_gen(11), dtype=torch.float64).to(dtype)
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("initial", [None, 2, -0.5])
def test_segment_reduce_lengths_and_offsets(dtype, initial):
    x = _segment_data(dtype)
    lengths = torch.tensor([2, 0, 3, 3])            # one empty segment
    offsets = torch.tensor([0, 2, 2, 5, 8])
    fns = [lambda x, r=r: torch.segment_reduce(x, r, lengths=lengths, initial=initial) for r in _SEGMENT_KINDS]
    fns += [lambda x, r=r: torch.segment_reduce(x, r, offsets=offsets, initial=initial) for r in _SEGMENT_KINDS]
    lowered_all(fns, x)


def test_segment_reduce_nan_ties_and_empty():
    x = torch.tensor([1.0, nan, 3.0, 2.0, 5.0, 5.0, 0.0, -inf, inf, 4.0])
    lengths = torch.tensor([0, 2, 3, 0, 3, 2])
    for initial in (None, 3, nan):
        lowered_all([lambda x, r=r: torch.segment_reduce(x, r, lengths=lengths, initial=initial)
                     for r in _SEGMENT_KINDS], x)
    # offsets that start after 0 and end before the size (torch ignores the other elements)
    offsets = torch.tensor([1, 4, 4, 7])
    lowered_all([lambda x, r=r: torch.segment_reduce(x, r, offsets=offsets) for r in _SEGMENT_KINDS], x)


def test_segment_reduce_axis1_and_batched_lengths():
    x = _segment_data(torch.float32, (3, 6, 2))
    lengths = torch.tensor([[2, 0, 4], [1, 2, 3], [6, 0, 0]])
    offsets = torch.cat([torch.zeros(3, 1, dtype=torch.long), lengths.cumsum(1)], 1)
    fns = [lambda x, r=r: torch.segment_reduce(x, r, lengths=lengths, axis=1) for r in _SEGMENT_KINDS]
    fns += [lambda x, r=r: torch.segment_reduce(x, r, offsets=offsets, axis=1, initial=1) for r in _SEGMENT_KINDS]
    lowered_all(fns, x)
    # 2-D data, axis 1; int32 lengths; unsafe lengths that do not cover the row
    y = _segment_data(torch.float64, (4, 5))
    l32 = torch.tensor([[1, 4], [2, 3], [0, 5], [5, 0]], dtype=torch.int32)
    short = torch.tensor([[1, 2], [2, 1], [0, 3], [0, 0]])
    lowered_all([lambda y, r=r: torch.segment_reduce(y, r, lengths=l32, axis=1) for r in _SEGMENT_KINDS]
                + [lambda y, r=r: torch.segment_reduce(y, r, lengths=short, axis=1, unsafe=True)
                   for r in _SEGMENT_KINDS], y)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_segment_reduce_half_rounds_each_step(dtype):
    x = (torch.rand(40, 2, generator=_gen(12)) * 4 + 0.5).to(dtype)
    lengths = torch.tensor([17, 0, 23])
    lowered_all([lambda x, r=r: torch.segment_reduce(x, r, lengths=lengths, initial=initial)
                 for r in _SEGMENT_KINDS for initial in (None, 1.5)], x, exact=True)


def _segment_grad_fn(reduce, **kw):
    def fn(x):
        out = torch.segment_reduce(x, reduce, **kw)
        w = torch.arange(1, out.numel() + 1, dtype=out.dtype).reshape(out.shape) - 2
        return torch.autograd.grad((out * w).sum(), x)[0]
    return fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_segment_reduce_backward(dtype):
    x = torch.tensor([[1.0, 2.0], [3.0, 2.0], [3.0, 0.0], [nan, 0.0], [2.0, 5.0],
                      [0.0, 5.0], [-1.0, 5.0], [4.0, -3.0]], dtype=dtype, requires_grad=True)
    lengths = torch.tensor([3, 0, 2, 3])
    offsets = torch.tensor([0, 3, 3, 5, 8])
    for r in _SEGMENT_KINDS:
        for initial in (None, 2):
            lowered(_segment_grad_fn(r, lengths=lengths, initial=initial), x, compared=True)
            lowered(_segment_grad_fn(r, offsets=offsets, initial=initial), x, compared=True)
    y = torch.randn(2, 5, 3, generator=_gen(13), dtype=torch.float64).to(dtype).requires_grad_()
    batched = torch.tensor([[2, 0, 3], [1, 4, 0]])
    for r in _SEGMENT_KINDS:
        lowered(_segment_grad_fn(r, lengths=batched, axis=1), y, compared=True)


def test_segment_reduce_backward_op_directly():
    # max ties split the gradient only where it is positive, as torch's CPU kernel does
    x = torch.tensor([3.0, 3.0, 1.0, 3.0, 2.0, 2.0, nan, nan])
    lengths = torch.tensor([4, 2, 2])
    grad = torch.tensor([-1.5, 4.0, 6.0])
    def fn(x, grad):
        out = torch.segment_reduce(x, "max", lengths=lengths)
        return aten._segment_reduce_backward(grad, out, x, "max", lengths=lengths)
    lowered(fn, x, grad, compared=True)
    lowered(fn, x, -grad, compared=True)


def _segment_raises(fn, *inputs):
    """Strict raises (lowered() checks that defer raises the same exception type)."""
    assert lowered(fn, *inputs) is None


def test_segment_reduce_errors():
    x = torch.randn(6)
    for lengths in (torch.tensor([2, 5]), torch.tensor([7, -1]), torch.tensor([2, 2])):
        _segment_raises(lambda x: torch.segment_reduce(x, "sum", lengths=lengths), x)
    # unsafe: a negative length still raises; decreasing offsets too
    _segment_raises(lambda x: torch.segment_reduce(x, "sum", lengths=torch.tensor([7, -1]), unsafe=True), x)
    _segment_raises(lambda x: torch.segment_reduce(x, "max", offsets=torch.tensor([0, 4, 2, 6])), x)
    # metadata errors: axis not the last dim of lengths, unknown reduction, overflowing initial
    _segment_raises(lambda x: torch.segment_reduce(x.reshape(2, 3), "sum", lengths=torch.tensor([1, 1]), axis=1), x)
    _segment_raises(lambda x: torch.segment_reduce(x, "median", lengths=torch.tensor([6])), x)
    _segment_raises(lambda x: torch.segment_reduce(x.half(), "sum", lengths=torch.tensor([6]), initial=1e6), x)
