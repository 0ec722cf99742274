"""TorchScript: torch.jit.script and torch.jit.trace of small models, saved to a BytesIO, loaded,
and run on new inputs (including a data-dependent branch in the scripted one)."""
import io

import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if bool(h.sum() > 0):
            return torch.relu(h)
        return -h


torch.manual_seed(0)
scripted = torch.jit.script(Gate())
buf = io.BytesIO()
torch.jit.save(scripted, buf)
buf.seek(0)
loaded = torch.jit.load(buf)
for k in range(3):
    x = torch.randn(2, 4) * (k - 1)
    a, b = scripted(x), loaded(x)
    print("script", k, [f"{v:.4f}" for v in b.flatten().tolist()], torch.equal(a, b))
print("script code has if", "if" in scripted.code)
net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)).eval()
traced = torch.jit.trace(net, torch.randn(1, 3, 8, 8))
buf = io.BytesIO()
torch.jit.save(traced, buf)
buf.seek(0)
t2 = torch.jit.load(buf)
new = torch.randn(3, 3, 10, 10)
with torch.no_grad():
    ref = net(new)
    out = t2(new)
print("trace new shape", tuple(out.shape), bool(torch.allclose(ref, out, atol=1e-6)))
print("trace values", [f"{v:.4f}" for v in out.flatten().tolist()])


@torch.jit.script
def swish_sum(x: torch.Tensor, n: int) -> torch.Tensor:
    acc = torch.zeros_like(x)
    for i in range(n):
        acc = acc + x * torch.sigmoid(x * float(i))
    return acc


print("scripted fn", [f"{v:.4f}" for v in swish_sum(torch.linspace(-1, 1, 5), 3).tolist()])
y = torch.randn(5, requires_grad=True)
swish_sum(y, 2).sum().backward()
print("grad through script", f"{y.grad.sum().item():.4f}")
print("type", type(loaded).__name__)
