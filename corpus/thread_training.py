"""A model built in the main thread, trained in a threading.Thread, results read back in main; and
inference from two threads over one shared model."""
import threading

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))
X = torch.randn(64, 5)
Y = X[:, :1] * 0.5 - X[:, 1:2]
log = []


def train():
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(30):
        loss = nn.functional.mse_loss(model(X), Y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 9:
            log.append(f"{loss.item():.5f}")


worker = threading.Thread(target=train)
worker.start()
worker.join()
print("losses from thread", log)
with torch.no_grad():
    print("main thread loss", f"{nn.functional.mse_loss(model(X), Y).item():.5f}")
results = {}


def infer(name, scale):
    with torch.no_grad():
        results[name] = model(X * scale).sum().item()


threads = [threading.Thread(target=infer, args=(f"t{i}", 1.0 + i)) for i in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("thread results", [f"{results[k]:.4f}" for k in sorted(results)])
out = {}


def make_tensor():
    out["t"] = torch.arange(4.0) * 3


th = threading.Thread(target=make_tensor)
th.start()
th.join()
print("tensor made in thread", out["t"].tolist(), type(out["t"]).__name__)
