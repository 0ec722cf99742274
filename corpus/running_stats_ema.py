"""Running statistics updated in place over a loop: a parameter EMA with _foreach ops and lerp_, Welford in float64, BatchNorm with cumulative momentum, gradient zeroing and foreach clipping."""
import copy

import torch
from torch import nn

torch.manual_seed(0)


def r(t, k=4):
    return [float(f"{v:.{k}g}") for v in t.flatten().tolist()]


model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8, momentum=None), nn.ReLU(), nn.Linear(8, 2))
ema = copy.deepcopy(model)
for p in ema.parameters():
    p.requires_grad_(False)
ema_lerp = copy.deepcopy(ema)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
decay = 0.9

# Welford running mean/var of the per-sample losses, float64
count = torch.zeros((), dtype=torch.long)
mean = torch.zeros((), dtype=torch.float64)
m2 = torch.zeros((), dtype=torch.float64)
feat_sum = torch.zeros(5, dtype=torch.float64)

for step in range(12):
    x = torch.randn(16, 5)
    y = torch.randn(16, 2)
    model.train()
    out = model(x)
    per = (out - y).pow(2).mean(1)
    loss = per.mean()
    if step % 3 == 0:
        opt.zero_grad(set_to_none=True)
    else:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=True)
    opt.step()
    with torch.no_grad():
        ep = list(ema.parameters())
        mp = list(model.parameters())
        torch._foreach_mul_(ep, decay)
        torch._foreach_add_(ep, mp, alpha=1 - decay)
        for a, b in zip(ema_lerp.parameters(), model.parameters()):
            a.lerp_(b, 1 - decay)
        for a, b in zip(ema.buffers(), model.buffers()):
            a.copy_(b)
        for a, b in zip(ema_lerp.buffers(), model.buffers()):
            a.copy_(b)
        for v in per.detach().double():
            count += 1
            delta = v - mean
            mean += delta / count
            m2 += delta * (v - mean)
        feat_sum.add_(x.double().sum(0))
    bn = model[1]
    print(step, f"loss {loss.item():.4f} norm {norm.item():.4f}", "nbt", bn.num_batches_tracked.item(),
          "count", count.item(), "grad none", model[0].weight.grad is None)
    if step % 4 == 3:
        diff = max((a - b).abs().max().item() for a, b in zip(ema.parameters(), ema_lerp.parameters()))
        print(" ema", r(ema[3].weight[0]), "lerp close", diff < 1e-5)
        print(" bn mean", r(bn.running_mean[:4]), "var", r(bn.running_var[:4]))
        print(" welford", f"{mean.item():.5f}", f"{(m2 / (count - 1)).item():.5f}")

allp = torch.cat([p.detach().flatten() for p in model.parameters()])
print("params sum", f"{allp.sum().item():.4f}", "feat mean", r(feat_sum / (12 * 16)))

# eval mode uses the cumulative stats; ema model evaluated too
model.eval()
ema.eval()
xe = torch.randn(4, 5)
with torch.no_grad():
    print("eval", r(model(xe)), "ema eval", r(ema(xe)))
print("nbt after eval", model[1].num_batches_tracked.item())

# param.data.copy_ and a requires_grad_(False) buffer-like parameter updated under no_grad
frozen = nn.Parameter(torch.zeros(3), requires_grad=False)
lin = nn.Linear(3, 3)
for step in range(5):
    with torch.no_grad():
        frozen.add_(torch.arange(3.0) * (step + 1))
        frozen.clamp_(max=10.0)
    lin.weight.data.copy_(torch.eye(3) * (step + 1))
    lin.bias.data.fill_(0.5)
    out = lin(frozen)
    print(step, "frozen", frozen.tolist(), frozen.requires_grad, "out", r(out), out.requires_grad)

# manual BatchNorm-style running stats with momentum and a cumulative average
rm = torch.zeros(3)
rv = torch.ones(3)
cm = torch.zeros(3)
nbt = torch.tensor(0, dtype=torch.long)
for step in range(6):
    b = torch.randn(8, 3) * (step + 1)
    with torch.no_grad():
        nbt.add_(1)
        rm.mul_(0.9).add_(b.mean(0), alpha=0.1)
        rv.mul_(0.9).add_(b.var(0, unbiased=True), alpha=0.1)
        cm.add_((b.mean(0) - cm) / nbt)
    print(step, "nbt", nbt.item(), "rm", r(rm), "rv", r(rv), "cm", r(cm))
