"""Gradient accumulation over micro-batches with clip_grad_norm_ and clip_grad_value_, compared with
one big batch."""
import copy

import torch
from torch import nn

torch.manual_seed(0)
base = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
X = torch.randn(64, 10)
Y = torch.randn(64, 1)

big = copy.deepcopy(base)
acc = copy.deepcopy(base)
opt_big = torch.optim.SGD(big.parameters(), lr=0.05)
opt_acc = torch.optim.SGD(acc.parameters(), lr=0.05)
accum = 4
for step in range(5):
    opt_big.zero_grad()
    loss_big = nn.functional.mse_loss(big(X), Y)
    loss_big.backward()
    nb = nn.utils.clip_grad_norm_(big.parameters(), max_norm=0.5)
    opt_big.step()

    opt_acc.zero_grad()
    total = 0.0
    for chunk in range(accum):
        xs, ys = X[chunk * 16:(chunk + 1) * 16], Y[chunk * 16:(chunk + 1) * 16]
        loss = nn.functional.mse_loss(acc(xs), ys) / accum
        loss.backward()
        total += loss.item()
    na = nn.utils.clip_grad_norm_(acc.parameters(), max_norm=0.5)
    opt_acc.step()
    print(step, f"{loss_big.item():.5f}", f"{total:.5f}", f"norms {nb.item():.4f} {na.item():.4f}")
diff = max((p - q).abs().max().item() for p, q in zip(big.parameters(), acc.parameters()))
print("params close", diff < 1e-5)
m = copy.deepcopy(base)
(m(X).pow(3).sum()).backward()
nn.utils.clip_grad_value_(m.parameters(), clip_value=0.1)
print("max |grad| after clip_value", f"{max(p.grad.abs().max().item() for p in m.parameters()):.4f}")
norm_inf = nn.utils.clip_grad_norm_(m.parameters(), max_norm=1.0, norm_type=float("inf"))
print("inf norm", f"{norm_inf.item():.4f}")
