"""JAX's CPU client, set up for the way deferfuse calls it.

deferfuse waits for every XLA computation it starts: the results go back to torch, which must
not see unfinished buffers.  JAX's CPU client dispatches computations asynchronously by default,
so each flush handed its work to another thread and then waited for it; on this 2-core VM,
after the few hundred microseconds of Python that recording and planning take, that hand-off
cost ~0.1 ms per call (a thread wake-up before the work, another after), more than a small
fused computation itself.  With async dispatch off, XLA runs a computation on the calling
thread (its intra-op parallelism, for dots and large fusions, is unchanged).

The setting belongs to JAX's CPU client, which JAX creates once per process: ``prepare()``
turns it off before deferfuse first touches JAX's backend, unless the user chose otherwise
(deferfuse's ``xla_cpu_async_dispatch`` setting, or JAX's own ``JAX_CPU_ENABLE_ASYNC_DISPATCH``
variable), and leaves an already created client as it is.
"""

from __future__ import annotations

import logging
import os
import threading

from .. import config
from .._lazy import lazy_import

jax = lazy_import("jax", globals(), "jax")

log = logging.getLogger("deferfuse")

_JAX_FLAG = "jax_cpu_enable_async_dispatch"
_prepared = False
_lock = threading.Lock()


def prepare() -> None:
    """Set JAX up for deferfuse, once per process, before its CPU client exists."""
    global _prepared
    if _prepared:
        return
    with _lock:   # (a second thread must not create the client while the first sets it up)
        if not _prepared:
            _prepare()
            _prepared = True


def _prepare() -> None:
    if config.get("xla_cpu_async_dispatch") or _JAX_FLAG.upper() in os.environ:
        return
    try:
        from jax._src import xla_bridge
        created = bool(xla_bridge._backends)
    except (ImportError, AttributeError):   # JAX's internals moved: keep its default
        return
    if created:
        log.info("deferfuse: JAX's CPU client was created before deferfuse first used it, so "
                 "its asynchronous dispatch stays on (each flush pays a thread hand-off); set "
                 "%s=0 in the environment to turn it off for the whole process.", _JAX_FLAG.upper())
        return
    jax.config.update(_JAX_FLAG, False)

