"""Memory torch does not own (NumPy arrays, buffers, DLPack imports, shared memory) may be
written by code deferfuse never sees, between two ops: each recorded read must see it as it is
at that op, as strict does, and writes into it must land in it in program order."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import deferfuse
from deferfuse.capture import storage

from oracle import assert_same


@pytest.fixture(params=["recorded", "defaults"])
def settings(request):
    """conftest records every op; the default settings run an op seen for the first time, or
    whose flushes were lone, at once instead: both must read foreign memory at the op."""
    if request.param == "recorded":
        return contextlib.nullcontext
    return lambda: deferfuse.config.override(eager_unseen_ops=True, eager_lone_ops=True)


def _both(program, settings=contextlib.nullcontext):
    """(strict result, defer result) of ``program()``, which makes its own inputs."""
    expected = program()
    with settings(), deferfuse.defer():
        actual = program()
    return expected, actual


def test_a_read_of_numpy_memory_sees_it_as_it_was_at_the_op():
    def program():
        buf = np.arange(4.0)
        t = torch.from_numpy(buf)
        u = t * 3
        buf[1] = 7
        return u, u[1].item()
    expected, actual = _both(program)
    assert expected[1] == 3.0
    assert isinstance(actual[0], deferfuse.DeferredTensor)   # (recorded, not run at once)
    assert_same(expected, actual)


def test_a_buffer_refilled_per_batch_trains_on_each_batch(settings):
    """A data pipeline that refills one NumPy buffer per batch while the earlier batches' ops
    are still pending."""
    def program():
        buf = np.zeros((4, 3), dtype=np.float32)
        w = torch.linspace(-1, 1, 6).reshape(3, 2)
        outs = []
        for step in range(3):
            buf[...] = np.arange(12, dtype=np.float32).reshape(4, 3) * (step + 1) - 5
            x = torch.from_numpy(buf)
            outs.append(((x @ w).relu() + x.sum(0)[:2]) * (step + 1))
        return outs
    deferfuse.reset_stats()
    expected, actual = _both(program, settings)
    assert_same(expected, actual)
    if settings is contextlib.nullcontext:
        # nothing was observed inside the block: all three batches were pending until its end
        assert all(isinstance(o, deferfuse.DeferredTensor) for o in actual)
        assert deferfuse.stats()["flushes"] == {"context_exit": 1}


def test_frombuffer_memory_is_read_at_the_op():
    def program():
        raw = bytearray(np.arange(6, dtype=np.float32).tobytes())
        t = torch.frombuffer(raw, dtype=torch.float32)
        first = t.sum() + t
        np.frombuffer(raw, dtype=np.float32)[:] = 10    # (NumPy over the same bytes)
        second = t * 2
        return first, second
    assert_same(*_both(program))


@pytest.mark.parametrize("importer", [
    torch.from_dlpack,
    lambda a: torch.utils.dlpack.from_dlpack(a.__dlpack__()),
], ids=["from_dlpack", "utils.dlpack"])
def test_dlpack_imported_memory_is_read_at_the_op(importer):
    def program():
        arr = np.linspace(0, 1, 8).reshape(2, 4)
        t = importer(arr)
        outs = [t.exp()]
        arr[0] = -3
        outs.append(t[0] + t[1])
        arr[:] = 5
        outs.append(t.mean(1))
        return outs
    assert_same(*_both(program))


def test_shared_memory_written_by_another_owner_is_read_at_the_op():
    """Shared memory another process may write: here its NumPy view stands for that process."""
    def program(t):
        other = t.numpy()      # (the other process's handle on the memory)
        u = t + 1
        other[2] = 100
        v = t * 2
        return u, v
    expected = program(torch.arange(6.0).share_memory_())
    t = torch.arange(6.0).share_memory_()
    with deferfuse.defer():
        actual = program(t)
    assert_same(expected, actual)


def test_a_slice_of_a_large_array_is_read_at_the_op():
    def program():
        data = np.arange(40.0).reshape(10, 4)
        x = torch.from_numpy(data)
        rows = []
        for i in range(3):
            rows.append(x[i:i + 2].t() * 1)     # (a strided view: what it reads is copied)
            data[i] = -1
        rows.append(x.expand(2, 10, 4).sum(0))   # (an expanded view: the storage is copied)
        return rows
    assert_same(*_both(program))


def test_inplace_writes_into_numpy_memory_land_in_order(settings):
    def program():
        buf = np.arange(6.0)
        t = torch.from_numpy(buf)
        t.mul_(2)
        after_mul = t + 1          # (the pending written value)
        t[1:3].add_(10)            # (a partial write)
        t[::2].neg_()
        after_all = t * 1
        return after_mul, after_all, buf
    expected, actual = _both(program, settings)
    assert_same(expected[:2], actual[:2])
    np.testing.assert_array_equal(actual[2], expected[2])   # the buffer holds every write, in order


def test_a_write_then_a_numpy_refill_reads_the_refill():
    """A write into foreign memory, flushed, then the memory refilled by NumPy: later ops read
    the refill, not the old write."""
    def program():
        buf = np.ones(4)
        t = torch.from_numpy(buf)
        t.add_(1)
        first = t.sum().item()      # (observed: flushed, buf holds the write)
        buf[:] = 10
        return first, t * 2
    assert_same(*_both(program))


def test_numpy_sees_a_write_into_its_memory_right_after_the_op(settings):
    """The owner of foreign memory reads it without asking torch: ``a.tolist()`` right after
    ``torch.from_numpy(a).add_(1)`` showed the old values (the write landed at the next flush).
    A write into foreign memory now lands at once, counted as a flush with reason
    ``foreign_write``, while the rest of the block stays pending."""
    def program():
        buf = np.arange(6.0).reshape(2, 3)
        out = np.zeros(3)
        t = torch.from_numpy(buf)
        pending = t.sum(0) * 2
        t.add_(1)
        seen = buf.tolist()
        t[1].mul_(-1)
        seen_row = buf[1].tolist()
        torch.from_numpy(out).copy_(pending)
        return seen, seen_row, out.tolist(), pending, type(pending).__name__
    deferfuse.reset_stats()
    expected, actual = _both(program, settings)
    assert actual[:3] == expected[:3]
    assert_same(expected[3], actual[3])
    assert actual[4] == "DeferredTensor"
    assert deferfuse.stats()["flushes"].get("foreign_write", 0) >= 1


def _memory(source: str) -> torch.Tensor:
    if source == "torch":
        return torch.zeros(4)
    if source == "torch.tensor(ndarray)":
        return torch.tensor(np.zeros(4))          # (a copy: torch's own memory)
    if source == "from_numpy":
        return torch.from_numpy(np.zeros(4))
    if source == "as_tensor(ndarray)":
        return torch.as_tensor(np.zeros(4))
    if source == "frombuffer":
        return torch.frombuffer(bytearray(16), dtype=torch.float32)
    if source == "from_dlpack":
        return torch.from_dlpack(np.zeros(4))
    if source == "share_memory_":
        return torch.zeros(4).share_memory_()
    raise AssertionError(source)


@pytest.mark.parametrize("source, foreign", [
    ("torch", False), ("torch.tensor(ndarray)", False), ("from_numpy", True),
    ("as_tensor(ndarray)", True), ("frombuffer", True), ("from_dlpack", True),
    ("share_memory_", True),
])
def test_foreign_memory_is_told_apart_from_torchs_own(source, foreign):
    t = _memory(source)
    assert storage.foreign(t.untyped_storage()) is foreign
    assert storage.foreign(t[1:].untyped_storage()) is foreign     # (views share the storage)


def _reads_once(t: torch.Tensor) -> bool:
    """Whether two recorded ops reading ``t`` read one graph input (torch's own memory) rather
    than a copy each (foreign memory)."""
    with deferfuse.defer():
        a = t * 2
        b = t + 1
        return a._storage.contents[1].node.inputs[0] is b._storage.contents[1].node.inputs[0]


def _train_in_place(t: torch.Tensor) -> torch.Tensor:
    for step in range(3):
        t.mul_(0.5).add_(t.square() * 0.1 + step)
    return t * 1


def test_a_privately_mapped_file_is_torchs_own(tmp_path):
    """torch.load(mmap=True) and safetensors (every from_pretrained model's weights) map their
    file privately (copy-on-write): nobody else writes that memory, so it reads and is written
    as torch's own memory, not copied per op nor flushed per write."""
    import safetensors.torch
    torch.save({"w": torch.arange(6.0)}, tmp_path / "t.pt")
    safetensors.torch.save_file({"w": torch.arange(6.0)}, tmp_path / "t.safetensors")
    loaders = {"torch.load(mmap=True)": lambda: torch.load(tmp_path / "t.pt", mmap=True)["w"],
               "safetensors": lambda: safetensors.torch.load_file(tmp_path / "t.safetensors")["w"]}
    for name, load in loaders.items():
        t = load()
        assert not t.untyped_storage().resizable()
        assert not storage.foreign(t.untyped_storage()), name
        assert _reads_once(t), name
        deferfuse.reset_stats()
        with deferfuse.defer():
            actual = _train_in_place(t)
        assert "foreign_write" not in deferfuse.stats()["flushes"], name
        assert_same(_train_in_place(load()), actual)
        assert_same(_train_in_place(load()) / 2, t / 2)   # (the memory holds every write)


def test_memory_mapped_shared_or_imported_stays_foreign(tmp_path):
    """A file mapped shared is the file's (other processes see and make writes); a NumPy
    memmap in copy-on-write mode is private but NumPy's to write, which the importer saw."""
    import mmap
    path = tmp_path / "t.pt"
    torch.save(torch.arange(4.0), path)
    shared = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=path.stat().st_size)
    assert storage.foreign(shared)
    torch.serialization.set_default_mmap_options(mmap.MAP_SHARED)
    try:
        assert storage.foreign(torch.load(path, mmap=True).untyped_storage())
    finally:
        torch.serialization.set_default_mmap_options(mmap.MAP_PRIVATE)
    np.arange(8.0).tofile(tmp_path / "a.bin")
    array = np.memmap(tmp_path / "a.bin", dtype=np.float64, mode="c")
    t = torch.from_numpy(array)
    assert storage.foreign(t.untyped_storage())

    def program(t):
        u = t * 2
        array[1] = 100.0       # (NumPy writes between two ops: the second op sees it)
        return u, t + 1
    expected = program(t)
    array[1] = 1.0
    with deferfuse.defer():
        actual = program(t)
    assert_same(expected, actual)


def test_memory_is_known_from_import_on(tmp_path):
    """An array made of a tensor, or a checkpoint loaded, before the first defer block: known
    as torch's memory all the same (a resumed run's optimizer flushed at each write of its
    state when torch.load ran before deferfuse's first block)."""
    script = tmp_path / "before_first_block.py"
    script.write_text(textwrap.dedent(f"""
        import json, torch, deferfuse
        torch.save({{"exp_avg": torch.zeros(8)}}, {str(tmp_path / "ck.pt")!r})
        state = torch.load({str(tmp_path / "ck.pt")!r})["exp_avg"]
        x = torch.randn(8)
        _ = x.numpy()
        del _
        with deferfuse.defer():
            for _ in range(3):
                state.mul_(0.9).add_(x * 0.1)
            a, b = x * 2, x + 1
            read_once = a._storage.contents[1].node.inputs[0] is b._storage.contents[1].node.inputs[0]
        print(json.dumps({{"flushes": deferfuse.stats()["flushes"], "read_once": read_once}}))
        """))
    env = {k: v for k, v in os.environ.items() if k != "TORCHTPU_MODE"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         timeout=120, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"flushes": {"context_exit": 1}, "read_once": True}


def test_reads_of_torchs_own_memory_stay_cached():
    """Only foreign memory is copied per read: a plain tensor read by two ops is one graph input."""
    x = torch.randn(8)
    with deferfuse.defer():
        a = x * 2
        b = x + 1
        assert a._storage.contents[1].node.inputs[0] is b._storage.contents[1].node.inputs[0]
    buf = np.zeros(8)
    y = torch.from_numpy(buf)
    with deferfuse.defer():
        a = y * 2
        b = y + 1
        assert a._storage.contents[1].node.inputs[0] is not b._storage.contents[1].node.inputs[0]


def test_a_from_pretrained_model_trains_as_torchs_own_memory(tmp_path):
    """A Hugging Face model as users get it (``from_pretrained``: its weights in the
    safetensors file's private mapping) fine-tuned in a defer block: strict's losses and
    weights, and its optimizer's writes recorded, not flushed one by one."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))

    def fine_tune():
        model = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses, [p.detach() for p in model.parameters()]

    expected = fine_tune()
    assert not any(storage.foreign(p.untyped_storage()) for p in
                   transformers.LlamaForCausalLM.from_pretrained(tmp_path).parameters())
    deferfuse.reset_stats()
    with deferfuse.defer():
        actual = fine_tune()
    assert "foreign_write" not in deferfuse.stats()["flushes"]
    assert_same(expected, actual)
