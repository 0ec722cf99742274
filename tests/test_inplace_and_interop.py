"""In-place ops recorded as one node of their functional twin, and the DLPack views of user
memory that flushes reuse: both must stay invisible next to strict."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import deferfuse
from deferfuse.capture.tensor import DeferredTensor
from deferfuse.exec import interop

from oracle import check


@pytest.mark.parametrize("program", [
    lambda x, y, i: x.mul_(y),                               # tensor argument
    lambda x, y, i: x.add_(y[0], alpha=-0.5),                # broadcast, runtime scalar
    lambda x, y, i: x.addcmul_(y, y, value=0.25).sqrt_(),    # chained on the returned self
    lambda x, y, i: x[1:].add_(x[:-1]),                      # partial overlap: strict raises
    lambda x, y, i: (lambda z: z[1:].add_(z[:-1]))(x * 2),    # the same on a pending result
    lambda x, y, i: (lambda z: z[1:].add_(y[:-1]))(x * 2),    # pending target, other memory
    lambda x, y, i: x.add_(y, alpha=2).mul_(i.float()),       # several other tensors, no overlap
    lambda x, y, i: x.add_(x),                               # full overlap is fine
    lambda x, y, i: x.t().mul_(2),                           # a view as the target
    lambda x, y, i: x[0].mul_(y),                            # broadcast into a smaller self: raises
    lambda x, y, i: i.mul_(1.5),                             # int64 result would be float: raises
    lambda x, y, i: i.add_(3).clamp_(min=0, max=5),          # integer ops, scalar arguments
    lambda x, y, i: x.copy_(y.t()),                          # copy_ from a transposed source
    lambda x, y, i: x.conj().mul_(2),                        # a lazy-bit view: the general path
    lambda x, y, i: (x.mul_(2), x.sum())[1],                 # a read after the write
])
def test_inplace_forms_match_strict(program):
    check(program, torch.randn(3, 3), torch.randn(3, 3), torch.tensor([[-4, 2, 9]] * 3))


def test_an_inplace_op_counts_as_one_recorded_op():
    x = torch.randn(4, 4)
    deferfuse.reset_stats()
    with deferfuse.defer():
        for _ in range(5):
            x.mul_(0.5).add_(1.0)
        assert deferfuse.stats()["ops_recorded"] == 10


def test_a_user_tensor_read_by_two_flushes_is_imported_once_and_seen_as_written():
    """The second flush reuses the first one's DLPack view of ``x`` and still reads what the
    first flush wrote back into it."""
    def program(x):
        first = (x * 2).sum().item()
        x.add_(1)
        second = (x * 2).sum().item()
        return first, second
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    expected = program(x.clone())
    deferfuse.reset_stats()
    with deferfuse.config.override(always_compile=True):
        with deferfuse.defer():
            got = program(x)
    assert got == pytest.approx(expected, rel=1e-5)   # (summation order differs)
    assert deferfuse.stats()["dlpack_copies"] == 0


def test_a_view_is_dropped_with_its_tensor():
    """The cache of DLPack views must not keep a tensor's memory alive."""
    t = torch.randn(256)
    interop.to_jax(t)
    key = id(t)
    assert key in interop._VIEWS
    del t
    gc.collect()
    assert key not in interop._VIEWS


def test_a_view_is_not_reused_after_the_memory_moved():
    t = torch.randn(16)
    first = interop.to_jax(t)
    t.set_(torch.randn(16).untyped_storage())
    second = interop.to_jax(t)
    assert second is not first
    assert second.unsafe_buffer_pointer() == t.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16,
                                   torch.complex64, torch.int64, torch.int8, torch.uint8, torch.bool])
@pytest.mark.parametrize("shape", [(), (0,), (3, 5)])
def test_dlpack_crossings_share_memory_both_ways(dtype, shape):
    """torch -> JAX -> torch without a copy, for every dtype a lowering may see."""
    t = torch.arange(int(torch.Size(shape).numel()), dtype=torch.float64).reshape(shape).to(dtype)
    a = interop.to_jax(t)
    back = interop.to_torch(a)
    assert back.dtype == t.dtype and back.shape == t.shape
    torch.testing.assert_close(back, t, rtol=0, atol=0)
    if t.numel():
        assert a.unsafe_buffer_pointer() == t.data_ptr() == back.data_ptr()


def _imports_counted(monkeypatch) -> list:
    imported: list = []
    original = interop._from_dlpack

    def counting(t):
        imported.append(t.data_ptr())
        return original(t)
    monkeypatch.setattr(interop, "_from_dlpack", counting)
    return imported


def test_a_user_tensor_read_in_every_defer_block_is_imported_once(monkeypatch):
    """Each defer context gives a user storage a new state, but the same flat buffer, so the
    DLPack view made by the first flush serves the next contexts, and still reads the memory
    as it is then (here changed by strict code between the contexts)."""
    x = torch.randn(64, 32)
    imported = _imports_counted(monkeypatch)
    got, expected = [], []
    with deferfuse.config.override(always_compile=True):
        for _ in range(3):
            expected.append(torch.tanh(x) * 2)
            with deferfuse.defer():
                got.append(torch.tanh(x) * 2)
            x.add_(1)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    assert imported.count(x.data_ptr()) == 1


def test_the_flat_buffer_of_a_user_tensor_goes_with_the_tensor():
    from deferfuse.capture.storage import buffer_keys
    x = torch.randn(64, 32)
    with deferfuse.config.override(always_compile=True):
        with deferfuse.defer():
            (x * 2).sum().item()
    key = id(x)
    assert key in buffer_keys()
    storage = weakref.ref(x.untyped_storage())
    del x
    gc.collect()
    assert key not in buffer_keys()
    assert storage() is None


@pytest.mark.parametrize("move", [
    lambda x: x.set_(torch.full((64, 32), 3.0).untyped_storage()),
    lambda x: x.resize_(128, 32).fill_(3.0),
])
def test_a_user_tensor_whose_memory_moved_between_blocks_is_read_afresh(move):
    x = torch.randn(64, 32)
    with deferfuse.config.override(always_compile=True):
        with deferfuse.defer():
            (x * 2).sum().item()
        move(x)
        with deferfuse.defer():
            got = x * 2
    torch.testing.assert_close(got, torch.full(x.shape, 6.0))


@pytest.mark.parametrize("swap", [
    lambda p: torch.arange(6.0).reshape(2, 3) * 10,   # other memory, same shape
    lambda p: p.data.t(),                              # the same memory, transposed
    lambda p: p.data[:1],                              # the same memory, another shape
])
def test_data_assignment_inside_a_block_is_seen_by_later_reads(swap):
    """``p.data = q`` changes a tensor without an aten op; what a context remembers of the
    tensor (its storage and layout) must not outlive it."""
    def program(p):
        first = (p * 2).sum()
        p.data = swap(p)
        return first, p * 3, p.add_(1)
    check(program, torch.arange(6.0).reshape(2, 3))


def test_a_storage_resized_through_an_alias_is_seen_by_later_reads():
    def program(p):
        alias = p.view(-1)
        first = p * 2
        alias.resize_(2)
        return first, p.sum(), alias * 1
    check(program, torch.arange(4.0).reshape(2, 2))


def test_old_style_sgd_through_data_matches_strict():
    """``p.data = p.data - lr * p.grad``: the value is a deferred tensor, computed when
    assigned (assigning .data bypasses aten, and a deferred tensor has no memory yet)."""
    def program(p, g):
        for _ in range(3):
            p.data = p.data - 0.1 * g
        return p * 1
    check(program, torch.randn(4, 3), torch.randn(4, 3))


def test_assigning_data_of_a_deferred_tensor_says_what_to_do():
    with deferfuse.defer():
        q = torch.ones(3) * 2
        with pytest.raises(NotImplementedError, match="deferfuse.sync"):
            q.data = torch.zeros(3)


@pytest.mark.parametrize("program", [
    lambda b, x: b.masked_fill_(b.select(0, 0), False),       # mask partially overlaps: raises
    lambda b, x: b.masked_fill_(b, False),                     # the same memory: fine
    lambda b, x: x.masked_fill_(b, x[0, 1]),                   # value a view of the target: fine
    lambda b, x: x.masked_fill_(b.clone(), x[1, 0] * 2),
    lambda b, x: x[0].masked_fill_(b[0], 5.0),
])
def test_masked_fill_checks_its_mask_against_the_target_as_torch_does(program):
    check(program, torch.tensor([[True, False], [False, True]]), torch.arange(4.0).reshape(2, 2))


def test_a_flush_reading_memory_it_writes_back_does_not_flush_again_inside_itself(monkeypatch):
    """A flush runs with Python dispatch off; its own reads of user memory (the DLPack import of
    a parameter whose new contents are pending) must not trigger the plain-read write-back, which
    would start a flush inside the flush."""
    from deferfuse.capture import flush
    p = torch.randn(64, generator=torch.Generator().manual_seed(1))
    before = p.clone()
    started = []
    original = flush.materialize_states

    def counted(*args, **kwargs):
        started.append(len(started))
        return original(*args, **kwargs)

    monkeypatch.setattr(flush, "materialize_states", counted)
    with deferfuse.config.override(always_compile=True):
        with deferfuse.defer():
            old = p * 2            # reads p before the write below
            p.add_(1.0)
            deferfuse.sync(old)
    torch.testing.assert_close(old, before * 2)
    torch.testing.assert_close(p, before + 1.0)
    # deferfuse.sync's flush, and the block's flush of what was left: none nested
    assert len(started) <= 2, started


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64])
def test_write_back_into_user_memory_matches_copy(monkeypatch, dtype):
    """The write-back of computed contents: one memmove for contiguous memory of the same dtype
    up to a size, torch's copy_ otherwise (strided sources, larger tensors)."""
    from deferfuse.capture import flush
    g = torch.Generator().manual_seed(3)
    source = (torch.randn(64, generator=g) * 4).to(dtype)
    for flat in (source, source[::2], source[:32]):      # contiguous, strided, (sizes match below)
        target = torch.zeros(flat.numel(), dtype=dtype)
        pointer = target.data_ptr()
        flush.write_back(target, flat)
        assert torch.equal(target, flat) and target.data_ptr() == pointer
    monkeypatch.setattr(flush, "MEMMOVE_BYTES", 8)   # a larger tensor: copy_
    target = torch.zeros(64, dtype=dtype)
    flush.write_back(target, source)
    assert torch.equal(target, source)


def test_an_update_written_back_is_seen_through_every_view_and_keeps_the_storage():
    p = torch.randn(4, 256, generator=torch.Generator().manual_seed(4))
    row, column = p[1], p[:, 3]
    pointer, expected = p.data_ptr(), p * 0.5 + 1
    with deferfuse.config.override(always_compile=True):
        with deferfuse.defer():
            p.mul_(0.5).add_(1)
    torch.testing.assert_close(p, expected)
    torch.testing.assert_close(row, expected[1])
    torch.testing.assert_close(column, expected[:, 3])
    assert p.data_ptr() == pointer


@pytest.mark.parametrize("reshape", [
    lambda t: t.t_(),
    lambda t: t.transpose_(0, 1),
    lambda t: t.unsqueeze_(1),
    lambda t: t.squeeze_(),
    lambda t: t.as_strided_((2, 2), (1, 3)),
    lambda t: t.resize_(3, 1),
], ids=["t_", "transpose_", "unsqueeze_", "squeeze_", "as_strided_", "resize_within"])
def test_an_inplace_view_op_on_a_deferred_tensor_outside_any_block_reshapes_it(reshape):
    """A deferred tensor used after its block (or in a segment run at once) ran the op on the
    real view of its memory, and the tensor itself kept its old shape: torch's unpad_sequence
    (transpose_) then zipped rows of the wrong length; found by a client program."""
    strict = torch.arange(6.0).view(2, 3) * 1
    with deferfuse.config.override(always_compile=True), deferfuse.defer():
        deferred = torch.arange(6.0).view(2, 3) * 1
    assert type(deferred) is DeferredTensor
    assert reshape(deferred) is deferred
    reshape(strict)
    assert (deferred.shape, deferred.stride(), deferred.storage_offset()) == \
        (strict.shape, strict.stride(), strict.storage_offset())
    assert deferred.tolist() == strict.tolist()
    assert (deferred + 1).tolist() == (strict + 1).tolist()
