"""The recorder's fast path (``Recorder.record_fast``) must record exactly what the general
path records: the same nodes, keys, runtime scalars and results."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deferfuse
from deferfuse.capture import mode, recorder, storage
from deferfuse.capture.dispatch_keys import no_dispatch
from deferfuse.ir import graph

from oracle import check

PROGRAMS = [
    lambda x, y, i: (x + 0.5) * 0.5,                     # runtime scalars
    lambda x, y, i: torch.where(x > 0, x, y),            # a bool tensor, three tensor arguments
    lambda x, y, i: x.pow(2) + x.pow(2.0),               # int and float exponents key apart
    lambda x, y, i: x.mul(-0.0).add(float("nan")),       # -0.0 and nan as arguments
    lambda x, y, i: x * np.float64(1.5),                 # a float subclass
    lambda x, y, i: (i + True) * (i - 1),                # bool and int scalars
    lambda x, y, i: x[0] * y.t(),                        # views of user tensors, broadcast
    lambda x, y, i: torch.sum(x, 1, True) / x.numel(),   # non-float positional arguments
    lambda x, y, i: x.conj() * y,                        # (real: conj is a no-op view)
    lambda x, y, i: torch.clamp(x, -1.0, 1.0) + x.exp().neg(),
    lambda x, y, i: torch.add(x, y, alpha=0.25).sub(y, alpha=2),   # keyword scalars
    lambda x, y, i: x.clone().mul_(2).add_(y, alpha=0.5),          # in-place on a deferred tensor
    lambda x, y, i: x.mul_(0.5).addcmul_(y, y, value=-1.5),        # in-place on a user tensor
    lambda x, y, i: i.add_(3).clamp_(min=0, max=5),                # integer in-place, keywords
    lambda x, y, i: x[1:].mul_(y[0]),                              # in-place into a view
    # repeated scalars share one RuntimeScalar; zeros of both signs and nans never do
    lambda x, y, i: (1 / x.mul(0.0) + 1 / x.mul(-0.0) + 1 / y.mul(0.0)) * 0.25 * 0.25,
    lambda x, y, i: x.add(float("nan")).add(float("nan")).mul(-0.0).reciprocal(),
    # views of deferred tensors (record_fast's view form): no node, the base's storage
    lambda x, y, i: (x * 2).t().reshape(9) * (y * 1).view(-1),
    lambda x, y, i: (x + 1).unsqueeze(0).expand(2, 3, 3).permute(2, 0, 1).detach() * y[0],
    lambda x, y, i: (x * 1).diagonal(offset=-1) + (y * 1).select(-1, 0)[:2].flip(0),
    lambda x, y, i: (x * 1).transpose(-1, -2)[1:, ::2].clone().mul_(3) + 1,
    lambda x, y, i: (i * 2).view(torch.int64).view(1, 9).squeeze(0)[2:],   # integer views
    lambda x, y, i: (x > 0).t() & (y < 0),                                  # bool views
    lambda x, y, i: torch.ops.aten.alias(x * 1).view(3, 1, 3).expand(3, 0, 3).sum(1),   # 0-size
]


def _recorded(program, *inputs) -> list:
    """(op, key, runtime scalars) of each pending node the program leaves behind."""
    with deferfuse.defer():
        out = program(*inputs)
        if isinstance(out, deferfuse.DeferredTensor):
            state = out._storage
        else:   # a user tensor written in place
            with no_dispatch():
                state = storage.state_at(out.untyped_storage().data_ptr())
        value = state.contents[1]
        nodes = graph.ancestors([value])
        found = [(str(n.op), repr(n.key), repr(n.scalars)) for n in nodes]
    return found


def _without_fast_path(monkeypatch):
    monkeypatch.setattr(mode, "fast_form", lambda func: None)
    monkeypatch.setattr(mode, "FAST", {})


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 3, generator=g), torch.randn(3, 3, generator=g), torch.tensor([[-4, 2, 9]] * 3)


@pytest.mark.parametrize("program", PROGRAMS)
def test_the_fast_path_records_what_the_general_path_does(program, monkeypatch):
    fast = _recorded(program, *_inputs())
    _without_fast_path(monkeypatch)
    general = _recorded(program, *_inputs())
    assert fast == general


@pytest.mark.parametrize("program", PROGRAMS)
def test_the_fast_path_matches_strict(program):
    check(program, *_inputs())


def test_a_conjugate_view_of_a_deferred_tensor_reads_conjugated():
    """The fast path knows a deferred tensor's lazy bits by its own flag (mutation.set_bits);
    a conjugate view shares its base's storage and metadata, so a missed bit would read the
    base's values."""
    z = torch.tensor([1 + 2j, -3 - 0.5j, 0.25j])
    expected = (z * 2.0).conj() * 1.5
    for _ in range(3):   # (from the second block on, torch's clone of the view is cached)
        with deferfuse.defer():
            got = (z * 2.0).conj() * 1.5
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_the_fast_path_takes_the_commonest_calls(monkeypatch):
    taken = []
    original = recorder.Recorder.record_fast

    def counting(self, func, form, args, kwargs):
        result = original(self, func, form, args, kwargs)
        taken.append(result is not NotImplemented)
        return result
    monkeypatch.setattr(recorder.Recorder, "record_fast", counting)
    x = torch.randn(8, 137)  # (a shape of its own: another test may have cached x * 2.0's)
    with deferfuse.defer():
        y = x * 2.0          # first sight of this call: its metadata is not cached yet
        for _ in range(3):
            y = x * 2.0
    assert taken == [False, True, True, True]


def test_views_of_deferred_tensors_take_the_fast_path(monkeypatch):
    taken = []
    original = recorder.Recorder.record_fast

    def counting(self, func, form, args, kwargs):
        result = original(self, func, form, args, kwargs)
        if form.view:
            taken.append((str(func), result is not NotImplemented))
        return result
    monkeypatch.setattr(recorder.Recorder, "record_fast", counting)
    x = torch.randn(6, 139)
    with deferfuse.defer(), deferfuse.config.override(eager_blocks=False):
        y = x * 2.0
        for _ in range(2):
            y.t()
            y.view(139, 6)
    # first sight: the general path infers and caches the view's metadata; then the fast path
    assert taken == [("aten.t.default", False), ("aten.view.default", False),
                     ("aten.t.default", True), ("aten.view.default", True)]


def test_a_view_of_a_plain_tensor_is_a_plain_view():
    """The fast path takes views of deferred tensors only: a user tensor's view is a real view
    of its memory, made at once, as the general path does."""
    x = torch.randn(4, 5)
    with deferfuse.defer():
        for _ in range(2):
            v = x.t()
            assert type(v) is torch.Tensor and v.data_ptr() == x.data_ptr()


def test_a_lazy_bit_view_of_a_deferred_view_keeps_its_bits():
    """A view of a conjugate view takes the general path, which gives the view the bits."""
    z = torch.tensor([[1 + 2j, -3 - 0.5j], [0.25j, 2 + 0j]])
    expected = (z * 2.0).conj().t() * 1.5
    for _ in range(3):
        with deferfuse.defer():
            got = (z * 2.0).conj().t() * 1.5
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_every_node_lists_the_values_among_its_arguments():
    """Nodes are given their inputs where the recorder knows them (the fast path, the storage
    model's reads, writes, casts and lazy bits) instead of walking their arguments: the lists
    must be what the walk finds."""
    x, y = torch.randn(4, 4), torch.randn(4, 4, dtype=torch.float64)
    z = torch.randn(3, dtype=torch.complex64)
    with deferfuse.defer():
        a = x[1:, :2] * 2.0             # a read of a view
        x[0].add_(1.0)                  # a write into a view
        x.mul_(y)                       # a cast into the target's dtype
        w = (z * 1.5).conj() * 2.0      # lazy bits of a deferred tensor
        r = torch.view_as_real(z * 1.0) * 3.0
        values = [a._storage.contents[1], w._storage.contents[1], r._storage.contents[1]]
        with no_dispatch():
            values.append(storage.state_at(x.untyped_storage().data_ptr()).contents[1])
        nodes = graph.ancestors(values)
        kinds = {str(n.op) for n in nodes}
        for n in nodes:
            assert n.inputs == tuple(n._walk_values()), n
    assert {"deferfuse.read_view", "deferfuse.write_view", "deferfuse.cast"} <= kinds, kinds


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1, 5), (5, 1), (2, 1, 3), (0, 1)])
def test_deferred_results_have_strict_layouts(shape) -> None:
    """A deferred tensor of torch's default layout is made without passing strides and offset
    (torch's defaults, cheaper per op); every result, default or not, must still report the
    sizes, strides and offset strict's has: size-0 and size-1 dims, views, offsets."""
    def program(x):
        y = x + 1
        views = [y, y.unsqueeze(0), y.unsqueeze(-1)]
        if y.dim() >= 2:
            views += [y.transpose(0, -1), y[1:], y.narrow(-1, 0, 0)]
        if y.numel():
            views += [y.reshape(-1)[1:], y.reshape(-1)[::2]]
        return views
    x = torch.rand(shape)
    expected = program(x)
    with deferfuse.config.override(always_compile=True), deferfuse.defer():
        actual = program(x)
        layouts = [(t.shape, t.stride(), t.storage_offset()) for t in actual]
        assert all(isinstance(t, deferfuse.DeferredTensor) for t in actual)
    assert layouts == [(t.shape, t.stride(), t.storage_offset()) for t in expected]
    for e, a in zip(expected, actual):
        torch.testing.assert_close(a, e)
