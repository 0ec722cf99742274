"""Tensors that are not dense and strided (sparse COO and CSR, nested, quantized, mkldnn) and
tensor subclasses with their own __torch_dispatch__ have no storage deferfuse can model: their
ops run at once on torch's kernel, after what they need is flushed, as a counted fallback
(reason ``sparse``), and must give strict's results, mutations included."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch.utils import _pytree as pytree

import deferfuse

from oracle import assert_same

try:
    from torch.testing._internal.two_tensor import TwoTensor
except ImportError:   # (a torch without it: the wrapper subclass of our own still runs)
    TwoTensor = None


@pytest.fixture(autouse=True)
def _quiet():
    # (sparse CSR, nested and quantized tensors warn that they are beta, prototype, deprecated)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


@pytest.fixture(params=["recorded", "defaults"])
def settings(request):
    """conftest records every op; the default settings run an op seen for the first time, or
    whose flushes were lone, at once instead."""
    if request.param == "recorded":
        return contextlib.nullcontext
    return lambda: deferfuse.config.override(eager_unseen_ops=True, eager_lone_ops=True)


def _plain(x):
    """What is observable of a result, as plain dense tensors and Python values."""
    if isinstance(x, (list, tuple)):
        return [_plain(y) for y in x]
    if not isinstance(x, torch.Tensor):
        return x
    if TwoTensor is not None and isinstance(x, TwoTensor):
        return ["TwoTensor", _plain(x.a), _plain(x.b)]
    if x.is_nested:
        return ["nested", str(x.layout), [_plain(y) for y in x.unbind()]]
    if x.is_quantized:
        return ["quantized", x.dtype, x.q_scale(), x.q_zero_point(), x.int_repr()]
    if x.layout is not torch.strided:
        return [str(x.layout), x.to_dense()]
    return x.detach()


def _compare(program, settings=contextlib.nullcontext, *, fallback: bool = True):
    """Run ``program()`` (which makes its inputs from a seeded generator) under strict and under
    defer and compare what it returns; the defer run's fallbacks must say why."""
    torch.manual_seed(0)
    expected = _plain(program())
    torch.manual_seed(0)
    deferfuse.reset_stats()
    with settings(), deferfuse.defer():
        actual = program()
    assert_same(expected, _plain(actual))
    if fallback:
        assert deferfuse.stats()["fallback_reasons"].get("opaque", 0) > 0
    return actual


# -- sparse ----------------------------------------------------------------------------------
def test_sparse_coo_ops():
    def program():
        x = torch.randn(4, 3).relu() * 2              # (deferred)
        s = x.to_sparse()
        d = torch.randn(3, 2)
        return (torch.sparse.mm(s, d), s.to_dense() * 2, s.coalesce(), s + s, s * 3, x + s,
                torch.mm(s, x.t()), s.sum())
    _compare(program)


def test_sparse_csr_ops():
    def program():
        x = torch.randn(4, 3).relu()
        c = x.to_sparse_csr()
        d = torch.randn(3, 2) + 1
        return c @ d, c.to_dense(), torch.sparse.mm(c, d), c * 2
    _compare(program)


def test_sparse_gradients_accumulate_into_grad():
    def program():
        w = torch.randn(5, 3, requires_grad=True)
        for _ in range(2):
            torch.nn.functional.embedding(torch.tensor([0, 2, 2]), w, sparse=True).pow(2).sum().backward()
        return w.grad
    grad = _compare(program)
    assert grad.layout is torch.sparse_coo


def test_sparse_mm_gradient_of_its_dense_argument():
    def program():
        s = torch.randn(4, 3).relu().to_sparse()
        w = torch.randn(3, 2, requires_grad=True)
        torch.sparse.mm(s, w).pow(2).sum().backward()
        return w.grad
    _compare(program)


def test_inplace_ops_on_sparse_tensors():
    def program():
        x = torch.randn(4, 3).relu()
        s = x.to_sparse()
        before = s.to_dense() + 1
        s.mul_(2)
        c = s.coalesce()
        values = c.values()
        values.add_(10)                # (pending: a write into the sparse tensor's memory)
        return before, s, values, c.to_dense()
    _compare(program)


def test_a_sparse_tensor_keeps_its_values_memory():
    """sparse_coo_tensor keeps the values tensor it is given: later writes into it show."""
    def program():
        values = torch.randn(3) * 2                   # (deferred)
        s = torch.sparse_coo_tensor(torch.tensor([[0, 2, 4]]), values, (5,))
        values.mul_(10)
        return s.to_dense(), values
    _compare(program)


def test_a_dense_tensor_written_with_a_sparse_one_is_read_afresh():
    def program():
        w = torch.randn(5, 3)
        before = w * 2
        w.add_(torch.randn(5, 3).relu().to_sparse(), alpha=-0.5)
        after = w * 2
        return before, after, w
    _compare(program)


def _embedding_training(steps: int, optimizers):
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    head = torch.nn.Linear(4, 1)
    opts = optimizers(embedding, head)
    index = torch.tensor([[1, 2], [3, 1], [7, 7]])

    def train():
        losses = []
        for _ in range(steps):
            for opt in opts:
                opt.zero_grad()
            loss = head(embedding(index).mean(1)).pow(2).sum()
            loss.backward()
            for opt in opts:
                opt.step()
            losses.append(loss.detach())
        return losses
    return embedding, head, opts, train


@pytest.mark.parametrize("optimizers", [
    lambda e, h: [torch.optim.SGD([*e.parameters(), *h.parameters()], lr=0.1)],
    lambda e, h: [torch.optim.SGD([*e.parameters(), *h.parameters()], lr=0.1, momentum=0.9)],
    lambda e, h: [torch.optim.SparseAdam(e.parameters(), lr=0.1), torch.optim.Adam(h.parameters(), lr=0.1)],
], ids=["sgd", "sgd_momentum", "sparse_adam_and_adam"])
def test_a_sparse_embedding_trains_as_strict(optimizers, settings):
    """nn.Embedding(sparse=True): its gradient is sparse, and SGD updates the dense weight with
    it (weight.add_(grad, alpha=-lr))."""
    strict_modules = _embedding_training(3, optimizers)
    expected = strict_modules[3]()
    modules = _embedding_training(3, optimizers)
    deferfuse.reset_stats()
    with settings(), deferfuse.defer():
        losses = modules[3]()
    assert_same(expected, losses)
    for strict_module, module in zip(strict_modules[:2], modules[:2]):
        for p, q in zip(strict_module.parameters(), module.parameters()):
            assert_same(p, q)
            assert_same(_plain(p.grad), _plain(q.grad))
    assert deferfuse.stats()["fallback_reasons"]["opaque"] > 0


# -- nested, quantized, mkldnn ---------------------------------------------------------------
def test_nested_tensors():
    def program():
        a = torch.randn(2, 3) * 2                     # (deferred components)
        n = torch.nested.nested_tensor([a, torch.randn(4, 3)])
        return (n * 2).relu(), n.sin(), torch.nested.to_padded_tensor(n, 0.0)
    _compare(program)


def test_jagged_nested_tensors():
    def program():
        n = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged)
        m = (n * 2).sin()
        return m, m.values() + 1
    _compare(program)


def test_quantized_tensors():
    def program():
        x = torch.randn(5) * 2                        # (deferred)
        q = torch.quantize_per_tensor(x, 0.1, 3, torch.quint8)
        return q, q.dequantize() + 1, q.int_repr()
    _compare(program)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no mkldnn")
def test_mkldnn_tensors():
    def program():
        m = (torch.randn(2, 3) + 1).to_mkldnn()
        return (m + m).to_dense(), m.to_dense() * 2
    _compare(program)


# -- subclasses ------------------------------------------------------------------------------
class Wrapped(torch.Tensor):
    """A minimal wrapper subclass: every op runs on the inner tensor, results wrapped again."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.inner if isinstance(x, Wrapped) else x   # noqa: E731
        out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs or {}))
        if func._schema.is_mutable:
            return args[0]
        return pytree.tree_map(lambda x: Wrapped(x) if type(x) is torch.Tensor else x, out)


def test_a_wrapper_subclass_of_our_own():
    def program():
        x = torch.randn(3)
        w = Wrapped(x)
        y = w * 2 + 1
        w.mul_(3)                      # (writes x)
        return y.inner, w.sum().inner, x, x * 1
    _compare(program)


@pytest.mark.skipif(TwoTensor is None, reason="this torch has no TwoTensor")
def test_two_tensor():
    def program():
        a, b = torch.randn(3), torch.randn(3)
        before = a * 2                 # (pending: reads a)
        t = TwoTensor(a, b)
        u = (t * 2).sin()
        t.add_(1)                      # (writes a and b)
        return u, t, a * 2, before, b
    _compare(program)


@pytest.mark.skipif(TwoTensor is None, reason="this torch has no TwoTensor")
def test_two_tensor_of_deferred_tensors():
    def program():
        t = TwoTensor(torch.randn(3) * 2, torch.randn(3) + 1)
        return t * 2 + 1
    _compare(program)


def test_random_and_inplace_view_ops_on_opaque_tensors():
    """Ops that act before converting their arguments (a random op draws from the generator, an
    in-place view op changes its target at once) must find an opaque one first: the generator
    then draws what strict draws, in the same order."""
    def program():
        n = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged)
        dropped = torch.nn.functional.dropout(n, 0.5, training=True)
        w = Wrapped(torch.zeros(3))
        w.uniform_()
        s = torch.randn(3, 2).relu().to_sparse()
        s.t_()
        return dropped, w.inner * 1, s, torch.rand(3)
    _compare(program)


def test_parameters_are_plain_tensors():
    """nn.Parameter is a subclass without a __torch_dispatch__ of its own: it is recorded."""
    p = torch.nn.Parameter(torch.randn(3))
    deferfuse.reset_stats()
    with deferfuse.defer():
        y = p * 2
        assert isinstance(y, deferfuse.DeferredTensor)
    assert not deferfuse.stats()["fallbacks"]


def test_opaque_tensors_in_the_shortcuts():
    """item() of a one-element tensor and ops on one-element CPU tensors take shortcuts that
    read memory directly: opaque tensors go the general way."""
    def program():
        s = torch.tensor([[0.0, 2.5]]).to_sparse()
        q = torch.quantize_per_tensor(torch.tensor([1.5]), 0.5, 0, torch.quint8)
        return s.sum().item(), q.dequantize().item(), (s * 2).to_dense(), q.int_repr() + 1
    with deferfuse.config.override(host_scalars_at_once=True):
        _compare(program)
