"""Movement lowerings against strict PyTorch: cat/stack, padding, reordering, copies of views,
gather/scatter, advanced indexing, sorting.

Every function below uses only movement ops (plus views and add/mul), so each check also asserts
that nothing fell back to eager torch and nothing was decomposed.
"""

import pytest
import torch

import deferfuse
from oracle import check, run_both

aten = torch.ops.aten
nan, inf = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def lowered(fn, *inputs, **kw):
    """check(), and assert that every op was lowered directly."""
    deferfuse.reset_stats()
    check(fn, *inputs, **kw)
    stats = deferfuse.stats()
    assert not stats["fallbacks"], f"fell back: {stats['fallbacks']}"
    assert not stats["decompositions"], f"decomposed: {stats['decompositions']}"


def raises_alike(fn, *inputs):
    """strict raises, and defer raises the same exception type (run_both checks the type)."""
    with pytest.raises(Exception):
        fn(*[t.clone() for t in inputs])
    run_both(fn, *inputs)


def sample(dtype, *shape, low=-5, high=5):
    if dtype is torch.bool:
        return torch.rand(*shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(*shape, dtype=dtype) * 3
    return torch.randint(low, high, shape, dtype=dtype)


DTYPES = [torch.float32, torch.int64, torch.bool]
SPECIAL = torch.tensor([[1.0, nan, -0.0, 0.0], [inf, -inf, 2.5, -1.0], [nan, 3.0, -2.0, 0.5]])


# -- cat, stack --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES + [torch.int32])
def test_cat_stack(dtype):
    a, b = sample(dtype, 3, 4), sample(dtype, 4, 2)
    lowered(lambda a, b: torch.cat([a, b.t()], 0), a, b)
    lowered(lambda a, b: torch.cat([a, b[:3], a[:, 1:2]], -1), a, b)
    lowered(lambda a, b: torch.stack([a, b.t()[1:]], -1), a, b)
    lowered(lambda a, b: torch.stack([a[0, 0], b[1, 1]]), a, b)  # 0-d -> 1-d


def test_cat_edge_cases():
    a, e = torch.randn(2, 3), torch.empty(0)
    lowered(lambda a, e: torch.cat([e, a, e, a], 1), a, e)      # legacy (0,) tensors are skipped
    lowered(lambda e: torch.cat([e, e]), e)
    lowered(lambda a: torch.cat([a[:0], a[:1]], 0), a)
    lowered(lambda a, i, d: torch.cat([a, i, d]),                # promotion over the list
            a, torch.arange(3, dtype=torch.int32)[None], torch.randn(1, 3, dtype=torch.float64))
    lowered(lambda a: torch.cat([a]), a)
    lowered(lambda a: torch.cat([a, a], dim=-2), SPECIAL)
    raises_alike(lambda a: torch.cat([a, a[0]], 0), a)       # rank mismatch, at record time
    raises_alike(lambda a: torch.stack([a, a.t()]), a)


# -- padding -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_constant_pad(dtype):
    x = sample(dtype, 3, 4)
    F = torch.nn.functional
    lowered(lambda x: F.pad(x, (1, 2)), x)
    lowered(lambda x: F.pad(x, (-1, 2, 0, -2), value=1), x)   # negative pads crop
    lowered(lambda x: F.pad(x.t(), (0, 0, 3, 1), value=True if dtype is torch.bool else 7), x)
    lowered(lambda x: F.pad(x[0, 0], ()), x)
    lowered(lambda x: F.pad(x[:0], (1, 1, 1, 1)), x)
    if dtype.is_floating_point:
        lowered(lambda x: F.pad(x, (2, 1), value=-1.5), x)
        lowered(lambda x: F.pad(x, (1, 1), value=nan), x)


@pytest.mark.parametrize("mode", ["reflect", "replicate"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_reflect_replicate_pad(mode, dtype):
    F = torch.nn.functional
    x = sample(dtype, 2, 3, 5)
    lowered(lambda x: F.pad(x, (2, 1), mode=mode), x)
    lowered(lambda x: F.pad(x, (-1, 3), mode=mode), x)
    lowered(lambda x: F.pad(x[None].transpose(-1, -2), (1, 2, 2, -1), mode=mode), x)
    lowered(lambda x: F.pad(x[0], (1, 2), mode=mode), x)     # unbatched
    if dtype.is_floating_point:
        lowered(lambda x: F.pad(x[None, None], (1, 1, 2, 0, 1, 1), mode=mode), x)
    if mode == "reflect":
        raises_alike(lambda x: F.pad(x, (5, 5), mode=mode), x)      # pad as large as the dim
    else:
        raises_alike(lambda x: F.pad(x[:, :, :0], (1, 1), mode=mode), x)


# -- reordering --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_flip_roll_repeat(dtype):
    x = sample(dtype, 3, 4, 2)
    lowered(lambda x: (x.flip(0), x.flip(-1, 0), x.transpose(0, 2).flip(1), x[0, 0, 0].flip(0)), x)
    lowered(lambda x: (x.roll(1), x.roll(-7), x.roll((1, -2), (0, -2)), x.roll(5, 1), x[:, :0].roll(3, 1)), x)
    lowered(lambda x: (x[0, 0, 0].roll(2), x.t().roll(1, 0) if x.ndim == 2 else x.mT.roll(1)), x)
    lowered(lambda x: (x.repeat(2, 1, 3), x.repeat(2, 1, 1, 1), x[0].t().repeat(0, 2), x[0, 0, 0].repeat(3)), x)
    lowered(lambda x: x.flipud().fliplr(), x)
    raises_alike(lambda x: x.flip(0, 0), x)
    raises_alike(lambda x: x.repeat(2), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_tril_triu_diag_embed(dtype):
    x = sample(dtype, 2, 4, 3)
    lowered(lambda x: (x.tril(), x.triu(1), x.tril(-2), x.transpose(1, 2).triu(-1), x[:, :0].tril()), x)
    lowered(lambda x: (x.tril(10), x.triu(-10)), x)
    if dtype is not torch.bool:
        lowered(lambda x: (torch.diag_embed(x), torch.diag_embed(x, 1), torch.diag_embed(x, -2, 0, 2),
                           torch.diag_embed(x.mT, 0, -1, 1)), x)
        lowered(lambda x: (x[0, 0].diag(), x[0, 0].diag(1)), x)


# -- copies of views ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bool])
def test_view_copies(dtype):
    x = sample(dtype, 3, 4, 2)
    lowered(lambda x: (aten._unsafe_view(x, [6, 4]), aten.view_copy(x, [-1]), aten._reshape_copy(x, [4, 6]),
                       aten.alias_copy(x), aten.detach_copy(x), aten.t_copy(x[0]),
                       aten.transpose_copy(x, 0, -1), aten.permute_copy(x, [1, 2, 0])), x)
    lowered(lambda x: (aten.expand_copy(x[:, :1], [2, 3, 4, 2]), aten.squeeze_copy(x[:, :1]),
                       aten.squeeze_copy.dim(x[:1], 0), aten.squeeze_copy.dims(x[:1, :1], [0, 1]),
                       aten.unsqueeze_copy(x, -1), aten.select_copy(x, 1, -1),
                       aten.slice_copy(x, 1, 1, None, 2), aten.narrow_copy(x, -1, 1, 1)), x)
    lowered(lambda x: (aten.diagonal_copy(x, 1, 0, 1), aten.unfold_copy(x, 1, 2, 1),
                       aten.unbind_copy(x, 1), aten.split_copy(x, 2, 1),
                       aten.split_with_sizes_copy(x, [1, 2], 0), aten.unbind_copy(x[:, :0], 1)), x)
    # non-contiguous inputs: the copy is logical
    lowered(lambda x: (aten._unsafe_view(x.transpose(0, 2), [8, 3]), aten.t_copy(x[:, 1].t()),
                       aten.narrow_copy(x.transpose(0, 1), 0, 1, 2), aten.view_copy.dtype(x, x.dtype)), x)
    # as_strided_copy reads the storage of a tensor that covers it
    lowered(lambda x: aten.as_strided_copy(x, [2, 2], [1, 3], 2), x)
    lowered(lambda x: aten.as_strided_copy(x.transpose(0, 1), [3, 2], [4, 1]), x)
    raises_alike(lambda x: aten.view_copy(x, [5, 5]), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_view_scatters(dtype):
    x = sample(dtype, 4, 5)
    src = sample(dtype, 4, 5)
    lowered(lambda x, s: (torch.slice_scatter(x, s[:, :2], 1, 1, 5, 2), torch.slice_scatter(x, s[:1], 0, -1),
                          torch.slice_scatter(x.t(), s.t()), torch.slice_scatter(x, s[:0], 0, 10, 20)), x, src)
    lowered(lambda x, s: (torch.select_scatter(x, s[0], 0, -1), torch.select_scatter(x.t(), s[:, 1], 1, 2),
                          torch.select_scatter(x[0], s[0, 0], 0, 3)), x, src)
    lowered(lambda x, s: (torch.diagonal_scatter(x, s[0, :4]), torch.diagonal_scatter(x, s[0, :3], 2),
                          torch.diagonal_scatter(x, s[1, :3], -1, 1, 0)), x, src)
    lowered(lambda x, s: (torch.as_strided_scatter(x, s[0, :3], (3,), (6,), 1),
                          torch.as_strided_scatter(x.t(), s[:2, :2], (2, 2), (1, 4)),
                          torch.as_strided_scatter(x, s[:2], (2, 5), (5, 1))), x, src)
    raises_alike(lambda x, s: torch.select_scatter(x, s[0, :3], 0, 0), x, src)


# -- gather / scatter --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather(dtype):
    x = sample(dtype, 4, 5)
    idx = torch.randint(0, 4, (6, 3))
    lowered(lambda x, i: (x.gather(0, i), x.t().gather(1, i.t()[:3]), x.gather(-1, i[:4])), x, idx)
    lowered(lambda x, i, z: (x[0, 0].gather(0, z), x.gather(1, i[:0]), x[:, 2].gather(0, i[:, 0])),
            x, idx, torch.tensor(0))
    lowered(lambda x, i: torch.take_along_dim(x, i[:4], 1), x, idx)
    raises_alike(lambda x, i: x.gather(0, i[0]), x, idx)
    raises_alike(lambda x, i: x.gather(0, i.float()), x, idx)


def _unique_index(rows, cols, size):
    """An index along dim 1 without duplicates in a row (scatter's set order is unspecified)."""
    return torch.stack([torch.randperm(size)[:cols] for _ in range(rows)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter(dtype):
    x, src = sample(dtype, 4, 6), sample(dtype, 5, 7)
    idx = _unique_index(3, 4, 6)
    value = True if dtype is torch.bool else 3
    lowered(lambda x, i, s: (x.scatter(1, i, s), x.scatter(-1, i, value), x.t().scatter(0, i.t(), s.t())),
            x, idx, src)
    lowered(lambda x, i, s, z: (x.scatter(1, i[:0], s), x[0, 0].scatter(0, z, s[0, 0])),
            x, idx, src, torch.tensor(0))
    if dtype is not torch.bool:
        dup, rows = torch.randint(0, 6, (5, 7)), torch.randint(0, 4, (3, 4))
        lowered(lambda x, i, r, s: (x.scatter_add(1, i[:4], s), x.scatter_add(0, r, s)), x, dup, rows, src)
        lowered(lambda x, i, s: (x.scatter(1, i, s, reduce="add"), x.scatter(1, i, s, reduce="multiply"),
                                 x.scatter(1, i, 2, reduce="add"), x.scatter(1, i, 2, reduce="multiply")),
                x, dup, src)
    if dtype.is_floating_point:
        lowered(lambda x, i: x.scatter(1, i, 2.5), x, idx)


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_scatter_reduce(reduce, dtype):
    x, src = sample(dtype, 4, 6), sample(dtype, 4, 9)
    idx = torch.randint(0, 6, (4, 9))
    idx[:, 0] = idx[:, 1]  # duplicates in every row
    narrow = torch.randint(0, 4, (3, 4))
    rows = torch.randint(0, 4, (2, 6))
    lowered(lambda x, i, r, s: (x.scatter_reduce(1, i, s, reduce),
                                x.scatter_reduce(1, i, s, reduce, include_self=False),
                                x.scatter_reduce(0, r, s.t(), reduce)), x, idx, rows, src)
    if dtype.is_floating_point:
        lowered(lambda x, i, s: (x.scatter_reduce(1, i, s, reduce),
                                 x.scatter_reduce(1, i, s, reduce, include_self=False)),
                SPECIAL, narrow, SPECIAL.flip(0) * 2)


# -- indexing with tensors ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype, index_dtype", [(torch.float32, torch.int64), (torch.float64, torch.int32),
                                                (torch.int64, torch.int64), (torch.bool, torch.int32)])
def test_index(dtype, index_dtype):
    x = sample(dtype, 4, 5, 3)
    i = torch.tensor([0, -1, 2, 2], dtype=index_dtype)
    j = torch.tensor([[1], [4], [-5]], dtype=index_dtype)
    lowered(lambda x, i, j: (x[i], x[:, i], x[..., i[:2]], x[i, j], x[i, :, i[:1]], x[:, j, i[:3]]), x, i, j)
    lowered(lambda x, i, j: (x[i[1]], x[1, i], x[i, 2:], x[None, :, j], x.transpose(0, 2)[i[:3], i[:3]]), x, i, j)
    lowered(lambda x, i, j: (x[i[:0]], x[:, j[:0]], x[:0][:, i]), x, i, j)
    raises_alike(lambda x, i, j: x[i, i[:3]], x, i, j)   # index shapes do not broadcast


@pytest.mark.parametrize("dtype", DTYPES)
def test_index_put(dtype):
    x, v = sample(dtype, 4, 5), sample(dtype, 3, 5)
    i, j = torch.tensor([0, -1, 2]), torch.tensor([4, 1, -5])

    def put(x, v, i, j):
        x[i] = v
        x[:, j] = v[0, :3]
        x[i, j] = v[:, 0]
        x.t()[j[:2], i[:2]] = v[1, 1]
        return x

    lowered(put, x, v, i, j)
    dup = torch.tensor([1, 1, -3, 0, 1])
    lowered(lambda x, v, d: (x.index_put((d,), v[:1], accumulate=True), x.index_put((d, d), v[0], accumulate=True),
                             x.index_put((None, d), v[:, :1].repeat(4, 1)[:4], accumulate=True)), x, v, dup)
    lowered(lambda x, v, e: x.index_put((e,), v[:0]), x, v, torch.tensor([], dtype=torch.long))
    raises_alike(lambda x, v, i: x.index_put((i,), v[:2]), x, v, i)
    raises_alike(lambda x, v, i: x.index_put((None, i), v[:, None]), x, v, i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_index_put_with_mask(dtype):
    x, v = sample(dtype, 4, 5, 2), sample(dtype, 5, 2)
    m1, m2 = torch.tensor([True, False, True, True]), torch.rand(4, 5) > 0.5

    def put(x, v, m1, m2):
        x[m1] = v[0, 0]
        x[:, m1[:1].expand(5)] = v[:1, 1]          # values broadcast along the selected elements
        x[m2] = v[2]
        x.index_put_((m1,), v[:1], accumulate=True)
        x[:, :, m1[:2]] = v[3, 0]
        return x

    lowered(put, x, v, m1, m2)
    lowered(lambda x, v: x.index_put((torch.zeros(4, 5, dtype=torch.bool),), v[0, 0]), x, v)
    # values that differ per selected element depend on the mask's count: run eagerly, still right
    check(lambda x, v, m: x.index_put((m,), v[:3, None]), x, v, m1)
    raises_alike(lambda x, v, m: x.index_put((m[:3],), v[0, 0]), x, v, m1)
    raises_alike(lambda x, v, m: x.index_put((m,), v[:3, 0]), x, v, m1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_index_ops(dtype):
    x, src = sample(dtype, 4, 5), sample(dtype, 4, 3)
    i, dup = torch.tensor([4, 0, 2]), torch.tensor([1, 1, 3])
    lowered(lambda x, s, i: (x.index_select(1, i), x.t().index_select(0, i.int()), x.index_select(-1, i[0]),
                             x[0, 0].index_select(0, i[:1] * 0), x.index_select(0, i[:0])), x, src, i)
    lowered(lambda x, s, i, z: (x.index_copy(1, i, s), x.t().index_copy(0, i, s.t()),
                                x[0, 0].index_copy(0, z, s[0, 0]), x[0, 0].index_copy(0, z[None], s[0, :1]),
                                x[0].index_copy(0, z, s[0, 0])), x, src, i, torch.tensor(0))
    if dtype is not torch.bool:
        lowered(lambda x, s, z: (x[0, 0].index_add(0, z, s[0, 0]), x[0].index_add(0, z[None], s[0, :1]),
                                 x[0, 0].index_reduce(0, z[None], s[0, 0], "amax")), x, src, torch.tensor(0))
    value = False if dtype is torch.bool else -3
    lowered(lambda x, s, i: (x.index_fill(1, i, value), x.index_fill(0, torch.tensor([-1, 0]), value),
                             x.index_fill(1, i, s[0, 0]), x[0, 0].index_fill(0, i[:1] * 0, value)), x, src, i)
    corners = torch.tensor([[-1, 3], [0, 19]])
    lowered(lambda x, i, c: (x.take(i), x.t().take(c), x[0, 0].take(i * 0)), x, i, corners)
    lowered(lambda x, s, i, c: (x.put(c[0], s[0, :2]), x.put(i, s[1], accumulate=dtype is not torch.bool)),
            x, src, dup, corners)
    if dtype is not torch.bool:
        lowered(lambda x, s, d, r: (x.index_add(1, d, s), x.index_add(0, d, r, alpha=2),
                                    x.index_add(-1, d, s, alpha=-1)), x, src, dup, sample(dtype, 3, 5))
        raises_alike(lambda x, s, d: x.index_add(0, d, s), x, src, dup)
    if dtype.is_floating_point:
        lowered(lambda x, s, d: x.index_add(1, d, s, alpha=0.5), x, src, dup)
        lowered(lambda x, s, i: (x.index_fill(1, i, 2.5), x.index_fill(1, i, nan)), x, src, i)
    raises_alike(lambda x, s, i: x.index_copy(1, i, s[:2]), x, src, i)
    raises_alike(lambda x, s, i: x.index_select(1, i[None]), x, src, i)
    raises_alike(lambda x, s, i: x.put(i, s[0, :2]), x, src, i)


@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_index_reduce(reduce, dtype):
    x, src = sample(dtype, 4, 5), sample(dtype, 4, 6)
    dup = torch.tensor([1, 1, 3, 0, -1, 1]) % 5
    lowered(lambda x, s, d: (x.index_reduce(1, d, s, reduce), x.index_reduce(1, d, s, reduce, include_self=False),
                             x.t().index_reduce(0, d, s.t(), reduce)), x, src, dup)


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_fill(dtype):
    x = sample(dtype, 3, 4)
    m = torch.rand(3, 4) > 0.5
    value = True if dtype is torch.bool else 7
    lowered(lambda x, m: (x.masked_fill(m, value), x.t().masked_fill(m.t(), value), x.masked_fill(m[0], value),
                          x.masked_fill(m, torch.tensor(value)), x[0, 0].masked_fill(m[0, 0], value),
                          x[:0].masked_fill(m[:0], value)), x, m)
    if dtype.is_floating_point:
        lowered(lambda x, m: (x.masked_fill(m, -inf), x.masked_fill(m, nan), x.masked_fill(m, 0.25)), x, m)
    raises_alike(lambda x, m: x.masked_fill(m.t(), value), x, m)


def test_unsafe_index_ops():
    x = torch.randn(4, 5)
    i, j = torch.tensor([0, 3, -1]), torch.tensor([[1], [7]])
    m = torch.tensor([[True, False, True], [False, True, True]])
    lowered(lambda x, i, j, m: (aten._unsafe_index(x, [i]), aten._unsafe_index(x, [None, i]),
                                aten._unsafe_index_put(x, [i], x[0], True),
                                aten._unsafe_masked_index(x, m, [None, j - 3], 0.5),
                                aten._unsafe_masked_index(x, m, [j - 4, i], -1)), x, i, j, m)
    # under a False mask an index may be out of range
    lowered(lambda x, j, m: aten._unsafe_masked_index(x, m[:, :1], [j, None], 2.0),
            x, torch.tensor([[2], [9]]), torch.tensor([[True], [False]]))
    rows, cols = torch.tensor([[1], [1]]), torch.tensor([0, 9, 2])
    lowered(lambda x, v, m, r, c: aten._unsafe_masked_index_put_accumulate(x, m, [r, c], v),
            x, torch.randn(2, 3), torch.tensor([[True, False, True], [True, False, False]]), rows, cols)


# -- sorting -----------------------------------------------------------------------------------
def distinct(dtype, *shape):
    n = 1
    for s in shape:
        n *= s
    return (torch.randperm(n) - n // 2).to(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.uint8])
def test_sort(dtype):
    x = distinct(dtype, 5, 7) if dtype is not torch.uint8 else torch.randperm(35).to(dtype).reshape(5, 7)
    lowered(lambda x: (x.sort(), x.sort(0, descending=True), x.t().sort(-1), x.sort(dim=1, descending=True),
                       x[0, 0].sort(), x[:0].sort(0), x.argsort(), x.msort()), x)
    lowered(lambda x: (x.topk(3), x.topk(2, 0, largest=False), x.t().topk(5, largest=True), x.topk(0),
                       x.topk(7, -1, False), x[0, 0].topk(1)), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_sort_stable_ties(dtype):
    x = sample(dtype, 4, 40, low=0, high=3)
    lowered(lambda x: (torch.sort(x, stable=True), torch.sort(x, dim=0, stable=True, descending=True),
                       torch.sort(x.t(), stable=True, descending=True), x.argsort(stable=True)), x)


def test_sort_nan_and_signed_zero():
    x = torch.cat([SPECIAL.reshape(-1), SPECIAL.reshape(-1).flip(0)]).reshape(2, 12)
    lowered(lambda x: (torch.sort(x, stable=True), torch.sort(x, stable=True, descending=True),
                       torch.sort(x.t(), 0, stable=True)), x)
    y = torch.tensor([[3.0, nan, -1.0, inf, 0.5], [-inf, 2.0, 1.0, nan, -0.5]])
    lowered(lambda y: (y.topk(2), y.topk(3, largest=False), y.sort(), y.sort(descending=True)), y)


def test_sort_unstable_ties_give_a_valid_order():
    # with ties, torch's default sort and topk leave the order of equal elements unspecified
    x = torch.randint(0, 3, (3, 50)).float()
    _, (values, indices), _, _ = run_both(lambda x: x.sort(descending=True), x)
    expected = x.sort(descending=True, stable=True)
    assert torch.equal(values, expected.values) and torch.equal(x.gather(1, indices), values)
    _, (values, indices), _, _ = run_both(lambda x: x.topk(10, sorted=False), x)
    assert torch.equal(values.sort().values, x.topk(10).values.sort().values)
    assert torch.equal(x.gather(1, indices), values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_searchsorted(dtype):
    seq = torch.sort(sample(dtype, 3, 8)).values
    values = sample(dtype, 3, 5)
    lowered(lambda s, v: (torch.searchsorted(s[0], v), torch.searchsorted(s[0], v, right=True),
                          torch.searchsorted(s, v), torch.searchsorted(s, v, side="right", out_int32=True),
                          torch.searchsorted(s[0], v[0, 0]), torch.searchsorted(s[0, :0], v),
                          torch.bucketize(v, s[1]), torch.bucketize(v, s[1], right=True)), seq, values)
    perm = torch.stack([torch.randperm(8) for _ in range(3)])
    unsorted = seq.gather(1, perm.argsort(1))
    lowered(lambda s, v, p: (torch.searchsorted(s, v, sorter=p),
                             torch.searchsorted(s[1], v[1], sorter=p[1], right=True)),
            unsorted, values, perm)
    lowered(lambda s: (torch.searchsorted(s[0], 2), torch.searchsorted(s[0], 1.5, right=True)), seq)


def test_searchsorted_nan():
    seq = torch.tensor([[1.0, 2.0, 3.0, nan], [-inf, 0.0, inf, inf]])
    values = torch.tensor([[nan, 2.0, 5.0, -inf], [inf, nan, 0.0, -0.0]])
    lowered(lambda s, v: (torch.searchsorted(s, v), torch.searchsorted(s, v, right=True),
                          torch.searchsorted(s[0], v)), seq, values)


def test_errors_torch_raises_in_its_kernels():
    """Checks torch makes in its CPU kernels but not in its meta functions raise alike."""
    x, d = torch.randn(4, 5), torch.randn(4, 5, dtype=torch.float64)
    i = torch.tensor([0, 2])
    raises_alike(lambda x, d, i: x.index_put((i,), d[0]), x, d, i)
    raises_alike(lambda x, d, i: x.index_put((i,), d[0, 0], accumulate=True), x, d, i)
    raises_alike(lambda x, d, i: x.index_add(0, i, d[:2]), x, d, i)
    raises_alike(lambda x, d, i: x.index_copy(0, i, d[:2]), x, d, i)
    raises_alike(lambda x, d, i: x.index_reduce(0, i, d[:2], "prod"), x, d, i)
    raises_alike(lambda x, d, i: x.put(i, d[0, :2]), x, d, i)
    raises_alike(lambda x, d, i: x.index_reduce(0, i, x[:2, :3], "amax"), x, d, i)
    raises_alike(lambda x, d, i: x[0, 0].index_add(0, i[:1], x[0, :1]), x, d, i)
    raises_alike(lambda x, d, i: x[0].index_add(0, i[0], x[0, 0]), x, d, i)
    raises_alike(lambda x, d, i: torch.searchsorted(x[0], x, side="middle"), x, d, i)
    raises_alike(lambda x, d, i: torch.searchsorted(x[0, :2], x, sorter=i.int()), x, d, i)
    raises_alike(lambda x, d, i: torch.bucketize(x, x), x, d, i)
    b = x > 0
    raises_alike(lambda b, i: b.topk(2), b, i)
    raises_alike(lambda b, i: b.scatter_reduce(0, i[None], b[:1, :2], "mean"), b, i)
    raises_alike(lambda b, i: torch.nn.functional.pad(b[None], (1, 1), mode="reflect"), b, i)
    raises_alike(lambda b, i: torch.searchsorted(b[0], b), b, i)
    raises_alike(lambda x, d, i: torch.diagonal_scatter(x, x[0]), x, d, i)
    raises_alike(lambda x, d, i: torch.slice_scatter(x, x[:1], 0, 0, 2), x, d, i)


def test_mask_put_converts_a_single_value():
    # torch turns x[mask] = <one-element tensor> into masked_fill, which converts its dtype
    x, m = torch.randn(4, 5), torch.tensor([True, False, True, False])
    lowered(lambda x, m, v: (x.index_put((m,), v), x.index_put((None, m[:1].expand(5)), v[0, 0])),
            x, m, torch.tensor([[[2.5]]], dtype=torch.float64))
    lowered(lambda x, m, v: x.index_put((m,), v), x.long(), m, torch.tensor(2.75))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    x, src = sample(dtype, 4, 6), sample(dtype, 4, 9)
    idx = torch.randint(0, 6, (4, 9))
    lowered(lambda x, i, s: (torch.cat([x, x.t().t()]), x.scatter_add(1, i, s), x.scatter_reduce(1, i, s, "mean"),
                             x.index_add(1, i[0, :6], s[:, :6]), torch.sort(x, stable=True), x[:, i[:2, :3]],
                             torch.nn.functional.pad(x, (1, 2), value=0.5)), x, idx, src, atol=1e-2, rtol=1e-2)


def test_gather_with_empty_index_of_another_rank():
    # torch accepts an empty index whose rank differs from the input's (OpInfo sample)
    x = torch.randn(5)
    for dtype in (torch.float32, torch.int64, torch.bool):
        lowered(lambda x: (torch.gather(x, 0, torch.zeros(2, 0, dtype=torch.int64)),
                           torch.gather(x, -1, torch.zeros(0, dtype=torch.int64))), x.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
def test_masked_scatter(dtype):
    x = sample(dtype, 3, 4)
    mask = torch.rand(3, 4) > 0.5
    source = sample(dtype, 4, 5)
    lowered(lambda x, m, s: (x.masked_scatter(m, s),
                             x.t().masked_scatter(m.t(), s),           # non-contiguous
                             x.masked_scatter(m[0], s),                # broadcast mask
                             x[0].masked_scatter(m, s),                # broadcast self
                             x.masked_scatter(torch.zeros_like(m), s[:0]),   # nothing selected
                             x[:0].masked_scatter(m[:0], s)), x, mask, source)


def test_masked_scatter_errors_and_grad():
    x, mask = torch.randn(3, 4), torch.ones(3, 4, dtype=torch.bool)
    # too few source elements: a value-dependent error, raised when the computation runs
    raises_alike(lambda x, m, s: x.masked_scatter(m, s) + 1, x, mask, torch.randn(5))
    raises_alike(lambda x, m, s: x.masked_scatter(m, s), x, mask.long(), torch.randn(12))
    raises_alike(lambda x, m, s: x.masked_scatter(m, s), x, mask, torch.randn(12, dtype=torch.float64))
    xg = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    sg = torch.randn(2, 7, dtype=torch.float64, requires_grad=True)
    m = torch.rand(3, 4) > 0.4
    g = torch.randn(3, 4, dtype=torch.float64)
    lowered(lambda x, s, m, g: torch.autograd.grad(x.masked_scatter(m, s), (x, s), g), xg, sg, m, g)


def test_masked_scatter_with_zero_dim_self_and_mask():
    # the checker's dtype-only replay gave the 0-dim mask a True element and the 1-d source none,
    # and raised "Number of elements of source < number of ones in mask" (masked_select's grad)
    lowered(lambda x, m, s: x.masked_scatter(m, s), torch.tensor(1.5), torch.tensor(True), torch.randn(1))
    xg = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    check(lambda x: torch.autograd.grad(torch.masked_select(x, torch.tensor(True)).sum(), x), xg)


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("start, end", [(None, None), (1, 3), (-2, None), (-10, 2), (2, 2), (3, 100), (None, -1)])
def test_slice_scatter_with_step_one_as_one_block(dim, start, end):
    # (lowered as one dynamic_update_slice, not a scatter of single elements: clamped, negative
    # and empty ranges as torch takes them)
    x = torch.randn(4, 5, 3)

    def fn(x):
        index = [slice(None)] * 3
        index[dim] = slice(start, end)
        return torch.slice_scatter(x * 1, x[tuple(index)] * 2 + 1, dim, start, end)
    lowered(fn, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_select_scatter_as_one_block(dtype):
    x = sample(dtype, 3, 4)
    for dim, index in ((0, 0), (0, -1), (1, 2), (-1, -4)):
        lowered(lambda x: torch.select_scatter(x.clone(), x.select(dim, 0).clone(), dim, index), x)
