"""Processes made from a process that uses deferfuse get correct data and never hang.

The scenarios run in one fresh interpreter (tests/proc_helpers.py, shared by the tests that
read its report) under a deadline, and every wait inside it has one too, so a hang fails; each
result is compared with strict PyTorch's, computed here.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from multiprocessing.reduction import ForkingPickler

import deferfuse
from proc_helpers import expected_batches

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="fork start method needs os.fork")


@pytest.fixture(scope="module")
def scenarios():
    """What tests/proc_helpers.py observed, in a fresh interpreter started with
    TORCHTPU_MODE=defer, under a deadline."""
    env = dict(os.environ, TORCHTPU_MODE="defer")
    env["PYTHONPATH"] = os.pathsep.join([REPO, TESTS, env.get("PYTHONPATH", "")])
    try:
        done = subprocess.run([sys.executable, os.path.join(TESTS, "proc_helpers.py")], capture_output=True,
                              text=True, env=env, cwd=REPO, timeout=240)
    except subprocess.TimeoutExpired:
        raise AssertionError("the scenarios did not finish in 240 s (a hang)") from None
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def plain(scenarios):
    return scenarios["plain"]


@pytest.fixture(scope="module")
def environment(scenarios):
    return scenarios["environment"]


# -- DataLoader workers ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["fork_inside", "fork_outside", "fork_after_xla"])
def test_dataloader_workers_deliver_strict_values(plain, case):
    """The issue's example: workers forked inside a defer block recorded their ops and sent
    data-less shared memory (zeros).  Also workers forked outside a block and consumed in one,
    and workers forked after the parent started XLA: all run strict."""
    assert plain[case]["values"] == expected_batches()
    assert plain[case]["worker_modes"] == ["strict"]


def test_dataloader_workers_under_torchtpu_mode(environment):
    """TORCHTPU_MODE=defer: a forked worker starts strict; a spawned worker imports deferfuse
    again and defers, and what it puts on its queue is computed first (its collated batch was
    a pending write into shared memory, which the queue's feeder thread sent as zeros)."""
    assert environment["mode"] == "defer"
    assert environment["fork"]["values"] == expected_batches()
    assert environment["fork"]["worker_modes"] == ["strict"]
    assert environment["spawn"]["values"] == expected_batches()
    assert environment["spawn"]["worker_modes"] == ["defer"]


# -- os.fork() ------------------------------------------------------------------------------------
def test_fork_with_pending_work(plain):
    """os.fork() inside a defer block with pending work, after XLA started: the child is strict
    with nothing pending, and exits quickly; the parent's work is still right."""
    x = torch.arange(6.0)
    y, written, other = x * 2 + 1, torch.zeros(6).add_(x), x * 5
    assert plain["jax_after"] and plain["pending_before_fork"] == [True]
    assert plain["fork_exit"] == 0
    assert plain["parent_mode_after_fork"] == "defer" and plain["z_deferred"]
    assert plain["parent"] == {"y": y.tolist(), "plain": written.tolist(), "z": (y + written).tolist(),
                               "other_thread_pending": other.tolist()}
    child = plain["child"]
    assert child["mode"] == child["mode_after_block"] == "strict"
    assert child["dispatch_modes"] == child["dispatch_modes_after_block"] == 0
    assert child["plain_result_type"] == "Tensor"
    # computed before the fork: the child's copy of a written plain tensor holds its value
    assert child["y_materialized"] and child["y"] == y.tolist() and child["plain"] == written.tolist()
    # another thread's pending tensor: computed by torch's kernels, never XLA, in the child
    assert child["other_thread_pending"] == other.tolist()
    assert child["xla_executions"] == 0 and child["eager_replays"] == 1


def test_fork_under_a_users_dispatch_mode(plain):
    """A user's mode entered inside the defer block stays on the child's stack, alone."""
    assert plain["user_mode_fork_exit"] == 0


def test_defer_in_a_child_forked_after_xla_runs_at_once(plain):
    child = plain["child"]
    assert child["defer_mode"] == "defer"
    assert child["defer_result_type"] == "Tensor"
    assert child["defer_values"] == (torch.arange(6.0) * 3).tolist()
    assert child["blocks_run_at_once"] == 2
    assert child["warnings"] == 1


# -- what crosses ---------------------------------------------------------------------------------
def test_queue_carries_deferred_tensors(plain):
    """Pending and computed deferred tensors, and a plain tensor with a pending write, in
    containers, through a torch.multiprocessing Queue: the consumer gets plain tensors in
    shared memory, with strict's values."""
    x = torch.arange(6.0)

    def sent(t):
        return ["Tensor", True, t.tolist()]
    assert plain["queue_sent"] == [True, True]
    assert plain["queue_consumer_exit"] == 0
    assert plain["queue_received"] == [
        "strict", sent(x * 2), sent(x + 1), sent(torch.zeros(6).add_(x)),
        {"nested": [sent(x * 3), [sent(x - 1)]]},
        {"namedtuple": "Pair", "items": [sent(x * 4), sent(x * 5)]}]


def test_shared_memory_is_shared_with_a_forked_child(plain):
    strict = torch.arange(6.0) * 2
    strict.share_memory_()
    strict.add_(100)
    assert plain["shared"] and plain["shared_child_exit"] == 0
    assert plain["shared_after_child"] == strict.tolist()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["inside", "after"])
def test_share_memory_of_a_deferred_tensor(when):
    x = torch.arange(6.0)
    strict = x * 2
    assert strict.share_memory_() is strict and strict.is_shared()
    strict.add_(1)
    with deferfuse.defer():
        y = x * 2
        assert isinstance(y, deferfuse.DeferredTensor)
        if when == "inside":
            assert y.share_memory_() is y and y.is_shared()
            y.add_(1)
    if when == "after":
        assert y.share_memory_() is y and y.is_shared()
        y.add_(1)
    assert y.tolist() == strict.tolist()
    # shared as torch shares: a receiver's writes are the sender's
    received = ForkingPickler.loads(ForkingPickler.dumps(y))
    received.add_(10)
    assert y.tolist() == (strict + 10).tolist()


@pytest.mark.timeout(60)
def test_share_memory_of_a_plain_tensor_written_in_a_block():
    """Moving a storage into shared memory copies it with torch's copy_: inside a defer block
    that copy was recorded, and the memory stayed zeros."""
    x = torch.arange(6.0)
    strict = torch.zeros(6).add_(x)
    strict.share_memory_()
    written, untouched = torch.zeros(6), x.clone()
    with deferfuse.defer():
        written.add_(x)                      # pending when shared
        assert written.share_memory_() is written and written.is_shared()
        assert untouched.share_memory_() is untouched and untouched.is_shared()
        assert written.tolist() == strict.tolist() and untouched.tolist() == x.tolist()
        written.mul_(2)                      # into the shared memory, at the block's end
    assert written.is_shared() and written.tolist() == (strict * 2).tolist()


@pytest.mark.timeout(60)
def test_forking_pickler_reduces_deferred_tensors_as_torch_does():
    x = torch.arange(6.0)
    leaf = torch.ones(3, requires_grad=True)

    def crossed(t):
        return ForkingPickler.loads(ForkingPickler.dumps(t))
    with deferfuse.defer():
        pending = x * 2
        out = crossed(pending)
        assert type(out) is torch.Tensor and out.is_shared() and out.tolist() == (x * 2).tolist()
        wants_grad = (x * 3).requires_grad_()
        out = crossed(wants_grad)
        assert out.requires_grad and out.is_leaf and out.tolist() == (x * 3).tolist()
        parameter = torch.nn.Parameter(x * 4)
        out = crossed(parameter)
        assert type(out) is torch.nn.Parameter and out.tolist() == (x * 4).tolist()
        # (torch's reduction drops a lazy conjugate bit; strict's result is the oracle)
        conjugate = crossed(torch.complex(x, x).conj()).tolist()
        with pytest.raises(RuntimeError) as deferred_error:
            crossed(leaf * 2)
    with pytest.raises(RuntimeError) as strict_error:
        crossed(leaf * 2)
    assert str(deferred_error.value) == str(strict_error.value)
    assert conjugate == crossed(torch.complex(x, x).conj()).tolist()


# -- JAX's fork warning, and JAX kernels in a forked child ---------------------------------------
_FORK_AFTER_XLA = r"""
import json, os, sys
import torch, deferfuse
if sys.argv[1] == "user":   # the program starts JAX's client itself, before deferfuse does
    import jax
    jax.devices()

@deferfuse.jax_op("forktest::double")
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2

x = torch.arange(4.0)
with deferfuse.config.override(always_compile=True):   # deferfuse runs XLA
    for _ in range(2):
        with deferfuse.defer():
            y = (x + 1).sum()
        float(y)
parent = double(x).tolist()
pid = os.fork()
if pid == 0:
    import warnings
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ok = double(x).tolist() == parent and double(x).tolist() == parent
    ours = [str(w.message) for w in seen if "forktest::double runs XLA in a process forked" in str(w.message)]
    os._exit(0 if ok and len(ours) == 1 and "spawn" in ours[0] else 3)
_, status = os.waitpid(pid, 0)
print(json.dumps({"parent": parent, "child_exit": os.waitstatus_to_exitcode(status)}))
"""


@pytest.mark.parametrize("who_started_jax", ["deferfuse", "user"])
def test_jax_fork_warning_and_jax_ops_in_a_child_forked_after_xla(who_started_jax):
    """JAX warns at each fork that the child may deadlock.  A program whose only JAX is
    deferfuse's does not see it (a DataLoader with workers would print it where strict prints
    nothing, and deferfuse never runs XLA in such a child); one that started JAX itself still
    does.  A jax_op called in such a child runs, and warns once, naming the op and what to do."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _FORK_AFTER_XLA, who_started_jax], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"parent": [0.0, 2.0, 4.0, 6.0], "child_exit": 0}
    warned = "os.fork() was called" in done.stderr
    assert warned == (who_started_jax == "user"), done.stderr[-3000:]


# -- threads ---------------------------------------------------------------------------------------
def test_a_thread_started_in_a_defer_block_sees_the_values_written_before_it():
    """The mode is per thread: a thread reads tensors' memory directly.  A model built in the
    block had its initialization pending, and a worker thread trained it on uninitialized
    memory (losses of 1e37, inf, nan).  Thread.start now computes the starting thread's
    pending work first, as os.fork() does."""
    import threading
    torch.manual_seed(0)
    expected = torch.nn.Linear(4, 2)
    seen = {}

    def read(model, t):
        seen["weight"] = model.weight.detach().clone()
        seen["t"] = t.tolist()
        seen["type"] = type(model.weight).__name__

    torch.manual_seed(0)
    with deferfuse.defer():
        model = torch.nn.Linear(4, 2)
        t = torch.zeros(3)
        t.add_(1)
        worker = threading.Thread(target=read, args=(model, t))
        worker.start()
        worker.join()
    assert seen["type"] == "Parameter" and seen["t"] == [1.0, 1.0, 1.0]
    assert torch.equal(seen["weight"], expected.weight.detach())
