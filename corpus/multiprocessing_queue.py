"""torch.multiprocessing: worker processes receive tensors through a Queue, compute, and send
results back; the parent sums them."""
import torch
import torch.multiprocessing as mp


def worker(rank, inq, outq):
    torch.manual_seed(rank)
    while True:
        item = inq.get()
        if item is None:
            break
        k, t = item
        outq.put((k, (t * 2 + rank * 0).sum().item(), (t @ t.T).trace().item()))


def main():
    torch.manual_seed(0)
    ctx = mp.get_context("spawn")
    inq, outq = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, inq, outq)) for r in range(2)]
    for p in procs:
        p.start()
    data = [torch.randn(3, 4) for _ in range(6)]
    for k, t in enumerate(data):
        inq.put((k, t))
    for _ in procs:
        inq.put(None)
    got = sorted(outq.get() for _ in data)
    for p in procs:
        p.join()
    for k, s, tr in got:
        print(k, f"{s:.4f}", f"{tr:.4f}", "check", abs(s - (data[k] * 2).sum().item()) < 1e-4)
    print("exit codes", [p.exitcode for p in procs])
    q, received = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=send_back, args=(q, received))
    p.start()
    t = q.get()
    received.set()
    p.join()
    print("tensor from child", t.tolist(), t.dtype)


def send_back(q, received):
    q.put(torch.arange(5) * 3)
    received.wait()  # keep the shared memory alive until the parent has it


if __name__ == "__main__":
    main()
