"""nn backward lowerings and friends (deferfuse/lower/nn_backward.py) against strict PyTorch:
upsampling and replication-padding backward, grid sampling, max pooling, pdist/cdist, histc and
hash_tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from oracle import grads, run_both
from oracle import lowered as _lowered

NAN, INF = float("nan"), float("inf")
aten = torch.ops.aten


def lowered(fn, *inputs, exact=False, **tol):
    """Compared, with nothing falling back to eager torch (forward ops that torch decomposes,
    such as upsample_bilinear2d, may go through torch._decomp)."""
    return _lowered(fn, *inputs, compared=True, decompositions=True, exact=exact, **tol)


def same_exception(fn, *inputs):
    """strict raises, and defer raises the same exception type (run_both checks the type)."""
    expected, actual, _, _ = run_both(fn, *inputs)
    assert expected is None and actual is None


def leaf(*shape, dtype=torch.float64, scale=1.0):
    return (torch.randn(*shape, dtype=dtype) * scale).requires_grad_()


# -- upsampling backward -------------------------------------------------------------------------

SIZES_1D = [dict(size=7), dict(size=3), dict(size=10), dict(size=1), dict(scale_factor=1.7),
            dict(scale_factor=2), dict(scale_factor=0.6)]


@pytest.mark.parametrize("mode", ["nearest", "nearest-exact", "linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_upsample_1d_backward(mode, dtype):
    torch.manual_seed(0)
    x = leaf(2, 3, 5, dtype=dtype)
    corners = (False, True) if mode == "linear" else (None,)
    for kw in SIZES_1D:
        for ac in corners:
            lowered(grads(lambda x: F.interpolate(x, mode=mode, align_corners=ac, **kw)), x)


@pytest.mark.parametrize("mode", ["nearest", "nearest-exact", "bilinear", "bicubic"])
def test_upsample_2d_backward(mode):
    torch.manual_seed(1)
    x = leaf(2, 3, 5, 4, dtype=torch.float32)
    corners = (False, True) if mode in ("bilinear", "bicubic") else (None,)
    for kw in [dict(size=(7, 3)), dict(size=(5, 4)), dict(scale_factor=1.7),
               dict(scale_factor=(2, 0.6)), dict(size=(1, 9))]:
        for ac in corners:
            lowered(grads(lambda x: F.interpolate(x, mode=mode, align_corners=ac, **kw)), x)


@pytest.mark.parametrize("mode", ["nearest", "nearest-exact", "trilinear"])
def test_upsample_3d_backward(mode):
    torch.manual_seed(2)
    x = leaf(1, 2, 3, 4, 5)
    corners = (False, True) if mode == "trilinear" else (None,)
    for kw in [dict(size=(7, 3, 5)), dict(scale_factor=1.7), dict(scale_factor=(2, 0.6, 1.3))]:
        for ac in corners:
            lowered(grads(lambda x: F.interpolate(x, mode=mode, align_corners=ac, **kw)), x)


def test_upsample_backward_direct_calls():
    # the aten ops themselves: non-contiguous grads, empty batches, recompute_scale_factor shapes
    torch.manual_seed(3)
    g = torch.randn(6, 2, 3, 7, dtype=torch.float64).transpose(0, 1)   # (2, 6, 3, 7), strided
    lowered(lambda g: (aten.upsample_bilinear2d_backward(g, [3, 7], [2, 6, 2, 4], False, None, None),
                       aten.upsample_bilinear2d_backward(g, [3, 7], [2, 6, 2, 4], True, None, None),
                       aten.upsample_bicubic2d_backward(g, [3, 7], [2, 6, 2, 4], False, 1.5, 1.75),
                       aten.upsample_nearest1d_backward(g[0], [7], [6, 3, 4], 1.75),
                       aten._upsample_nearest_exact2d_backward(g, [3, 7], [2, 6, 2, 4], None, None),
                       aten.upsample_linear1d_backward(g[0], [7], [6, 3, 3], False, None)), g)
    e = torch.randn(0, 3, 8)
    lowered(lambda e: (aten.upsample_linear1d_backward(e, [8], [0, 3, 4], False, None),
                       aten.upsample_nearest1d_backward(e, [8], [0, 3, 4], None)), e)


def test_upsample_backward_half():
    torch.manual_seed(4)
    x = leaf(1, 2, 4, 4, dtype=torch.bfloat16)
    lowered(grads(lambda x: F.interpolate(x, scale_factor=1.5, mode="bilinear")), x,
            rtol=2e-2, atol=2e-2)


# -- replication padding backward ----------------------------------------------------------------

@pytest.mark.parametrize("pad", [(2, 3), (1, 2, 0, 3), (1, 1, 2, 0, 1, 3), (-1, 2, 1, -1), (0, 0)])
def test_replication_pad_backward(pad):
    torch.manual_seed(5)
    nd = len(pad) // 2
    x = leaf(*((2, 3) + (4,) * nd))
    lowered(grads(lambda x: F.pad(x, pad, mode="replicate")), x)
    # unbatched and non-contiguous inputs
    y = leaf(*((3,) + (5,) * nd))
    lowered(grads(lambda y: F.pad(y.transpose(-1, -2) if nd > 1 else y * 1, pad, mode="replicate")), y)


# -- max pooling ---------------------------------------------------------------------------------

def test_adaptive_max_pool_2d():
    torch.manual_seed(6)
    x = leaf(2, 3, 7, 5, dtype=torch.float32)
    awkward = x.detach().clone()
    awkward[0, 0, 1, 1] = NAN
    awkward[0, 0, 4, 2] = NAN          # two NaNs in a window: torch keeps the last
    awkward[0, 1] = -INF              # all -inf: the first index
    awkward[1, 0, 2:4, :] = 3.0       # ties: the first index
    awkward.requires_grad_()
    for inp in (x, awkward):
        for size in [(3, 2), (7, 5), (1, 1), (10, 6), (4, None)]:
            lowered(lambda x: F.adaptive_max_pool2d(x, size, return_indices=True), inp)
            lowered(grads(lambda x: F.adaptive_max_pool2d(x, size)), inp)
    # unbatched, non-contiguous, 1d, empty
    lowered(lambda x: F.adaptive_max_pool2d(x[0].transpose(1, 2), (2, 3), return_indices=True), x)
    lowered(lambda x: F.adaptive_max_pool1d(x, 3, return_indices=True), torch.randn(3, 8))
    lowered(lambda x: F.adaptive_max_pool2d(x, 2, return_indices=True), torch.randn(0, 3, 4, 4))


def test_adaptive_max_pool_3d_and_max_pool3d_backward():
    torch.manual_seed(7)
    y = leaf(2, 5, 4, 6)
    lowered(lambda x: F.adaptive_max_pool3d(x, (2, 3, 4), return_indices=True), y)
    lowered(grads(lambda x: F.adaptive_max_pool3d(x, (2, 3, 4))), y)
    lowered(grads(lambda x: F.adaptive_max_pool3d(x, (3, 1, 7))), y[None].detach().requires_grad_())
    lowered(grads(lambda x: F.max_pool3d(x, 2, stride=1, padding=1)), y)
    lowered(grads(lambda x: F.max_pool3d(x, (2, 3, 2), ceil_mode=True, dilation=(1, 1, 2))), y)
    lowered(grads(lambda x: F.max_pool3d(x.transpose(1, 3), 2)), y)


# -- grid sampling -------------------------------------------------------------------------------

GRID_CASES = [(nd, mode, pad, ac) for nd in (2, 3)
              for mode in (("bilinear", "nearest", "bicubic") if nd == 2 else ("bilinear", "nearest"))
              for pad in ("zeros", "border", "reflection") for ac in (False, True)]


@pytest.mark.parametrize("nd,mode,pad,ac", GRID_CASES)
def test_grid_sample(nd, mode, pad, ac):
    torch.manual_seed(8)
    x = leaf(*((2, 3) + (5, 4, 6)[:nd]))
    grid = (torch.rand(*((2,) + (3, 4, 2)[:nd] + (nd,)), dtype=torch.float64) * 3 - 1.5).requires_grad_()

    def f(x, grid):
        return F.grid_sample(x, grid, mode=mode, padding_mode=pad, align_corners=ac)
    if nd == 3:
        lowered(f, x, grid)
    lowered(grads(f), x, grid)
    lowered(grads(f), x.detach(), grid)       # output_mask (False, True)
    lowered(grads(f), x, grid.detach())


def test_grid_sample_edges():
    torch.manual_seed(9)
    x = leaf(1, 2, 4, 3)
    # points on the borders and corners, and a size-1 input dim
    grid = torch.tensor([[[[-1.0, -1.0], [1.0, 1.0], [0.0, 1.0], [1.0, -1.0]]]], dtype=torch.float64)
    for pad in ("zeros", "border", "reflection"):
        for ac in (False, True):
            lowered(grads(lambda x: F.grid_sample(x, grid, padding_mode=pad, align_corners=ac)), x)
    thin = leaf(1, 2, 1, 3, 1)
    g3 = torch.rand(1, 2, 2, 2, 3, dtype=torch.float64) * 2 - 1
    lowered(lambda x, g: F.grid_sample(x, g, padding_mode="reflection", align_corners=True), thin, g3)
    # empty output
    lowered(lambda x, g: F.grid_sample(x, g, align_corners=False), x, torch.rand(1, 0, 3, 2, dtype=torch.float64))


# -- pdist and cdist -----------------------------------------------------------------------------

@pytest.mark.parametrize("p", [0, 1, 2, 0.5, 1.5, 3, INF])
def test_pdist(p):
    torch.manual_seed(10)
    x = leaf(6, 4)
    lowered(lambda x: F.pdist(x, p), x)
    lowered(grads(lambda x: F.pdist(x, p)), x)
    if p >= 1:   # duplicated rows: distance 0 (the gradient is 0 there)
        dup = x.detach().clone()
        dup[3] = dup[1]
        lowered(grads(lambda x: F.pdist(x, p)), dup.requires_grad_())
    lowered(lambda x: F.pdist(x, p), torch.randn(1, 3, dtype=torch.float64))
    lowered(lambda x: F.pdist(x, p), torch.randn(5, 0, dtype=torch.float32))


@pytest.mark.parametrize("p", [0, 1, 2, 0.5, 1.5, 3, INF])
def test_cdist(p):
    torch.manual_seed(11)
    a = leaf(2, 5, 3)
    b = leaf(4, 3)
    lowered(lambda a, b: torch.cdist(a, b, p), a, b)
    lowered(grads(lambda a, b: torch.cdist(a, b, p)), a, b)
    lowered(grads(lambda a, b: torch.cdist(a, b, p, compute_mode="donot_use_mm_for_euclid_dist")), a, b)
    lowered(lambda a, b: torch.cdist(a.transpose(1, 2), b.t(), p), leaf(2, 3, 5).detach(), leaf(3, 4).detach())


def test_cdist_matmul_path_and_empty():
    torch.manual_seed(12)
    a, b = leaf(30, 3, dtype=torch.float32), leaf(4, 3, dtype=torch.float32)
    lowered(lambda a, b: torch.cdist(a, b), a, b)
    lowered(grads(lambda a, b: torch.cdist(a, b)), a, b)
    lowered(lambda a, b: aten._cdist_forward(a, b, 2.0, 1), a, b)
    lowered(lambda a, b: torch.cdist(a, b), torch.randn(0, 3), torch.randn(4, 3))
    lowered(lambda a, b: torch.cdist(a, b), torch.randn(2, 0), torch.randn(4, 0))
    lowered(lambda a, b: torch.cdist(a, b), torch.randn(0, 2, 3), torch.randn(1, 4, 3))
    # the backward of an empty broadcast batch: zeros shaped like x1 itself
    lowered(grads(lambda a, b: torch.cdist(a, b, 1.5)), leaf(4, 5), leaf(0, 3, 5))
    lowered(grads(lambda a, b: torch.cdist(a, b, 1.5)), leaf(2, 1, 4, 5), leaf(3, 2, 5))


# -- histc ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_histc(dtype):
    torch.manual_seed(13)
    x = torch.randn(100, dtype=dtype)
    for args in [(10,), (7, -1, 1), (5, 0, 0), (4, 1, 1), (3, -0.5, 0.2), (1,), (6, -10, 10)]:
        lowered(lambda x: torch.histc(x, *args), x, exact=True)
    edges = torch.tensor([-1.0, 1.0, 0.0, 0.5, NAN, 2.0, -3.0, INF], dtype=dtype)
    lowered(lambda x: (torch.histc(x, 4, -1, 1), torch.histc(x[:4], 3), torch.histc(x[[0, 1, 3, 6]].view(2, 2).t(), 4)),
            edges, exact=True)
    lowered(lambda x: torch.histc(x, 5), torch.tensor([2.0, 2.0], dtype=dtype), exact=True)   # widened
    lowered(lambda x: torch.histc(x, 4, -1, 1), torch.tensor([1.0, INF, -INF, NAN], dtype=dtype), exact=True)
    lowered(lambda x: torch.histc(x, 5), torch.empty(0, dtype=dtype), exact=True)
    lowered(lambda x: torch.histc(x, 5), torch.tensor(3.0, dtype=dtype), exact=True)


def test_histc_errors():
    # data ranges that are not finite, and max < min: torch's RuntimeError, when the values run
    same_exception(lambda x: torch.histc(x, 5), torch.tensor([1.0, NAN]))
    same_exception(lambda x: torch.histc(x, 5), torch.tensor([1.0, INF]))
    same_exception(lambda x: torch.histc(x, 5, 1, 0), torch.tensor([1.0]))
    same_exception(lambda x: torch.histc(x, 5), torch.tensor([1, 2]))   # integers: not implemented


# -- hash_tensor ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int64,
                                   torch.int32, torch.int8, torch.uint8, torch.bool])
def test_hash_tensor(dtype):
    torch.manual_seed(14)
    x = (torch.randn(3, 4, 5) * 4).to(dtype)
    lowered(lambda x: (torch.hash_tensor(x), torch.hash_tensor(x, 1),
                       torch.hash_tensor(x, [0, 2], keepdim=True), torch.hash_tensor(x.transpose(0, 2)[1:], 0),
                       torch.hash_tensor(torch.empty(0, 3, dtype=x.dtype), 1), torch.hash_tensor(x[0, 0, 0])),
            x, exact=True)


def test_hash_tensor_special_values():
    lowered(lambda x: (torch.hash_tensor(x), torch.hash_tensor(x.float())),
            torch.tensor([NAN, -0.0, 0.0, INF, -INF, 1e-310], dtype=torch.float64), exact=True)
    same_exception(lambda x: torch.hash_tensor(x), torch.empty(0))
    same_exception(lambda x: torch.hash_tensor(x, 0), torch.empty(0, 3))
