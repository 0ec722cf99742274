"""Who could have written the disk cache's folder, and folders and files only their owner uses.

An entry of the disk cache (exec/diskcache.py) is code: XLA loads its machine code and this
process runs it.  So, as ssh reads keys only from folders no one else can write, the cache
reads a folder only when no one but this user and root could have put anything in it:

- the folder must be owned by this user or by root, and not writable by its group or others;
- so must each folder above it, up to the first that this user owns or that root owns with the
  sticky bit (``/tmp``: others create there, but cannot rename or delete what is ours); above
  that, only its owner could replace the path;
- a folder not created yet is judged by its nearest existing ancestor, with the rules of the
  folders above (the folders deferfuse creates are this user's, 0700), and again once created;
- each file read must be owned by this user or root and not writable by its group or others
  (``untrusted_file``): a folder that was once open may hold what others left in it.

``untrusted_reason`` and ``untrusted_file`` say why not, or None; the disk cache decides what
follows (the cache off, one warning, or ``cache_trust_shared``).  Paths are resolved first
(``os.path.realpath``): the folders judged are those the files are in.

**Modes.**  Every folder deferfuse creates is ``FOLDER_MODE`` (0700) and every file
``FILE_MODE`` (0600), whatever the umask (``make_folders``, and the cache's writer):
only their owner can list a folder or read an entry.  ``tighten`` makes an existing folder
tree private (the default folder, which deferfuse created 0755 before).
"""

from __future__ import annotations

import os
import stat
from typing import Optional

FOLDER_MODE = 0o700
FILE_MODE = 0o600
_OPEN_BITS = 0o077        # any access by the group or others
_ROOT = 0


def effective_uid() -> int:
    """The user this process acts as (tests stand in another)."""
    return os.geteuid()


def _owner_fault(path: str, st: os.stat_result, me: int) -> Optional[str]:
    if st.st_uid not in (me, _ROOT):
        return f"{path} is owned by uid {st.st_uid}"
    if st.st_mode & stat.S_IWOTH:
        return f"{path} is writable by others"
    if st.st_mode & stat.S_IWGRP:
        return f"{path} is writable by its group"
    return None


def untrusted_reason(folder: str) -> Optional[str]:
    """Why someone besides this user and root could have written in ``folder`` or could
    replace it, or None.  A folder that does not exist yet is judged by the folders above."""
    me = effective_uid()
    path = os.path.realpath(folder)
    itself = True
    while True:
        try:
            st = os.stat(path)
            break
        except (FileNotFoundError, NotADirectoryError):
            parent = os.path.dirname(path)
            if parent == path:
                return None
            path, itself = parent, False
        except OSError as exc:
            return f"{path} cannot be examined ({exc.strerror or exc})"
    if not stat.S_ISDIR(st.st_mode):
        return None     # (nothing to read: creating the folder fails, and turns the cache off)
    if itself:
        reason = _owner_fault(path, st, me)
        if reason is not None:
            return reason
        path = os.path.dirname(path)    # ("/" is its own parent: judged once more, as a parent)
    # the folders above it (for a folder not created yet: its nearest ancestor, and above)
    while True:
        try:
            st = os.stat(path)
        except OSError as exc:
            return f"{path} cannot be examined ({exc.strerror or exc})"
        sticky_root = st.st_uid == _ROOT and bool(st.st_mode & stat.S_ISVTX)
        if not sticky_root:
            reason = _owner_fault(path, st, me)
            if reason is not None:
                return reason
        if st.st_uid == me or sticky_root:
            return None
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def untrusted_file(path: str, st: os.stat_result) -> Optional[str]:
    """Why a file of the cache (``st``: its ``os.fstat``) could be someone else's, or None."""
    return _owner_fault(path, st, effective_uid())


def make_folders(path: str, mode: int = FOLDER_MODE) -> None:
    """Create ``path`` and each missing folder above it with ``mode``, whatever the umask; a
    folder that exists is left as it is.  Raises OSError when one cannot be created."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, mode)
        except FileExistsError:
            continue     # (made meanwhile by another process: the caller judges the result)
        # (mkdir's mode passes through the umask, which only takes bits away: never wider)
        os.chmod(folder, mode)


def is_open(folder: str) -> bool:
    """Whether its group or others have any access to ``folder`` (False when it is missing)."""
    try:
        return bool(os.stat(folder).st_mode & _OPEN_BITS)
    except OSError:
        return False


def tighten(folder: str) -> tuple[int, int]:
    """Make ``folder`` and everything in it that this user owns private: folders FOLDER_MODE,
    files FILE_MODE.  Symbolic links are not followed.  Returns how many folders and files
    were changed."""
    me = effective_uid()
    folders = files = 0
    for top, _, names in os.walk(folder):
        for path, mode in [(top, FOLDER_MODE)] + [(os.path.join(top, n), FILE_MODE) for n in names]:
            try:
                st = os.lstat(path)
                if st.st_uid != me or stat.S_ISLNK(st.st_mode) or not st.st_mode & _OPEN_BITS:
                    continue
                os.chmod(path, mode)
            except OSError:
                continue     # (gone meanwhile; or not ours to change: a later read judges it)
            if mode == FOLDER_MODE:
                folders += 1
            else:
                files += 1
    return folders, files
