"""Conjugate and negative views (x.conj(), the _neg_view autograd makes) of pending tensors: the
same memory read through a lazy bit, as torch does.  They ran eagerly (a flush and a fallback)
before, and FFT decompositions are full of them."""

from __future__ import annotations

import pytest
import torch

import deferfuse
from oracle import check

aten = torch.ops.aten
Z = torch.tensor([[1 + 2j, -3j, 0.5], [float("nan") + 1j, 2 - 1j, -0.0 + 0j]], dtype=torch.complex64)


def _no_fallback(program, *inputs):
    deferfuse.reset_stats()
    out = check(program, *inputs)
    assert deferfuse.stats()["fallbacks"] == {}, deferfuse.stats()["fallbacks"]
    return out


@pytest.mark.parametrize("program", [
    lambda z: (z * 2).conj(),
    lambda z: (z * 2).conj() + 1,
    lambda z: (z * 2).sum(0).conj(),
    lambda z: (z * 2).conj().t().contiguous(),          # a view of a conjugate view is conjugate
    lambda z: (z * 2).conj()[1:, ::2] * 3,
    lambda z: (z * 2).conj().conj() - z,                # the bit toggles
    lambda z: aten._neg_view(z * 2) + 0,
    lambda z: aten._neg_view((z * 2).conj()).resolve_neg().resolve_conj(),
    lambda z: (z * 2).conj().is_conj(),
    lambda z: (z * 2).conj()[0, 0].item(),
    lambda z: (z * 2).conj()[0].tolist(),
    lambda z: torch.fft.hfft(z * 2),
    lambda z: torch.fft.ihfft(z.real * 2),
    lambda z: torch.fft.ifft(z * 2),
], ids=["conj", "conj_add", "conj_of_sum", "conj_t", "conj_slice", "conj_conj", "neg_view",
        "neg_of_conj", "is_conj", "item", "tolist", "hfft", "ihfft", "ifft"])
def test_lazy_views_of_pending_tensors_stay_pending(program):
    _no_fallback(program, Z)


@pytest.mark.parametrize("program", [
    lambda z: z.conj().tolist(),
    lambda z: z.conj().imag.tolist(),                  # (imag of a conjugate: a negative view)
    lambda z: aten._neg_view(z.real).tolist(),
    lambda z: [z.conj()[1].tolist(), z.conj().resolve_conj().tolist()],
], ids=["conj", "conj_imag", "neg_view", "row_and_resolved"])
def test_tolist_of_a_lazy_view_of_a_plain_tensor(program):
    """torch's tolist resolves the view with a clone through the dispatcher, then reads the
    clone's memory: under defer the clone was deferred ("tolist() shouldn't be called on a
    tensor with unallocated storage"); found by a client program."""
    check(program, torch.tensor([[1 + 2j, -3j, 0.5], [4.5 + 1j, 2 - 1j, -0.0 + 0j]]))   # (lists: no NaN)


def test_conjugate_view_sees_later_writes_to_its_base():
    def program(z):
        y = z * 2
        c = y.conj()
        y.add_(1)
        return c + 0, y
    _no_fallback(program, Z)


def test_writes_through_a_conjugate_view_store_the_conjugate():
    def program(z):
        y = z * 2
        y.conj().add_(1j)           # runs eagerly: the value stored is conj(conj(y) + 1j)
        return y
    check(program, Z)


def test_numpy_of_a_conjugate_view_raises_like_strict():
    check(lambda z: torch.from_numpy((z * 2).conj().numpy()), Z)
    check(lambda z: torch.from_numpy((z * 2).conj().resolve_conj().numpy()), Z)


# -- real views of complex memory (view_as_real, .real, .imag) -----------------------------------
@pytest.mark.parametrize("program", [
    lambda z: torch.view_as_real(z * 2),
    lambda z: torch.view_as_real(z * 2)[..., 1] * 3,              # a view of the real view
    lambda z: (z * 2).real + 0,
    lambda z: (z * 2).imag.sum(),
    lambda z: torch.view_as_real((z * 2).t()).sum(-1),
    lambda z: torch.from_numpy(torch.view_as_real(z * 2).numpy()),
    lambda z: torch.fft.irfft(z * 2, 4),
], ids=["view_as_real", "select", "real", "imag", "transposed", "numpy", "irfft"])
def test_real_views_of_pending_complex_tensors_stay_pending(program):
    _no_fallback(program, Z)


def test_real_view_sees_later_writes_to_its_base():
    def program(z):
        y = z * 2
        r = torch.view_as_real(y)
        y.add_(1)
        return r + 0, y
    _no_fallback(program, Z)


def test_writes_through_a_real_view_reach_the_complex_tensor():
    def program(z):
        y = z * 2
        torch.view_as_real(y).mul_(2)       # runs eagerly, on the computed memory
        y.imag.add_(1)
        return y
    check(program, Z)


def test_fft_gradients_through_real_views():
    def program(z):
        leaf = torch.complex(z.real.nan_to_num(), z.imag).requires_grad_()
        out = torch.fft.irfft(leaf * 2, 4)
        (grad,) = torch.autograd.grad(out.pow(2).sum(), [leaf])
        return grad
    _no_fallback(program, Z)
