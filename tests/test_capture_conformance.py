"""Capture-layer bugs found by the OpInfo conformance sweep (conformance/, docs/conformance.md).

Each test is the smallest program of one failure cluster, compared against strict PyTorch.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import deferfuse
from oracle import check, lowered

aten = torch.ops.aten


def _fallback_reasons(fn, *inputs) -> dict:
    """stats()["fallback_reasons"] of one defer run of ``fn``."""
    deferfuse.reset_stats()
    with deferfuse.config.override(always_compile=True), deferfuse.defer():
        fn(*inputs)
    return deferfuse.stats()["fallback_reasons"]


@pytest.mark.parametrize("program, inputs", [
    (lambda x: torch.histogramdd(x, [2, 3]), (torch.randn(10, 2),)),
    (lambda x, m, o: torch.masked_select(x, m, out=o),
     (torch.randn(5), torch.tensor([True, False, True, False, True]), torch.empty(0))),
    (lambda x: (x * 2).to_sparse().to_dense(), (torch.randn(3, 3),)),
], ids=["histogramdd", "masked_select_out", "to_sparse"])
def test_op_without_meta_kernel_runs_eagerly(program, inputs):
    """An op with no meta kernel raised 'attempted to run this operator with Meta tensors'
    instead of running eagerly."""
    check(program, *inputs)


def test_op_without_meta_kernel_is_counted_and_still_raises_user_errors():
    # histogramdd runs two such ops (_histogramdd_bin_edges, _histogramdd_from_bin_cts)
    program = lambda x: torch.histogramdd(x * 2, [2, 3])  # noqa: E731
    assert _fallback_reasons(program, torch.randn(10, 2)).get("no_meta") == 2
    check(lambda x: torch.histogramdd(x, [2, 3]), torch.randn(10, 3))   # strict's error: 3 dims, 2 bin counts


def test_out_list_ops_return_none():
    """out= ops writing a list of tensors return nothing; defer returned the list ('Expected
    __torch_dispatch__ for aten::unbind_copy.int_out to return None')."""
    check(lambda x, a, b: torch.unbind_copy(x, 0, out=[a, b]), torch.randn(2, 3), torch.empty(3), torch.empty(3))
    check(lambda x, a, b: torch.split_with_sizes_copy(x, [1, 2], out=[a, b]),
          torch.randn(3), torch.empty(1), torch.empty(2))


def test_kron_out_writes_through_unsafe_view():
    """kron's out= variant writes through _unsafe_view(out), which deferfuse took for a copy:
    out was never written."""
    check(lambda a, b, o: torch.kron(a, b, out=o), torch.randn(2, 3), torch.randn(2, 2), torch.empty(4, 6))


def test_decomposition_returning_not_implemented_runs_eagerly():
    """adaptive_max_pool2d's decomposition declines non-divisible sizes; its NotImplemented
    reached torch ('Multiple dispatch failed')."""
    check(lambda x: F.adaptive_max_pool2d(x, (3, 2)), torch.randn(1, 5, 7))


def test_sparse_argument_runs_eagerly():
    """A sparse argument raised 'Cannot access storage of SparseCsrTensorImpl'."""
    check(lambda d, s: torch.sparse.sampled_addmm(s, d, d.t()), torch.randn(3, 3), torch.eye(3).to_sparse_csr())
    assert _fallback_reasons(lambda d, s: torch.sparse.sampled_addmm(s, d * 2, d.t()),
                             torch.randn(3, 3), torch.eye(3).to_sparse_csr()).get("opaque") == 1


def test_sparse_argument_error_has_stricts_type():
    check(lambda d, s, o: torch.sparse.sampled_addmm(s, d, d.t(), out=o),
          torch.randn(3, 3), torch.eye(3).to_sparse_csr(), torch.empty(3, 3))


def test_circular_pad_copies_between_disjoint_strided_regions():
    """pad(mode='circular') copies between slices of one output whose ranges interleave but
    whose elements differ; torch's partial-overlap check calls that 'too hard' and allows it,
    defer raised."""
    check(lambda x: F.pad(x, (1, 2), mode="circular"), torch.randn(1, 2, 4))


def test_inplace_addbmm_resizing_a_broadcast_self_runs_like_strict():
    """addbmm_ on a self of shape (1,): the CPU kernel resizes self to the result's shape, the
    meta kernel rejects the call; defer raised."""
    check(lambda s, a, b: s.addbmm_(a, b), torch.randn(1), torch.randn(3, 5, 4), torch.randn(3, 4, 10))


@pytest.mark.parametrize("op", ["native_batch_norm", "no_training"])
def test_eval_batch_norm_saves_no_statistics(op):
    """In eval mode the CPU kernel returns empty save_mean/save_invstd; the meta kernel one per
    channel."""
    if op == "native_batch_norm":
        fn = lambda x, m, v: aten.native_batch_norm(x, None, None, m, v, False, 0.1, 1e-5)  # noqa: E731
    else:
        fn = lambda x, m, v: aten._native_batch_norm_legit_no_training(x, None, None, m, v, 0.1, 1e-5)  # noqa: E731
    check(fn, torch.randn(3, 2, 4), torch.randn(2), torch.rand(2) + 0.5)


@pytest.mark.parametrize("program, inputs", [
    (lambda x: x.logit_(), (torch.tensor([1, 2]),)),
    (lambda x, e: x.ldexp_(e), (torch.tensor([True, False]), torch.tensor([1, 2]))),
    (lambda x, y, o: torch.add(x, y, out=o), (torch.randn(2), torch.randn(2), torch.empty(2, dtype=torch.long))),
])
def test_inplace_result_that_cannot_be_cast_raises(program, inputs):
    check(program, *inputs)


def test_nonzero_out_runs_eagerly():
    check(lambda x, o: torch.nonzero(x * 2, out=o), torch.tensor([1.0, 0.0, 2.0]), torch.empty(0, dtype=torch.long))


@pytest.mark.parametrize("program", [
    lambda a, b, o: torch.complex(a, b, out=o),
    lambda a, b, o: torch.polar(a.abs(), b, out=o),
    lambda a, b, o: o.copy_(torch.complex(a, b)),
], ids=["complex_out", "polar_out", "copy_of_complex"])
def test_complex_result_written_into_user_tensor(program):
    """torch.complex's decomposition writes its result through view_as_real, a float32 view of
    complex memory; reading the complex tensor then ignored those pending writes (garbage)."""
    check(program, torch.randn(3), torch.randn(3), torch.empty(3, dtype=torch.complex64))


@pytest.mark.parametrize("program", [
    lambda x: torch.unique(x * 2, dim=0),
    lambda x: torch.unique_consecutive(x * 2, dim=0),
])
def test_data_dependent_eager_ops_are_counted(program):
    """Data-dependent ops ran in torch without being counted as fallbacks.  (Most are recorded
    after a size sync now: test_sized.py.)"""
    x = torch.tensor([1.0, -1.0, 2.0, 1.0])
    assert _fallback_reasons(program, x).get("data_dependent") == 1
    check(program, x)


def test_empty_is_not_counted():
    assert _fallback_reasons(lambda x: torch.empty(3) + x, torch.ones(3)) == {}


def test_inplace_whose_functional_form_orders_arguments_differently():
    # polygamma_(self, n) is polygamma(n, self): it ran eagerly, unmatched
    deferfuse.reset_stats()
    check(lambda x: x.polygamma_(2), torch.linspace(0.5, 3, 6))
    assert deferfuse.stats()["fallbacks"] == {}


@pytest.mark.parametrize("program, shape", [
    (lambda x: x.squeeze_(1).mul_(2), (2, 1, 3)),
    (lambda x: (x.t_(), x.add_(1), x.transpose_(0, 1), x * 3), (2, 3)),
    (lambda x: (x.mul_(2), x.unsqueeze_(0), x.as_strided_((3, 2), (1, 3)), x + 1), (2, 3)),
])
def test_inplace_view_of_a_plain_tensor_is_metadata_only(program, shape):
    # squeeze_/t_/as_strided_ on a user tensor flushed everything and counted a fallback
    deferfuse.reset_stats()
    check(program, torch.arange(6.0).reshape(shape))
    assert deferfuse.stats()["fallbacks"] == {}



# -- out= tensors of the wrong shape, and factories' out= variants -----------------------------
_EYE3 = torch.eye(3) * 3


@pytest.mark.parametrize("program, inputs", [
    (lambda a, o: torch.mm(a * 1, a, out=o), (torch.randn(3, 3), torch.empty(0))),
    (lambda a, v, i: torch.sort(a * 2, out=(v, i)), (torch.randn(4, 3), torch.empty(0), torch.empty(0, dtype=torch.long))),
    (lambda a, o: torch.linalg.inv(a + _EYE3, out=o), (torch.randn(2, 3, 3), torch.empty(0))),
    (lambda a, o: torch.nn.functional.logsigmoid(a - 1, out=o), (torch.randn(5), torch.empty(0))),
    (lambda a, o: torch.linalg.det(a + _EYE3, out=o), (torch.randn(3, 3), torch.empty(0))),
], ids=["mm", "sort", "inv", "logsigmoid", "det"])
def test_empty_out_is_resized_and_the_op_lowered(program, inputs):
    """out= tensors of another shape went to eager torch: torch resizes them (resize_output)."""
    lowered(program, *inputs, compared=True)


def test_nonempty_out_of_the_wrong_shape_warns_like_strict():
    import warnings

    def caught(defer: bool) -> tuple[int, torch.Tensor]:
        a, out = torch.randn(3, 3), torch.ones(2, 2)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with deferfuse.config.override(always_compile=True), \
                    (deferfuse.defer() if defer else contextlib.nullcontext()):
                torch.mm(a * 1, a, out=out)
        return sum("was resized" in str(w.message) for w in seen), out

    (strict_count, strict_out), (defer_count, defer_out) = caught(False), caught(True)
    assert defer_count == strict_count == 1
    assert defer_out.shape == strict_out.shape == (3, 3)


def test_resized_out_keeps_the_layout_strict_gives_it():
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    strict_out, defer_out = torch.empty(0), torch.empty(0)
    torch.add(x * 1, 1, out=strict_out)
    with deferfuse.defer():
        torch.add(x * 1, 1, out=defer_out)
    assert defer_out.stride() == strict_out.stride()
    torch.testing.assert_close(defer_out, strict_out)


def test_out_with_pending_contents_is_resized_eagerly():
    def program(a, o):
        o.add_(1)                     # o's storage now has pending contents
        return torch.mm(a * 1, a, out=o)

    check(program, torch.randn(3, 3), torch.zeros(2, 2))


def _sum_into_a_flat_out(a):
    out = torch.zeros(3)                      # (made in the block: deferred)
    return torch.sum(a * 1, 0, keepdim=True, out=out)


def _cat_into_a_reused_out(a):
    out = torch.zeros(8)
    out.resize_(0)                            # (the reuse torch's resize warning suggests)
    return torch.cat([a.flatten(), a[0] * 2], out=out)


def _eval_batch_norm_into_reused_outs(x):
    w, b, rm, rv = torch.ones(3), torch.zeros(3), torch.zeros(3) + 0.5, torch.ones(3) * 2
    o, m, r = torch.zeros(30), torch.zeros(5), torch.zeros(5)
    for t in (o, m, r):
        t.resize_(0)
    # (the CPU kernel writes other shapes than the functional twin computes: run eagerly)
    torch.ops.aten.native_batch_norm.out(x * 1, w, b, rm, rv, False, 0.1, 1e-5, out=o, save_mean=m, save_invstd=r)
    return o, m, r


@pytest.mark.parametrize("program, inputs", [
    (_sum_into_a_flat_out, (torch.randn(2, 3),)),
    (_cat_into_a_reused_out, (torch.randn(2, 2),)),
    (_eval_batch_norm_into_reused_outs, (torch.randn(2, 3, 4),)),
], ids=["same-numel", "reused-after-resize_(0)", "eager-kernel-resizes"])
def test_a_deferred_out_takes_the_results_shape_within_its_storage(program, inputs):
    """A deferred out= tensor of another shape kept its old shape (the values written in the
    old layout, or nothing: an eager kernel resized only the real view it was given)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # (torch's resize warning, in both)
        check(program, *inputs)


def test_a_deferred_out_that_must_grow_raises_and_keeps_its_contents():
    """Growing a deferred out= tensor's storage raised torch's "storage that is not resizable"
    (or nothing, with a wrong shape); it now says what to do, and the tensor is untouched."""
    import warnings
    with deferfuse.config.override(always_compile=True), deferfuse.defer(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.zeros(2) + 1
        with pytest.raises(NotImplementedError, match=r"would grow its out= tensor to shape \(3,\)"):
            torch.mul(torch.ones(3), 2.0, out=out)
        reused = torch.zeros(5)
        reused.resize_(0)
        with pytest.raises(NotImplementedError, match="out= tensor of the result's shape"):
            torch.cat([torch.arange(3.0), torch.arange(3.0)], out=reused)
        assert out.tolist() == [1.0, 1.0] and tuple(reused.shape) == (0,)


@pytest.mark.parametrize("program, out", [
    (lambda o: torch.zeros(2, 3, out=o), torch.empty(2, 3, dtype=torch.int64)),
    (lambda o: torch.ones(4, out=o), torch.empty(0, dtype=torch.bool)),
    (lambda o: torch.full((2, 2), 7, out=o), torch.empty(2, 2, dtype=torch.int64)),
    (lambda o: torch.arange(1, 9, 3, out=o), torch.empty(0, dtype=torch.int64)),
    (lambda o: torch.arange(2.5, out=o), torch.empty(0, dtype=torch.float64)),
    (lambda o: torch.linspace(-1, 1, 5, out=o), torch.empty(5, dtype=torch.float64)),
    (lambda o: torch.linspace(0, 10, 4, out=o), torch.empty(4, dtype=torch.int64)),
    (lambda o: torch.logspace(0, 2, 3, out=o), torch.empty(3)),
    (lambda o: torch.eye(3, 4, out=o), torch.empty(3, 4, dtype=torch.bool)),
], ids=["zeros_int", "ones_bool", "full_int", "arange_int", "arange_end", "linspace", "linspace_int",
        "logspace", "eye_bool"])
def test_factory_out_variants_are_lowered_in_the_outputs_dtype(program, out):
    """zeros.out and friends went to eager torch: their functional form takes dtype and device,
    which the out= form takes from ``out``."""
    lowered(program, out, compared=True)


@pytest.mark.parametrize("training", [True, False])
def test_mutating_op_without_a_functional_twin_records_torchs_decomposition(training):
    """_native_batch_norm_legit writes its running statistics (positional arguments): it has no
    out-of-place twin and ran eagerly; torch's decomposition writes them with copy_."""
    def program(x, running_mean, running_var):
        return aten._native_batch_norm_legit(x * 1, None, None, running_mean, running_var, training, 0.1, 1e-5)
    deferfuse.reset_stats()
    check(program, torch.randn(4, 3, 5), torch.zeros(3), torch.ones(3))
    assert deferfuse.stats()["fallbacks"] == {}


def test_random_mutating_op_keeps_torchs_generator():
    def program(x, noise):
        torch.manual_seed(0)
        return aten.rrelu_with_noise_(x * 1, noise, 0.1, 0.3, True)
    check(program, torch.randn(6), torch.zeros(6))


@pytest.mark.parametrize("program", [
    lambda x, t: (x * 2).resize_as_(t),                            # same number of elements
    lambda x, t: (x * 2).resize_as_(t[:2]),                        # fewer
    lambda x, t: (x * 2).resize_as_(t.t(), memory_format=torch.preserve_format),
    lambda x, t: (x * 2).resize_as_(t, memory_format=torch.contiguous_format),
], ids=["same_numel", "smaller", "preserve", "contiguous"])
def test_resize_as_of_a_deferred_tensor_within_its_storage(program):
    """resize_as_ raised NotImplementedError for a deferred tensor even when it only changes
    metadata: only the template's shape matters."""
    deferfuse.reset_stats()
    check(program, torch.arange(6.0), torch.zeros(3, 2))
    assert deferfuse.stats()["fallbacks"] == {}


def test_resize_as_that_grows_a_deferred_tensor_still_says_what_to_do():
    with pytest.raises(NotImplementedError, match="deferfuse.sync"):
        with deferfuse.defer():
            (torch.arange(6.0) * 2).resize_as_(torch.zeros(4, 4))


def test_decomposition_that_rejects_a_call_torchs_kernel_runs():
    """nan_to_num of a complex tensor: torch's reference decomposition raises RuntimeError
    (complex isneginf), strict's kernel runs it."""
    z = torch.tensor([complex(float("nan"), float("inf")), 1 - 2j], dtype=torch.complex64)
    check(lambda z: torch.nan_to_num(z * 2), z)
    check(lambda z: torch.nan_to_num(z * 2, nan=1.0, posinf=2.0), z)


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
@pytest.mark.parametrize("out", [
    lambda: torch.empty(0, dtype=torch.int64), lambda: torch.empty(2, dtype=torch.int64),
    lambda: torch.empty(3, dtype=torch.float32), lambda: torch.empty(6, dtype=torch.int64)[::2],
], ids=["empty", "resized", "float", "strided"])
@pytest.mark.parametrize("hermitian", [False, True])
def test_matrix_rank_out_is_written(out, hermitian):
    """Under any dispatch mode torch's matrix_rank composite rebinds out= to a new tensor instead
    of writing into it: the caller's tensor kept its old contents."""
    a = torch.randn(3, 5, 2, dtype=torch.float64)
    a = a @ a.mT   # rank 2 of 5, symmetric
    check(lambda a, o: torch.linalg.matrix_rank(a, hermitian=hermitian, out=o), a, out())
