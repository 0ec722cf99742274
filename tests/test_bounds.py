"""Defer mode never returns clamped data for an out-of-range index: it raises what strict raises."""

import pytest
import torch

import deferfuse

x = torch.arange(12.0).reshape(3, 4)
bad = torch.tensor([5])
CASES = {
    "gather": lambda x: x.gather(0, torch.tensor([[5, 0, 0, 0]])),
    "scatter": lambda x: x.scatter(0, torch.tensor([[5, 0, 0, 0]]), 1.0),
    "scatter_add": lambda x: x.scatter_add(0, torch.tensor([[5, 0, 0, 0]]), torch.ones(1, 4)),
    "index": lambda x: x[bad],
    "index_negative": lambda x: x[torch.tensor([-4])],
    "index_put": lambda x: x.index_put((bad,), torch.tensor(1.0)),
    "setitem": lambda x: x.__setitem__(bad, 1.0),
    "index_select": lambda x: x.index_select(0, bad),
    "index_add": lambda x: x.index_add(0, bad, torch.ones(1, 4)),
    "index_copy": lambda x: x.index_copy(0, bad, torch.ones(1, 4)),
    "index_fill": lambda x: x.index_fill(1, torch.tensor([4]), 1.0),
    "take": lambda x: x.take(torch.tensor([20])),
    "embedding": lambda x: torch.nn.functional.embedding(torch.tensor([7]), x),
    "embedding_negative": lambda x: torch.nn.functional.embedding(torch.tensor([-1]), x),
    "gather_negative": lambda x: x.gather(0, torch.tensor([[-1, 0, 0, 0]])),
    "index_select_negative": lambda x: x.index_select(0, torch.tensor([-1])),
    "index_add_negative": lambda x: x.index_add(0, torch.tensor([-1]), torch.ones(1, 4)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_out_of_range_index_raises_like_strict(name):
    fn = CASES[name]
    with pytest.raises(Exception) as strict:
        fn(x.clone())
    target = x.clone()
    with deferfuse.config.override(always_compile=True):
        with pytest.raises(type(strict.value)) as deferred:
            with deferfuse.defer():
                y = fn(target)
                deferfuse.sync()
    message = str(deferred.value)
    assert "test_bounds.py" in message or "index out of range" in message or "out of bounds" in message
    # nothing was written back: the input is unchanged
    assert torch.equal(target, x)


def test_in_range_negative_indices_still_work():
    """Where torch accepts negative indices (x[idx], take, index_fill), defer does too."""
    def program(x):
        return x[torch.tensor([-1, -3, 0])], x.take(torch.tensor([-1, -12])), x.index_fill(1, torch.tensor([-1]), 7.0)
    expected = program(x)
    with deferfuse.config.override(always_compile=True):
        with deferfuse.defer():
            actual = program(x)
    for e, a in zip(expected, actual):
        torch.testing.assert_close(a, e)


def test_error_names_value_bound_dim_and_line():
    with deferfuse.config.override(always_compile=True):
        with pytest.raises(IndexError, match=r"index 9 is out of bounds for dimension 1 with size 4.*test_bounds.py:\d+"):
            with deferfuse.defer():
                y = x[:, torch.tensor([1, 9])] * 2
                deferfuse.sync(y)
