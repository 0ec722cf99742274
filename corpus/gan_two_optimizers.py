"""A tiny GAN on 2-D points: a generator and a discriminator, each with its own Adam optimizer."""
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
G = nn.Sequential(nn.Linear(4, 32), nn.LeakyReLU(0.2), nn.Linear(32, 2))
D = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
opt_g = torch.optim.Adam(G.parameters(), lr=2e-3, betas=(0.5, 0.999))
opt_d = torch.optim.Adam(D.parameters(), lr=2e-3, betas=(0.5, 0.999))
real_center = torch.tensor([2.0, -1.0])
for step in range(60):
    real = real_center + 0.3 * torch.randn(32, 2)
    z = torch.randn(32, 4)
    fake = G(z)
    d_real, d_fake = D(real), D(fake.detach())
    loss_d = F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real)) + \
        F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake))
    opt_d.zero_grad()
    loss_d.backward()
    opt_d.step()
    d_gen = D(fake)
    loss_g = F.binary_cross_entropy_with_logits(d_gen, torch.ones_like(d_gen))
    opt_g.zero_grad()
    loss_g.backward()
    opt_g.step()
    if step % 10 == 9:
        print(step, f"D {loss_d.item():.4f}", f"G {loss_g.item():.4f}")
with torch.no_grad():
    samples = G(torch.randn(256, 4))
print("sample mean", [f"{v:.3f}" for v in samples.mean(0).tolist()])
print("D grads set", all(p.grad is not None for p in D.parameters()))
