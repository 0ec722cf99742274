"""torch.save/torch.load of a training checkpoint (model, optimizer, scheduler, RNG state) mid-run,
then resuming from it in a fresh model: the resumed run must match the uninterrupted one bit for bit
(with torch.use_deterministic_algorithms(True), as docs/semantics.md asks of a program that
compares bits across runs: by default where each step runs, torch's kernels or XLA's, follows
timings, and they round differently)."""
import io
import os
import tempfile

import torch
from torch import nn

torch.use_deterministic_algorithms(True)


def make():
    model = nn.Sequential(nn.Linear(6, 24), nn.ReLU(), nn.Dropout(0.2), nn.Linear(24, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    return model, opt, sched


def step(model, opt, sched, k):
    g = torch.Generator().manual_seed(100 + k)
    x = torch.randn(16, 6, generator=g)
    y = torch.randint(0, 2, (16,), generator=g)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


torch.manual_seed(0)
model, opt, sched = make()
full = []
ckpt_bytes = None
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "ckpt.pt")
    for k in range(10):
        if k == 5:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "rng": torch.get_rng_state(), "step": k}, path)
        full.append(step(model, opt, sched, k))
    print("uninterrupted", [f"{v:.5f}" for v in full])
    final_full = [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(1)  # a different process state before resuming
    model2, opt2, sched2 = make()
    ckpt = torch.load(path, weights_only=True)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    torch.set_rng_state(ckpt["rng"])
    resumed = [step(model2, opt2, sched2, k) for k in range(ckpt["step"], 10)]
    print("resumed", [f"{v:.5f}" for v in resumed])
    print("losses bitwise equal", resumed == full[5:])
    print("params bitwise equal", all(torch.equal(a, b) for a, b in zip(final_full, model2.parameters())))
    print("lr", opt2.param_groups[0]["lr"], "opt step", int(opt2.state[opt2.param_groups[0]["params"][0]]["step"]))
    print("keys", sorted(ckpt["model"].keys()))
buf = io.BytesIO()
torch.save(model.state_dict(), buf)
buf.seek(0)
sd = torch.load(buf)
print("BytesIO round trip", all(torch.equal(sd[k], v) for k, v in model.state_dict().items()))
