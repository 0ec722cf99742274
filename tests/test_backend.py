"""JAX's CPU client as deferfuse sets it up (exec/backend.py): synchronous dispatch, unless the
user chose otherwise or JAX's client existed before deferfuse first used it."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent("""
    import json, sys, torch
    if sys.argv[1] == "jax-first":
        import jax
        jax.devices()          # JAX's CPU client is created before deferfuse uses it
    import deferfuse
    import jax
    x = torch.linspace(-3, 3, 1000)
    with deferfuse.config.override(always_compile=True):
        with deferfuse.defer():
            y = (x * 0.5 + 2.0).tanh() * x
    expected = (x * 0.5 + 2.0).tanh() * x
    print(json.dumps({"async": bool(jax.config.values["jax_cpu_enable_async_dispatch"]),
                      "executions": deferfuse.stats()["executions"],
                      "equal": bool(torch.allclose(y, expected, rtol=1e-6, atol=1e-6))}))
""")


def _run(case: str, **env_vars: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("DEFERFUSE_XLA_CPU_ASYNC_DISPATCH", "JAX_CPU_ENABLE_ASYNC_DISPATCH")}
    env.update(env_vars)
    out = subprocess.run([sys.executable, "-c", PROGRAM, case], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["executions"] == 1 and result["equal"], result
    return result


def test_dispatch_is_synchronous_by_default():
    assert _run("plain")["async"] is False


@pytest.mark.parametrize("env", [{"DEFERFUSE_XLA_CPU_ASYNC_DISPATCH": "1"},
                                 {"JAX_CPU_ENABLE_ASYNC_DISPATCH": "1"}])
def test_user_choice_keeps_async_dispatch(env):
    assert _run("plain", **env)["async"] is True


def test_existing_client_is_left_alone():
    # JAX's client reads the setting when it is created: changing it later would only make the
    # setting disagree with the client
    assert _run("jax-first")["async"] is True


# -- malloc_tuning ----------------------------------------------------------------------------------
FAULTS = textwrap.dedent("""
    import json, resource, torch, deferfuse
    from deferfuse.exec import backend
    x = torch.rand(16 << 20)          # 64 MiB: above glibc's largest adaptive mmap threshold
    faults = []
    with deferfuse.config.override(always_compile=True):
        for _ in range(10):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            with deferfuse.defer():
                y = x * 2.0 + 1.0     # an XLA output buffer of 64 MiB, freed when y is dropped
            assert abs(y[7].item() - (x[7].item() * 2.0 + 1.0)) < 1e-5
            del y
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps({"tuned": backend.malloc_tuned, "again": backend.tune_malloc() if backend.malloc_tuned else None,
                      "faults": faults}))
""")


def _faults(**env_vars: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "DEFERFUSE_MALLOC_TUNING")}
    env.update(env_vars)
    out = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or __import__("platform").libc_ver()[0] != "glibc",
                           reason="mallopt is glibc's")


@glibc
def test_xla_buffers_are_reused_instead_of_faulted_in_afresh():
    tuned = _faults()
    assert tuned["tuned"] and tuned["again"]
    pages = (64 << 20) // 4096
    # after the first runs the 64 MiB result mostly comes from the heap: no fresh pages (a run
    # now and then grows the heap, while the previous result's buffer is still being released)
    later = sorted(tuned["faults"][3:])
    assert later[len(later) // 2] < pages // 8, tuned
    # untuned, glibc maps every 64 MiB block afresh and faults all its pages in
    untuned = _faults(DEFERFUSE_MALLOC_TUNING="0")
    assert not untuned["tuned"]
    assert min(untuned["faults"][3:]) > pages // 2, untuned


@glibc
def test_the_users_allocator_settings_are_left_alone():
    assert not _faults(MALLOC_TRIM_THRESHOLD_="134217728")["tuned"]
    assert not _faults(GLIBC_TUNABLES="glibc.malloc.mmap_threshold=1048576")["tuned"]
