"""Memory the storage model cannot stand for: sparse, nested, quantized and mkldnn tensors, and
subclasses that dispatch their ops themselves.  An op touching one runs at once on torch's kernel.
"""

from __future__ import annotations

import torch

from .tensor import DeferredTensor


NO_STORAGE_MESSAGE = "Cannot access storage of"   # (c10's TensorImpl::throw_cannot_access_storage)
QUANTIZED_DTYPES = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})


class NoStorage(Exception):
    """A tensor argument or result has no storage to model (``opaque``): its op runs eagerly."""


# Per tensor subclass, whether it has a __torch_dispatch__ of its own (TwoTensor, the jagged
# NestedTensor, a user's wrapper): its ops must reach it.  nn.Parameter and other subclasses
# that only override Python methods are plain tensors to us.
_OWN_DISPATCH: dict[type, bool] = {}


def opaque(t: torch.Tensor) -> bool:
    """Whether the storage model cannot stand for ``t``'s memory: not dense and strided (sparse,
    mkldnn, nested, quantized: its values are not its storage's elements in its dtype), an
    efficient zero tensor (no memory at all: the zero tangents of ``torch.func.hessian``'s
    forward-over-reverse), a meta tensor (no memory either: ``model.to("meta")``, the
    prims ops of ``hessian``'s decompositions), a torch.func transform's wrapper, or a subclass
    that dispatches its ops itself.  DeferredTensors are
    never opaque."""
    cls = type(t)
    if cls is not torch.Tensor and cls is not DeferredTensor:
        own = _OWN_DISPATCH.get(cls)
        if own is None:
            own = _OWN_DISPATCH[cls] = not issubclass(cls, DeferredTensor) and \
                getattr(cls, "__torch_dispatch__", None) is not torch._C._disabled_torch_dispatch_impl
        if own:
            return True
    return t.layout is not torch.strided or t.is_nested or t.is_quantized or t._is_zerotensor() \
        or _functorch_wrapped(t)


# a torch.func transform's wrapper (its memory is the wrapped tensor's, at another level):
# jacfwd's forward-mode decompositions run ops on them below the transform
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def opaque_in(args: tuple, kwargs: dict) -> bool:
    """Whether an opaque tensor is among the arguments (a loop over them rather than
    ``tensors_in``, which builds a list: foreach ops pass hundreds)."""
    for group in (args, kwargs.values()):
        for a in group:
            if type(a) is DeferredTensor:
                continue
            if isinstance(a, torch.Tensor):
                if opaque(a):
                    return True
            elif isinstance(a, (list, tuple)):
                if opaque_in(a, {}):
                    return True
    return False
