"""Compiled executables on disk, so a second process running the same program compiles nothing.

**Key.**  A SHA-256 of the structural signature's text and of everything else the executable
depends on (``key_inputs()``): the entry format, deferfuse's version and a fingerprint of its
sources (a changed lowering must not load an old executable), the versions of jax, jaxlib and
torch, the XLA platform, its version, device kind and device count, the host CPU's features (an
executable compiled for AVX-512 dies on a machine without it) and XLA_FLAGS.

**Entry.**  ``<folder>/<2 hex>/<key>.xla``: a magic line, a one-line JSON header (format, key,
payload size and SHA-256, the custom-call targets the executable calls; at most 1 MiB), then the
payload: a line of JSON metadata (its inputs, results, runtime scalars and runtime checks) and
the executable as XLA serializes it (exec/entryformat.py).  The targets include deferfuse's host
kernels (native/hostkernels.py) where its products call them; such an entry is loaded only
where they are registered first (``prepare_targets``).  Nothing in it is unpickled: only
XLA's deserializer reads its bytes.  An entry is checked against its header before anything
reads the payload, so a truncated or corrupted file never reaches XLA.  Written 0600 to a
temporary file and renamed: readers never see half an entry.

**Trust.**  An entry is code this process runs, so the cache uses a folder only when no one but
this user and root could have written in it (exec/cachefolder.py): the folder and the folders
above it, judged once per process before its first use, and each file read.  A folder others
can write turns the cache off for the process, with one warning, unless ``cache_trust_shared``
is on.  The folders deferfuse creates are 0700 and its files 0600, whatever the umask; the
default folder, which an older deferfuse created 0755, is made private at its first use.

**Load.**  Deserializing skips JAX's lowering, and lowering is where JAX readies what some custom
calls need; ``prepare_targets()`` does that instead, or refuses the entry (see its docstring).

**Abuse.**  Anything wrong with an entry or the folder is counted in
``stats()["disk_cache_errors"]``, logged once per process per kind (``ErrorKind``), and the
computation is compiled again: never a crash.  A folder that cannot be created turns the cache
off for the process.

**Bound.**  After a write, when the folder exceeds ``cache_max_bytes``, the least recently used
entries (by mtime: a hit touches its entry) are deleted down to 90% of it.  To keep a write
cheap the folder is walked only at a process's first write to it and when the process's running
total (its last walk plus its own writes since) passes the bound; what other processes wrote
since is seen at the next walk, so the folder can run over by that much until then.

**Block choices.**  The block tier's choice for a ``with`` line (exec/blocks.py) is kept in
``<folder>/blocks/<key>.json``, so that a later process starts from it instead of measuring
again (``load_choice``/``save_choice``): a small JSON record, keyed by the place's text and by
``host_key_inputs()`` and the settings (nothing that needs JAX: a block that runs at once never
imports it).  Bad or missing records are ignored (counted as errors when unreadable).

JAX's global configuration (including its own compilation cache) is left untouched.
"""

from __future__ import annotations

import collections
import enum
import functools
import hashlib
import json
import logging
import os
import platform
import re
import tempfile
import threading
import time
from typing import Any, Iterable, Optional

import torch

from .. import config, version
from ..native import hostkernels
from ..stats import STATS
from .._lazy import lazy_import
from . import cachefolder, entryformat

jax = lazy_import("jax", globals(), "jax")

log = logging.getLogger("deferfuse")

_FORMAT = 3
_MAGIC = b"deferfuse-executable\n"
_HEADER_LIMIT = 1 << 20       # bytes a header line may take
_SUFFIX = ".xla"
_LOW_WATER = 0.9              # eviction deletes down to this share of cache_max_bytes
_STALE_TMP_SECONDS = 3600.0   # a temporary file this old was left by a process that died writing


class ErrorKind(enum.Enum):
    """What went wrong with the disk cache; each kind is logged once per process."""
    UNREADABLE = "an unreadable entry (truncated, corrupted, or not an entry at all)"
    OTHER_FORMAT = "an entry whose header names another format or key"
    UNLOADABLE = "an entry that needs a custom-call target this process cannot provide"
    DESERIALIZE = "an entry that XLA refused to load"
    SERIALIZE = "an executable that could not be serialized"
    WRITE = "a failed write (read-only folder, full disk)"
    FOLDER = "a cache folder that cannot be created (the disk cache is off for this process)"
    UNTRUSTED = "a cache folder or entry that others could have written"
    EVICT = "a failed eviction"


_LOCK = threading.RLock()
_WARNED: set[ErrorKind] = set()
_FOLDER_OFF: set[str] = set()      # folders not created, or not trusted: the cache is off there
_TRUSTED: set[str] = set()         # folders judged (once they exist) and used
_USAGE: dict[str, int] = {}        # folder -> bytes at its last walk plus this process's writes since
_COUNTS: collections.Counter[str] = collections.Counter()


def counts() -> dict[str, int]:
    """This process's disk cache counts since it started (or since ``clear()``); unlike
    ``stats()`` they survive ``reset_stats()``.  ``hits``, ``misses``, ``errors``, ``evicted``,
    and for every compiled executable offered to ``save()`` exactly one of ``writes`` and
    ``not_saved``: their sum is how many executables this process compiled with the cache on."""
    with _LOCK:
        return {name: _COUNTS[name] for name in
                ("hits", "misses", "writes", "not_saved", "errors", "evicted")}


def clear() -> None:
    """Forget this process's disk cache state: counts, warnings given, folder sizes, folders
    judged and turned off.  The entries on disk stay."""
    with _LOCK:
        _COUNTS.clear()
        _WARNED.clear()
        _FOLDER_OFF.clear()
        _TRUSTED.clear()
        _USAGE.clear()


def _error(kind: ErrorKind, message: str, *args: Any) -> None:
    with _LOCK:
        STATS.disk_cache_errors += 1
        _COUNTS["errors"] += 1
        first = kind not in _WARNED
        _WARNED.add(kind)
    if first:
        log.warning("deferfuse: disk cache: " + message + " (logged once per process; every such "
                    "case is counted in stats()['disk_cache_errors'])", *args)


def cache_dir() -> Optional[str]:
    """The cache folder, or None when the disk cache is off (DEFERFUSE_CACHE_DIR="", a folder
    this process could not create, or one others could write: see ``_trusted``)."""
    path = config.get("cache_dir")
    if path is None or path == "":
        return None
    path = os.path.expanduser(path)
    if path in _FOLDER_OFF:
        return None
    return path if _trusted(path) else None


def default_folder() -> str:
    """The cache folder when none is set (``cache_dir``'s default)."""
    return os.path.expanduser(config.settings()["cache_dir"].default)


def _trusted(folder: str) -> bool:
    """Whether the cache may read and write ``folder``: judged at its first use in this process
    (until it exists, by the folders above it: again once created).  The default folder, if
    its group or others have any access to it, is made private first."""
    if folder in _TRUSTED:
        return True
    shared = config.get("cache_trust_shared")
    if not shared and cachefolder.is_open(folder) \
            and os.path.realpath(folder) == os.path.realpath(default_folder()):
        folders, files = cachefolder.tighten(folder)
        log.info("deferfuse: disk cache: made %s private (%d folders now 0700, %d files 0600): "
                 "its entries are code this process runs", folder, folders, files)
    reason = cachefolder.untrusted_reason(folder)
    if reason is not None and not shared:
        with _LOCK:
            first = folder not in _FOLDER_OFF     # (another thread may have judged it meanwhile)
            _FOLDER_OFF.add(folder)
        if first:
            _error(ErrorKind.UNTRUSTED, "not using the cache folder %s: %s, so someone else could "
                   "put code there that this process would run; the disk cache is off for this "
                   "process.  Make the folder named yours and private (chown, chmod 700), use "
                   "another (leave DEFERFUSE_CACHE_DIR unset for the default, %s), or set "
                   "DEFERFUSE_CACHE_TRUST_SHARED=1 if everyone who can write it is trusted",
                   folder, reason, default_folder())
        return False
    if reason is not None:
        log.info("deferfuse: disk cache: using %s although %s (cache_trust_shared)", folder, reason)
    if os.path.isdir(folder):
        with _LOCK:
            _TRUSTED.add(folder)
    return True


def _modes(folder: str) -> tuple[int, int]:
    """The modes of the folders and files written in ``folder``: private, or under
    cache_trust_shared, open as ``folder`` is (so that its group can read what one wrote)."""
    if not config.get("cache_trust_shared"):
        return cachefolder.FOLDER_MODE, cachefolder.FILE_MODE
    try:
        mode = os.stat(folder).st_mode
    except OSError:
        return cachefolder.FOLDER_MODE, cachefolder.FILE_MODE
    return (mode & 0o2777) | cachefolder.FOLDER_MODE, (mode & 0o666) | cachefolder.FILE_MODE


def _foreign(path: str, f: Any) -> Optional[str]:
    """Why the open cache file ``f`` could have been written by someone else, or None."""
    if config.get("cache_trust_shared"):
        return None
    return cachefolder.untrusted_file(path, os.fstat(f.fileno()))


# --------------------------------------------------------------------------------------------
# The key

@functools.cache
def _code_version() -> str:
    """A hash of deferfuse's own sources: a changed lowering must not load old executables."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(package):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as f:
                    digest.update(os.path.relpath(os.path.join(folder, name), package).encode()
                                  + b"\0" + f.read())
    return digest.hexdigest()


@functools.cache
def _xla_flags() -> str:
    """XLA_FLAGS as XLA read them when its backend started (they change what it compiles:
    fast math, the dot libraries, the instruction sets); read once, as XLA does."""
    return config.xla_flags()


@functools.cache
def _cpu_features() -> str:
    """The host CPU's instruction-set features, which XLA's CPU compiler targets: the flags
    line of /proc/cpuinfo (x86) or its Features line (Arm); elsewhere, what ``platform`` says.
    The CPU's model name is not enough: one model is sold, and virtualized, with different
    features."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features"):
                    features = " ".join(sorted(value.split()))
                    return f"{platform.machine()} {hashlib.sha256(features.encode()).hexdigest()[:16]}"
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {platform.platform()}"


def _jaxlib_version() -> str:
    import jaxlib.version
    return jaxlib.version.__version__


def key_inputs() -> dict[str, str]:
    """Everything besides the signature that the key of an executable holds."""
    device = jax.devices()[0]
    return {"format": str(_FORMAT), "deferfuse": version.__version__, "code": _code_version(),
            "jax": jax.__version__, "jaxlib": _jaxlib_version(), "torch": torch.__version__,
            "platform": f"{device.client.platform} {device.client.platform_version}",
            "device": f"{device.device_kind} x{len(jax.devices())}",
            "cpu": _cpu_features(), "xla_flags": _xla_flags(), "host_kernels": hostkernels.key()}


def host_key_inputs() -> dict[str, str]:
    """What a block choice's key holds besides its place: what makes one process time a block
    differently from another without asking JAX (which a block running at once never imports)."""
    return {"format": str(_FORMAT), "deferfuse": version.__version__, "code": _code_version(),
            "torch": torch.__version__, "cpu": _cpu_features(), "xla_flags": _xla_flags(),
            "settings": repr(config.choice_key())}


def _key(signature: Any) -> Optional[str]:
    text = repr(signature)
    if " at 0x" in text:
        # something in the signature has no stable text (an object's address): memory cache only
        return None
    salt = json.dumps(key_inputs(), sort_keys=True)
    return hashlib.sha256((salt + "\n" + text).encode()).hexdigest()


def _entry_path(folder: str, key: str) -> str:
    return os.path.join(folder, key[:2], key + _SUFFIX)


# --------------------------------------------------------------------------------------------
# What an executable needs before it can be loaded

_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_PYTHON_CALLBACK = re.compile(r"xla_.*python.*callback")


def custom_call_targets(executable: Any) -> list[str]:
    """The custom-call targets a compiled executable calls (from its optimized HLO)."""
    return sorted(set(_TARGET.findall(executable.as_text() or "")))


def _registered_targets() -> Optional[set[str]]:
    """The custom-call targets registered for this process's platform, or None where jaxlib
    cannot list them."""
    from jax._src.lib import _jax as jaxlib_core
    listing = getattr(jaxlib_core, "custom_call_targets", None)
    if listing is None:
        return None
    return set(listing(jax.devices()[0].client.platform))


@functools.cache
def _lapack_targets() -> frozenset[str]:
    """The targets whose handlers call LAPACK through the pointers initialize_lapack() fills."""
    from jax._src.lib import lapack
    return frozenset(name for targets in lapack.registrations().values() for name, _, _ in targets)


def unsaveable_reason(targets: Iterable[str]) -> Optional[str]:
    """Why an executable calling ``targets`` must not be written to disk, or None."""
    callbacks = [t for t in targets if _PYTHON_CALLBACK.search(t)]
    if callbacks:
        # a host callback refers to a Python object of the process that compiled it
        return f"it calls back into Python ({', '.join(callbacks)})"
    return None


def prepare_targets(targets: Iterable[str]) -> Optional[str]:
    """Make ready what an executable's custom calls need before it is deserialized; return why
    it cannot be loaded in this process, or None when it can.

    ``targets`` are those of its custom-call targets that were registered with jaxlib when it
    was compiled (XLA's own, such as ``__onednn$matmul``, need nothing).  Deserializing skips
    JAX's lowering, and lowering is where JAX readies some of them: jaxlib registers its LAPACK
    handlers (``lapack_sgeqrf_ffi``, ...) when ``jax._src.lax.linalg`` is imported, but fills
    the LAPACK function pointers they call only in ``jaxlib.lapack._lapack.initialize()``, which
    JAX runs while lowering a LAPACK op (``prepare_lapack_call``).  An executable loaded from
    disk in a process that lowered no LAPACK op called null pointers: the second run of a
    program with a QR segfaulted.  deferfuse's own host kernels (native/hostkernels.py) are
    registered when their library is loaded, which happens at the first product lowered, so a
    process that loads a program before lowering any loads the library here (building it if
    needed); where it cannot, the entry is refused.  (The key holds the library's fingerprint,
    or "off", so an entry compiled with them is not even looked up where they are missing.)  A
    Python host callback refers to an object of the process that compiled it, and any other
    target must be registered here too.
    """
    targets = list(targets)
    if not targets:
        return None
    reason = unsaveable_reason(targets)
    if reason is not None:
        return reason
    host = sorted(set(targets) & set(hostkernels.TARGETS.values()))
    if host and not hostkernels.ensure():
        return (f"it calls deferfuse's host kernels ({', '.join(host)}), unavailable in this "
                f"process: {hostkernels.status().get('error') or 'turned off (host_kernels)'}")
    try:
        import jax._src.lax.linalg as jax_linalg   # registers jaxlib's linear algebra targets
        if any(t in _lapack_targets() for t in targets):
            jax_linalg.initialize_lapack()
    except (ImportError, AttributeError) as exc:     # a jax without these: compile instead
        return f"this jax cannot prepare its LAPACK targets ({exc})"
    registered = _registered_targets()
    missing = [t for t in targets if registered is not None and t not in registered]
    if missing:
        return f"its custom-call targets {', '.join(missing)} are not registered in this process"
    return None


# --------------------------------------------------------------------------------------------
# Entries

def _encode(key: str, payload: bytes, targets: list[str]) -> bytes:
    header = {"format": _FORMAT, "key": key, "size": len(payload),
              "sha256": hashlib.sha256(payload).hexdigest(), "targets": targets}
    return _MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload


class _Unreadable(Exception):
    pass


class _OtherFormat(Exception):
    pass


def _decode(key: str, data: bytes) -> tuple[list[str], bytes]:
    """The custom-call targets and the payload of an entry, checked against its header and the
    header against ``key``."""
    if not data.startswith(_MAGIC):
        raise _Unreadable("no entry header")
    line_end = data.find(b"\n", len(_MAGIC), len(_MAGIC) + _HEADER_LIMIT)
    if line_end < 0:
        raise _Unreadable("its header is cut off, or longer than any this version writes")
    try:
        header = json.loads(data[len(_MAGIC):line_end])
    except (ValueError, RecursionError) as exc:   # (not JSON, not UTF-8, nested too deep)
        raise _Unreadable(f"a malformed header ({exc})") from None
    if not isinstance(header, dict) or "format" not in header or "key" not in header:
        raise _Unreadable("a header without a format and a key")
    fmt, entry_key = header["format"], header["key"]
    if type(fmt) is not int or fmt != _FORMAT or entry_key != key:
        raise _OtherFormat(f"format {str(fmt)[:16]!r} and key {str(entry_key)[:16]}..., "
                           f"expected format {_FORMAT} and key {key[:16]}...")
    size, digest, targets = header.get("size"), header.get("sha256"), header.get("targets")
    if type(size) is not int or not isinstance(digest, str) or not isinstance(targets, list) \
            or not all(isinstance(t, str) for t in targets):
        raise _Unreadable("a malformed header (its size, sha256 or targets)")
    payload = data[line_end + 1:]
    if len(payload) != size:
        raise _Unreadable(f"{len(payload)} bytes of payload where the header says {size}: truncated")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise _Unreadable("its payload does not match the header's checksum")
    return targets, payload


def load(signature: Any, n_inputs: Optional[int] = None, n_scalars: Optional[int] = None
         ) -> Optional[tuple[Any, int, list, list[str]]]:
    """The executable saved for ``signature`` (taking ``n_inputs`` inputs and ``n_scalars``
    runtime scalars, when given), with its scalar count, runtime checks and the custom-call
    targets it needs; None on a miss (or a bad entry: counted, logged once, and compiled again
    by the caller)."""
    folder = cache_dir()
    key = _key(signature) if folder else None
    if key is None:
        return None
    path = _entry_path(folder, key)
    try:
        with open(path, "rb") as f:
            foreign = _foreign(path, f)
            data = b"" if foreign else f.read()
    except (FileNotFoundError, NotADirectoryError):     # (no such entry, or no such folder)
        _count("misses")
        return None
    except OSError as exc:
        _error(ErrorKind.UNREADABLE, "cannot read %s (%s); compiling again", path, exc)
        return None
    if foreign is not None:
        _error(ErrorKind.UNTRUSTED, "not loading %s: %s, so it could be someone else's code; "
               "compiling again", path, foreign)
        return None
    try:
        targets, payload = _decode(key, data)
        metadata, xla_bytes = entryformat.parse(payload)
        if n_inputs not in (None, metadata.n_inputs) or n_scalars not in (None, metadata.n_scalars):
            raise _Unreadable(f"it takes {metadata.n_inputs} inputs and {metadata.n_scalars} "
                              f"scalars, where the program has {n_inputs} and {n_scalars}")
    except (_Unreadable, entryformat.Malformed) as exc:
        _error(ErrorKind.UNREADABLE, "ignoring %s: %s; compiling again", path, exc)
        return None
    except _OtherFormat as exc:
        _error(ErrorKind.OTHER_FORMAT, "ignoring %s: its header names %s; compiling again", path, exc)
        return None
    refusal = prepare_targets(targets)
    if refusal is not None:
        _error(ErrorKind.UNLOADABLE, "not loading %s: %s; compiling again", path, refusal)
        return None
    try:
        executable = entryformat.load(metadata, xla_bytes)
    except Exception as exc:  # noqa: BLE001 - a bad entry is compiled again, never fatal
        _error(ErrorKind.DESERIALIZE, "could not load %s (%s: %s); compiling again",
               path, type(exc).__name__, exc)
        return None
    _touch(path)
    STATS.disk_cache_hits += 1
    _count("hits")
    return executable, metadata.n_scalars, metadata.checks, targets


def save(signature: Any, executable: Any, n_scalars: int, checks: list,
         targets: Optional[Iterable[str]] = None) -> None:
    """Write ``executable`` (a JAX ``Compiled`` of a Program, just compiled for ``signature``,
    calling ``targets``: read from its HLO when not given) to the cache folder."""
    folder = cache_dir()
    key = _key(signature) if folder else None
    if key is None:
        _count("not_saved")
        return
    try:
        targets = custom_call_targets(executable) if targets is None else list(targets)
        refusal = unsaveable_reason(targets)
        if refusal is None:
            try:
                payload = entryformat.serialize(executable, n_scalars, checks)
            except entryformat.Unsaveable as exc:
                refusal = str(exc)
        if refusal is not None:
            log.debug("deferfuse: disk cache: not saving an executable: %s", refusal)
            _count("not_saved")
            return
        registered = _registered_targets()
        # only the targets jaxlib provides need preparing at load; the others are XLA's own
        needed = [t for t in targets if registered is None or t in registered]
        data = _encode(key, payload, needed)
    except Exception as exc:  # noqa: BLE001 - the executable in memory still works
        _count("not_saved")
        _error(ErrorKind.SERIALIZE, "could not serialize an executable (%s: %s); this process goes "
               "on without saving it", type(exc).__name__, exc)
        return
    if not _ensure_folder(folder):
        _count("not_saved")
        return
    path = _entry_path(folder, key)
    try:
        _write_atomically(path, data, folder)
    except OSError as exc:
        _count("not_saved")
        _error(ErrorKind.WRITE, "could not write %s (%s); this process goes on without it",
               path, exc)
        return
    STATS.disk_cache_writes += 1
    _count("writes")
    _after_write(folder, len(data))


_CHOICES = "blocks"   # the subfolder of block choices


def _choice_path(folder: str, place: str) -> str:
    salt = json.dumps(host_key_inputs(), sort_keys=True)
    key = hashlib.sha256((salt + "\n" + place).encode()).hexdigest()
    return os.path.join(folder, _CHOICES, key + ".json")


def load_choice(place: str) -> Optional[dict]:
    """The block choice saved for ``place`` (a stable text naming a ``with`` line and its code)
    by an earlier process, or None (no cache, no record, or a record that does not parse)."""
    folder = cache_dir()
    if folder is None:
        return None
    path = _choice_path(folder, place)
    try:
        with open(path, "rb") as f:
            foreign = _foreign(path, f)
            data = b"" if foreign else f.read(1 << 16)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        _error(ErrorKind.UNREADABLE, "cannot read %s (%s); measuring the block again", path, exc)
        return None
    if foreign is not None:
        _error(ErrorKind.UNTRUSTED, "ignoring %s: %s; measuring the block again", path, foreign)
        return None
    try:
        record = json.loads(data)
        if not isinstance(record, dict) or record.get("place") != place:
            raise ValueError("not a block choice for this place")
    except (ValueError, RecursionError) as exc:   # (not JSON, not UTF-8, nested too deep)
        _error(ErrorKind.UNREADABLE, "ignoring %s (%s); measuring the block again", path, exc)
        return None
    return record


def save_choice(place: str, record: dict) -> None:
    """Keep ``record`` (JSON-able; exec/blocks.py's) as the choice for ``place``."""
    folder = cache_dir()
    if folder is None or not _ensure_folder(folder):
        return
    path = _choice_path(folder, place)
    try:
        _write_atomically(path, json.dumps(dict(record, place=place)).encode(), folder)
    except (OSError, TypeError, ValueError) as exc:
        _error(ErrorKind.WRITE, "could not write %s (%s); this process goes on without it",
               path, exc)


def _count(name: str) -> None:
    with _LOCK:
        _COUNTS[name] += 1


def _touch(path: str) -> None:
    """Mark an entry as used now, for least-recently-used eviction.  Nanosecond times from the
    clock, not the kernel's file timestamps (coarser: entries written in one tick would tie)."""
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
    except OSError:
        pass   # a read-only folder: its entries still load, eviction order is only a hint


def _ensure_folder(folder: str) -> bool:
    """Create ``folder`` (0700, as each missing folder above it) if it is missing; whether the
    cache may write there (judged again once it exists: ``_trusted``)."""
    try:
        cachefolder.make_folders(folder)
        problem = None if os.path.isdir(folder) else "not a folder"
    except OSError as exc:
        problem = None if os.path.isdir(folder) else exc
    if problem is not None:
        with _LOCK:
            _FOLDER_OFF.add(folder)
        _error(ErrorKind.FOLDER, "cannot create the cache folder %s (%s); the disk cache is off "
               "for this process", folder, problem)
        return False
    return _trusted(folder)


def _write_atomically(path: str, data: bytes, folder: str) -> None:
    """Write ``data`` to ``path`` (in the cache folder ``folder``) so that a reader sees the
    whole entry or none: another process writing the same key at once writes its own
    temporary file, and the last rename wins with an entry as good as the other.  Its folder
    and the file get ``_modes(folder)``, whatever the umask."""
    folder_mode, file_mode = _modes(folder)
    cachefolder.make_folders(os.path.dirname(path), folder_mode)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), file_mode)
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _touch(path)


# --------------------------------------------------------------------------------------------
# The bound

def _after_write(folder: str, size: int) -> None:
    limit = config.get("cache_max_bytes")
    if limit <= 0:
        return
    with _LOCK:
        known = _USAGE.get(folder)
        if known is not None and known + size <= limit:
            _USAGE[folder] = known + size
            return
        _USAGE[folder] = _evict(folder, limit)


def _evict(folder: str, limit: int) -> int:
    """Walk ``folder``; when its entries pass ``limit`` bytes, delete the least recently used
    down to _LOW_WATER of it.  Returns the bytes left.  Temporary files of writers that died
    are deleted on the way."""
    entries = []
    total = 0
    now = time.time()
    try:
        subfolders = [e.path for e in os.scandir(folder) if e.is_dir(follow_symlinks=False)]
        for sub in subfolders:
            for e in os.scandir(sub):
                if not e.name.endswith((".tmp", _SUFFIX)):
                    continue       # not ours
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue       # renamed or evicted by another process meanwhile
                if e.name.endswith(_SUFFIX):
                    entries.append((st.st_mtime_ns, e.path, st.st_size))
                    total += st.st_size
                elif now - st.st_mtime > _STALE_TMP_SECONDS:
                    _unlink(e.path)
                else:
                    total += st.st_size
    except OSError as exc:
        _error(ErrorKind.EVICT, "could not walk %s to bound its size (%s)", folder, exc)
        return total
    if total <= limit:
        return total
    entries.sort()
    target = int(limit * _LOW_WATER)
    for _, path, size in entries:
        if total <= target:
            break
        if _unlink(path):
            _count("evicted")
            total -= size
        elif not os.path.exists(path):
            total -= size     # another process evicted it first
    return total


def _unlink(path: str) -> bool:
    """Delete ``path``; whether this call deleted it."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        _error(ErrorKind.EVICT, "could not delete %s (%s)", path, exc)
        return False
