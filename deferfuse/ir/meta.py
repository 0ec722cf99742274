"""TensorMeta: what a deferred value carries instead of data."""

from __future__ import annotations

from typing import NamedTuple

import torch


class TensorMeta(NamedTuple):
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device
    storage_numel: int  # elements in the storage this tensor would own or view

    @staticmethod
    def of(t: torch.Tensor, device: torch.device | None = None) -> "TensorMeta":
        storage_numel = torch._C.TensorBase.untyped_storage(t).nbytes() // t.element_size() if t.element_size() else 0
        return TensorMeta(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype,
                          t.device if device is None else device, storage_numel)

    def to_meta_tensor(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    @property
    def is_dense(self) -> bool:
        """Non-overlapping and dense: a permutation of a contiguous layout."""
        dims = sorted((s, n) for n, s in zip(self.shape, self.stride) if n != 1)
        expected = 1
        for stride, size in dims:
            if stride != expected:
                return False
            expected *= size
        return True

    @property
    def covers_storage(self) -> bool:
        """Dense, starting at offset 0, and spanning exactly the whole storage.  Asked for every
        write into a storage (each in-place op), and working it out sorts the strides (~1.6 us),
        where looking it up by the metadata costs ~0.15 us: the few layouts a program uses are
        remembered."""
        covers = _COVERS.get(self)
        if covers is None:
            covers = self.offset == 0 and self.numel == self.storage_numel and self.is_dense
            if len(_COVERS) >= _COVERS_SIZE:
                _COVERS.clear()
            _COVERS[self] = covers
        return covers


_COVERS: dict[TensorMeta, bool] = {}
_COVERS_SIZE = 4096
