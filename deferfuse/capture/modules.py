"""nn.Module parameters made under defer mode are real ``nn.Parameter``s.

``nn.Parameter(t)`` keeps the type of a tensor subclass: given a deferred tensor
(``nn.Parameter(torch.ones(n))`` in a norm layer's ``__init__``, run under a defer block or
``TORCHTPU_MODE=defer``), it returns that DeferredTensor marked as a parameter.  Such a
parameter has no memory of its own until computed, so code that re-points parameters at other
memory fails: ``Module._apply`` (``model.to(device)``, ``.half()``) assigns ``param.data``,
``load_state_dict`` copies into it, Hugging Face's ``Trainer`` does both before its first step.

A global parameter registration hook (torch's own ``register_module_parameter_registration_hook``)
swaps each deferred parameter, as a module registers it, for an ``nn.Parameter`` over real memory
whose contents are the deferred value, written by a recorded ``copy_``: nothing is computed at
registration, the write fuses with the rest of the block, and the memory is a plain tensor's
from the start.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from .tensor import DeferredTensor

_install_lock = threading.Lock()
_installed = False


def install() -> None:
    """Register the hook, once per process (called when deferfuse first pushes a mode)."""
    global _installed
    if _installed:
        return
    with _install_lock:
        if not _installed:
            torch.nn.modules.module.register_module_parameter_registration_hook(_real_parameter)
            _installed = True


def _real_parameter(module: torch.nn.Module, name: str, param: Optional[torch.Tensor]):
    """The hook: a real ``nn.Parameter`` in place of a deferred one (None keeps ``param``)."""
    if not isinstance(param, DeferredTensor):
        return None
    from .recorder import no_dispatch
    with no_dispatch():
        memory = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device=param.device)
    with torch.no_grad():
        # (recorded by the defer block on this thread; outside one, the deferred value computes)
        memory.copy_(param)
    return torch.nn.Parameter(memory, requires_grad=param.requires_grad)
