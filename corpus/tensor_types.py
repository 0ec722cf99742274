"""What type a user's tensors have: a training loop keeping its best loss (loss.detach()), a
user's own Tensor subclass, Parameters, isinstance checks libraries make."""
import torch
from torch import nn


class Tagged(torch.Tensor):
    pass


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
x, y = torch.randn(16, 4), torch.randn(16, 1)
best = None
for step in range(25):
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if best is None or loss.item() < best.item():
        best = loss.detach()
print("best", f"{best.item():.4f}", type(best).__name__, type(best) is torch.Tensor)
print("param", type(model[0].weight).__name__, isinstance(model[0].weight, nn.Parameter))
t = torch.randn(3).as_subclass(Tagged) * 2
print("subclass", type(t).__name__, isinstance(t, Tagged))
u = torch.randn(3)
print("plain", type(u).__name__, isinstance(u * 2, torch.Tensor), (u * 2).sum().item() == (2 * u).sum().item())
