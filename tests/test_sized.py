"""Data-dependent ops (nonzero, masked_select, boolean-mask indexing) recorded after one scalar
synchronization: their output size.  They then lower and fuse like any op (deferfuse/capture/sized.py)."""

from __future__ import annotations

import pytest
import torch

import deferfuse
from oracle import check, lowered

NAN = float("nan")
X = torch.tensor([[0.0, 1.0, NAN], [2.0, 0.0, -0.0]])


@pytest.mark.parametrize("program", [
    lambda x: torch.nonzero(x * 1) + 1,
    lambda x: torch.nonzero(x.sum()),                       # 0-dim input: rows of no columns
    lambda x: torch.nonzero(x > 0),
    lambda x: torch.nonzero(x.t()),                         # non-contiguous: row-major order of the view
    lambda x: torch.argwhere(x > 0),
    lambda x: torch.nonzero(x > 100),                       # nothing: shape (0, 2)
    lambda x: torch.nonzero(x, as_tuple=True),
    lambda x: torch.nonzero_static(x, size=7, fill_value=-5),
    lambda x: torch.nonzero_static(x, size=1),
    lambda x: torch.masked_select(x * 2, x > 0).sum(),
    lambda x: torch.masked_select(x * 2, torch.tensor([True, False, True])),   # broadcast mask
    lambda x: torch.masked_select(torch.tensor(3.0), x != 0),                    # broadcast input
    lambda x: x[x > 0] * 3,
    lambda x: x[torch.tensor([True, False]), 1:],
    lambda x: x[torch.tensor([1, 0]), torch.tensor([True, False, True])],
    lambda x: x[:, torch.tensor([False, False, False])],
    lambda x: x.long()[x.long() != 0],
    lambda x: (x > 0)[x == x],
], ids=["nonzero", "nonzero_0d", "nonzero_bool", "nonzero_view", "argwhere", "nonzero_none",
        "as_tuple", "static_padded", "static_truncated", "masked_select_sum", "masked_select_bcast_mask",
        "masked_select_bcast_input", "getitem", "getitem_rows", "getitem_mixed", "getitem_empty",
        "int64", "bool"])
def test_data_dependent_op_is_lowered_after_a_size_sync(program):
    lowered(program, X, compared=True)


def test_out_variants():
    def program(x, out_nz, out_ms):
        torch.nonzero(x * 2, out=out_nz)
        torch.masked_select(x + 1, x > 0, out=out_ms)
        return out_nz, out_ms
    lowered(program, X, torch.empty(0, dtype=torch.long), torch.empty(0), compared=True)


@pytest.mark.parametrize("program", [
    lambda x: x[torch.tensor([True, False, True])],                   # mask of the wrong shape
    lambda x: torch.masked_select(x, torch.ones(2, 3)),               # a float mask
    lambda x: torch.masked_select(x, torch.ones(4, dtype=torch.bool)),  # does not broadcast
    lambda x: x[torch.tensor(True)],                                  # a 0-dim mask adds a dimension
    lambda x: torch.nonzero(x.to(torch.complex64)),                   # complex: eager
], ids=["wrong_shape", "float_mask", "no_broadcast", "zero_dim_mask", "complex"])
def test_calls_it_declines_run_eagerly_with_stricts_errors(program):
    check(program, X)


def test_gradients_through_masks():
    def program(x):
        x = x.clone().requires_grad_()
        y = x.nan_to_num() * 2
        loss = y[y > 0].sum() + torch.masked_select(y, y < 1).pow(2).sum()
        loss.backward()
        return loss, x.grad
    check(program, X)


def test_only_the_size_is_computed_at_the_sync():
    """The ops after the mask stay pending: the sync flushes what the count needs, and the
    selection fuses with what follows it."""
    x = torch.randn(64)
    deferfuse.reset_stats()
    with deferfuse.config.override(always_compile=True), deferfuse.defer():
        y = x * 2
        z = y[y > 0] + 1
        flushes_after_select = deferfuse.stats()["flushes"]
        w = (z * 3).sum()
        assert deferfuse.stats()["flushes"] == flushes_after_select
        value = float(w)
    assert deferfuse.stats()["fallbacks"] == {}
    expected = float((((x * 2)[(x * 2) > 0] + 1) * 3).sum())
    assert value == pytest.approx(expected, rel=1e-6)


R = torch.tensor([2, 0, 1, 3])


@pytest.mark.parametrize("program", [
    lambda r: torch.repeat_interleave(r * 1),
    lambda r: torch.repeat_interleave(r.float() * 2, r),
    lambda r: torch.repeat_interleave(torch.arange(8.0).reshape(4, 2) * 2, r, dim=0),
    lambda r: torch.repeat_interleave(r * 2, 3),
    lambda r: torch.repeat_interleave(r * 1, output_size=6),
    lambda r: torch.repeat_interleave(r[:0] * 1),
], ids=["indices", "values", "dim", "scalar_repeats", "output_size", "empty"])
def test_repeat_interleave_is_lowered_after_a_size_sync(program):
    lowered(program, R, compared=True)


@pytest.mark.parametrize("program", [
    lambda r: torch.repeat_interleave(r - 1),                    # a negative repeat
    lambda r: torch.repeat_interleave(r * 1, output_size=5),     # a size that does not match
    lambda r: torch.repeat_interleave(r.reshape(2, 2)),          # not 1-d
    lambda r: torch.repeat_interleave(r.float()),                # not integers
], ids=["negative", "wrong_output_size", "2d", "float"])
def test_repeat_interleave_errors_like_strict(program):
    check(program, R)


U = torch.tensor([[3.0, 1.0], [2.0, 1.0], [NAN, NAN], [-0.0, 0.0]])


@pytest.mark.parametrize("program", [
    lambda x: torch.unique(x * 1),
    lambda x: torch.unique(x * 1, return_inverse=True, return_counts=True),    # each NaN distinct
    lambda x: torch.unique(x * 1, sorted=False, return_inverse=True),          # CPU sorts anyway
    lambda x: torch.unique(x.nan_to_num().long(), return_counts=True),
    lambda x: torch.unique(x > 1, return_inverse=True),
    lambda x: torch.unique(x[:0] * 1, return_inverse=True, return_counts=True),
    lambda x: torch.unique(x[0, 0] * 1, return_inverse=True, return_counts=True),
    lambda x: torch.ops.aten._unique(x.t() * 1, True, True),
    lambda x: torch.unique_consecutive(x * 1),
    lambda x: torch.unique_consecutive(x * 1, return_inverse=True, return_counts=True),
    lambda x: torch.unique_consecutive(torch.tensor([1, 1, 2, 2, 3, 1]) * 1, return_counts=True),
    lambda x: torch.unique_consecutive(x[:0] * 1, return_inverse=True, return_counts=True),
    lambda x: torch.bincount(x.nan_to_num().long().abs().reshape(-1)),
    lambda x: torch.bincount(torch.tensor([1, 3, 1, 0]) * 1, minlength=6),
    lambda x: torch.bincount(torch.tensor([1, 3, 1, 0]), x[:, 0].nan_to_num()),
    lambda x: torch.bincount(torch.tensor([1, 3, 1, 0]), torch.tensor([1, 2, 3, 4])),
    lambda x: torch.bincount(torch.tensor([], dtype=torch.long), minlength=2),
], ids=["unique", "unique_all", "unique_unsorted", "unique_int", "unique_bool", "unique_empty",
        "unique_0d", "_unique", "consecutive", "consecutive_all", "consecutive_int",
        "consecutive_empty", "bincount", "bincount_minlength", "bincount_weights",
        "bincount_int_weights", "bincount_empty"])
def test_unique_and_bincount_are_lowered_after_a_size_sync(program):
    lowered(program, U, compared=True)


@pytest.mark.parametrize("program", [
    lambda x: torch.bincount(torch.tensor([-1, 2])),
    lambda x: torch.bincount(x.long()),                       # not 1-d
    lambda x: torch.bincount(torch.tensor([1.0, 2.0])),
    lambda x: torch.unique(x.long() * 1, dim=0),
    lambda x: torch.unique_consecutive(x * 1, dim=1),
], ids=["bincount_negative", "bincount_2d", "bincount_float", "unique_dim", "consecutive_dim"])
def test_unique_and_bincount_calls_it_declines_match_strict(program):
    check(program, U)
