"""torch.distributed under defer mode (issue 28): collectives are flush points that run on torch's
process group, DDP builds and trains inside defer, and ranks may run different programs.

The ranks are processes on gloo over 127.0.0.1.  Each launch runs many scenarios
(tests/dist_workers.py): every scenario runs under strict PyTorch and under defer in the same
rank, and the rank reports whether the two agree; DDP is also compared with one process
training on every rank's batch.  Every launch has a deadline, and every collective a timeout,
so a hang fails.
"""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

import dist_workers

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
DEADLINE = 150   # seconds a launch of the ranks may take (a hang fails here)
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _env(user_settings: bool = False, **extra) -> dict:
    """The environment of the ranks (``user_settings``: without the test suite's settings of
    deferfuse, as a user's script runs)."""
    env = dict(os.environ)
    env.pop("TORCHTPU_MODE", None)
    if user_settings:
        for name in [n for n in env if n.startswith("DEFERFUSE_")]:
            del env[name]
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join([REPO, TESTS, env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _launch(group: str, world: int, tmp_path) -> list[dict]:
    """Run the scenarios of ``group`` on ``world`` ranks; their reports, by rank."""
    procs = [subprocess.Popen([sys.executable, os.path.join(TESTS, "dist_workers.py"), group, str(r), str(world),
                               str(tmp_path / "init"), str(tmp_path / f"out{r}.json")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO)
             for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=DEADLINE)[0])
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the ranks of {group!r} did not finish in {DEADLINE} s (a hang)") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    reports = []
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} failed:\n{log[-4000:]}"
        reports.append(json.loads((tmp_path / f"out{r}.json").read_text()))
    for r, report in enumerate(reports):
        assert "_crash" not in report, f"rank {r}: {report['_crash']['detail']}"
    return reports


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _launch("main", 2, tmp_path_factory.mktemp("dist2"))


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    return _launch("three", 3, tmp_path_factory.mktemp("dist3"))


def _check(reports: list[dict], prefix: str, at_least: int = 1) -> None:
    found = 0
    for r, report in enumerate(reports):
        for name, result in report.items():
            if name == prefix or name.startswith(prefix + "_"):
                found += 1
                assert result["ok"], f"rank {r}: {name}: {result['detail']}"
    assert found >= at_least, f"no result named {prefix!r}"


@pytest.mark.parametrize("name", list(dist_workers.collective_table()))
def test_collective_on_pending_tensors_equals_strict(two_ranks, name):
    """Each collective (sync and async, in place and out of place, the functional ones) on
    tensors pending under defer gives strict's results; pending readers of a written tensor
    keep its old contents (``plain_written``)."""
    for r, report in enumerate(two_ranks):
        assert report[name]["ok"], f"rank {r}: {report[name]['detail']}"


def test_ddp_built_and_trained_inside_defer(two_ranks):
    """DDP built inside defer, several buckets, no_sync accumulation and gradient clipping,
    with gradient_as_bucket_view off and on: equal to strict DDP and to one process training
    on the full batch; replicas identical."""
    for bucket_view in (False, True):
        for check in ("replicas_identical", "equals_full_batch", "several_buckets"):
            _check(two_ranks, f"ddp_bucket_view_{bucket_view}_defer_{check}", at_least=2)
        _check(two_ranks, f"ddp_bucket_view_{bucket_view}_defer_equals_strict", at_least=2)


@pytest.mark.parametrize("option", ["find_unused_parameters", "static_graph", "broadcast_buffers"])
def test_ddp_options_inside_defer(two_ranks, option):
    """DDP with an unused layer every other step (find_unused_parameters), static_graph, and
    BatchNorm buffers broadcast each step: equal to strict DDP."""
    _check(two_ranks, f"ddp_option_{option}", at_least=2)


@pytest.mark.parametrize("label", ["defer", "mixed_defer_first", "mixed_strict_first"])
def test_two_stage_pipeline_mpmd(two_ranks, label):
    """A hand-written pipeline, each rank its own stage (send/recv of activations and
    gradients, a .item() branch on one stage only), under defer and with one rank strict."""
    _check(two_ranks, f"pipeline_{label}", at_least=2)


def test_pipelining_schedule_gpipe(two_ranks):
    """torch.distributed.pipelining: PipelineStage + ScheduleGPipe, 4 microbatches."""
    _check(two_ranks, "pipelining_gpipe", at_least=2)


def test_fsdp2_fully_shard(two_ranks):
    """FSDP2 (fully_shard, DTensor parameters; it frees and reallocates unsharded memory with
    UntypedStorage.resize_) trains as strict does."""
    _check(two_ranks, "fsdp2_fully_shard", at_least=2)


def test_rank_dependent_loops_and_item_branches(two_ranks):
    _check(two_ranks, "rank_dependent_loops_and_item", at_least=2)


def test_stats_and_explain_name_the_collective(two_ranks):
    _check(two_ranks, "stats_count_collectives", at_least=2)
    _check(two_ranks, "explain_names_collective", at_least=2)


def test_new_group_used_only_by_its_members(three_ranks):
    """new_group([0, 1]) of three ranks: its collectives run on ranks 0 and 1 only."""
    _check(three_ranks, "new_group_members_only", at_least=3)


@pytest.mark.parametrize("name", ["all_reduce_sum", "broadcast_async", "all_gather", "batch_isend_irecv",
                                  "send_recv"])
def test_collectives_on_three_ranks(three_ranks, name):
    _check(three_ranks, f"{name}_3_ranks", at_least=3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("how", ["-m deferfuse --mode defer", "TORCHTPU_MODE=defer"])
def test_torchrun_script_unchanged(how, tmp_path):
    """``torchrun ... -m deferfuse --mode defer script.py`` and ``TORCHTPU_MODE=defer torchrun
    script.py``: an unchanged script (all_reduce, DDP training) equals its strict run."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun is not installed beside this Python")
    script = os.path.join(TESTS, "dist_script.py")
    head = [torchrun, "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(_free_port())]
    if how.startswith("-m"):
        command, env = head + ["-m", "deferfuse", "--mode", "defer", script], _env(True, DIST_SCRIPT_OUT=str(tmp_path))
    else:
        # (no exploration budget: a script this short runs at once as strict under the default
        # settings, as the other case shows; this one checks the collectives deferred)
        command, env = head + [script], _env(True, TORCHTPU_MODE="defer", DIST_SCRIPT_OUT=str(tmp_path),
                                             DEFERFUSE_EXPLORE_SHARE="1")
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"torchrun did not finish in {DEADLINE} s (a hang)") from None
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in reports:
        assert r["mode"] == "defer" and r["equal"], r
        if not how.startswith("-m"):
            assert r["collectives"].get("c10d::allreduce_", 0) >= 2, r


def test_storage_resize_inside_defer_computes_pending_reads_first():
    """UntypedStorage.resize_ (no aten op sees it; FSDP2 frees and reallocates memory with it):
    pending readers of the memory see it as it was, and the memory is read afresh after."""
    import torch

    import deferfuse

    def program():
        with deferfuse.strict():
            x = torch.arange(6.0)   # (plain memory, as FSDP2's unsharded parameters are)
        with_pending = x * 2
        x.untyped_storage().resize_(0)
        x.untyped_storage().resize_(6 * 4)
        x.copy_(torch.ones(6))
        return with_pending.tolist(), (x + 1).tolist()

    with deferfuse.strict():
        expected = program()
    with deferfuse.defer():
        got = program()
    assert got == expected
