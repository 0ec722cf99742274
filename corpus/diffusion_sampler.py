"""A DDPM-like sampler: a tiny denoiser conditioned on a timestep embedding, 100 reverse steps
under no_grad with seeded noise from a generator, the sample read only at the end."""
import math

import torch
from torch import nn

torch.manual_seed(0)


class Denoiser(nn.Module):
    def __init__(self, dim=8, hidden=64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim + 16, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, dim))

    def forward(self, x, t):
        half = 8
        freqs = torch.exp(-math.log(1000) * torch.arange(half) / half)
        ang = t[:, None].float() * freqs[None]
        temb = torch.cat([ang.sin(), ang.cos()], dim=1)
        return self.net(torch.cat([x, temb], dim=1))


T = 100
betas = torch.linspace(1e-4, 0.02, T)
alphas = 1 - betas
alpha_bar = torch.cumprod(alphas, 0)
model = Denoiser().eval()
g = torch.Generator().manual_seed(2024)
x = torch.randn(32, 8, generator=g)
with torch.no_grad():
    for t in reversed(range(T)):
        tt = torch.full((32,), t)
        eps = model(x, tt)
        mean = (x - betas[t] / torch.sqrt(1 - alpha_bar[t]) * eps) / torch.sqrt(alphas[t])
        if t > 0:
            x = mean + torch.sqrt(betas[t]) * torch.randn(x.shape, generator=g)
        else:
            x = mean
print("sample mean", f"{x.mean().item():.5f}", "std", f"{x.std().item():.5f}")
print("first row", [f"{v:.4f}" for v in x[0].tolist()])
# DDIM-style deterministic sampler with a python-float schedule
x = torch.randn(32, 8, generator=g)
steps = list(range(T - 1, -1, -10))
with torch.no_grad():
    for i, t in enumerate(steps):
        ab = alpha_bar[t]
        ab_prev = alpha_bar[steps[i + 1]] if i + 1 < len(steps) else torch.tensor(1.0)
        eps = model(x, torch.full((32,), t))
        x0 = (x - (1 - ab).sqrt() * eps) / ab.sqrt()
        x = ab_prev.sqrt() * x0 + (1 - ab_prev).sqrt() * eps
print("ddim", f"{x.abs().mean().item():.5f}", f"{x.sum().item():.4f}")
