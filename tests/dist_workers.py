"""Ranks of the torch.distributed scenarios of tests/test_distributed.py (gloo, 127.0.0.1).

``python tests/dist_workers.py GROUP RANK WORLD INIT_FILE OUT_JSON`` runs every scenario of
GROUP on one rank, each under strict PyTorch and under defer in the same process, and writes
one JSON object: scenario name -> {"ok": bool, "detail": str}.  Process start is the expensive
part (torch and jax imports), so one launch of the ranks runs many checks.  Every collective
of gloo has a timeout, so a hang ends the rank (the parent has a deadline too).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import deferfuse  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=40)


def _modes():
    return {"strict": deferfuse.strict, "defer": deferfuse.defer}


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and \
            torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
    return a == b


def _plain(x):
    """Results as plain tensors computed now (read inside the mode that made them)."""
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, torch.Tensor):
        return torch.tensor(x.tolist(), dtype=x.dtype) if x.dim() else torch.tensor(x.item(), dtype=x.dtype)
    return x


def _pending(rank: int, n: int = 6, dtype=torch.float32) -> torch.Tensor:
    """A tensor computed by ops (pending under defer), different on each rank."""
    return (torch.arange(n, dtype=dtype) + 1) * (rank + 1) + 2


# -- the collective table --------------------------------------------------------------------
def _all_reduce(op, async_op):
    def run(rank, world):
        dtype = torch.int64 if op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR) else torch.float32
        t = _pending(rank, dtype=dtype)
        old = t * 2
        work = dist.all_reduce(t, op=op, async_op=async_op)
        if async_op:
            other = old + 1   # (work recorded while the collective is in flight)
            work.wait()
            return [t + 0, old, other]
        return [t, old, t * 3]
    return run


def _plain_written(async_op):
    """A plain tensor read by pending work, then written by a collective: the pending work
    keeps its old contents, and reads cached before the collective are dropped."""
    def run(rank, world):
        with deferfuse.strict():
            t = _pending(rank)
        cached = t + 0
        cached.tolist()          # (a read of t, computed and cached)
        old = t * 2
        work = dist.all_reduce(t, async_op=async_op)
        if async_op:
            work.wait()
        after = t + 0
        return [old, after, cached, t]
    return run


def _broadcast(async_op):
    def run(rank, world):
        t = _pending(rank)
        before = t.sum()
        work = dist.broadcast(t, src=0, async_op=async_op)
        if async_op:
            work.wait()
        return [t, before, t.sum()]
    return run


def _all_gather(async_op):
    def run(rank, world):
        t = _pending(rank)
        outs = [torch.zeros(6) + 5 for _ in range(world)]
        work = dist.all_gather(outs, t * 1, async_op=async_op)
        if async_op:
            work.wait()
        return [*outs, torch.stack(outs).sum(0)]
    return run


def _all_gather_into_tensor(async_op):
    def run(rank, world):
        t = _pending(rank)
        out = torch.zeros(world * 6) - 1
        work = dist.all_gather_into_tensor(out, t, async_op=async_op)
        if async_op:
            work.wait()
        return [out, out * 2]
    return run


def _reduce_scatter_tensor(async_op):
    def run(rank, world):
        t = _pending(rank, n=2 * world)
        out = torch.zeros(2) + 7
        work = dist.reduce_scatter_tensor(out, t, async_op=async_op)
        if async_op:
            work.wait()
        return [out, out + t[:2]]
    return run


def _all_to_all_single(async_op):
    def run(rank, world):
        t = _pending(rank, n=2 * world)
        out = torch.zeros(2 * world) + 1
        work = dist.all_to_all_single(out, t, async_op=async_op)
        if async_op:
            work.wait()
        return [out, out.cumsum(0)]
    return run


def _reduce(async_op):
    def run(rank, world):
        t = _pending(rank)
        work = dist.reduce(t, dst=0, async_op=async_op)
        if async_op:
            work.wait()
        return [t * 1] if rank == 0 else [torch.zeros(())]   # (other ranks' t is unspecified)
    return run


def _scatter(async_op):
    def run(rank, world):
        out = torch.zeros(3) + rank
        chunks = [_pending(r, n=3) for r in range(world)] if rank == 0 else None
        work = dist.scatter(out, chunks, src=0, async_op=async_op)
        if async_op:
            work.wait()
        return [out, out.exp()]
    return run


def _gather(async_op):
    def run(rank, world):
        t = _pending(rank, n=3)
        outs = [torch.zeros(3) for _ in range(world)] if rank == 0 else None
        work = dist.gather(t.sqrt(), outs, dst=0, async_op=async_op)
        if async_op:
            work.wait()
        return outs if rank == 0 else [t]
    return run


def _barrier(rank, world):
    t = _pending(rank)
    dist.barrier()
    return [t * 2]


def _send_recv(blocking):
    def run(rank, world):
        if rank >= 2:
            return []
        mine = _pending(rank) * 3
        got = torch.zeros(6) - 1
        peer = 1 - rank
        if blocking:
            if rank == 0:
                dist.send(mine, peer)
                dist.recv(got, peer)
            else:
                dist.recv(got, peer)
                dist.send(mine + got, peer)
        else:
            if rank == 0:
                dist.isend(mine, peer).wait()
                dist.irecv(got, peer).wait()
            else:
                dist.irecv(got, peer).wait()
                dist.isend(mine + got, peer).wait()
        return [got, got + mine]
    return run


def _objects(rank, world):
    """Object collectives: pickled into byte tensors (frombuffer: foreign memory) and back."""
    t = _pending(rank, n=3)
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "values": t.tolist()})
    objects = [t * 2 if rank == 0 else None, "x"]
    dist.broadcast_object_list(objects, src=0)
    return [torch.tensor(g["values"]) for g in gathered] + [objects[0]]


def _views(rank, world):
    """Collectives on views of pending tensors (a slice, a column, a reshaped block)."""
    base = _pending(rank, n=12).reshape(3, 4)
    row, column = base[1], base[:, 2]
    dist.all_reduce(row)
    dist.broadcast(column, src=1)
    block = base.reshape(12)[4:10]
    dist.all_reduce(block, op=dist.ReduceOp.MAX)
    return [base, row + column.sum()]


def _list_forms(rank, world):
    """all_to_all and reduce_scatter of tensor lists (where gloo runs them)."""
    ins = [_pending(rank, n=2) + r for r in range(world)]
    outs = [torch.zeros(2) for _ in range(world)]
    dist.all_to_all(outs, ins)
    return outs


def _batch_isend_irecv(rank, world):
    mine = _pending(rank) ** 2
    got = torch.zeros(6)
    ops = [dist.P2POp(dist.isend, mine, (rank + 1) % world),
           dist.P2POp(dist.irecv, got, (rank - 1) % world)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return [got, got - mine]


def _functional(kind):
    def run(rank, world):
        group = dist.group.WORLD
        t = _pending(rank, n=2 * world)
        if kind == "all_reduce":
            out = funcol.all_reduce(t, "sum", group)
        elif kind == "all_gather_tensor":
            out = funcol.all_gather_tensor(t, 0, group)
        elif kind == "reduce_scatter_tensor":
            out = funcol.reduce_scatter_tensor(t, "sum", 0, group)
        elif kind == "all_to_all_single":
            out = funcol.all_to_all_single(t, None, None, group)
        elif kind == "broadcast":
            out = funcol.broadcast(t, 0, group)
        elif kind == "autograd":   # _c10d_functional_autograd, and its backward
            w = t.detach().requires_grad_()
            gathered = funcol.all_gather_tensor_autograd(w * 3, 0, group)
            gathered.pow(2).sum().backward()
            out = torch.cat([gathered.detach(), w.grad])
        elif kind == "ops":   # the ops themselves, with wait_tensor
            ops = torch.ops._c10d_functional
            out = ops.wait_tensor(ops.all_reduce(t * 2, "max", group.group_name))
        else:   # the in-place op
            ops = torch.ops._c10d_functional
            out = t * 1
            ops.wait_tensor(ops.all_reduce_(out, "sum", group.group_name))
        return [out * 1 + 1, t]
    return run


def collective_table() -> dict:
    table = {}
    for name, op in [("sum", dist.ReduceOp.SUM), ("product", dist.ReduceOp.PRODUCT), ("min", dist.ReduceOp.MIN),
                     ("max", dist.ReduceOp.MAX), ("band", dist.ReduceOp.BAND), ("bor", dist.ReduceOp.BOR),
                     ("bxor", dist.ReduceOp.BXOR)]:
        for async_op in (False, True):
            table[f"all_reduce_{name}{'_async' if async_op else ''}"] = _all_reduce(op, async_op)
    for name, make in [("broadcast", _broadcast), ("all_gather", _all_gather),
                       ("all_gather_into_tensor", _all_gather_into_tensor),
                       ("reduce_scatter_tensor", _reduce_scatter_tensor),
                       ("all_to_all_single", _all_to_all_single), ("reduce", _reduce),
                       ("scatter", _scatter), ("gather", _gather)]:
        for async_op in (False, True):
            table[f"{name}{'_async' if async_op else ''}"] = make(async_op)
    table["plain_written"] = _plain_written(False)
    table["plain_written_async"] = _plain_written(True)
    table["barrier"] = _barrier
    table["objects"] = _objects
    table["views"] = _views
    table["all_to_all_lists"] = _list_forms
    table["send_recv"] = _send_recv(True)
    table["isend_irecv"] = _send_recv(False)
    table["batch_isend_irecv"] = _batch_isend_irecv
    for kind in ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single",
                 "broadcast", "autograd", "ops", "inplace"):
        table[f"functional_{kind}"] = _functional(kind)
    return table


def _compare(name, run, rank, world, results) -> None:
    outcome = {}
    for mode_name, mode in _modes().items():
        try:
            with mode():
                outcome[mode_name] = ("value", _plain(run(rank, world)))
        except Exception as error:  # noqa: BLE001 - compared with strict's
            outcome[mode_name] = ("error", f"{type(error).__name__}: {error}")
            if mode_name == "strict":
                break
        dist.barrier()
    strict, defer = outcome["strict"], outcome.get("defer")
    if strict[0] == "error":
        results[name] = {"ok": None, "detail": f"strict raises {strict[1][:200]}"}
        return
    ok = defer is not None and defer[0] == "value" and _same(strict[1], defer[1])
    results[name] = {"ok": ok, "detail": "" if ok else f"strict {strict[1]!r:.300} defer {defer!r:.300}"}


# -- DDP ---------------------------------------------------------------------------------------
def _model():
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                               torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(rank: int, step: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(8, 20, generator=g), torch.randn(8, 4, generator=g)


STEPS, MICRO = 3, 2


def _ddp_train(rank, world, bucket_view: bool):
    """DDP built and trained in the current mode: no_sync for the first micro-batch of each
    step, gradient clipping, SGD with momentum.  Returns the flat parameters."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(rank)   # (DDP broadcasts rank 0's parameters)
    model = DDP(_model(), bucket_cap_mb=0.002, gradient_as_bucket_view=bucket_view)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(MICRO):
            x, y = _batch(rank, step, micro)
            if micro < MICRO - 1:
                with model.no_sync():
                    (torch.nn.functional.mse_loss(model(x), y) / MICRO).backward()
            else:
                (torch.nn.functional.mse_loss(model(x), y) / MICRO).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), len(model.reducer._get_zeros_like_grad_buckets())


def _full_batch(world):
    """One process, the batches of every rank: what DDP must equal."""
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(MICRO):
            xs, ys = zip(*(_batch(r, step, micro) for r in range(world)))
            (torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)) / MICRO).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def ddp_checks(rank, world, results) -> None:
    full = _full_batch(world)
    for bucket_view in (False, True):
        got = {}
        for mode_name, mode in _modes().items():
            key = f"ddp_bucket_view_{bucket_view}_{mode_name}"
            try:
                with mode():
                    params, buckets = _ddp_train(rank, world, bucket_view)
                    params = _plain(params)
                got[mode_name] = params
                replicas = [torch.zeros_like(params) for _ in range(world)]
                dist.all_gather(replicas, params)
                same = all(torch.equal(r, replicas[0]) for r in replicas)
                results[key + "_replicas_identical"] = {"ok": same, "detail": ""}
                close = torch.allclose(params, full, rtol=1e-4, atol=1e-5)
                results[key + "_equals_full_batch"] = {"ok": close, "detail": f"{(params - full).abs().max()}"}
                results[key + "_several_buckets"] = {"ok": buckets > 1, "detail": str(buckets)}
            except Exception:  # noqa: BLE001
                results[key] = {"ok": False, "detail": traceback.format_exc()[-1500:]}
            dist.barrier()
        if len(got) == 2:
            ok = torch.allclose(got["strict"], got["defer"], rtol=1e-5, atol=1e-6)
            results[f"ddp_bucket_view_{bucket_view}_defer_equals_strict"] = {
                "ok": ok, "detail": f"{(got['strict'] - got['defer']).abs().max()}"}


class _Branchy(torch.nn.Module):
    """BatchNorm (a buffer DDP broadcasts), and with ``unused`` a layer used every other step."""

    def __init__(self, unused: bool):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 2)
        self.bn = torch.nn.BatchNorm1d(8)
        self.unused = torch.nn.Linear(8, 2) if unused else None

    def forward(self, x, use_b=True):
        h = self.bn(self.a(x).relu())
        return self.b(h) if use_b else self.unused(h)


def _ddp_variant(options: dict):
    """DDP with find_unused_parameters, static_graph or broadcast_buffers."""
    def run(rank, world):
        from torch.nn.parallel import DistributedDataParallel as DDP
        torch.manual_seed(rank)
        unused = bool(options.get("find_unused_parameters"))
        model = DDP(_Branchy(unused), bucket_cap_mb=0.0005, **options)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            g = torch.Generator().manual_seed(step + 10 * rank)
            loss = model(torch.randn(5, 6, generator=g), step % 2 == 0 or not unused).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [p.detach() for p in model.parameters()] + [model.module.bn.running_mean]
    return run


# -- MPMD: a two-stage pipeline, rank-dependent programs -----------------------------------------
def _pipeline(rank, steps: int = 3, micro: int = 2):
    """Stage ``rank`` of a two-stage pipeline: activations forward, gradients back, each
    stage its own program.  Returns the stage's flat parameters and its losses."""
    torch.manual_seed(10 + rank)
    stage = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU()) if rank == 0 else torch.nn.Linear(16, 3)
    opt = torch.optim.Adam(stage.parameters(), lr=0.01)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        for m in range(micro):
            g = torch.Generator().manual_seed(100 * step + m)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
            if rank == 0:
                h = stage(x)
                dist.send(h.detach(), 1)
                grad = torch.empty_like(h)
                dist.recv(grad, 1)
                h.backward(grad)
            else:
                h = torch.zeros(4, 16)
                dist.recv(h, 0)
                h.requires_grad_()
                loss = torch.nn.functional.mse_loss(stage(h), y)
                loss.backward()
                if loss.item() > 100:   # (a data-dependent branch on one stage only)
                    stage.weight.grad.mul_(0.5)
                dist.send(h.grad, 0)
                losses.append(loss.detach())
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in stage.parameters()])
    return _plain([flat, *losses])


def pipeline_checks(rank, world, results) -> None:
    if rank >= 2:
        return
    runs = {}
    modes = _modes()
    for label, chosen in [("strict", ("strict", "strict")), ("defer", ("defer", "defer")),
                          ("mixed_defer_first", ("defer", "strict")), ("mixed_strict_first", ("strict", "defer"))]:
        try:
            with modes[chosen[rank]]():
                runs[label] = _pipeline(rank)
        except Exception:  # noqa: BLE001
            results[f"pipeline_{label}"] = {"ok": False, "detail": traceback.format_exc()[-1500:]}
    for label, got in runs.items():
        if label != "strict":
            results[f"pipeline_{label}"] = {"ok": _same(runs["strict"], got), "detail": ""}


def _rank_dependent(rank, world):
    """Each rank loops its own number of times and branches on a value it read."""
    t = torch.ones(4) * (rank + 1)
    for i in range(rank + 2):
        t = t * 1.5 + i
    if t.sum().item() > 20:
        t = t - 1
    else:
        t = t + 1
    dist.all_reduce(t)
    s = t.sum()
    if s.item() > 0:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [t, s]


def _pipelining(rank, world):
    """torch.distributed.pipelining: a PipelineStage per rank, ScheduleGPipe, 4 microbatches."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    torch.manual_seed(20 + rank)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU()) if rank == 0 else torch.nn.Linear(16, 3)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=torch.nn.functional.mse_loss)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 3, generator=g)
    losses = []
    for step in range(2):
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        opt.step()
    return [p.detach() for p in module.parameters()] + losses


def _fsdp2(rank, world):
    """FSDP2: fully_shard per layer and on the model; parameters gathered at the end."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        g = torch.Generator().manual_seed(step * 10 + rank)
        loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.full_tensor().detach() for p in model.parameters()] + [loss.detach()]


def explain_checks(rank, world, results) -> None:
    deferfuse.reset_stats()
    with deferfuse.defer():
        t = _pending(rank)
        dist.all_reduce(t)
        t.tolist()
    stats = deferfuse.stats()
    text = deferfuse.explain(last=3)
    results["stats_count_collectives"] = {
        "ok": stats["collectives"].get("c10d::allreduce_") == 1 and stats["flushes"].get("collective") == 1,
        "detail": f"{stats['collectives']} {stats['flushes']}"}
    results["explain_names_collective"] = {"ok": "collective c10d::allreduce_" in text, "detail": text[-500:]}


def new_group_checks(rank, world, results) -> None:
    pair = dist.new_group([0, 1])

    def run(rank, world):
        t = _pending(rank)
        if rank in (0, 1):
            dist.all_reduce(t, group=pair)
            u = t * 2
        else:
            u = t.exp().sum() * torch.ones(6)   # (other work, no collective)
        dist.all_reduce(u)
        return [t, u]
    _compare("new_group_members_only", run, rank, world, results)


# -- groups of scenarios, one launch of the ranks each -----------------------------------------------
def group_main(rank, world, results) -> None:
    for name, run in collective_table().items():
        _compare(name, run, rank, world, results)
    _compare("rank_dependent_loops_and_item", _rank_dependent, rank, world, results)
    explain_checks(rank, world, results)
    pipeline_checks(rank, world, results)
    _compare("pipelining_gpipe", _pipelining, rank, world, results)
    _compare("fsdp2_fully_shard", _fsdp2, rank, world, results)
    ddp_checks(rank, world, results)
    for name in ("find_unused_parameters", "static_graph", "broadcast_buffers"):
        _compare(f"ddp_option_{name}", _ddp_variant({name: True}), rank, world, results)


def group_three(rank, world, results) -> None:
    new_group_checks(rank, world, results)
    for name in ("all_reduce_sum", "broadcast_async", "all_gather", "batch_isend_irecv", "send_recv"):
        _compare(f"{name}_{world}_ranks", collective_table()[name], rank, world, results)


GROUPS = {"main": group_main, "three": group_three}


def main(argv) -> None:
    group, rank, world, init_file, out = argv[1], int(argv[2]), int(argv[3]), argv[4], argv[5]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    results: dict = {}
    try:
        GROUPS[group](rank, world, results)
    except Exception:  # noqa: BLE001
        results["_crash"] = {"ok": False, "detail": traceback.format_exc()[-3000:]}
    with open(out, "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv)
