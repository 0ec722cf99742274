"""A plain training loop that prints the loss every 10 steps and a running average."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
X = torch.randn(512, 20)
Y = torch.randint(0, 5, (512,))
running = 0.0
for step in range(1, 61):
    i = (step * 32) % 512
    xb, yb = X[i:i + 32], Y[i:i + 32]
    loss = nn.functional.cross_entropy(model(xb), yb)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    running += loss.item()
    if step % 10 == 0:
        print(f"step {step:3d} loss {loss.item():.4f} avg {running / 10:.4f}")
        running = 0.0
print("final weight norm", f"{model[0].weight.norm().item():.4f}")
