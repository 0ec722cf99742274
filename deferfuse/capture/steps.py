"""Step boundaries: where a deferred program ends although nothing was read.

A loop that reads its loss every 50 steps left 50 steps pending before each read, and the read
compiled them as one program: a new signature per window, each compile slower and bigger than
the last window's (an MLP's 50-step window: ~6,750 ops, 30 s to compile, 3.5 GiB).  The user's
step is the natural bound of a program, so a program ends where a step ends, whenever the
user reads:

- **the end of an optimizer's ``step()``** (a global post hook, registered when deferfuse first
  pushes a mode): what is pending is computed there.  A training loop's steady state is then
  one program a step (two where a read inside the step computes the forward pass first),
  whatever its logging period.  Gradient accumulation keeps its micro-batches in the step's
  program: the step is the user's.
- **a loop with no optimizer** (an ODE integrator, a sampler, beam search) has no such hook.
  When the pending work passes ``program_nodes`` ops with no boundary, the recorder cuts there
  and takes the op it was recording as the loop's *anchor* (its place in the code and its op);
  from then on each time the anchor comes round again, at least ``program_nodes // 8`` ops
  later, the program ends after it (``Recorder.loop_came_round``).  Windows then start and end
  at the same place of the loop body, so their signatures repeat: one program per iteration,
  or per few iterations of a short body.

A ``with deferfuse.defer(span="block"):`` block is one program however many steps it holds,
for a user who wants a longer program on purpose (and ``torch.compile`` of a multi-step
function).  Under a default defer mode with the segment tier on (exec/segments.Segments), a
step's end also ends a segment, so the tier times and chooses per step.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Optional

import torch.optim.optimizer as torch_optimizer

from ..debugging.source import user_line_from

_install_lock = threading.Lock()
_installed = False
# modes.active_recorder, handed in by install (modes imports this module, so not the reverse)
_active_recorder: Optional[Callable[[], Any]] = None


def install(active_recorder: Callable[[], Any]) -> None:
    """Register the optimizer hook, once per process (called when deferfuse first pushes a mode,
    after capture/modules.py's hook, which must run first: it records the copies that make a
    step's new state plain)."""
    global _installed, _active_recorder
    if _installed:
        return
    with _install_lock:
        if not _installed:
            _active_recorder = active_recorder
            torch_optimizer.register_optimizer_step_post_hook(_step_ended)
            _installed = True


def _step_ended(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The optimizer step post-hook: a step of this thread's defer mode ended."""
    recorder = _active_recorder()
    if recorder is not None and recorder.active:
        # (the hook runs in torch's step wrapper: the place is the user's step() call)
        recorder.step_ended(user_line_from(sys._getframe(1)))
