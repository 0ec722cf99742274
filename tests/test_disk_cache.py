"""The on-disk executable cache (deferfuse/exec/diskcache.py): a second process compiles
nothing, every op family loads, the key covers every input of an executable, the cache
survives abuse, and its folder is bounded.

Every case ends in results compared with strict PyTorch.  Whatever could crash the process (an
executable loaded from disk, an entry XLA could be handed) runs in a subprocess.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import deferfuse
from deferfuse import config
from deferfuse import engine
from deferfuse.exec import diskcache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A subprocess: runs a few graphs (one per size), checks each against strict, prints the
# disk cache's counts.
PROGRAM = textwrap.dedent("""
    import json, os, sys, torch, deferfuse
    from deferfuse.exec import diskcache
    sizes = [int(n) for n in os.environ["SIZES"].split(",")]
    barrier = os.environ.get("BARRIER")
    if barrier:      # start together with the other process that has this barrier
        import time
        open(os.path.join(barrier, str(os.getpid())), "w").close()
        deadline = time.time() + 120
        while len(os.listdir(barrier)) < 2 and time.time() < deadline:
            time.sleep(0.005)
    values = []
    for n in sizes:
        x = torch.linspace(-2.0, 2.0, n)
        with deferfuse.defer():
            y = (x * 0.5 + 2.0).tanh() * x
        torch.testing.assert_close(y, (x * 0.5 + 2.0).tanh() * x)
        values.append(float(y.sum()))
    s = deferfuse.stats()
    print(json.dumps({"compiles": s["compiles"], "hits": s["disk_cache_hits"],
                      "writes": s["disk_cache_writes"], "errors": s["disk_cache_errors"],
                      "values": values, "cache_dir": diskcache.cache_dir()}))
""")

SIZES = (96, 160, 224)


def _run(code: str, cache_dir, **extra_env) -> dict:
    env = dict(os.environ, DEFERFUSE_CACHE_DIR=str(cache_dir), DEFERFUSE_ALWAYS_COMPILE="1",
               SIZES=",".join(map(str, SIZES)), **extra_env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, f"exit code {out.returncode}:\n{out.stderr[-3000:]}"
    report = json.loads(out.stdout.strip().splitlines()[-1])
    report["warnings"] = [line for line in out.stderr.splitlines() if "deferfuse: disk cache:" in line]
    return report


def _entries(folder) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(folder) for f in files if f.endswith(".xla"))


def _folder_bytes(folder) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


# --------------------------------------------------------------------------------------------
# A second process

def test_second_process_compiles_nothing(tmp_path):
    first = _run(PROGRAM, tmp_path)
    second = _run(PROGRAM, tmp_path)
    assert first["compiles"] == len(SIZES) and first["writes"] == len(SIZES) and first["hits"] == 0
    assert second["compiles"] == 0 and second["hits"] == len(SIZES) and second["errors"] == 0
    assert second["values"] == first["values"]


LINALG = textwrap.dedent("""
    import json, torch, deferfuse
    torch.manual_seed(0)
    a = torch.randn(48, 48)
    b = torch.randn(48, 3)
    spd = a @ a.T / 48 + torch.eye(48)

    def program(a, b, spd):
        q, r = torch.linalg.qr(a * 2)
        lower = torch.linalg.cholesky(spd)
        lu, pivots = torch.linalg.lu_factor(a.double() + 1)   # (float32 LU: rounding differs)
        return q, r, lower, torch.linalg.solve(spd, b), lu, pivots, torch.linalg.slogdet(spd)[1]

    with deferfuse.defer():
        got = program(a, b, spd)
    for g, s in zip(got, program(a, b, spd)):
        torch.testing.assert_close(g, s)
    st = deferfuse.stats()
    print(json.dumps({"compiles": st["compiles"], "hits": st["disk_cache_hits"],
                      "writes": st["disk_cache_writes"], "errors": st["disk_cache_errors"]}))
""")


def test_a_lapack_executable_loads_in_a_second_process(tmp_path):
    """Found as a segfault: the second run of a program with a QR called LAPACK through null
    pointers (see diskcache.prepare_targets)."""
    first = _run(LINALG, tmp_path)
    headers = [_header(path) for path in _entries(tmp_path)]
    assert any(t.startswith("lapack_") for h in headers for t in h["targets"]), headers
    second = _run(LINALG, tmp_path)
    assert first["writes"] >= 1 and first["hits"] == 0
    assert second["compiles"] == 0 and second["hits"] == first["writes"] and second["errors"] == 0


def test_stablehlo_of_an_executable_loaded_from_disk(tmp_path):
    """A second process loads the executable instead of compiling it, and can still show its
    StableHLO (lowered again on demand)."""
    program = PROGRAM.replace("s = deferfuse.stats()", 'print(json.dumps({"hlo": deferfuse.stablehlo()}))\ns = deferfuse.stats()')
    for _ in range(2):
        env = dict(os.environ, DEFERFUSE_CACHE_DIR=str(tmp_path), DEFERFUSE_ALWAYS_COMPILE="1", SIZES="64")
        out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        lines = [json.loads(line) for line in out.stdout.strip().splitlines()]
        assert "stablehlo.tanh" in lines[0]["hlo"]
    assert lines[1]["hits"] == 1 and lines[1]["compiles"] == 0


def test_disk_cache_can_be_turned_off():
    with config.override(cache_dir=""):
        assert diskcache.cache_dir() is None


# --------------------------------------------------------------------------------------------
# What an executable needs before it loads

def test_load_preparation_of_custom_call_targets():
    assert diskcache.prepare_targets([]) is None
    assert diskcache.prepare_targets(["lapack_sgeqrf_ffi", "lapack_dpotrf_ffi"]) is None
    assert "no_such_target_ffi" in diskcache.prepare_targets(["no_such_target_ffi"])
    assert "Python" in diskcache.prepare_targets(["xla_ffi_python_cpu_callback"])


def test_an_executable_that_calls_back_into_python_is_never_saved(tmp_path):
    import jax
    import jax.numpy as jnp
    compiled = jax.jit(lambda a: jax.pure_callback(lambda v: v * 2, jax.ShapeDtypeStruct((3,), jnp.float32), a)
                       ).lower(jnp.ones(3, jnp.float32)).compile()
    assert any("python" in t for t in diskcache.custom_call_targets(compiled))
    diskcache.clear()
    with config.override(cache_dir=str(tmp_path)):
        diskcache.save(("a signature that calls back",), compiled, 0, [])
    assert diskcache.counts()["not_saved"] == 1 and diskcache.counts()["writes"] == 0
    assert _entries(tmp_path) == []


# --------------------------------------------------------------------------------------------
# The key

@pytest.fixture
def disk(tmp_path):
    """An empty cache folder, every flush compiled, no executable in memory, fresh disk cache
    state (counts, warnings given, folder sizes)."""
    folder = tmp_path / "cache"
    engine.clear_cache()
    diskcache.clear()
    deferfuse.reset_stats()
    with config.override(cache_dir=str(folder), always_compile=True):
        yield folder
    engine.clear_cache()
    diskcache.clear()


def _graph(n: int) -> None:
    """Runs the graph of size ``n`` from nothing in memory (so from the disk, or compiled), and
    checks it against strict."""
    engine.clear_cache()
    x = torch.linspace(-2.0, 2.0, n)
    with deferfuse.defer():
        y = (x * 0.5 + 2.0).tanh() * x
    torch.testing.assert_close(y, (x * 0.5 + 2.0).tanh() * x)


def _tiny_executable():
    """An executable shaped as a program's (exec/program.py): inputs and scalars in, results
    and no checks out."""
    import jax
    import jax.numpy as jnp
    with jax.enable_x64(True):
        return jax.jit(lambda ins, scalars: ([jnp.sin(ins[0]) * 2], None, None), keep_unused=True).lower(
            [jnp.ones(4, jnp.float32)], jax.ShapeDtypeStruct((0,), jnp.float64)).compile()


def test_the_key_covers_every_input_of_the_executable(disk, monkeypatch):
    """An entry saved under other versions, other sources, another CPU or other XLA_FLAGS is
    simply not found (a different key): no error."""
    import jax
    import jaxlib.version
    signature = ("a signature",)
    diskcache.save(signature, _tiny_executable(), 0, [])
    assert diskcache.load(signature) is not None
    changes = [(diskcache, "_code_version", lambda: "changed lowering"),
               (deferfuse.version, "__version__", "9.9.9"), (jax, "__version__", "9.9.9"),
               (jaxlib.version, "__version__", "9.9.9"), (torch, "__version__", "9.9.9"),
               (diskcache, "_cpu_features", lambda: "x86_64 without avx512"),
               (diskcache, "_xla_flags", lambda: "--xla_cpu_enable_fast_math=true"),
               (diskcache, "_FORMAT", 99)]
    for target, name, value in changes:
        with monkeypatch.context() as patch:
            patch.setattr(target, name, value)
            assert diskcache.load(signature) is None, name
    counts = diskcache.counts()
    assert counts["misses"] == len(changes) and counts["errors"] == 0 and counts["hits"] == 1
    assert set(diskcache.key_inputs()) >= {"format", "deferfuse", "code", "jax", "jaxlib", "torch",
                                          "platform", "device", "cpu", "xla_flags"}


def test_a_changed_lowering_compiles_again(disk, monkeypatch):
    _graph(64)
    _graph(64)
    assert deferfuse.stats()["compiles"] == 1 and deferfuse.stats()["disk_cache_hits"] == 1
    monkeypatch.setattr(diskcache, "_code_version", lambda: "a changed lowering")
    _graph(64)
    assert deferfuse.stats()["compiles"] == 2 and deferfuse.stats()["disk_cache_hits"] == 1
    assert len(_entries(disk)) == 2


# --------------------------------------------------------------------------------------------
# Abuse

def _header(path) -> dict:
    with open(path, "rb") as f:
        f.readline()
        return json.loads(f.readline())


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _random_bytes(data: bytes) -> bytes:
    return os.urandom(len(data))


def _flip_a_payload_byte(data: bytes) -> bytes:
    at = len(data) - 10      # (the header is at the start)
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]


def _empty(data: bytes) -> bytes:
    return b""


def _another_format(data: bytes) -> bytes:
    magic, header, payload = data.split(b"\n", 2)
    fields = json.loads(header)
    fields["format"] = 1
    return magic + b"\n" + json.dumps(fields).encode() + b"\n" + payload


@pytest.mark.parametrize("damage", [_truncate, _random_bytes, _flip_a_payload_byte, _empty, _another_format],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_damaged_entry_is_compiled_again(tmp_path, damage):
    first = _run(PROGRAM, tmp_path)
    entries = _entries(tmp_path)
    assert len(entries) == len(SIZES)
    for path in entries:
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(damage(data))
    second = _run(PROGRAM, tmp_path)
    assert second["errors"] == len(SIZES) and second["compiles"] == len(SIZES)
    assert len(second["warnings"]) == 1, second["warnings"]     # once per process, not per entry
    assert second["values"] == first["values"]
    third = _run(PROGRAM, tmp_path)            # rewritten by the second
    assert third["compiles"] == 0 and third["errors"] == 0 and third["values"] == first["values"]


def test_other_xla_flags_compile_again(tmp_path):
    # XLA_FLAGS change what XLA compiles (fast math, dot libraries): an executable compiled
    # under other flags is not loaded
    plain = _run(PROGRAM, tmp_path, XLA_FLAGS="")
    flagged = _run(PROGRAM, tmp_path, XLA_FLAGS="--xla_cpu_enable_fast_math=false")
    assert flagged["compiles"] == plain["compiles"] and flagged["hits"] == 0 and flagged["errors"] == 0
    again = _run(PROGRAM, tmp_path, XLA_FLAGS="--xla_cpu_enable_fast_math=false")
    assert again["compiles"] == 0 and again["hits"] == plain["compiles"]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "disk cache" in r.getMessage()]


def test_an_entry_needing_an_unknown_custom_call_is_compiled_again(disk, caplog):
    """Refused before XLA sees it (so this may run in the test process)."""
    _graph(64)
    _graph(80)
    for path in _entries(disk):
        with open(path, "rb") as f:
            magic, header, payload = f.read().split(b"\n", 2)
        fields = json.loads(header)
        fields["targets"] = ["no_such_target_ffi"]
        with open(path, "wb") as f:
            f.write(magic + b"\n" + json.dumps(fields).encode() + b"\n" + payload)
    deferfuse.reset_stats()
    with caplog.at_level(logging.WARNING, logger="deferfuse"):
        _graph(64)
        _graph(80)
    stats = deferfuse.stats()
    assert stats["disk_cache_errors"] == 2 and stats["compiles"] == 2 and stats["disk_cache_hits"] == 0
    assert len(_warnings(caplog)) == 1 and "no_such_target_ffi" in _warnings(caplog)[0]


def test_a_read_only_folder_still_serves_its_entries(disk, monkeypatch, caplog):
    _graph(64)
    for folder, _, _ in os.walk(disk):
        os.chmod(folder, 0o555)
    if os.geteuid() == 0:        # root writes through permissions: make the write fail as it would
        def read_only(*args, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied")
        monkeypatch.setattr(diskcache.tempfile, "mkstemp", read_only)
    try:
        deferfuse.reset_stats()
        with caplog.at_level(logging.WARNING, logger="deferfuse"):
            _graph(64)     # loads
            _graph(80)     # compiles, cannot write
            _graph(96)
    finally:
        for folder, _, _ in os.walk(disk):
            os.chmod(folder, 0o755)
    stats = deferfuse.stats()
    assert stats["disk_cache_hits"] == 1 and stats["compiles"] == 2
    assert stats["disk_cache_errors"] == 2 and stats["disk_cache_writes"] == 0
    assert len(_warnings(caplog)) == 1
    assert len(_entries(disk)) == 1 and not any(name.endswith(".tmp") for _, _, names in os.walk(disk) for name in names)


def test_a_full_disk_leaves_no_partial_entry(disk, monkeypatch, caplog):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(diskcache.os, "replace", no_space)
    with caplog.at_level(logging.WARNING, logger="deferfuse"):
        _graph(64)
        _graph(80)
    monkeypatch.undo()
    stats = deferfuse.stats()
    assert stats["compiles"] == 2 and stats["disk_cache_errors"] == 2 and stats["disk_cache_writes"] == 0
    assert len(_warnings(caplog)) == 1 and "No space" in _warnings(caplog)[0]
    assert [name for _, _, names in os.walk(disk) for name in names] == []
    _graph(64)          # space again
    assert deferfuse.stats()["disk_cache_writes"] == 1


def test_a_missing_folder_is_created(disk):
    assert not disk.exists()
    _graph(64)
    assert len(_entries(disk)) == 1 and deferfuse.stats()["disk_cache_errors"] == 0


def test_a_folder_that_cannot_be_created_turns_the_cache_off(tmp_path, caplog):
    blocker = tmp_path / "a file"
    blocker.write_text("not a folder")
    engine.clear_cache()
    diskcache.clear()
    deferfuse.reset_stats()
    try:
        with config.override(cache_dir=str(blocker / "cache"), always_compile=True):
            with caplog.at_level(logging.WARNING, logger="deferfuse"):
                _graph(64)
                assert diskcache.cache_dir() is None
                _graph(80)
    finally:
        engine.clear_cache()
        diskcache.clear()
    stats = deferfuse.stats()
    assert stats["compiles"] == 2 and stats["disk_cache_errors"] == 1 and stats["disk_cache_writes"] == 0
    assert len(_warnings(caplog)) == 1 and "off" in _warnings(caplog)[0]


def test_two_processes_writing_the_same_entries_at_once(tmp_path):
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    cache = tmp_path / "cache"
    env = dict(os.environ, DEFERFUSE_CACHE_DIR=str(cache), DEFERFUSE_ALWAYS_COMPILE="1",
               SIZES=",".join(str(n) for n in range(40, 52)), BARRIER=str(barrier))
    racers = [subprocess.Popen([sys.executable, "-c", PROGRAM], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    reports = []
    for racer in racers:
        out, err = racer.communicate(timeout=300)
        assert racer.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["errors"] == 0 for r in reports)
    assert reports[0]["values"] == reports[1]["values"]
    assert len(_entries(cache)) == 12 and not any(n.endswith(".tmp") for _, _, ns in os.walk(cache) for n in ns)
    env.pop("BARRIER")
    after = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, env=env, timeout=300)
    assert after.returncode == 0, after.stderr[-3000:]
    report = json.loads(after.stdout.strip().splitlines()[-1])
    assert report["compiles"] == 0 and report["hits"] == 12 and report["errors"] == 0
    assert report["values"] == reports[0]["values"]


# --------------------------------------------------------------------------------------------
# The bound

def test_the_folder_is_bounded_least_recently_used_first(disk):
    _graph(64)
    size = _folder_bytes(disk)
    with config.override(cache_max_bytes=int(size * 3.5)):
        for n in (65, 66):
            _graph(n)
        assert len(_entries(disk)) == 3
        _graph(64)                                  # a hit: now the most recently used
        assert deferfuse.stats()["disk_cache_hits"] == 1
        for n in (67, 68):
            _graph(n)
            assert _folder_bytes(disk) <= size * 3.5
        assert len(_entries(disk)) == 3 and diskcache.counts()["evicted"] == 2
        deferfuse.reset_stats()
        _graph(64)                                  # kept: it was used after 65 and 66
        _graph(68)
        assert deferfuse.stats()["disk_cache_hits"] == 2 and deferfuse.stats()["compiles"] == 0
        _graph(65)                                  # evicted
        assert deferfuse.stats()["compiles"] == 1


def test_the_folder_is_walked_only_when_it_may_be_over(disk, monkeypatch):
    """A write adds its size to the process's running total; the folder is walked at the
    process's first write and when the total passes the bound.  A temporary file left by a
    writer that died is deleted by a walk."""
    stale = disk / "00" / "left-by-a-dead-writer.tmp"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x" * 100)
    os.utime(stale, (time.time() - 2 * 3600,) * 2)
    walks = []
    real = diskcache._evict
    monkeypatch.setattr(diskcache, "_evict", lambda folder, limit: walks.append(folder) or real(folder, limit))
    for n in (64, 65, 66, 67):
        _graph(n)
    assert len(walks) == 1 and not stale.exists()
    size = max(os.path.getsize(p) for p in _entries(disk))
    with config.override(cache_max_bytes=_folder_bytes(disk) + size // 2):
        _graph(68)
    assert len(walks) == 2 and len(_entries(disk)) < 5


# --------------------------------------------------------------------------------------------
# Every op family, from disk

# One or two OpInfos per family, and the LAPACK-backed ones (the fast subset has none).
SWEEP_OPS = (r"^(linalg\.qr|linalg\.cholesky|linalg\.lu_factor|linalg\.solve|triangular_solve|ormqr|"
             r"fft\.rfft|sort|cumsum|nn\.functional\.conv2d|softmax|index_put|nonzero|bernoulli)$")


def _sweep(cache, json_path, args: list[str]) -> dict:
    env = dict(os.environ, DEFERFUSE_CACHE_DIR=str(cache), DEFERFUSE_ALWAYS_COMPILE="1")
    out = subprocess.run([sys.executable, "-m", "conformance.sweep", *args, "--in-process", "--progress",
                          "--json", str(json_path)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=900)
    started = [line for line in out.stderr.splitlines() if line.startswith("start ")]
    assert out.returncode == 0, (f"the sweep exited with {out.returncode} in the case "
                                 f"{started[-1][6:].strip() if started else '(none started)'}:\n"
                                 f"{out.stderr[-3000:]}")
    with open(json_path) as f:
        return json.load(f)


def _sweep_twice(tmp_path, args: list[str]) -> None:
    for attempt in range(2):
        sources = diskcache._code_version.__wrapped__()
        cache = tmp_path / f"cache{attempt}"
        first = _sweep(cache, tmp_path / "first.json", args)
        second = _sweep(cache, tmp_path / "second.json", args)
        if diskcache._code_version.__wrapped__() == sources:
            break
        # deferfuse's sources changed between the two processes (someone is editing them):
        # the second rightly compiled everything again
    else:
        pytest.fail("deferfuse's sources kept changing while the test ran")
    outcome = {c["op"] + "|" + c["dtype"] + "|" + c["variant"]: (c["status"], c["reason"]) for c in first["cases"]}
    again = {c["op"] + "|" + c["dtype"] + "|" + c["variant"]: (c["status"], c["reason"]) for c in second["cases"]}
    assert again == outcome
    assert not [k for k, (status, _) in outcome.items() if status == "fail"]
    ran, loaded = first["meta"]["disk_cache"], second["meta"]["disk_cache"]
    assert ran["writes"] > 0 and ran["errors"] == 0 and ran["not_saved"] == 0
    # (an executable the first process loaded is one it wrote earlier and dropped from memory)
    assert loaded["hits"] == ran["writes"] + ran["hits"] and loaded["errors"] == 0
    # every compile offers its executable to the cache: writes + not_saved is what was compiled
    assert loaded["writes"] + loaded["not_saved"] == 0


def test_every_op_family_loads_from_disk_in_a_second_process(tmp_path):
    _sweep_twice(tmp_path, ["--subset", "full", "--ops", SWEEP_OPS, "--max-samples", "1"])


def _long_runs_asked_for(pytest_config) -> bool:
    """``-m slow`` (not ``-m "not slow"``), or the deep suite (``make test-deep``): nothing else
    leaves ``slow`` tests out of the default run."""
    return (re.search(r"(?<!not )\bslow\b", pytest_config.getoption("markexpr") or "") is not None
            or os.environ.get("HYPOTHESIS_PROFILE") == "deep")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_fast_conformance_subset_loads_from_disk_in_a_second_process(tmp_path, request):
    """The whole CI subset (~2 minutes on 2 cores); the test above is its default-run variant."""
    if not _long_runs_asked_for(request.config):
        pytest.skip("slow: run with -m slow")
    _sweep_twice(tmp_path, ["--subset", "fast"])


# --------------------------------------------------------------------------------------------
# The test suite's own cache folder

def test_the_tests_never_use_the_users_cache_folder(tmp_path):
    """tests/conftest.py points DEFERFUSE_CACHE_DIR at a fresh folder; subprocesses the tests
    start inherit it."""
    users = [os.path.realpath(os.path.expanduser("~/.cache"))]
    if os.environ.get("XDG_CACHE_HOME"):
        users.append(os.path.realpath(os.environ["XDG_CACHE_HOME"]))
    ours = os.path.realpath(diskcache.cache_dir())
    assert not any(ours == u or ours.startswith(u + os.sep) for u in users), ours
    assert ours == os.path.realpath(os.environ["DEFERFUSE_CACHE_DIR"])
    out = subprocess.run([sys.executable, "-c", "from deferfuse.exec import diskcache; print(diskcache.cache_dir())"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert os.path.realpath(out.stdout.strip()) == ours
