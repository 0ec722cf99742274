"""Processes made from a process that uses deferfuse: the scenarios of tests/test_processes.py.

Run as a script with TORCHTPU_MODE=defer, ``python tests/proc_helpers.py``, it prints one
JSON line of what it observed; the test compares that with strict PyTorch.  A spawned child
imports this file again (as ``__mp_main__``), so everything at the top level is importable and
quick: the dataset, the queue consumer.  Every wait has a deadline, so a hang ends as a failure.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import sys
import tempfile
import threading
import time
import traceback

import torch
import torch.multiprocessing as mp
import torch.utils._python_dispatch

import deferfuse

DEADLINE = 60   # seconds any one wait may take (a DataLoader's timeout, a child's exit)
Pair = collections.namedtuple("Pair", "first second")


class Doubled(torch.utils.data.Dataset):
    """Item i: (i * 2 + [0, 1, 2, 3], the eager mode the worker ran it in)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        return torch.full((4,), float(i)) * 2 + torch.arange(4.0), deferfuse.get_mode().value


def expected_batches(batch_size: int = 8) -> list:
    """What a DataLoader over Doubled gives under strict PyTorch (values only)."""
    items = [torch.full((4,), float(i)) * 2 + torch.arange(4.0) for i in range(len(Doubled()))]
    return [torch.stack(items[i:i + batch_size]).tolist() for i in range(0, len(items), batch_size)]


def loader(context: str, workers: int = 2):
    return torch.utils.data.DataLoader(Doubled(), batch_size=8, num_workers=workers,
                                       multiprocessing_context=context, timeout=DEADLINE)


def _batches(batches) -> dict:
    """Values (computed in this process, inside whatever mode is on) and the workers' modes."""
    values, modes = [], set()
    for data, mode in batches:
        values.append((data * 1).tolist())
        modes.update(mode)
    return {"values": values, "worker_modes": sorted(modes)}


def _described(obj):
    """``obj`` as JSON: each tensor as [type name, shared?, values]."""
    if isinstance(obj, torch.Tensor):
        return [type(obj).__name__, obj.is_shared(), obj.tolist()]
    if isinstance(obj, dict):
        return {k: _described(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return {"namedtuple": type(obj).__name__, "items": [_described(v) for v in obj]}
    return [_described(v) for v in obj]


def consume(inbox, outbox, count: int) -> None:
    """A consumer process: describes ``count`` objects from ``inbox`` into ``outbox``."""
    outbox.put([deferfuse.get_mode().value] + [_described(inbox.get(timeout=DEADLINE)) for _ in range(count)])


def _wait(pid: int) -> int:
    """The exit status of child ``pid``, killed if it outlives the deadline (-1 then)."""
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return -1


@contextlib.contextmanager
def _child_exits(in_child, finished: bool = True):
    """A forked child never runs on past its part (``in_child()`` says whether this is the
    child): it exits with 1 if the block raised, and with 0 at its end if ``finished``."""
    try:
        yield
    except BaseException:
        if in_child():
            traceback.print_exc()
            os._exit(1)
        raise
    if finished and in_child():
        os._exit(0)


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _fork_with_pending_work(report: dict) -> None:
    """os.fork() inside a defer block with pending work, after XLA started, while another thread
    holds a block with pending work too."""
    x = torch.arange(6.0)
    plain = torch.zeros(6)
    recorded, forked = threading.Event(), threading.Event()
    other: dict = {}

    def other_thread() -> None:
        with deferfuse.defer():
            other["pending"] = x * 5
            recorded.set()
            forked.wait(DEADLINE)
    thread = threading.Thread(target=other_thread, daemon=True)
    thread.start()
    recorded.wait(DEADLINE)
    descriptor, out_path = tempfile.mkstemp(prefix="deferfuse-fork-", suffix=".json")
    os.close(descriptor)
    child: dict = {}
    pid = -1
    with _child_exits(lambda: pid == 0, finished=False), deferfuse.defer():
        y = x * 2 + 1                # pending, deferred
        plain.add_(x)                # a pending write into a plain tensor
        report["pending_before_fork"] = [not deferfuse.is_materialized(y)]
        pid = os.fork()
        if pid == 0:
            warnings = _Warnings()
            logging.getLogger("deferfuse").addHandler(warnings)
            before = deferfuse.stats()
            child["mode"] = deferfuse.get_mode().value
            child["dispatch_modes"] = torch._C._len_torch_dispatch_stack()
            child["plain_result_type"] = type(x + 1).__name__
            child["y_materialized"] = deferfuse.is_materialized(y)
            child["y"] = y.tolist()
            child["plain"] = plain.tolist()
            for _ in range(2):
                with deferfuse.defer():
                    inside = x * 3
                    child["defer_mode"] = deferfuse.get_mode().value
                    child["defer_result_type"] = type(inside).__name__
                    child["defer_values"] = inside.tolist()
            with deferfuse.config.override(always_compile=True):
                child["other_thread_pending"] = other["pending"].tolist()
            after = deferfuse.stats()
            child["blocks_run_at_once"] = after["blocks_run_at_once"] - before["blocks_run_at_once"]
            child["xla_executions"] = after["executions"] - before["executions"]
            child["eager_replays"] = after["eager_replays"] - before["eager_replays"]
            child["warnings"] = sum("forked from one that had started XLA" in m for m in warnings.messages)
        else:
            report["fork_exit"] = _wait(pid)
            report["parent_mode_after_fork"] = deferfuse.get_mode().value
            z = y + plain            # recorded after the fork, still deferred
            report["z_deferred"] = isinstance(z, deferfuse.DeferredTensor)
    if pid == 0:
        with _child_exits(lambda: True):
            # the child left the block its parent entered: still strict, nothing on the stack
            child["mode_after_block"] = deferfuse.get_mode().value
            child["dispatch_modes_after_block"] = torch._C._len_torch_dispatch_stack()
            with open(out_path, "w") as f:
                json.dump(child, f)
    forked.set()
    thread.join(DEADLINE)
    report["parent"] = {"y": y.tolist(), "plain": plain.tolist(), "z": z.tolist(),
                        "other_thread_pending": other["pending"].tolist()}
    with open(out_path) as f:
        report["child"] = json.load(f)
    os.unlink(out_path)


class Counting(torch.utils._python_dispatch.TorchDispatchMode):
    """A user's dispatch mode: counts the ops it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _fork_under_a_user_mode(report: dict) -> None:
    """os.fork() inside a user's dispatch mode entered inside a defer block: the child keeps
    the user's mode, without deferfuse's under it."""
    x = torch.arange(6.0)
    pid = -1
    with _child_exits(lambda: pid == 0), deferfuse.defer():
        with Counting() as counting:
            pid = os.fork()
            if pid == 0:
                seen = counting.ops
                result = x + 1
                assert torch._C._len_torch_dispatch_stack() == 1 and counting.ops == seen + 1
                assert type(result) is torch.Tensor and result.tolist() == (x.numpy() + 1).tolist()
        assert pid != 0 or torch._C._len_torch_dispatch_stack() == 0
        if pid != 0:
            report["user_mode_fork_exit"] = _wait(pid)


def _queue_to_another_process(report: dict) -> None:
    """Deferred tensors, pending and computed, and a plain tensor with a pending write, through
    a torch.multiprocessing Queue to a consumer process."""
    context = mp.get_context("fork")
    inbox, outbox = context.Queue(), context.Queue()
    consumer = context.Process(target=consume, args=(inbox, outbox, 5), daemon=True)
    consumer.start()
    x = torch.arange(6.0)
    with deferfuse.defer():
        pending = x * 2
        computed = x + 1
        computed.tolist()
        plain = torch.zeros(6)
        plain.add_(x)
        report["queue_sent"] = [not deferfuse.is_materialized(pending), deferfuse.is_materialized(computed)]
        inbox.put(pending)
        inbox.put(computed)
        inbox.put(plain)
        inbox.put({"nested": (x * 3, [x - 1])})
        inbox.put(Pair(x * 4, x * 5))
        report["queue_received"] = outbox.get(timeout=DEADLINE)
    consumer.join(DEADLINE)
    report["queue_consumer_exit"] = consumer.exitcode


def _shared_memory_across_fork(report: dict) -> None:
    """share_memory_() of a deferred tensor, then a forked child writes it in place."""
    x = torch.arange(6.0)
    pid = -1
    with _child_exits(lambda: pid == 0), deferfuse.defer():
        y = x * 2
        y.share_memory_()
        report["shared"] = y.is_shared()
        pid = os.fork()
        if pid == 0:
            y.add_(100)              # strict in the child: straight into the shared memory
            return
        report["shared_child_exit"] = _wait(pid)
        report["shared_after_child"] = y.tolist()


def plain() -> dict:
    report: dict = {}
    with deferfuse.defer():
        report["fork_inside"] = _batches(loader("fork"))
    batches = iter(loader("fork"))   # workers forked outside any block
    with deferfuse.defer():
        report["fork_outside"] = _batches(batches)
    _queue_to_another_process(report)
    _shared_memory_across_fork(report)
    report["jax_before"] = "jax" in sys.modules
    with deferfuse.config.override(always_compile=True), deferfuse.defer():
        report["xla_value"] = (torch.arange(6.0) * 7).sum().item()
    report["jax_after"] = "jax" in sys.modules
    with deferfuse.defer():
        report["fork_after_xla"] = _batches(loader("fork"))
    _fork_with_pending_work(report)
    _fork_under_a_user_mode(report)
    return report


def environment() -> dict:
    """Under TORCHTPU_MODE=defer: loaders made in the default (deferred) mode."""
    return {"mode": deferfuse.get_mode().value,
            "fork": _batches(loader("fork")),
            "spawn": _batches(loader("spawn", workers=1))}


def main() -> dict:
    """Started with TORCHTPU_MODE=defer (each interpreter spends seconds importing torch, so
    one runs both): the environment's scenarios, then, strict by default and with the variable
    gone for the children, the others."""
    report = {"environment": environment()}
    deferfuse.set_mode("strict")
    os.environ.pop("TORCHTPU_MODE", None)
    report["plain"] = plain()
    return report


if __name__ == "__main__":
    print(json.dumps(main()))
