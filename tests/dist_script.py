"""An unchanged torch.distributed script for tests/test_distributed.py, started by torchrun
under a deferfuse mode (``-m deferfuse --mode defer`` or TORCHTPU_MODE=defer): an all_reduce of
computed tensors and a few DDP training steps, compared with the same code under
deferfuse.strict() in the same process.  Each rank writes a JSON report into $DIST_SCRIPT_OUT."""

import datetime
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import deferfuse


def program(rank):
    t = torch.arange(6.0) * (rank + 1) + 1
    old = t * 2
    dist.all_reduce(t)
    torch.manual_seed(rank)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)),
                bucket_cap_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(step * 10 + rank)
        loss = model(torch.randn(4, 10, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print_loss = f"{loss:.4f}"   # (a read, as a training script's log line)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return [x.tolist() for x in (t, old, params)] + [print_loss]


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=40))
    rank = dist.get_rank()
    mode = deferfuse.get_mode().value
    got = program(rank)
    with deferfuse.strict():
        expected = program(rank)
    close = all(torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)
                for a, b in zip(got[:3], expected[:3]))
    report = json.dumps({"rank": rank, "mode": mode, "equal": close, "collectives": deferfuse.stats()["collectives"]})
    with open(os.path.join(os.environ["DIST_SCRIPT_OUT"], f"rank{rank}.json"), "w") as f:
        f.write(report)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
