"""A small WGAN-GP on 2-D points: the critic's gradient penalty via autograd.grad(create_graph=True), double backward."""
import torch
from torch import nn

torch.manual_seed(0)
G = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
C = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
opt_g = torch.optim.Adam(G.parameters(), lr=1e-3, betas=(0.5, 0.9))
opt_c = torch.optim.Adam(C.parameters(), lr=1e-3, betas=(0.5, 0.9))
real_center = torch.tensor([1.5, -0.5])
lambda_gp = 10.0


def gradient_penalty(critic, real, fake):
    alpha = torch.rand(real.size(0), 1)
    interp = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    scores = critic(interp)
    grads, = torch.autograd.grad(outputs=scores, inputs=interp, grad_outputs=torch.ones_like(scores),
                                 create_graph=True, retain_graph=True)
    return ((grads.norm(2, dim=1) - 1) ** 2).mean(), grads


for step in range(40):
    real = real_center + 0.2 * torch.randn(64, 2)
    fake = G(torch.randn(64, 4)).detach()
    gp, grads = gradient_penalty(C, real, fake)
    loss_c = C(fake).mean() - C(real).mean() + lambda_gp * gp
    opt_c.zero_grad()
    loss_c.backward()
    opt_c.step()
    if step % 2 == 0:
        loss_g = -C(G(torch.randn(64, 4))).mean()
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
    if step % 10 == 9:
        print(step, f"C {loss_c.item():.4f}", f"GP {gp.item():.4f}", f"G {loss_g.item():.4f}",
              f"|grad| {grads.norm(2, dim=1).mean().item():.4f}")
gnorm = torch.sqrt(sum(p.grad.pow(2).sum() for p in C.parameters()))
print("critic grad norm", f"{gnorm.item():.4f}")
with torch.no_grad():
    samples = G(torch.randn(256, 4))
print("sample mean", [f"{v:.3f}" for v in samples.mean(0).tolist()])
