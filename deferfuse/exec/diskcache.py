"""Compiled executables on disk, so a second process running the same program compiles nothing.

The key is a SHA-256 of the structural signature's text together with the versions of deferfuse,
jax, jaxlib and torch, the XLA platform and XLA_FLAGS.  An entry holds the serialized executable and the
metadata of its runtime checks.  Any entry that cannot be read is ignored (and counted); the
computation is compiled again and the entry rewritten.  JAX's global configuration (including its
own compilation cache) is left untouched.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
from typing import Any, Optional

import torch

from .. import config
from ..stats import STATS
from .._lazy import lazy_import

jax = lazy_import("jax", globals(), "jax")

log = logging.getLogger("deferfuse")
_FORMAT = 1


def cache_dir() -> Optional[str]:
    """The cache folder, or None when the disk cache is off (DEFERFUSE_CACHE_DIR="")."""
    path = config.get("cache_dir")
    if path is None or path == "":
        return None
    return os.path.expanduser(path)


@functools.cache
def _code_version() -> str:
    """A hash of deferfuse's own sources: a changed lowering must not load old executables."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder, _, files in sorted(os.walk(package)):
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as f:
                    digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()


@functools.cache
def _xla_flags() -> str:
    """XLA_FLAGS as XLA read them when its backend started (they change what it compiles:
    fast math, the dot libraries); read once, as XLA does."""
    return os.environ.get("XLA_FLAGS", "")


def _key(signature: Any) -> Optional[str]:
    text = repr(signature)
    if " at 0x" in text:
        # something in the signature has no stable text (an object's address): memory cache only
        return None
    from .. import __version__
    salt = f"{_FORMAT}|{__version__}|{_code_version()}|{jax.__version__}|{jax.lib.__version__ if hasattr(jax.lib, '__version__') else ''}|{torch.__version__}|{jax.default_backend()}|{_xla_flags()}"
    return hashlib.sha256((salt + "\n" + text).encode()).hexdigest()


def load(signature: Any) -> Optional[tuple[Any, int, list]]:
    folder = cache_dir()
    key = _key(signature) if folder else None
    if key is None:
        return None
    path = os.path.join(folder, key[:2], key + ".xla")
    if not os.path.exists(path):
        return None
    try:
        from jax.experimental import serialize_executable
        with open(path, "rb") as f:
            payload, in_tree, out_tree, n_scalars, checks = pickle.load(f)
        if not isinstance(checks, list):
            raise ValueError("entry of an older format")
        executable = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    except Exception as exc:  # noqa: BLE001 - a bad entry is rebuilt, never fatal
        STATS.disk_cache_errors += 1
        log.warning("deferfuse: ignoring unreadable cache entry %s (%s: %s); it will be rebuilt",
                    path, type(exc).__name__, exc)
        return None
    STATS.disk_cache_hits += 1
    return executable, n_scalars, checks


def save(signature: Any, executable: Any, n_scalars: int, checks: list) -> None:
    folder = cache_dir()
    key = _key(signature) if folder else None
    if key is None:
        return
    try:
        from jax.experimental import serialize_executable
        payload, in_tree, out_tree = serialize_executable.serialize(executable)
        data = pickle.dumps((payload, in_tree, out_tree, n_scalars, checks))
        target_dir = os.path.join(folder, key[:2])
        os.makedirs(target_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target_dir, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(target_dir, key + ".xla"))
        STATS.disk_cache_writes += 1
    except Exception as exc:  # noqa: BLE001 - the memory cache still works
        log.warning("deferfuse: could not write the compilation cache in %s (%s: %s)",
                    folder, type(exc).__name__, exc)
