"""The host kernels: torch's own CPU matrix products as XLA FFI targets, built on first use.

On the CPU, XLA's own dots run the products of a training step slower than torch's (MKL,
oneDNN) and copy transposed operands row-major first (docs/performance.md); convolutions too
are torch's (oneDNN) here.  ``host_kernels.cc``
holds XLA FFI handlers that call torch's CPU kernels on XLA's buffers; this module compiles it,
loads it and registers its handlers with JAX (``jax.ffi.register_ffi_target``, platform "cpu"),
so the lowerings (lower/host_products.py) can call them with ``jax.ffi.ffi_call`` inside one
XLA computation, as XLA on a GPU calls cuBLAS.

**Build.**  With the C++ compiler (``CXX``, else ``g++``) against the headers and libraries of
the torch and jaxlib this process imported: by ``make install`` (``python -m deferfuse.native``)
into the package's own folder (``deferfuse/native/build/``), where every process finds it
whatever its cache folder; else at first use, into the cache folder
(``<cache_dir>/native/``).  The library is named by a hash of the source, the compile command
and the versions of torch and jaxlib (``host_kernels-<fingerprint>.so``), so another torch or
jaxlib builds its own.
It is written to a temporary file and renamed: two processes building at once each rename a
whole library, and a reader never loads half of one.  Like the disk cache's entries it is code
this process runs, so the same rules hold (exec/cachefolder.py): the folder 0700, the file
0600, and a folder or file others could have written is not used (the library is then built
in a private temporary folder for this process, unless ``cache_trust_shared``).  With the disk
cache off (``cache_dir`` empty) it is built per process in a temporary folder.

**Without it.**  No compiler, a failed build or a failed load: one warning, the reason in
``status()``, and the products lower to XLA's own dots (each counted in
``stats()["host_kernel_fallbacks"]``).  ``host_kernels=False`` (``DEFERFUSE_HOST_KERNELS=0``)
turns it off without a warning.  Only XLA's CPU platform has these targets: a program compiled
for another platform keeps XLA's library calls (``use_on``).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from typing import Callable, Optional, TypeVar

from .. import config
from ..exec import cachefolder
from .._lazy import lazy_import

jax = lazy_import("jax", globals(), "jax")

log = logging.getLogger("deferfuse")

T = TypeVar("T")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_kernels.cc")
# where make install puts the library: beside its source, as trusted as the package's own code
PACKAGED = os.path.join(os.path.dirname(SOURCE), "build")
# aten op -> the FFI target of its handler (the symbol host_kernels.cc exports under that name)
TARGETS = {"mm": "deferfuse_host_mm", "bmm": "deferfuse_host_bmm", "addmm": "deferfuse_host_addmm",
           "baddbmm": "deferfuse_host_baddbmm", "convolution": "deferfuse_host_convolution",
           "convolution_backward": "deferfuse_host_convolution_backward",
           "_scaled_dot_product_flash_attention_for_cpu": "deferfuse_host_flash_attention",
           "_scaled_dot_product_flash_attention_for_cpu_backward": "deferfuse_host_flash_attention_backward"}
TARGET_PREFIX = "deferfuse_host_"   # (every target's name starts so)
PLATFORM = "cpu"
_BUILD_SECONDS = 600      # a compile that takes longer than this has hung

_lock = threading.Lock()
_state: dict[str, Optional[str]] = {}    # "library": its path once registered; "error": why not
_temporary: list[str] = []               # private folders made for this process's builds
_registered: list = []                   # (path, ctypes handle) of the library whose handlers JAX holds


def _torch_paths() -> tuple[list[str], list[str]]:
    """torch's C++ headers and libraries, where ``torch.utils.cpp_extension`` finds them
    (without importing it: it imports setuptools, ~50 ms, and the disk cache's key asks)."""
    import torch
    root = os.path.dirname(os.path.abspath(torch.__file__))
    include = os.path.join(root, "include")
    return [include, os.path.join(include, "torch", "csrc", "api", "include")], [os.path.join(root, "lib")]


@functools.cache
def compile_command() -> tuple[str, ...]:
    """The compiler's command line, less its output file: part of the library's name."""
    import torch
    includes, libraries = _torch_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    command = [config.cxx_compiler(), "-O2", "-std=c++20", "-shared", "-fPIC", "-w",
               f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I" + jax.ffi.include_dir()]
    command += ["-I" + path for path in includes]
    command += [SOURCE]
    for path in libraries:
        command += ["-L" + path, "-Wl,-rpath," + path]
    # (-ldl: dlsym, in libc itself from glibc 2.34, in libdl before)
    return tuple(command + ["-ltorch_cpu", "-lc10", "-ldl"])


@functools.cache
def fingerprint() -> str:
    """A hash of what the library is built from: the source, the command, torch's and jaxlib's
    versions.  The disk cache keys executables by it (exec/diskcache.py)."""
    import jaxlib.version
    import torch
    digest = hashlib.sha256()
    with open(SOURCE, "rb") as f:
        digest.update(f.read())
    for part in compile_command() + (torch.__version__, jaxlib.version.__version__):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:16]


def _private_folder() -> str:
    folder = tempfile.mkdtemp(prefix="deferfuse-native-")     # (0700)
    if not _temporary:
        atexit.register(lambda: [shutil.rmtree(f, ignore_errors=True) for f in _temporary])
    _temporary.append(folder)
    return folder


def _folder() -> str:
    """Where the library is kept: the cache folder's ``native/``, when it is this user's own."""
    root = config.get("cache_dir")
    if not root:
        return _private_folder()
    folder = os.path.join(os.path.expanduser(root), "native")
    try:
        cachefolder.make_folders(folder)
    except OSError as exc:
        log.info("deferfuse: host kernels: cannot create %s (%s): building in a private folder", folder, exc)
        return _private_folder()
    reason = cachefolder.untrusted_reason(folder)
    if reason is not None and not config.get("cache_trust_shared"):
        log.info("deferfuse: host kernels: not using %s (%s): building in a private folder", folder, reason)
        return _private_folder()
    return folder


def _build(path: str) -> None:
    """Compile the library to ``path``: into a temporary file of its folder, then renamed."""
    command = compile_command()
    if shutil.which(command[0]) is None:
        raise RuntimeError(f"no C++ compiler {command[0]!r} on PATH (set CXX to use another)")
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run(list(command) + ["-o", tmp], capture_output=True, text=True,
                              timeout=_BUILD_SECONDS)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line]
            raise RuntimeError(f"{command[0]} failed (exit {done.returncode}) on {SOURCE}: "
                               f"{(errors or done.stderr.splitlines() or [''])[0][:500]}")
        os.chmod(tmp, cachefolder.FILE_MODE)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(path: str) -> None:
    """dlopen the library and register its handlers for XLA's CPU platform."""
    if not config.get("cache_trust_shared"):
        reason = cachefolder.untrusted_file(path, os.stat(path))
        if reason is not None:
            raise RuntimeError(f"not loading {path}: {reason}")
    library = ctypes.CDLL(path)
    for target in TARGETS.values():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, target)),
                                    platform=PLATFORM)
    _registered.append((path, library))    # (kept: the handlers live in it)


def _load_or_build() -> str:
    if _registered:
        # (registered once per process: JAX's registry keeps the first handlers of a name)
        return _registered[0][0]
    import torch   # noqa: F401 - libtorch_cpu is loaded before the library that links to it
    name = f"host_kernels-{fingerprint()}.so"
    packaged = os.path.join(PACKAGED, name)
    if os.path.exists(packaged):
        _load(packaged)
        return packaged
    path = os.path.join(_folder(), name)
    if not os.path.exists(path):
        _build(path)
    try:
        _load(path)
    except OSError:
        # a library that does not load (truncated by a full disk, left by a crash): built again
        _build(path)
        _load(path)
    return path


def ensure() -> bool:
    """Whether the host kernels are registered in this process: built and loaded at the first
    call (when the ``host_kernels`` setting is on), with one warning if that fails."""
    if "library" in _state:
        return _state["library"] is not None
    if not config.get("host_kernels"):
        return False
    with _lock:
        if "library" not in _state:
            try:
                _state["library"] = _load_or_build()
                _state["error"] = None
            except Exception as exc:  # noqa: BLE001 - any failure leaves XLA's dots, said once
                _state["library"] = None
                _state["error"] = f"{type(exc).__name__}: {exc}"
                warnings.warn(f"deferfuse: host kernels unavailable ({_state['error']}); matrix "
                              f"products run as XLA's own dots (slower on the CPU; each counted "
                              f"in stats()['host_kernel_fallbacks']).  DEFERFUSE_HOST_KERNELS=0 "
                              f"turns them off without this warning.", RuntimeWarning, stacklevel=2)
    return _state["library"] is not None


def use_on(platform: str) -> bool:
    """Whether a product in a program compiled for ``platform`` (JAX's name: "cpu", "cuda",
    "rocm", "tpu") calls the host kernels: only on the CPU, and only where they are registered.
    Other platforms keep XLA's own library calls (cuBLAS, cuDNN)."""
    return platform == PLATFORM and config.get("host_kernels") and ensure()


def guest_calls() -> int:
    """How many host-kernel calls this process ran on a thread made for the call, because XLA
    called them on a thread of its own pool while no thread served (host_kernels.cc, ``Run``):
    0 before the library is loaded."""
    return _counter("deferfuse_host_guest_calls")


def _counter(name: str) -> int:
    if not _registered:
        return 0
    function = getattr(_registered[0][1], name)
    function.restype = ctypes.c_int64
    return int(function())


def served_calls() -> int:
    """How many host-kernel calls XLA made on one of its own threads and the thread that runs
    the program (the user's) served (``served``): 0 before the library is loaded."""
    return _counter("deferfuse_host_served_calls")


def team_releases() -> int:
    """How many times the serving thread released its OpenMP team because no kernel followed
    (host_kernels.cc, "Releasing the serving team's workers"): 0 before the library is loaded."""
    return _counter("deferfuse_host_team_releases")


def kernel_seconds() -> float:
    """Seconds this process has spent inside the host kernels, on any thread."""
    return _counter("deferfuse_host_kernel_ns") * 1e-9


def handover_seconds() -> float:
    """Seconds that handing served calls over cost: from a call's request (or the end of the
    kernel the serving thread was running then) to its kernel's start, and from its kernel's
    end to the requesting thread's waking.  A request that waits while another kernel runs
    does not count that wait: the serving thread was busy."""
    return _counter("deferfuse_host_handover_ns") * 1e-9


def counters() -> tuple[float, int, int, float]:
    """(``kernel_seconds()``, ``served_calls()``, ``guest_calls()``, ``handover_seconds()``) so
    far: the benchmarks take their differences around the work they time."""
    return kernel_seconds(), served_calls(), guest_calls(), handover_seconds()


class _Driver:
    """The thread that runs programs for ``served``: one per process, made at first use."""

    def __init__(self) -> None:
        self.jobs: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="deferfuse-xla", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            run, box, end = self.jobs.get()
            try:
                box.append((True, run()))
            except BaseException as exc:  # noqa: BLE001 - handed to the serving thread, raised there
                box.append((False, exc))
            finally:
                # (nothing of the job stays on this thread once it is handed back: its results
                # and inputs would live until the next job came)
                del run, box
                end()


_serving = threading.Lock()     # held by the one thread that serves
_release_set: list = [None]     # host_kernel_team_release_us as last handed to the library
_driver: list[_Driver] = []


def served(run: Callable[[], T]) -> T:
    """``run()`` (a call that runs an XLA program calling the host kernels, and waits for it),
    with this thread serving the kernels: ``run`` goes to a driver thread, and the kernels the
    program calls, on whichever of XLA's threads, run here, on this thread's OpenMP team, as
    strict's kernels do (host_kernels.cc, "Serving").  Where the library is not loaded, or
    another thread is serving, ``run()`` runs here as it is."""
    if not _registered or not _serving.acquire(blocking=False):
        return run()
    try:
        library = _registered[0][1]
        if not _driver:
            _driver.append(_Driver())
        box: list = []
        release = config.get("host_kernel_team_release_us")
        if _release_set[0] != release:
            library.deferfuse_host_set_release_after_us(ctypes.c_int64(release))
            _release_set[0] = release
        library.deferfuse_host_serve_begin()
        _driver[0].jobs.put((run, box, library.deferfuse_host_serve_end))
        library.deferfuse_host_serve()     # (ctypes lets go of the GIL while it serves)
    finally:
        _serving.release()
    ok, value = box[0]
    if not ok:
        raise value
    return value


def after_fork_in_child() -> None:
    """In a forked child the driver thread is gone (the library's own serving state is reset by
    its pthread_atfork handler)."""
    global _serving
    _driver.clear()
    _serving = threading.Lock()


def status() -> dict[str, Optional[str]]:
    """The library's path once registered, or why it is not (``error``); empty before first use."""
    return dict(_state)


def key() -> str:
    """What the disk cache's key holds of the host kernels: the library's fingerprint where a
    program compiled here calls them, "off" where its products are XLA's dots.  It builds
    nothing: a process whose programs have no products never needs the library, and one whose
    build fails afterwards keys its later programs "off" (an entry found meanwhile that calls
    the kernels is refused by the disk cache's prepare_targets, which needs them loaded)."""
    import jax as jax_module
    if not config.get("host_kernels") or jax_module.default_backend() != PLATFORM \
            or ("library" in _state and _state["library"] is None):
        return "off"
    return fingerprint()


def clear() -> None:
    """Forget this process's attempt (tests): the next ``ensure()`` tries again.  Handlers
    registered with JAX stay registered, and are used again."""
    with _lock:
        _state.clear()


def build_packaged() -> Optional[str]:
    """Build the library into the package's folder (``make install``), where every process
    finds it; None where that folder cannot be written (an installed package: the library is
    then built at first use, in the cache folder)."""
    path = os.path.join(PACKAGED, f"host_kernels-{fingerprint()}.so")
    try:
        os.makedirs(PACKAGED, exist_ok=True)
        if not os.access(PACKAGED, os.W_OK):
            return None
    except OSError:
        return None
    if not os.path.exists(path):
        _build(path)
    os.chmod(path, 0o644)   # (read by whoever uses the package, as its Python files are)
    return path


def main() -> int:
    """``python -m deferfuse.native``: build the library into the package's folder (else the
    cache folder) and load it."""
    if config.get("host_kernels"):
        try:
            build_packaged()
        except Exception as exc:  # noqa: BLE001 - said by ensure() below, which tries again
            log.info("deferfuse: host kernels: building in the package failed (%s)", exc)
    if ensure():
        print(f"deferfuse host kernels: {_state['library']}")
        return 0
    print(f"deferfuse host kernels unavailable: {_state.get('error') or 'turned off (host_kernels)'}",
          file=sys.stderr)
    return 1

