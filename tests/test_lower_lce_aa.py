"""Lowerings of antialiased bilinear upsampling (aten._upsample_bilinear2d_aa and its backward,
deferfuse/lower/nn_backward.py) and of the chunked linear_cross_entropy custom ops
(torch_nn._linear_cross_entropy_batch_chunked{,_no_reduction}, deferfuse/lower/nn.py) against
strict PyTorch."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.nn.modules.linear_cross_entropy  # noqa: F401  (registers the torch_nn ops)

from oracle import check, grads, run_both
from oracle import lowered as _lowered

NAN, INF = float("nan"), float("inf")
aten = torch.ops.aten


def lowered(fn, *inputs, **tol):
    """Compared, with nothing falling back to eager torch."""
    return _lowered(fn, *inputs, compared=True, decompositions=True, **tol)


def leaf(*shape, dtype=torch.float64, scale=1.0):
    return (torch.randn(*shape, dtype=dtype) * scale).requires_grad_()


# -- antialiased bilinear upsampling -------------------------------------------------------------

AA_SIZES = [dict(size=(3, 2)), dict(size=(7, 3)), dict(size=(2, 11)), dict(size=(1, 1)),
            dict(size=(9, 5)), dict(size=(16, 12)), dict(scale_factor=0.3),
            dict(scale_factor=(0.45, 1.7)), dict(scale_factor=(2.5, 0.6)),
            dict(scale_factor=0.5, recompute_scale_factor=True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("align_corners", [False, True])
def test_upsample_aa(dtype, align_corners):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 9, 5, dtype=dtype)
    for kw in AA_SIZES:
        lowered(lambda x: F.interpolate(x, mode="bilinear", antialias=True,
                                        align_corners=align_corners, **kw), x)


@pytest.mark.parametrize("align_corners", [False, True])
def test_upsample_aa_backward(align_corners):
    torch.manual_seed(1)
    x = leaf(2, 3, 9, 5)
    for kw in AA_SIZES:
        lowered(grads(lambda x: F.interpolate(x, mode="bilinear", antialias=True,
                                              align_corners=align_corners, **kw)), x)


def test_upsample_aa_float32_backward():
    torch.manual_seed(2)
    x = leaf(1, 2, 12, 7, dtype=torch.float32)
    for kw in [dict(size=(4, 3)), dict(size=(20, 3)), dict(scale_factor=0.25)]:
        lowered(grads(lambda x: F.interpolate(x, mode="bilinear", antialias=True, **kw)), x)


def test_upsample_aa_large_downscale():
    # many taps per output pixel (applied as one gather and a sum)
    torch.manual_seed(3)
    x = leaf(1, 2, 70, 90)
    for kw in [dict(size=(3, 2)), dict(size=(2, 90)), dict(scale_factor=(0.1, 0.04))]:
        lowered(lambda x: F.interpolate(x, mode="bilinear", antialias=True, **kw), x.detach())
        lowered(grads(lambda x: F.interpolate(x, mode="bilinear", antialias=True, **kw)), x)


def test_upsample_aa_direct_calls():
    torch.manual_seed(4)
    x = torch.randn(3, 2, 6, 8, dtype=torch.float64).transpose(0, 1)    # non-contiguous
    g = torch.randn(2, 3, 4, 8, dtype=torch.float64)
    lowered(lambda x, g: (
        aten._upsample_bilinear2d_aa(x, [4, 8], False, None, None),
        aten._upsample_bilinear2d_aa(x, [4, 8], False, 0.7, 1.1),        # width unchanged: skipped
        aten._upsample_bilinear2d_aa(x, [6, 8], True, 1.3, 0.9),         # nothing changes: a copy
        aten._upsample_bilinear2d_aa(x, [6, 3], True, None, 0.4),
        aten._upsample_bilinear2d_aa.vec(x, None, False, [0.5, 1.5]),
        # the backward kernel resamples every dim, changed or not
        aten._upsample_bilinear2d_aa_backward(g, [4, 8], [2, 3, 6, 8], False, None, None),
        aten._upsample_bilinear2d_aa_backward(g, [4, 8], [2, 3, 6, 8], False, 0.7, 1.1),
        aten._upsample_bilinear2d_aa_backward(g, [4, 8], [2, 3, 5, 11], True, None, None),
        aten._upsample_bilinear2d_aa_backward(g.transpose(2, 3)[..., :4, :4], [4, 4],
                                              [2, 3, 3, 9], False, None, None)), x, g)


def test_upsample_aa_empty_and_nonfinite():
    e = torch.randn(0, 3, 6, 5)
    lowered(lambda e: F.interpolate(e, size=(3, 7), mode="bilinear", antialias=True), e)
    lowered(lambda g: aten._upsample_bilinear2d_aa_backward(g, [3, 7], [0, 3, 6, 5], False, None, None),
            torch.randn(0, 3, 3, 7))
    # (no channels: torch raises, and so does defer)
    expected, actual, _, _ = run_both(
        lambda e: F.interpolate(e, size=(3, 7), mode="bilinear", antialias=True), torch.randn(2, 0, 6, 5))
    assert expected is None and actual is None
    # an infinite or NaN pixel spreads only as far as the windows that read it
    x = torch.randn(1, 1, 12, 10)
    x[0, 0, 0, 0] = INF
    x[0, 0, 7, 9] = NAN
    x[0, 0, 11, 3] = -INF
    for kw in [dict(size=(3, 4)), dict(size=(5, 17)), dict(scale_factor=0.7)]:
        lowered(lambda x: F.interpolate(x, mode="bilinear", antialias=True, **kw), x)


def test_upsample_aa_dtype_errors_match_torch():
    for dtype in (torch.float16, torch.bfloat16, torch.int64):
        x = torch.ones(1, 1, 6, 6, dtype=dtype)
        expected, actual, _, _ = run_both(lambda x: aten._upsample_bilinear2d_aa(x, [3, 3], False), x)
        assert expected is None and actual is None
        expected, actual, _, _ = run_both(
            lambda g: aten._upsample_bilinear2d_aa_backward(g, [3, 3], [1, 1, 6, 6], False), x[..., :3, :3])
        assert expected is None and actual is None


def test_upsample_aa_one_pixel_wide():
    # torch's height pass gives every row of a one-pixel-wide (height-innermost) output the
    # window of row 0; channels-last outputs iterate over the channels and do not
    torch.manual_seed(5)
    x = torch.randn(2, 3, 9, 5, dtype=torch.float64)
    for kw in [dict(size=(2, 1)), dict(size=(5, 1)), dict(size=(13, 1)), dict(scale_factor=0.3)]:
        lowered(lambda x: F.interpolate(x, mode="bilinear", antialias=True, **kw), x)
        lowered(lambda x: F.interpolate(x.contiguous(memory_format=torch.channels_last),
                                        mode="bilinear", antialias=True, **kw), x)
        lowered(grads(lambda x: F.interpolate(x, mode="bilinear", antialias=True, **kw)),
                x.clone().requires_grad_())


# -- chunked linear_cross_entropy ----------------------------------------------------------------

LCEO = torch.nn.LinearCrossEntropyOptions
chunked_op = torch.ops.torch_nn._linear_cross_entropy_batch_chunked.default
none_op = torch.ops.torch_nn._linear_cross_entropy_batch_chunked_no_reduction.default


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # the options' fallback warnings, if any
        yield


def lce(reduction="mean", chunk=2, policy="auto", retain=True, **kw):
    """F.linear_cross_entropy on the chunked path, with its loss and the gradients of the inputs
    that require grad (for a non-uniform output gradient when the loss is per row)."""
    options = LCEO(batch_chunk_size=chunk, acc_policy=policy, allow_retain_graph=retain)

    def run(x, w, target, bias=None, weight=None):
        loss = F.linear_cross_entropy(x, w, target, linear_bias=bias, weight=weight,
                                      reduction=reduction, options=options, **kw)
        wanted = [t for t in (x, w, bias) if t is not None and t.requires_grad]
        if not wanted:
            return loss
        g = torch.arange(loss.numel(), dtype=loss.dtype).reshape(loss.shape).cos() + 1.5
        return (loss,) + torch.autograd.grad(loss, wanted, g)
    return run


def lce_inputs(n=7, features=4, classes=5, dtype=torch.float64, grad=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, dtype=dtype, generator=gen).requires_grad_(grad)
    w = torch.randn(classes, features, dtype=dtype, generator=gen).requires_grad_(grad)
    target = torch.randint(0, classes, (n,), generator=gen)
    bias = torch.randn(classes, dtype=dtype, generator=gen).requires_grad_(grad)
    weight = torch.rand(classes, dtype=dtype, generator=gen) + 0.5
    return x, w, target, bias, weight


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_cross_entropy_chunked(reduction):
    x, w, target, bias, weight = lce_inputs()
    for chunk in (1, 3, 50):        # (50: one partial chunk)
        lowered(lce(reduction, chunk), x, w, target)
    lowered(lce(reduction, 2), x.detach(), w.detach(), target)
    lowered(lce(reduction, 3), x, w, target, bias, weight)
    lowered(lce(reduction, 2, policy="compact"), x, w.detach(), target, bias)
    lowered(lce(reduction, 4, policy="balanced"), x.detach(), w, target, bias.detach(), weight)
    lowered(lce(reduction, 3, policy="accurate"), x, w, target, None, weight)
    x32, w32, t32, b32, c32 = lce_inputs(n=13, features=6, classes=9, dtype=torch.float32, seed=3)
    lowered(lce(reduction, 5), x32, w32, t32, b32, c32)
    lowered(lce(reduction, 4), x32.detach(), w32.detach(), t32)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_cross_entropy_chunked_ignore_index(reduction):
    x, w, target, bias, weight = lce_inputs(n=9, seed=1)
    for ignore, extra in [(1, (bias, weight)), (-100, ()), (7, (None, weight))]:
        t = target.clone()
        t[::3] = ignore
        lowered(lce(reduction, 2, ignore_index=ignore), x, w, t, *extra)
    # every row ignored: mean divides by a zero total weight (NaN), sum and none give 0
    lowered(lce(reduction, 2, ignore_index=3), x, w, torch.full((9,), 3), bias, weight)
    # a NaN in an ignored row still reaches the loss, as torch's 0 * NaN does
    nan_x = x.detach().clone()
    nan_x[3] = NAN
    t = target.clone()
    t[3] = -100
    lowered(lce(reduction, 2), nan_x.requires_grad_(), w, t, bias)


def test_linear_cross_entropy_chunked_shapes():
    x, w, target, bias, weight = lce_inputs(n=11, features=3, classes=8, seed=2)
    # unbatched input, a single class, an empty batch (mean: NaN loss, zero weight gradients)
    lowered(lce("mean", 2), x[0].detach().requires_grad_(), w, target[0])
    lowered(lce("none", 2), x[0].detach().requires_grad_(), w, target[0], bias)
    lowered(lce("sum", 3), x, w[:1], torch.zeros(11, dtype=torch.long))
    for reduction in ("mean", "sum", "none"):
        lowered(lce(reduction, 3), x[:0].detach().requires_grad_(), w, target[:0], bias)
    # allow_retain_graph=False: the backward scales the gradients it was handed in place
    lowered(lce("mean", 4, retain=False), x, w, target, bias, weight)
    lowered(lce("sum", 4, policy="compact", retain=False), x, w, target, bias, weight)


def test_linear_cross_entropy_chunked_direct_calls():
    # the custom ops themselves, with each subset of the gradients they precompute
    x, w, target, bias, weight = [t.detach() for t in lce_inputs(n=8, seed=4)]
    for reduction, flags in [("mean", (False, False, False)), ("sum", (True, False, False)),
                             ("mean", (False, True, False)), ("sum", (False, False, True)),
                             ("mean", (True, True, True)), ("sum", (True, True, True))]:
        lowered(lambda x, w, t, b, c: chunked_op(x, w, t, b, c, reduction, -100, 0.0, 3, "accurate",
                                                 torch.float64, True, *flags),
                x, w, target, bias, weight)
    lowered(lambda x, w, t: chunked_op(x, w, t, None, None, "sum", 2, -0.5, 5, "compact",
                                       torch.float64, False, True, True, False), x, w, target)
    lowered(lambda x, w, t, b, c: none_op(x, w, t, b, c, 1, 3, "balanced", torch.float64),
            x, w, target, bias, weight)


def test_linear_cross_entropy_chunked_errors_match_torch():
    x, w, target, bias, weight = [t.detach() for t in lce_inputs(n=6, seed=5)]
    bad = target.clone()
    bad[4] = 5
    negative = target.clone()
    negative[2] = -1
    for t in (bad, negative):
        for reduction in ("mean", "none"):
            # out-of-range targets: gather's RuntimeError, or index_select's IndexError with weights
            for c in (None, weight):
                expected, actual, _, _ = run_both(lce(reduction, 4), x, w, t, None, c)
                assert expected is None and actual is None
    # calls the chunked path rejects run eagerly and raise torch's errors
    for call in [lambda x, w, t: chunked_op(x, w, t, None, None, "mean", -100, 0.1, 2, "accurate",
                                            torch.float64, True, False, False, False),
                 lambda x, w, t: chunked_op(x, w, t, None, None, "sum", -100, 0.0, 2, "accurate",
                                            torch.float32, True, False, False, False),
                 lambda x, w, t: none_op(x, w.float(), t, None, None, -100, 2, "compact", torch.float64),
                 lambda x, w, t: none_op(x, w, t.int(), None, None, -100, 2, "compact", torch.float64)]:
        expected, actual, _, _ = run_both(call, x, w, target)
        assert expected is None and actual is None


def test_linear_cross_entropy_chunked_half_runs_eagerly():
    # fp16/bf16 with a float32 accumulator: not lowered, but still torch's numbers
    x, w, target, bias, _ = lce_inputs(n=6, dtype=torch.bfloat16, grad=False, seed=6)
    check(lce("mean", 4), x, w, target, bias)
    check(lce("none", 4), x, w, target)
