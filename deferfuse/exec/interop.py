"""torch <-> JAX through DLPack.  A crossing that had to copy is counted, never hidden."""

from __future__ import annotations

import weakref

import torch

from ..stats import STATS
from .._lazy import lazy_import
from . import backend

jax = lazy_import("jax", globals(), "jax")

# JAX arrays over the memory of torch tensors, by id(tensor): (weak reference to the tensor,
# data pointer, shape, strides, array).  A user tensor's storage enters every flush that reads it
# (an optimizer's parameters, each step), and importing it through DLPack costs ~50 us; the view
# stays valid while the tensor lives and still points at the same memory, laid out the same way.
# The array reads whatever the memory holds when a computation runs (it is a view, not a copy),
# which is what a graph input means here: the flush reads the tensor as it is now.
_VIEWS: dict[int, tuple] = {}

# (torch's own method: capture/patches.py's READ_PATCHES wraps Tensor.data_ptr while defer blocks write plain tensors)
data_ptr = _data_ptr = torch._C.TensorBase.data_ptr


def _forget(key: int):
    return lambda _ref: _VIEWS.pop(key, None)


# jax.dlpack.from_dlpack and jax.Array.__dlpack__ spend most of their time (~25 of ~30 us, and
# ~9 of ~10) in Python around one jaxlib call each: device and stream lookups, sharding checks,
# a no-op asarray.  For CPU arrays the two calls are made directly; with a jaxlib whose internals
# differ (checked once, on a probe), the public functions are used.
_DIRECT: list = []   # [(import, export)] once resolved, [None] where the public path is used


def _direct_crossings():
    if not _DIRECT:
        backend.prepare()
        try:
            from jax._src.lib import _jax, jaxlib_extension_version
            device = jax.devices("cpu")[0]
            if jaxlib_extension_version < 467:
                raise ImportError("older DLPack import signature")
            cpu = 1   # DLDeviceType.kDLCPU
            to_capsule = torch._C._to_dlpack

            def import_(t: torch.Tensor):
                # (torch's C export, which Tensor.__dlpack__ calls for a CPU tensor after
                # Python-level checks that to_jax has made: ~1.7 of its ~4.5 us)
                return _jax.dlpack_managed_tensor_to_buffer(to_capsule(t), device, None, None, cpu)

            def export(a) -> torch.Tensor:
                # (torch.from_dlpack of a capsule only forwards it to this, after a failed
                # attribute lookup)
                return torch._C._from_dlpack(_jax.buffer_to_dlpack_managed_tensor(a, stream=None))
            probe = torch.arange(4, dtype=torch.float32)
            imported = import_(probe)
            back = export(imported)
            if imported.unsafe_buffer_pointer() != probe.data_ptr() or back.data_ptr() != probe.data_ptr():
                raise ImportError("a direct DLPack crossing copied")
            _DIRECT.append((import_, export))
        except Exception:  # noqa: BLE001 - any difference in JAX's internals: the public path
            _DIRECT.append(None)
    return _DIRECT[0]


def _from_dlpack(t: torch.Tensor):
    direct = _direct_crossings() if t.device.type == "cpu" else None
    return jax.dlpack.from_dlpack(t) if direct is None else direct[0](t)


def to_jax(t: torch.Tensor) -> jax.Array:
    cached = _VIEWS.get(id(t))
    if cached is not None and cached[0]() is t and cached[1] == _data_ptr(t) \
            and cached[2] == t.shape and cached[3] == t.stride():
        return cached[4]
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        STATS.dlpack_copies += 1
        t = t.contiguous()
    # (through an alias: DLPack holds on to the tensor it exports, and torch keeps a tensor's
    # Python object alive while C++ holds it, so exporting ``t`` itself would never let the
    # cache entry go)
    arr = _from_dlpack(t.detach())
    if not is_view(arr, t):
        STATS.dlpack_copies += 1
        return arr
    _VIEWS[id(t)] = (weakref.ref(t, _forget(id(t))), _data_ptr(t), t.shape, t.stride(), arr)
    return arr


def is_view(array: jax.Array, t: torch.Tensor) -> bool:
    """Whether ``array`` (from ``to_jax(t)``) reads ``t``'s memory, rather than a copy of it."""
    return t.numel() == 0 or array.unsafe_buffer_pointer() == _data_ptr(t)


def to_torch(a: jax.Array) -> torch.Tensor:
    direct = _direct_crossings() if a.platform() == "cpu" else None
    return torch.from_dlpack(a) if direct is None else direct[1](a)
