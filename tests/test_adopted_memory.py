"""A deferred tensor's storage whose memory nothing outside deferfuse has seen takes the memory
of its new contents at a flush instead of having them copied into it (an optimizer's state,
updated in place every step).  Memory that was handed out (numpy, data_ptr, DLPack, a view made
outside a block) keeps receiving the contents, so every alias the user holds stays true."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

import deferfuse
from deferfuse.capture import flush


def _counting_write_backs(monkeypatch) -> list:
    copied = []
    original = flush.write_back

    def counting(buffer, flat):
        copied.append(buffer.numel())
        return original(buffer, flat)
    monkeypatch.setattr(flush, "write_back", counting)
    return copied


def _state_made_in_a_block(x: torch.Tensor, scale: float = 0.0) -> torch.Tensor:
    with deferfuse.config.override(always_compile=True), deferfuse.defer():
        state = x * scale
    assert isinstance(state, deferfuse.DeferredTensor)
    return state


def test_a_deferred_state_updated_in_place_is_not_copied(monkeypatch):
    x = torch.randn(64)
    state, expected = _state_made_in_a_block(x), torch.zeros(64)
    copied = _counting_write_backs(monkeypatch)
    for step in range(4):
        with deferfuse.config.override(always_compile=True), deferfuse.defer():
            state.mul_(0.9).add_(x, alpha=0.1)
            state.sum().item()
        expected.mul_(0.9).add_(x, alpha=0.1)
        torch.testing.assert_close(state, expected)
    assert copied == []


def _numpy(t):
    return t.numpy()


def _array(t):
    return np.asarray(t)


def _data_ptr(t):
    return np.ctypeslib.as_array((ctypes.c_float * t.numel()).from_address(t.data_ptr()))


def _storage(t):
    return torch.tensor([], dtype=t.dtype).set_(t.untyped_storage()).numpy()


def _dlpack(t):
    return torch.from_dlpack(t).numpy()


def _outside_view(t):
    return t[:].numpy()


@pytest.mark.parametrize("expose", [_numpy, _array, _data_ptr, _storage, _dlpack, _outside_view])
def test_memory_handed_out_keeps_receiving_the_contents(expose, monkeypatch):
    x = torch.randn(16)
    state = _state_made_in_a_block(x)
    alias = expose(state)
    copied = _counting_write_backs(monkeypatch)
    for step in range(3):
        with deferfuse.config.override(always_compile=True), deferfuse.defer():
            state.add_(x)
            state.sum().item()
        np.testing.assert_array_equal(alias, state.detach().numpy())
    np.testing.assert_array_equal(alias, (3 * x).numpy())
    assert copied == [16] * 3


def test_a_pending_reader_of_the_old_memory_keeps_the_old_contents():
    x = torch.randn(8)
    for numel in (8, 1):   # (a one-element storage takes the small flush, which snapshots)
        state = _state_made_in_a_block(x[:numel] + 1.0, 1.0)
        with deferfuse.config.override(always_compile=True), deferfuse.defer():
            state.add_(1.0)
            state.sum().item()           # state's memory is now a computation's own
            before = state * 1.0         # reads that memory
            state.mul_(10.0)
            state.sum().item()           # the flush of state alone
            old = before.sum().item()
        assert old == pytest.approx(float((x[:numel] + 1.0).sum()) + numel * 1.0, rel=1e-6)
        torch.testing.assert_close(state, (x[:numel] + 2.0) * 10.0)


def test_two_storages_with_the_same_contents_do_not_share_memory():
    x = torch.randn(5)
    with deferfuse.config.override(always_compile=True), deferfuse.defer():
        a = x * 2.0
        b = x * 0.0
        b.copy_(a)
        a.sum().item()
    with deferfuse.config.override(always_compile=True), deferfuse.defer():
        a.add_(1.0)
    torch.testing.assert_close(b, x * 2.0, rtol=0, atol=0)
    torch.testing.assert_close(a, x * 2.0 + 1.0, rtol=0, atol=0)


def test_an_optimizer_state_saved_and_loaded_stays_true(tmp_path):
    """torch.save reads the state (a copy): later steps still update what the optimizer holds,
    and a loaded copy is the state as it was saved."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    strict_model = torch.nn.Linear(4, 3)
    strict_model.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    strict_opt = torch.optim.AdamW(strict_model.parameters(), lr=0.1)
    data = torch.randn(6, 4)
    for step in range(4):
        for m, o, deferred in ((model, opt, True), (strict_model, strict_opt, False)):
            ctx = deferfuse.defer() if deferred else deferfuse.mode("strict")
            with ctx:
                o.zero_grad()
                m(data).square().mean().backward()
                o.step()
        if step == 1:
            torch.save(opt.state_dict(), tmp_path / "opt.pt")
            saved = torch.load(tmp_path / "opt.pt")
            saved_avg = saved["state"][0]["exp_avg"].clone()
            torch.testing.assert_close(saved_avg, strict_opt.state_dict()["state"][0]["exp_avg"])
    for p, q in zip(model.parameters(), strict_model.parameters()):
        torch.testing.assert_close(p, q)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(opt.state[model.weight][key], strict_opt.state[strict_model.weight][key])
    assert not torch.equal(saved_avg, opt.state[model.weight]["exp_avg"])
