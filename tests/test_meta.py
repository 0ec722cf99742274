"""TensorMeta: the layout facts a deferred value carries, checked against torch's own tensors."""

import pytest
import torch
import torch._prims_common

from deferfuse.ir import meta as meta_module
from deferfuse.ir.meta import TensorMeta

BASE = torch.arange(24.0).reshape(2, 3, 4)
LAYOUTS = {
    "contiguous": BASE,
    "transposed": BASE.transpose(0, 2),         # dense, not contiguous: covers its storage
    "row slice": BASE[1:],                      # offset into the storage
    "column slice": BASE[:, :, :2],             # strided, not dense
    "broadcast": torch.zeros(3, 1).expand(3, 4),   # stride 0: overlapping
    "0-dim": torch.tensor(1.5),
    "0-size": torch.zeros(0, 3),
    "size-1 dims": torch.zeros(1, 5, 1),
    "view of bigger storage": torch.zeros(10)[:5],
}


def _covers(t: torch.Tensor) -> bool:
    # torch's view of it: dense (non-overlapping, no gaps), starting at offset 0 and spanning
    # the whole storage
    dense = torch._prims_common.is_non_overlapping_and_dense_or_false(t)
    return dense and t.storage_offset() == 0 and t.numel() * t.element_size() == t.untyped_storage().nbytes()


@pytest.mark.parametrize("name", LAYOUTS)
def test_covers_storage_agrees_with_torch(name):
    t = LAYOUTS[name]
    m = TensorMeta.of(t)
    assert m.covers_storage == _covers(t)
    assert m.covers_storage == _covers(t)   # the remembered answer, the second time


def test_remembered_layouts_are_bounded(monkeypatch):
    monkeypatch.setattr(meta_module, "_COVERS_SIZE", 4)
    meta_module._COVERS.clear()
    metas = [TensorMeta.of(torch.zeros(n)) for n in range(1, 10)]
    assert all(m.covers_storage for m in metas)
    assert len(meta_module._COVERS) <= 4
    assert not TensorMeta.of(torch.zeros(10)[2:]).covers_storage
