"""linalg and nn lowerings (deferfuse/lower/linalg.py, nn.py) against strict PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import deferfuse
from oracle import check, run_both

NAN, INF = float("nan"), float("inf")
FLOATS = [torch.float32, torch.float64]
MATMUL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8]
TOL = {torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def lowered(fn, *inputs, decomposed=(), **tol):
    """check(), and assert that no op fell back to eager torch and that only the ``decomposed``
    ops went through torch._decomp."""
    deferfuse.reset_stats()
    out = check(fn, *inputs, **tol)
    assert out is not None, "strict raised: nothing was compared"
    stats = deferfuse.stats()
    assert not stats["fallbacks"], stats["fallbacks"]
    assert set(stats["decompositions"]) <= set(decomposed), stats["decompositions"]
    return out


def same_exception(fn, *inputs):
    expected, actual, _, _ = run_both(fn, *inputs)
    assert expected is None and actual is None


def rand(*shape, dtype=torch.float32, low=-4, high=5):
    if dtype.is_floating_point:
        return torch.randn(*shape, dtype=torch.float64).to(dtype)
    if dtype == torch.uint8:
        low = 0
    return torch.randint(low, high, shape, dtype=dtype)


# -- linalg --------------------------------------------------------------------------------------

MATMUL_SHAPES = [((3, 4), (4, 5)), ((4,), (4,)), ((3, 4), (4,)), ((2, 3, 4), (2, 4, 5)),
                 ((2, 3, 4), (4, 5)), ((3, 4), (2, 4, 6)), ((4,), (2, 4, 5)), ((2, 3, 4), (4,)),
                 ((2, 1, 3, 4), (1, 3, 4, 5)), ((0, 4), (4, 5)), ((3, 0), (0, 5)), ((2, 0, 3), (2, 3, 4)),
                 ((0,), (0,)), ((1, 1), (1, 1))]


@pytest.mark.parametrize("dtype", MATMUL_DTYPES)
def test_matmul_shapes(dtype):
    torch.manual_seed(0)
    pairs = [(rand(*a, dtype=dtype), rand(*b, dtype=dtype)) for a, b in MATMUL_SHAPES]
    # non-contiguous operands: transposed and sliced
    pairs.append((rand(5, 3, dtype=dtype).t(), rand(5, 8, dtype=dtype)[:, 1::2]))
    pairs.append((rand(2, 4, 3, dtype=dtype).transpose(1, 2), rand(4, 2, 5, dtype=dtype).permute(1, 0, 2)))
    lowered(lambda ps: [a @ b for a, b in ps], pairs, **TOL.get(dtype, {}))


def test_integer_matmul_wraps_like_torch():
    big8 = torch.full((3, 4), 100, dtype=torch.int8)
    big64 = torch.full((2, 3), 2 ** 62, dtype=torch.int64)
    lowered(lambda a, b: (a @ a.t(), torch.addmm(a[:, :3], a, a.t(), alpha=3), b @ b.t(),
                          torch.dot(b[0], b[1])), big8, big64)


def test_matmul_nan_inf():
    a = torch.tensor([[1., NAN, 2.], [INF, 0., 1.], [1., 2., 3.]])
    b = torch.tensor([[0., 1.], [1., 0.], [-INF, 2.]])
    lowered(lambda a, b: (a @ b, b.t() @ a, torch.mv(a, b[:, 0]), torch.dot(a[2], b[:, 1])), a, b)


def test_linear_einsum_tensordot():
    torch.manual_seed(1)
    x, w, bias = torch.randn(2, 3, 4), torch.randn(6, 4), torch.randn(6)
    lowered(lambda x, w, bias: (F.linear(x, w, bias), F.linear(x, w), F.linear(x[0, 0], w, bias),
                                torch.einsum("bij,bjk->bik", x, x.transpose(1, 2)),
                                torch.einsum("ij,ij->i", w, w), torch.einsum("bij,j->bi", x, w[0]),
                                torch.tensordot(x, w, dims=([2], [1])),
                                torch.linalg.multi_dot([w, w.t(), w]), torch.inner(x, w),
                                torch.vdot(w[0], w[1])),
            x, w, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16])
def test_scaled_products(dtype):
    torch.manual_seed(2)
    m, v3, v4 = rand(3, 4, dtype=dtype), rand(3, dtype=dtype), rand(4, dtype=dtype)
    b1, b2, c = rand(2, 3, 4, dtype=dtype), rand(2, 4, 5, dtype=dtype), rand(3, 5, dtype=dtype)
    scales = [dict(), dict(beta=2, alpha=3), dict(beta=0, alpha=1), dict(beta=1, alpha=-1)]
    if dtype.is_floating_point:
        scales += [dict(beta=0.5, alpha=1.5), dict(beta=0.0, alpha=2.0)]

    def fn(m, v3, v4, b1, b2, c):
        outs = []
        for kw in scales:
            outs += [torch.addmm(c, m, b2[0], **kw), torch.addmm(c[0], m, b2[0], **kw),
                     torch.addmv(v3, m, v4, **kw), torch.addr(m, v3, v4, **kw),
                     torch.baddbmm(c, b1, b2, **kw), torch.addbmm(c, b1, b2, **kw),
                     torch.addmm(c[0, 0], m, b2[0], **kw)]
        return outs
    lowered(fn, m, v3, v4, b1, b2, c, **TOL.get(dtype, {}))


def test_integer_scales_truncate_like_torch():
    i = torch.arange(4).view(2, 2)
    lowered(lambda i: (torch.addmm(i, i, i, alpha=0.5, beta=1.7), torch.addmv(i[0], i, i[1], beta=2.9),
                       torch.baddbmm(i[None], i[None], i[None], alpha=-1.5)), i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zero_scales_and_nan(dtype):
    c = torch.tensor([[NAN, 1.], [2., INF]], dtype=dtype)
    a = torch.tensor([[1., NAN], [2., 3.]], dtype=dtype)
    e = torch.eye(2, dtype=dtype)
    big = torch.randn(2, 20, 20, dtype=dtype)
    big[0, 0, 0] = NAN

    def fn(c, a, e, big):
        outs = []
        for beta, alpha in [(0, 1), (0.0, 1.0), (-0.0, 2), (1, 0), (1.0, 0.0), (0, 0)]:
            outs += [torch.addmm(c, a, e, beta=beta, alpha=alpha),
                     torch.addmv(c[0], a, e[0], beta=beta, alpha=alpha),
                     torch.addr(c, a[0], e[0], beta=beta, alpha=alpha),
                     torch.baddbmm(c[None], a[None], e[None], beta=beta, alpha=alpha),
                     torch.baddbmm(big, big, big, beta=beta, alpha=alpha),
                     torch.addbmm(c, a[None], e[None], beta=beta, alpha=alpha)]
        return outs
    lowered(fn, c, a, e, big)


def test_runtime_scales_do_not_recompile_wrongly():
    m, c = torch.randn(3, 3), torch.randn(3, 3)
    c[0, 0] = NAN
    for beta in (0.5, 0.0, 2.0):
        lowered(lambda m, c: torch.addmm(c, m, m, beta=beta, alpha=beta + 1), m, c)


def test_matmul_dtype_errors_match_torch():
    b = torch.ones(2, 2, dtype=torch.bool)
    same_exception(lambda b: b @ b, b)
    same_exception(lambda b: torch.mm(b.float(), b.double()), b)
    same_exception(lambda b: torch.bmm(b[None].int(), b[None].long()), b)


def test_matmul_gradients():
    torch.manual_seed(3)
    x = torch.randn(2, 3, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    bias = torch.randn(5, requires_grad=True)
    g = torch.randn(2, 3, 5)

    def fn(x, w, bias, g):
        F.linear(x, w, bias).backward(g)
        return x.grad, w.grad, bias.grad
    lowered(fn, x, w, bias, g, decomposed=("aten.sum.dim_IntList",))


def test_bilinear():
    torch.manual_seed(4)
    x1, x2, w, b = torch.randn(3, 4), torch.randn(3, 5), torch.randn(6, 4, 5), torch.randn(6)
    lowered(lambda x1, x2, w, b: F.bilinear(x1, x2, w, b), x1, x2, w, b)


def test_vector_matrix_matmul():
    lowered(lambda v, m: v @ m, torch.randn(3), torch.randn(3, 4))


# -- convolution ---------------------------------------------------------------------------------

CONVS = [  # (input shape, weight shape, kwargs)
    ((2, 3, 8, 8), (4, 3, 3, 3), dict()),
    ((2, 3, 8, 8), (4, 3, 3, 3), dict(stride=2, padding=1)),
    ((1, 4, 9, 7), (6, 2, 3, 2), dict(stride=(2, 1), padding=(1, 0), dilation=(2, 1), groups=2)),
    ((2, 4, 10), (4, 1, 3), dict(padding=2, groups=4)),
    ((2, 3, 10), (5, 3, 4), dict(stride=3, dilation=2)),
    ((1, 2, 5, 6), (3, 2, 3, 5), dict(padding="same")),
    ((0, 3, 6, 6), (2, 3, 3, 3), dict()),
    ((1, 2, 4, 4, 4), (3, 2, 2, 2, 2), dict(stride=2)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_convolution(dtype):
    torch.manual_seed(5)
    cases = [(rand(*xs, dtype=dtype), rand(*ws, dtype=dtype), rand(ws[0], dtype=dtype), kw)
             for xs, ws, kw in CONVS]

    def fn(cases):
        conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}
        outs = [conv[x.ndim](x, w, b, **kw) for x, w, b, kw in cases]
        outs += [conv[x.ndim](x, w, None, **kw) for x, w, b, kw in cases[:2]]
        x, w, b, _ = cases[0]
        outs.append(F.conv2d(x.transpose(2, 3), w, b))             # non-contiguous input
        outs.append(F.conv2d(x[0], w, b))                          # unbatched
        outs.append(F.conv2d(x.to(memory_format=torch.channels_last), w, b, padding=1))
        return outs
    lowered(fn, cases, **TOL.get(dtype, {}))


# (input shape, weight shape, layout): oneDNN and the 2-D slow path keep a channels-last input's
# or weight's layout; the 3-D slow path (a 1x1x1 filter on one small image) writes contiguous
CONV_LAYOUTS = [
    ((2, 3, 6, 6), (8, 3, 3, 3), "input"), ((1, 3, 6, 6), (8, 3, 3, 3), "input"),
    ((2, 3, 6, 6), (8, 3, 3, 3), "weight"), ((1, 2, 3, 4), (2, 2, 1, 1), "weight"),
    ((2, 4, 5, 5, 5), (6, 4, 3, 3, 3), "input"), ((1, 2, 3, 4, 5), (2, 2, 1, 1, 1), "input"),
    ((2, 3, 6, 6), (8, 3, 3, 3), "neither"),
]


@pytest.mark.parametrize("path", ["compiled", "replayed"])
@pytest.mark.parametrize("x_shape, w_shape, layout", CONV_LAYOUTS)
def test_convolution_strides_are_the_cpu_kernels(x_shape, w_shape, layout, path):
    """Found by corpus/channels_last_conv.py: a channels-last-3d input of a 1x1x1 Conv3d gave a
    channels-last output under defer, where torch's CPU kernel (its 3-D slow path) writes it
    contiguous.  The output's and both gradients' strides are strict's, on every path."""
    fmt = torch.channels_last if len(x_shape) == 4 else torch.channels_last_3d
    torch.manual_seed(0)
    x, w = torch.randn(x_shape), torch.randn(w_shape)
    if layout == "input":
        x = x.to(memory_format=fmt)
    elif layout == "weight":
        w = w.to(memory_format=fmt)
    conv = torch.ops.aten.convolution.default
    nd = len(x_shape) - 2
    params = ([1] * nd, [0] * nd, [1] * nd, False, [0] * nd, 1)

    def fn(x, w):
        y = conv(x, w, None, *params)
        grads = torch.ops.aten.convolution_backward.default(
            torch.ones_like(y), x, w, None, *params, [True, True, False])
        return y, grads[0], grads[1]

    expected = fn(x, w)
    settings = dict(always_compile=True) if path == "compiled" else dict(always_compile=False, eager_first_runs=1)
    with deferfuse.config.override(cache_dir="", background_compile=False, **settings):
        with deferfuse.defer():
            got = fn(x, w)
            strides = [t.stride() for t in got]
    for e, g, s in zip(expected, got, strides):
        assert s == e.stride() and g.stride() == e.stride()
        torch.testing.assert_close(g, e)


def test_integer_convolution_is_exact():
    x = torch.randint(-50, 50, (2, 3, 6, 6))
    w = torch.randint(-9, 9, (4, 3, 3, 3))
    lowered(lambda x, w: (F.conv2d(x, w, padding=1), F.conv1d(x[:, :, 0], w[:, :, 0], stride=2)), x, w)


def test_convolution_nan_inf_and_errors():
    x = torch.randn(1, 2, 5, 5)
    x[0, 0, 1, 1], x[0, 1, 4, 4] = NAN, INF
    lowered(lambda x, w: F.conv2d(x, w, padding=1), x, torch.randn(3, 2, 3, 3))
    same_exception(lambda x, w: F.conv2d(x, w), x, torch.randn(3, 2, 3, 3, dtype=torch.float64))
    same_exception(lambda x, w: F.conv2d(x, w), x.bool(), torch.ones(3, 2, 3, 3, dtype=torch.bool))


TRANSPOSED = [
    ((2, 3, 5, 5), (3, 4, 3, 3), dict()),
    ((2, 3, 5, 5), (3, 4, 3, 3), dict(stride=2, padding=1, output_padding=1)),
    ((1, 4, 4, 6), (4, 3, 2, 3), dict(stride=(2, 3), padding=(0, 1), dilation=(1, 2), groups=2)),
    ((2, 2, 7), (2, 3, 5), dict(stride=3, padding=4, output_padding=2)),
]


def test_transposed_convolution():
    torch.manual_seed(6)
    cases = [(torch.randn(*xs), torch.randn(*ws), torch.randn(ws[1] * kw.get("groups", 1)), kw)
             for xs, ws, kw in TRANSPOSED]
    convt = {3: F.conv_transpose1d, 4: F.conv_transpose2d}
    lowered(lambda cases: [convt[x.ndim](x, w, b, **kw) for x, w, b, kw in cases], cases)


def test_convolution_backward():
    torch.manual_seed(7)
    cases = []
    for xs, ws, kw in CONVS:
        x, w, b = (torch.randn(*shape, requires_grad=True) for shape in (xs, ws, ws[:1]))
        conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[len(xs)]
        cases.append((conv, x, w, b, kw, torch.randn(conv(x, w, b, **kw).shape)))

    def fn(cases):
        for conv, x, w, b, kw, g in cases:
            conv(x, w, b, **kw).backward(g)
        return [t.grad for _, x, w, b, _, _ in cases for t in (x, w, b)]
    lowered(fn, cases)


def test_convolution_backward_partial_mask():
    # The input needs no gradient: convolution_backward gets output_mask [False, True, True]
    # and returns None first.
    x = torch.randn(2, 3, 6, 6)
    w, b = torch.randn(4, 3, 3, 3, requires_grad=True), torch.randn(4, requires_grad=True)
    g = torch.randn(2, 4, 4, 4)

    def fn(x, w, b, g):
        F.conv2d(x, w, b).backward(g)
        return w.grad, b.grad
    lowered(fn, x, w, b, g)


def test_transposed_convolution_backward():
    torch.manual_seed(8)
    x, w = torch.randn(2, 3, 5, 5, requires_grad=True), torch.randn(3, 4, 3, 3, requires_grad=True)
    g = torch.randn(2, 4, 10, 10)

    def fn(x, w, g):   # no bias: output_mask [True, True, False]
        F.conv_transpose2d(x, w, stride=2, padding=1, output_padding=1).backward(g)
        return x.grad, w.grad
    lowered(fn, x, w, g)


# -- embedding and nll_loss ----------------------------------------------------------------------

def test_embedding_and_backward():
    torch.manual_seed(9)
    weight = torch.randn(6, 3, requires_grad=True)
    idx = torch.tensor([[0, 2, 2], [5, 1, 2]])
    g = torch.randn(2, 3, 3)

    def fn(weight, idx, g):
        outs = [F.embedding(idx, weight), F.embedding(idx[0, 1], weight), F.embedding(idx.int(), weight)]
        F.embedding(idx, weight, padding_idx=2).backward(g)
        outs.append(weight.grad)
        weight.grad = None
        F.embedding(idx, weight, padding_idx=-1, scale_grad_by_freq=True).backward(g)
        outs.append(weight.grad)
        weight.grad = None
        F.embedding(idx.t(), weight).backward(g.transpose(0, 1))
        return outs + [weight.grad]
    lowered(fn, weight, idx, g)


def test_pool_dtype_errors_match_torch():
    x = torch.randint(0, 9, (1, 2, 4, 4), dtype=torch.uint8)
    same_exception(lambda x: F.avg_pool2d(x, 2), x)
    same_exception(lambda x: F.adaptive_avg_pool2d(x.long(), 3), x)
    same_exception(lambda x: F.max_pool2d(x.bool(), 2), x)


def test_nll_loss_dtype_errors_match_torch():
    lp = torch.randn(4, 5).log_softmax(1)
    same_exception(lambda lp, t: F.nll_loss(lp, t), lp, torch.tensor([0, 1, 2, 3], dtype=torch.int32))
    same_exception(lambda lp, t: F.nll_loss(lp, t), lp.long(), torch.tensor([0, 1, 2, 3]))


def test_embedding_of_integer_weights():
    lowered(lambda w, i: F.embedding(i, w), torch.arange(12).view(4, 3), torch.tensor([3, 0, 0]))


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_nll_loss(reduction):
    torch.manual_seed(10)
    logits = torch.randn(5, 4, requires_grad=True)
    target = torch.tensor([0, 3, 1, 1, 2])
    weight = torch.rand(4)
    image = torch.randn(2, 4, 3, 3, requires_grad=True)
    image_target = torch.randint(0, 4, (2, 3, 3))
    image_target[0, 0, 0] = -100
    logits.data[1, 3] = NAN   # the target class of sample 1; sample 1 is ignored in some calls
    g = torch.rand(5) if reduction == "none" else torch.rand(())
    g2 = torch.rand(2, 3, 3) if reduction == "none" else torch.rand(())

    def fn(logits, target, weight, image, image_target, g, g2):
        lp = F.log_softmax(logits, 1)
        ignored = target.clone()
        ignored[1] = -100
        outs = [F.nll_loss(lp, target, reduction=reduction),
                F.nll_loss(lp, target, weight, reduction=reduction),
                F.nll_loss(lp, ignored, weight, reduction=reduction),
                F.nll_loss(lp, target, ignore_index=1, reduction=reduction),
                F.nll_loss(lp[0], target[0], reduction=reduction),
                F.nll_loss(lp[:0], target[:0], reduction=reduction),
                F.nll_loss(lp, torch.full_like(target, -100), reduction=reduction),
                F.cross_entropy(image, image_target, weight, reduction=reduction)]
        F.nll_loss(lp, ignored, weight, reduction=reduction).backward(g)
        F.cross_entropy(image, image_target, weight, reduction=reduction).backward(g2)
        return outs + [logits.grad, image.grad]
    lowered(fn, logits, target, weight, image, image_target, g, g2)


# -- pooling and upsampling ----------------------------------------------------------------------

MAX_POOLS = [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1),
             dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(2, 1)),
             dict(kernel_size=3, stride=2, ceil_mode=True),
             dict(kernel_size=2, stride=3, padding=1, ceil_mode=True),
             dict(kernel_size=1, stride=2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16])
def test_max_pool2d(dtype):
    torch.manual_seed(11)
    x = rand(2, 3, 7, 7, dtype=dtype, low=-3, high=3)   # small ints: many ties
    if dtype.is_floating_point:
        x[0, 0, 0, 0] = x[0, 0, 1, 1] = NAN
        x[0, 1, :3, :3] = -INF
        x[1, 2] = x[1, 2].round()

    def fn(x):
        outs = []
        for kw in MAX_POOLS:
            outs += list(F.max_pool2d(x, return_indices=True, **kw))
        outs += list(F.max_pool2d(x[0], 2, return_indices=True))
        outs += list(F.max_pool2d(x.to(memory_format=torch.channels_last), 3, 1, 1, return_indices=True))
        outs += list(F.max_pool2d(x.transpose(2, 3), 2, return_indices=True))
        outs += list(F.max_pool1d(x[:, :, 0], 3, 2, return_indices=True))
        return outs
    lowered(fn, x)


def test_max_pool2d_backward():
    torch.manual_seed(12)
    x = torch.randn(2, 3, 7, 7, requires_grad=True)

    def fn(x, g1, g2):
        F.max_pool2d(x, 3, 2, 1).backward(g1)
        F.max_pool2d(x, 2, ceil_mode=True).backward(g2)   # accumulates into x.grad
        return x.grad
    lowered(fn, x, torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4))


AVG_POOLS = [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1),
             dict(kernel_size=3, stride=2, padding=1, count_include_pad=False),
             dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 1), ceil_mode=True),
             dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
             dict(kernel_size=2, divisor_override=3),
             dict(kernel_size=2, divisor_override=-2),   # negative: divides by it, as torch does
             dict(kernel_size=4, stride=3, padding=2, ceil_mode=True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_avg_pool2d(dtype):
    torch.manual_seed(13)
    x = rand(2, 3, 7, 6, dtype=dtype, low=-50, high=50)
    if dtype.is_floating_point:
        x[0, 0, 0, 0], x[1, 1, 3, 3] = NAN, INF
    lowered(lambda x: [F.avg_pool2d(x, **kw) for kw in AVG_POOLS] + [F.avg_pool2d(x[0], 2)]
            + [F.avg_pool2d(x.transpose(2, 3), 3, 1, 1)], x, **TOL.get(dtype, {}))


def test_avg_pool2d_backward():
    torch.manual_seed(14)
    x = torch.randn(2, 3, 7, 6, requires_grad=True)
    gs = [torch.randn(F.avg_pool2d(x, **kw).shape) for kw in AVG_POOLS]

    def fn(x, gs):
        grads = []
        for kw, g in zip(AVG_POOLS, gs):
            F.avg_pool2d(x, **kw).backward(g)
            grads.append(x.grad.clone())
        return grads
    lowered(fn, x, gs)


def test_adaptive_avg_pool2d():
    torch.manual_seed(15)
    x = torch.randn(2, 3, 8, 7, requires_grad=True)
    x.data[0, 0, 0, 0] = INF
    sizes = [3, (3, 2), (5, 7), (8, 7), (11, 9), (1, 4)]
    gs = [torch.randn(F.adaptive_avg_pool2d(x, s).shape) for s in sizes]

    def fn(x, gs):
        outs = [F.adaptive_avg_pool2d(x, s) for s in sizes] + [F.adaptive_avg_pool2d(x[0], 3)]
        for s, g in zip(sizes, gs):
            F.adaptive_avg_pool2d(x, s).backward(g)
        return outs + [x.grad]
    lowered(fn, x, gs)


AVG_POOLS_3D = [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1),
                dict(kernel_size=(3, 2, 3), stride=(2, 1, 2), padding=(1, 0, 1), ceil_mode=True),
                dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
                dict(kernel_size=2, divisor_override=3), dict(kernel_size=3, stride=3, ceil_mode=True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_avg_pool3d(dtype):
    torch.manual_seed(17)
    x = rand(2, 3, 5, 6, 4, dtype=dtype, low=-50, high=50)
    if dtype.is_floating_point:
        x[0, 0, 0, 0, 0], x[1, 1, 3, 3, 3] = NAN, INF
    lowered(lambda x: [F.avg_pool3d(x, **kw) for kw in AVG_POOLS_3D] + [F.avg_pool3d(x[0], 2)]
            + [F.avg_pool3d(x.transpose(2, 4), 3, 1, 1), F.avg_pool3d(x[:0], 2)], x)


def test_avg_pool3d_backward_and_dtype_errors():
    torch.manual_seed(18)
    x = torch.randn(2, 3, 5, 6, 4, requires_grad=True)
    gs = [torch.randn(F.avg_pool3d(x, **kw).shape) for kw in AVG_POOLS_3D]

    def fn(x, gs):
        grads = []
        for kw, g in zip(AVG_POOLS_3D, gs):
            F.avg_pool3d(x, **kw).backward(g)
            grads.append(x.grad.clone())
        return grads
    lowered(fn, x, gs)
    for bad in (torch.ones(1, 2, 4, 4, 4, dtype=torch.bool), torch.ones(1, 2, 4, 4, 4, dtype=torch.int32)):
        same_exception(lambda x: F.avg_pool3d(x, 2), bad)
        same_exception(lambda x: F.adaptive_avg_pool3d(x, 2), bad)


def test_adaptive_avg_pool3d():
    torch.manual_seed(19)
    x = torch.randn(2, 3, 5, 6, 7, requires_grad=True)
    x.data[0, 0, 0, 0, 0] = INF
    sizes = [1, 3, (3, 4, 2), (5, 6, 7), (7, 3, 9), (None, 2, 3)]
    gs = [torch.randn(F.adaptive_avg_pool3d(x, s).shape) for s in sizes]

    def fn(x, gs):
        outs = [F.adaptive_avg_pool3d(x, s) for s in sizes]
        outs += [F.adaptive_avg_pool3d(x[0], 2), F.adaptive_avg_pool3d(x.transpose(2, 4), 3)]
        for s, g in zip(sizes, gs):
            F.adaptive_avg_pool3d(x, s).backward(g)
        return outs + [x.grad]
    lowered(fn, x, gs)


UPSAMPLES = [dict(scale_factor=2), dict(scale_factor=3), dict(size=(5, 7)), dict(scale_factor=1.5),
             dict(scale_factor=(0.5, 2.5)), dict(size=(3, 4)), dict(size=(7, 2)), dict(scale_factor=1.7)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_upsample_nearest2d(dtype):
    x = rand(2, 3, 3, 4, dtype=dtype, low=0, high=200)
    lowered(lambda x: [F.interpolate(x, **kw) for kw in UPSAMPLES]
            + [F.interpolate(x, scale_factor=1.7, recompute_scale_factor=True),
               F.interpolate(x.transpose(2, 3), scale_factor=2),
               torch.ops.aten.upsample_nearest2d.vec(x, None, [2.0, 1.5]),
               torch.ops.aten.upsample_nearest2d.vec(x, [5, 7], None)], x)


def test_upsample_nearest2d_backward():
    torch.manual_seed(16)
    x = torch.randn(2, 3, 3, 4, requires_grad=True)
    gs = [torch.randn(F.interpolate(x, **kw).shape) for kw in UPSAMPLES]

    def fn(x, gs):
        for kw, g in zip(UPSAMPLES, gs):
            F.interpolate(x, **kw).backward(g)
        return x.grad
    lowered(fn, x, gs)


# -- losses --------------------------------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_regression_losses(reduction):
    torch.manual_seed(17)
    x, y = torch.randn(4, 5, requires_grad=True), torch.randn(4, 5)
    y[0, :3] = x.detach()[0, :3] + torch.tensor([0.5, 1.0, -1.0])   # at the beta/delta boundary
    g = torch.randn(4, 5) if reduction == "none" else torch.randn(())
    losses = [lambda a, b: F.mse_loss(a, b, reduction=reduction),
              lambda a, b: F.smooth_l1_loss(a, b, reduction=reduction),
              lambda a, b: F.smooth_l1_loss(a, b, reduction=reduction, beta=0.5),
              lambda a, b: F.smooth_l1_loss(a, b, reduction=reduction, beta=0.0),
              lambda a, b: F.huber_loss(a, b, reduction=reduction, delta=0.5)]

    def fn(x, y, g):
        outs = [loss(x, y) for loss in losses] + [losses[0](x[0, 0], y[0, 0])]
        for loss in losses:
            loss(x, y).backward(g)
            outs.append(x.grad.clone())
        return outs
    lowered(fn, x, y, g)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_binary_cross_entropy(reduction):
    torch.manual_seed(18)
    p = torch.rand(3, 4)
    p[0, :3] = torch.tensor([0.0, 1.0, 0.5])   # log(0) clamps at -100
    p.requires_grad_()
    t = torch.rand(3, 4)
    t[0, :2] = torch.tensor([0.0, 1.0])
    w, pos = torch.rand(4), torch.rand(4) * 3
    logits = (torch.randn(3, 4) * 30).requires_grad_()   # large logits: no overflow in exp
    g = torch.rand(3, 4) if reduction == "none" else torch.rand(())

    def fn(p, t, w, pos, logits, g):
        outs = [F.binary_cross_entropy(p, t, reduction=reduction),
                F.binary_cross_entropy(p, t, w, reduction=reduction),
                F.binary_cross_entropy_with_logits(logits, t, reduction=reduction),
                F.binary_cross_entropy_with_logits(logits, t, w, reduction=reduction, pos_weight=pos)]
        F.binary_cross_entropy(p, t, w, reduction=reduction).backward(g)
        return outs + [p.grad]
    lowered(fn, p, t, w, pos, logits, g)


# -- factorizations and solvers (LAPACK through XLA) ---------------------------------------------

def _linalg_inputs(dtype):
    g = torch.Generator().manual_seed(7)
    a = torch.randn(4, 4, generator=g, dtype=dtype) + 4 * torch.eye(4, dtype=dtype)
    batch = torch.randn(2, 3, 3, generator=g, dtype=dtype)
    b = torch.randn(4, 2, generator=g, dtype=dtype)
    return a, batch, b, torch.randn(5, 3, generator=g, dtype=dtype).t()


@pytest.mark.parametrize("dtype", FLOATS)
def test_linalg_factorizations_and_solves(dtype):
    a, batch, b, wide = _linalg_inputs(dtype)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else {}

    def fn(a, batch, b, wide):
        lu, piv = torch.linalg.lu_factor(a)
        return [
            torch.linalg.inv_ex(a), torch.linalg.inv(batch),
            torch.linalg.solve_triangular(a.triu(), b, upper=True),
            torch.linalg.solve_triangular(a, b.t(), upper=False, left=False, unitriangular=True),
            torch.linalg.solve_triangular(batch.tril(), batch[:1], upper=False),   # broadcast batch
            torch.linalg.lu_factor_ex(batch), torch.linalg.lu_factor_ex(wide),
            torch.linalg.lu_solve(lu, piv, b), torch.linalg.lu_solve(lu, piv, b, adjoint=True),
            torch.linalg.lu_solve(lu, piv, b.t(), left=False),
            torch.linalg.solve_ex(a, b), torch.linalg.solve(a, b[:, 0]), torch.linalg.solve(a, b.t(), left=False),
            torch.linalg.qr(wide), torch.linalg.qr(wide.t(), mode="complete"), torch.linalg.qr(batch, mode="r")[1],
        ]
    lowered(fn, a, batch, b, wide, **tol)


def test_linalg_empty_matrices_match_torch():
    # torch answers these without LAPACK: an identity U for a 3x0 SVD, zero info, ...
    lowered(lambda e, w, t: [torch.linalg.inv_ex(e), torch.linalg.svd(w), torch.linalg.svd(t, full_matrices=False),
                             torch.linalg.qr(w, mode="complete"), torch.linalg.lu_factor_ex(e)],
            torch.empty(0, 3, 3), torch.empty(3, 0), torch.empty(2, 0, 4, dtype=torch.float64))


def test_linalg_singular_info_and_integer_errors():
    singular = torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.0, 1.0, 1.0]])
    check(lambda s: [torch.linalg.lu_factor_ex(s)[2], torch.linalg.inv_ex(s)[1]], singular)
    same_exception(lambda x: torch.linalg.inv(x), torch.ones(3, 3, dtype=torch.int64))


def test_eigh_and_svd_vectors_fall_back():
    # eigenvector and singular vector signs differ from torch's LAPACK (MKL): not lowered
    # (det and slogdet are lowered: tests/test_lower_linalg_more.py)
    x = torch.randn(3, 5, dtype=torch.float64)
    deferfuse.reset_stats()
    check(lambda x: [torch.linalg.eigh(x[:, :3] + x[:, :3].mT),
                     torch.linalg.svd(x), torch.linalg.svd(x.t(), full_matrices=False)], x)
    fallbacks = deferfuse.stats()["fallbacks"]
    assert all(any(name in op for op in fallbacks) for name in ("eigh", "svd")), fallbacks
