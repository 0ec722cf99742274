"""An exponential moving average copy of a model (copy.deepcopy), updated with lerp_ / mul_+add_
after each step, evaluated against the live model."""
import copy

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))
ema = copy.deepcopy(model)
for p in ema.parameters():
    p.requires_grad_(False)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
X = torch.randn(128, 8)
Y = (X[:, :1] * 2 - X[:, 1:2]).tanh()
decay = 0.9
for step in range(20):
    idx = torch.arange(step * 16, step * 16 + 16) % 128
    loss = nn.functional.mse_loss(model(X[idx]), Y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        for pe, pm in zip(ema.parameters(), model.parameters()):
            pe.mul_(decay).add_(pm, alpha=1 - decay)
        for be, bm in zip(ema.buffers(), model.buffers()):
            be.copy_(bm)
    if step % 5 == 4:
        print(step, f"{loss.item():.4f}")
model.eval()
ema.eval()
with torch.no_grad():
    print("live loss", f"{nn.functional.mse_loss(model(X), Y).item():.4f}")
    print("ema loss", f"{nn.functional.mse_loss(ema(X), Y).item():.4f}")
print("ema differs from model", not torch.equal(ema[0].weight, model[0].weight))
print("ema requires_grad", ema[0].weight.requires_grad, "model", model[0].weight.requires_grad)
print("ema is Parameter", type(ema[0].weight).__name__)
# the torch.optim.swa_utils way
swa = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
for k in range(3):
    with torch.no_grad():
        model[0].weight.add_(0.01)
    swa.update_parameters(model)
print("swa n_averaged", swa.n_averaged.item(), f"{swa.module[0].weight.sum().item():.4f}")
