"""Parameters, buffers and optimizer state made under defer mode are plain tensors.

``nn.Parameter(t)`` keeps the type of a tensor subclass: given a deferred tensor
(``nn.Parameter(torch.ones(n))`` in a norm layer's ``__init__``, run under a defer block or
``TORCHTPU_MODE=defer``), it returns that DeferredTensor marked as a parameter.  Such a
parameter has no memory of its own until computed, so code that re-points parameters at other
memory fails: ``Module._apply`` (``model.to(device)``, ``.half()``) assigns ``param.data``,
``load_state_dict`` copies into it, Hugging Face's ``Trainer`` does both before its first step.

Optimizer state has the other cost of a long-lived deferred tensor: AdamW's ``exp_avg`` made by
``zeros_like`` in a deferred first step stays a DeferredTensor for good, and once the block
tier runs the steps at once (as strict), every op on it goes through the wrapper's Python
dispatch: the zoo's ViT, Swin and ResNet steps ran 6-14% slower at once than strict.

So each such tensor, where it is kept, is swapped for a plain one over real memory whose
contents are the deferred value, written by a recorded ``copy_`` (nothing is computed; the write
fuses with the rest of the block): a parameter as ``nn.Parameter`` is made (its ``__new__``,
wrapped: ``copy.deepcopy`` of a module, which ``nn.TransformerEncoder`` does to its layer and an
EMA model to the whole network, makes ``nn.Parameter(p.data.clone())`` and puts it straight into
the copy's ``_parameters``, past any registration hook), a buffer as its module registers it
(``register_module_buffer_registration_hook``), optimizer state after each step
(``register_optimizer_step_post_hook``; each tensor once, when first made).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch
import torch.optim.optimizer as torch_optimizer

from .dispatch_keys import no_dispatch
from .tensor import DeferredTensor

_install_lock = threading.Lock()
_installed = False
# modes.active_recorder, handed in by install (modes imports this module, so not the reverse)
_active_recorder: Optional[Callable[[], Any]] = None


def install(active_recorder: Callable[[], Any]) -> None:
    """Register the hook, once per process (called when deferfuse first pushes a mode, with the
    function that gives this thread's active recorder or None)."""
    global _installed, _active_recorder
    if _installed:
        return
    with _install_lock:
        if not _installed:
            _active_recorder = active_recorder
            original_new = torch.nn.Parameter.__new__

            def parameter_new(cls, data=None, requires_grad=True):
                if type(data) is DeferredTensor:
                    data = _plain(data)
                return original_new(cls, data, requires_grad)
            torch.nn.Parameter.__new__ = staticmethod(parameter_new)
            torch.nn.modules.module.register_module_buffer_registration_hook(_real_buffer)
            torch_optimizer.register_optimizer_step_post_hook(_plain_state)
            _installed = True


def _plain(value: DeferredTensor) -> torch.Tensor:
    """A plain tensor over new memory, laid out as ``value``, that a recorded copy fills."""
    with no_dispatch():
        memory = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    with torch.no_grad():
        # (recorded by the defer block on this thread; outside one, the deferred value computes)
        memory.copy_(value)
    return memory


def _real_buffer(module: torch.nn.Module, name: str, buffer: Optional[torch.Tensor]):
    """The buffer hook (a BatchNorm's running statistics made under defer)."""
    if not isinstance(buffer, DeferredTensor) or buffer.requires_grad:
        return None
    return _plain(buffer)


def _plain_state(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """The optimizer step post-hook: the state tensors this step made, plain.  Only a step run
    under defer makes deferred state, so a step run otherwise (strict, or a block run at once)
    does not walk the state."""
    recorder = _active_recorder()
    if recorder is None or recorder.at_once_segment:
        return
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, DeferredTensor) and not value.requires_grad:
                state[key] = _plain(value)
