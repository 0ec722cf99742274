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

``prepare()`` also tunes glibc's malloc for XLA's buffers (``malloc_tuning``): every execution
allocates its temporaries and results afresh, tens of MB for a training step, and glibc maps
blocks above its mmap threshold (adaptive, at most 32 MiB) straight from the kernel and unmaps
them on free, and trims its heap's top past the trim threshold.  Whether a step's buffers were
then reused or faulted in afresh depended on the heap's layout: the GPT step of
``bench.train_gpt`` touched ~96 MB of fresh pages (24k page faults, ~30 ms of a 110-140 ms
step) in some processes and none in others, the same code with one more model copy alive
flipping it.  With the mmap threshold at 256 MiB and the trim threshold at 1 GiB the buffers
come from the heap and stay there: no faults, in every process.  The price is that memory the
process frees stays mapped (its resident size does not shrink after a peak).  It is done once,
process-wide, not undone, and not at all where the user set the same thresholds (the
``MALLOC_*_`` variables or ``GLIBC_TUNABLES``) or where the C library is not glibc.
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Any

from .. import config
from ..stats import one_off
from .._lazy import lazy_import

jax = lazy_import("jax", globals(), "jax")

log = logging.getLogger("deferfuse")

_JAX_FLAG = "jax_cpu_enable_async_dispatch"
_MMAP_THRESHOLD = 256 << 20
_TRIM_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # (mallopt's parameter numbers, malloc.h)
_prepared = False
# this process is a forked child of one that had imported JAX, whose XLA may deadlock here: the
# engine replays graphs with torch's kernels instead (set by deferfuse/processes.py's fork handler)
forked_after_xla = False
# JAX warns at every os.fork() once its client exists ("... will likely lead to a deadlock"):
# silenced where deferfuse started that client (quiet_jax_fork_warning)
JAX_FORK_WARNING = r"os\.fork\(\) was called\. os\.fork\(\) is incompatible with multithreaded code"
quieted_fork_warning = False
malloc_tuned = False   # whether prepare() set malloc's thresholds in this process
_lock = threading.Lock()


def prepare() -> None:
    """Set JAX up for deferfuse, once per process, before its CPU client exists."""
    global _prepared
    if _prepared:
        return
    with _lock:   # (a second thread must not create the client while the first sets it up)
        if not _prepared:
            with one_off():   # (importing JAX: a one-off cost)
                _prepare()
            _prepared = True


def tune_malloc() -> bool:
    """Raise glibc malloc's mmap and trim thresholds (see the module docstring); whether it did."""
    global malloc_tuned
    if malloc_tuned:
        return True
    if config.user_tuned_malloc():
        return False   # the user chose the allocator's behaviour
    import platform
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        done = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1 \
            and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    except (OSError, AttributeError):
        return False
    malloc_tuned = done
    log.debug("deferfuse: malloc's mmap threshold %s MiB, trim threshold %s MiB: %s",
              _MMAP_THRESHOLD >> 20, _TRIM_THRESHOLD >> 20, "set" if done else "refused")
    return done


def release_free_memory() -> None:
    """Give the memory malloc holds free back to the system (glibc's malloc_trim), after a
    compile: with malloc_tuning, freed memory otherwise stays mapped, and XLA's compiler frees
    hundreds of MB (a GPT-2 training step's compile: 480 MB resident after it, against 46 MB
    once trimmed).  Nothing off glibc."""
    global _malloc_trim
    if _malloc_trim is None:
        _malloc_trim = False
        import platform
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            try:
                import ctypes
                _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
            except (OSError, AttributeError):
                pass
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None   # glibc's malloc_trim, False where there is none


def _prepare() -> None:
    if config.get("malloc_tuning"):
        tune_malloc()
    try:
        from jax._src import xla_bridge
        created = bool(xla_bridge._backends)
    except (ImportError, AttributeError):   # JAX's internals moved: keep its defaults
        return
    if not created:
        quiet_jax_fork_warning()
        quiet_backend_probe_logs()
    if config.get("xla_cpu_async_dispatch") or config.jax_flag_in_environment(_JAX_FLAG):
        return
    if created:
        log.info("deferfuse: JAX's CPU client was created before deferfuse first used it, so "
                 "its asynchronous dispatch stays on (each flush pays a thread hand-off); set "
                 "%s=0 in the environment to turn it off for the whole process.", _JAX_FLAG.upper())
        return
    jax.config.update(_JAX_FLAG, False)


def quiet_jax_fork_warning() -> None:
    """Silence JAX's warning at each ``os.fork()`` when deferfuse starts JAX's client itself.

    The warning is for a child that goes on using XLA, whose threads did not survive the fork.
    deferfuse never does (deferfuse/processes.py: a child forked after JAX started runs defer
    blocks at once and computes inherited pending tensors with torch's kernels; a ``jax_op``
    called there warns for itself, naming the op), so for a program whose only JAX is
    deferfuse's, a DataLoader with workers would print a deadlock warning that strict does not
    and that does not apply.  Where the program had started JAX's client before deferfuse first
    used it, the warning stays.
    """
    global quieted_fork_warning
    if not quieted_fork_warning:
        warnings.filterwarnings("ignore", message=JAX_FORK_WARNING, category=RuntimeWarning)
        quieted_fork_warning = True


class _BackendProbeFilter(logging.Filter):
    """Drops JAX's INFO records of the backends it probed and could not start ("Unable to
    initialize backend 'tpu': ... libtpu.so ...") when deferfuse started JAX's client: a script
    with ``logging.basicConfig(level=logging.INFO)`` printed them under defer, where strict never
    imports JAX.  Errors and warnings pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.INFO
                    and str(record.msg).startswith("Unable to initialize backend"))


def quiet_backend_probe_logs() -> None:
    jax_logger = logging.getLogger("jax._src.xla_bridge")
    if not any(isinstance(f, _BackendProbeFilter) for f in jax_logger.filters):
        jax_logger.addFilter(_BackendProbeFilter())
