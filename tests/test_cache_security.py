"""The disk cache runs only what its own user wrote (deferfuse/exec/diskcache.py, cachefolder.py,
entryformat.py): its folders and files are private whatever the umask, a folder someone else
could write is not read (unless ``cache_trust_shared``), and nothing read back is unpickled: a
planted pickle never runs, and the program compiles again.

Whatever could run a planted entry runs in a fresh subprocess.  The suite runs as root here:
a folder "owned by another user" is one ``os.chown``-ed to a uid that is not ours; as another
user, ``cachefolder.effective_uid`` stands in for the owner check.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import stat
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

import deferfuse
from deferfuse import config, engine
from deferfuse.exec import cachefolder, diskcache, entryformat

ROOT = os.geteuid() == 0
STRANGER = 12345          # a uid that is neither ours nor root's


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _tree(folder) -> tuple[list, list]:
    """The folders (the top one included) and files under ``folder``."""
    folders, files = [], []
    for top, _, names in os.walk(folder):
        folders.append(top)
        files += [os.path.join(top, n) for n in names]
    return folders, files


@pytest.fixture
def fresh():
    """Every flush compiled, no executable in memory, fresh disk cache state."""
    engine.clear_cache()
    diskcache.clear()
    deferfuse.reset_stats()
    with config.override(always_compile=True):
        yield
    engine.clear_cache()
    diskcache.clear()


def _graph(n: int) -> None:
    """Runs a graph of size ``n`` from nothing in memory and checks it against strict."""
    engine.clear_cache()
    x = torch.linspace(-2.0, 2.0, n)
    with deferfuse.defer():
        y = (x * 0.5 + 2.0).tanh() * x
    torch.testing.assert_close(y, (x * 0.5 + 2.0).tanh() * x)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and "disk cache" in r.getMessage()]


# --------------------------------------------------------------------------------------------
# Private modes

@pytest.mark.parametrize("umask", [0o022, 0o000], ids=["umask022", "umask000"])
def test_folders_are_0700_and_files_0600_whatever_the_umask(tmp_path, fresh, umask):
    folder = tmp_path / "made" / "by" / "deferfuse"       # (the folders above it are made too)
    previous = os.umask(umask)
    try:
        with config.override(cache_dir=str(folder)):
            _graph(64)
            _graph(80)
            diskcache.save_choice("a place", {"choice": "at once"})
    finally:
        os.umask(previous)
    folders, files = _tree(tmp_path / "made")
    assert any(f.endswith(".xla") for f in files) and any(f.endswith(".json") for f in files)
    assert any(os.path.basename(f) == "blocks" for f in folders)
    assert {f: _mode(f) for f in folders} == {f: 0o700 for f in folders}
    assert {f: _mode(f) for f in files} == {f: 0o600 for f in files}
    assert deferfuse.stats()["disk_cache_errors"] == 0 and deferfuse.stats()["disk_cache_writes"] == 2


def test_the_default_folder_is_made_private_once(tmp_path, fresh, monkeypatch, caplog):
    """deferfuse made its default folder 0755 before: the first use tightens it, with a note."""
    default = tmp_path / "default"
    sub = default / "ab"
    sub.mkdir(parents=True)
    entry = sub / "old.xla"
    entry.write_bytes(b"an entry")
    for path, mode in ((default, 0o755), (sub, 0o775), (entry, 0o644)):
        os.chmod(path, mode)
    monkeypatch.setattr(diskcache, "default_folder", lambda: str(default))
    with config.override(cache_dir=str(default)), caplog.at_level(logging.INFO, logger="deferfuse"):
        assert diskcache.cache_dir() == str(default)
        _graph(64)
        diskcache.clear()           # (a later judgement in this process finds nothing to do)
        assert diskcache.cache_dir() == str(default)
    notes = [r.getMessage() for r in caplog.records if "private" in r.getMessage()]
    assert len(notes) == 1 and str(default) in notes[0], notes
    assert (_mode(default), _mode(sub), _mode(entry)) == (0o700, 0o700, 0o600)
    assert deferfuse.stats()["disk_cache_errors"] == 0 and deferfuse.stats()["disk_cache_writes"] == 1


def test_a_folder_set_by_the_user_is_never_tightened(tmp_path, fresh, caplog):
    """Not the default: refused as it is (below), not silently chmod-ed."""
    folder = tmp_path / "mine"
    folder.mkdir()
    os.chmod(folder, 0o777)
    with config.override(cache_dir=str(folder)), caplog.at_level(logging.INFO, logger="deferfuse"):
        assert diskcache.cache_dir() is None
    assert _mode(folder) == 0o777


# --------------------------------------------------------------------------------------------
# A folder someone else can write is not read

def test_a_group_writable_folder_is_refused_with_one_warning(tmp_path, fresh, caplog):
    folder = tmp_path / "team"
    folder.mkdir()
    os.chmod(folder, 0o770)
    with config.override(cache_dir=str(folder)), caplog.at_level(logging.WARNING, logger="deferfuse"):
        _graph(64)
        _graph(80)
        assert diskcache.cache_dir() is None
    stats = deferfuse.stats()
    assert stats["compiles"] == 2 and stats["disk_cache_errors"] == 1
    assert stats["disk_cache_writes"] == 0 and stats["disk_cache_hits"] == 0
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    assert str(folder) in warnings[0] and "writable by its group" in warnings[0]
    assert "chmod 700" in warnings[0] and "DEFERFUSE_CACHE_TRUST_SHARED=1" in warnings[0]
    assert _tree(folder) == ([str(folder)], [])


def test_a_group_writable_folder_is_used_with_cache_trust_shared(tmp_path, fresh, caplog):
    """A team's folder, on purpose: used, and what is written there its group can read."""
    folder = tmp_path / "team"
    folder.mkdir()
    os.chmod(folder, 0o770)
    with config.override(cache_dir=str(folder), cache_trust_shared=True), \
            caplog.at_level(logging.WARNING, logger="deferfuse"):
        _graph(64)
        _graph(64)
    stats = deferfuse.stats()
    assert stats["compiles"] == 1 and stats["disk_cache_hits"] == 1 and stats["disk_cache_errors"] == 0
    assert _warnings(caplog) == []
    folders, files = _tree(folder)
    assert {_mode(f) for f in folders} == {0o770} and {_mode(f) for f in files} == {0o660}


def _owned_by_a_stranger(path, monkeypatch) -> None:
    """Make ``path`` another user's: chown it as root; otherwise act as another user."""
    if ROOT:
        os.chown(path, STRANGER, STRANGER)
    else:
        monkeypatch.setattr(cachefolder, "effective_uid", lambda: STRANGER)


def test_a_folder_owned_by_another_user_is_refused(tmp_path, fresh, monkeypatch, caplog):
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    _owned_by_a_stranger(folder, monkeypatch)
    with config.override(cache_dir=str(folder)), caplog.at_level(logging.WARNING, logger="deferfuse"):
        _graph(64)
        assert diskcache.cache_dir() is None
    assert deferfuse.stats()["disk_cache_errors"] == 1 and deferfuse.stats()["disk_cache_writes"] == 0
    warnings = _warnings(caplog)
    owner = STRANGER if ROOT else os.geteuid()
    assert len(warnings) == 1 and f"{folder} is owned by uid {owner}" in warnings[0], warnings


def test_a_parent_writable_by_others_is_refused(tmp_path, fresh, caplog):
    """Whoever can write the folder above can rename ours away and put theirs in its place;
    a folder not created yet is judged by the folders above."""
    above = tmp_path / "open"
    above.mkdir()
    os.chmod(above, 0o777)          # (no sticky bit)
    existing = above / "cache"
    existing.mkdir(mode=0o700)
    for folder in (existing, above / "not yet" / "cache"):
        diskcache.clear()
        with config.override(cache_dir=str(folder)), caplog.at_level(logging.WARNING, logger="deferfuse"):
            assert diskcache.cache_dir() is None
        assert f"{above} is writable by others" in _warnings(caplog)[-1]
    assert not (above / "not yet").exists()


@pytest.mark.skipif(not (os.stat("/tmp").st_uid == 0 and os.stat("/tmp").st_mode & stat.S_ISVTX),
                    reason="/tmp is not root's with the sticky bit here")
def test_a_folder_in_tmp_is_used(fresh):
    """/tmp is writable by everyone, but sticky and root's: no one can rename what is ours."""
    top = tempfile.mkdtemp(prefix="deferfuse-security-")
    try:
        for folder in (os.path.join(top, "cache"), os.path.join(top, "later", "cache")):
            with config.override(cache_dir=folder):
                _graph(64)
            assert os.path.isdir(folder) and _mode(folder) == 0o700
        assert _mode(os.path.join(top, "later")) == 0o700
        assert deferfuse.stats()["disk_cache_errors"] == 0 and deferfuse.stats()["disk_cache_writes"] == 2
    finally:
        for folder, _, names in os.walk(top, topdown=False):
            for name in names:
                os.unlink(os.path.join(folder, name))
            os.rmdir(folder)


def test_a_file_another_user_left_is_not_read(tmp_path, fresh, monkeypatch, caplog):
    """A folder once open may hold what others left in it: each file read must be ours."""
    folder = tmp_path / "cache"
    with config.override(cache_dir=str(folder)):
        _graph(64)
        diskcache.save_choice("a place", {"choice": "at once"})
        assert diskcache.load_choice("a place") is not None
        for path in _tree(folder)[1]:
            if ROOT:
                os.chown(path, STRANGER, STRANGER)
        if not ROOT:      # (the folder is judged already: only the files are seen by another)
            monkeypatch.setattr(cachefolder, "effective_uid", lambda: STRANGER)
        deferfuse.reset_stats()
        with caplog.at_level(logging.WARNING, logger="deferfuse"):
            _graph(64)
            assert diskcache.load_choice("a place") is None
    stats = deferfuse.stats()
    assert stats["compiles"] == 1 and stats["disk_cache_hits"] == 0 and stats["disk_cache_errors"] == 2
    assert "could be someone else's" in _warnings(caplog)[0]


# --------------------------------------------------------------------------------------------
# Nothing of ours is unpickled

class Planted:
    """Unpickled, it creates the file it names."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


PROGRAM = textwrap.dedent("""
    import json, torch, deferfuse
    values = []
    for n in (96, 160):
        x = torch.linspace(-2.0, 2.0, n)
        with deferfuse.defer():
            y = (x * 0.5 + 2.0).tanh() * x
        torch.testing.assert_close(y, (x * 0.5 + 2.0).tanh() * x)
        values.append(float(y.sum()))
    s = deferfuse.stats()
    print(json.dumps({"compiles": s["compiles"], "hits": s["disk_cache_hits"],
                      "writes": s["disk_cache_writes"], "errors": s["disk_cache_errors"],
                      "values": values}))
""")


def _run(code: str, cache) -> dict:
    env = dict(os.environ, DEFERFUSE_CACHE_DIR=str(cache), DEFERFUSE_ALWAYS_COMPILE="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, f"exit code {out.returncode}:\n{out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def _entry(magic: bytes, header: dict, payload: bytes) -> bytes:
    header = dict(header, size=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    return magic + b"\n" + json.dumps(header).encode() + b"\n" + payload


def _plant_payload(magic, header, payload, bomb) -> bytes:
    """This format's header, its payload a pickle."""
    return _entry(magic, header, bomb)


def _plant_metadata(magic, header, payload, bomb) -> bytes:
    """This format's header, the metadata line a pickle, XLA's own bytes after it."""
    return _entry(magic, header, bomb.replace(b"\n", b"") + b"\n" + payload.split(b"\n", 1)[1])


def _plant_format_2(magic, header, payload, bomb) -> bytes:
    """The layout of format 2, which pickled its payload: (serialized, trees, scalars, checks)."""
    return _entry(magic, dict(header, format=2), bomb)


@pytest.mark.parametrize("plant", [_plant_payload, _plant_metadata, _plant_format_2],
                         ids=lambda f: f.__name__[len("_plant_"):])
def test_a_planted_pickle_never_runs(tmp_path, plant):
    cache = tmp_path / "cache"
    first = _run(PROGRAM, cache)
    assert first["writes"] == 2
    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(Planted(str(proof))))      # the bomb is live: unpickled, it writes
    assert proof.exists()
    marker = tmp_path / "planted"
    bomb = pickle.dumps((Planted(str(marker)), None, None, 0, []))
    entries = [p for p in _tree(cache)[1] if p.endswith(".xla")]
    for path in entries:
        with open(path, "rb") as f:
            magic, header, payload = f.read().split(b"\n", 2)
        with open(path, "wb") as f:
            f.write(plant(magic, json.loads(header), payload, bomb))
    second = _run(PROGRAM, cache)
    assert not marker.exists()
    assert second["compiles"] == 2 and second["hits"] == 0 and second["errors"] >= 1
    assert second["values"] == first["values"]
    third = _run(PROGRAM, cache)       # (rewritten by the second)
    assert third["compiles"] == 0 and third["hits"] == 2 and not marker.exists()


CHECKED = textwrap.dedent("""
    import json, torch, deferfuse
    x = torch.linspace(-2.0, 2.0, 10)

    def program(index):
        return x.index_select(0, index) * 2

    index = torch.tensor([1, 7])
    with deferfuse.defer():
        y = program(index)
    torch.testing.assert_close(y, program(index))
    raised = {}
    for how in ("deferred", "strict"):
        try:
            if how == "strict":
                program(torch.tensor([1, 12]))
            else:
                with deferfuse.defer():
                    program(torch.tensor([1, 12])).tolist()   # (the same graph: compiled once)
        except Exception as exc:
            raised[how] = [type(exc).__name__, str(exc)]
    s = deferfuse.stats()
    print(json.dumps({"compiles": s["compiles"], "hits": s["disk_cache_hits"],
                      "errors": s["disk_cache_errors"], "raised": raised}))
""")


def test_a_runtime_check_raises_from_an_executable_loaded_from_disk(tmp_path):
    """XLA's own bytes, called without JAX's trees: same results, same IndexError as strict."""
    first = _run(CHECKED, tmp_path / "cache")
    second = _run(CHECKED, tmp_path / "cache")
    assert first["compiles"] == 1 and second["compiles"] == 0 and second["hits"] == 1
    assert second["errors"] == 0
    for report in (first, second):
        (deferred, message), (strict, strict_message) = report["raised"]["deferred"], report["raised"]["strict"]
        assert deferred == strict == "IndexError" and strict_message in message, report
    assert second["raised"] == first["raised"]


# --------------------------------------------------------------------------------------------
# What is read is data of a fixed shape, bounded

def _metadata(**fields) -> bytes:
    base = {"inputs": 1, "results": 1, "scalars": 0, "checks": [[0, "IndexError", "out of range"]]}
    return json.dumps(dict(base, **fields)).encode() + b"\nxla bytes"


@pytest.mark.parametrize("payload", [
    _metadata(checks=[[0, "os.system", "rm"]]),            # an error not in the table
    _metadata(checks=[[0, "IndexError"]]),
    _metadata(checks=[["0", "IndexError", "m"]]),
    _metadata(inputs=True),                                 # a bool is not a count
    _metadata(results=-1),
    _metadata(scalars=1.0),
    _metadata(extra=1),
    b'{"inputs": 1}\nxla',
    b"[" * 100_000 + b"\nxla",                               # nested too deep
    b"no metadata line at all",
    b"x" * (entryformat.METADATA_LIMIT + 10) + b"\nxla",     # past the bound
    pickle.dumps(Planted("/nonexistent/never")),
], ids=lambda p: p[:24].decode("latin-1"))
def test_malformed_metadata_is_refused(payload):
    with pytest.raises(entryformat.Malformed):
        entryformat.parse(payload)


def test_well_formed_metadata_is_read():
    metadata, rest = entryformat.parse(_metadata(checks=[[3, "torch.linalg.LinAlgError", "singular"]]))
    assert (metadata.n_inputs, metadata.n_results, metadata.n_scalars) == (1, 1, 0)
    assert metadata.checks == [(3, torch.linalg.LinAlgError, "singular")] and rest == b"xla bytes"


def test_a_header_past_its_bound_is_refused_before_it_is_parsed(tmp_path, fresh, caplog):
    folder = tmp_path / "cache"
    with config.override(cache_dir=str(folder)):
        _graph(64)
        (path,) = [p for p in _tree(folder)[1] if p.endswith(".xla")]
        with open(path, "rb") as f:
            magic, header, payload = f.read().split(b"\n", 2)
        fields = dict(json.loads(header), padding="x" * (2 << 20))
        with open(path, "wb") as f:
            f.write(magic + b"\n" + json.dumps(fields).encode() + b"\n" + payload)
        deferfuse.reset_stats()
        with caplog.at_level(logging.WARNING, logger="deferfuse"):
            _graph(64)
    assert deferfuse.stats()["disk_cache_errors"] == 1 and deferfuse.stats()["compiles"] == 1
    assert "longer than any" in _warnings(caplog)[0]
