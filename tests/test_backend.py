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
