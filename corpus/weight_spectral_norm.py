"""Parametrizations: weight_norm, spectral_norm (power iteration in train mode) and a user-written one."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

torch.manual_seed(0)


class Symmetric(nn.Module):
    def forward(self, X):
        return X.triu() + X.triu(1).transpose(-1, -2)


class SkewExp(nn.Module):
    """An orthogonal matrix as the exponential of a skew-symmetric one."""
    def forward(self, X):
        A = X.triu(1)
        return torch.matrix_exp(A - A.transpose(-1, -2))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = weight_norm(nn.Conv2d(1, 8, 3, padding=1))
        self.conv2 = spectral_norm(nn.Conv2d(8, 8, 3, padding=1))
        self.fc1 = spectral_norm(nn.Linear(8 * 4 * 4, 32), n_power_iterations=2)
        self.mix = nn.Linear(32, 32, bias=False)
        parametrize.register_parametrization(self.mix, "weight", Symmetric())
        self.rot = nn.Linear(32, 32)
        parametrize.register_parametrization(self.rot, "weight", SkewExp())
        self.out = weight_norm(nn.Linear(32, 3), dim=0)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        x = torch.tanh(self.mix(x))
        x = self.rot(x)
        return self.out(x)


model = Net()
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
x = torch.randn(24, 1, 16, 16)
y = torch.randint(0, 3, (24,))
for step in range(30):
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 10 == 9:
        print(step, f"loss {loss.item():.4f}")

sn = model.conv2.parametrizations.weight[0]
print("conv2 _u norm", f"{sn._u.norm().item():.4f}", "_v norm", f"{sn._v.norm().item():.4f}")
print("fc1 _u[:3]", [f"{v:.4f}" for v in model.fc1.parametrizations.weight[0]._u[:3].tolist()])
with torch.no_grad():
    sigma = torch.linalg.matrix_norm(model.fc1.weight, ord=2)
print("fc1 sigma", f"{sigma.item():.3f}")
W = model.mix.weight
print("mix symmetric", torch.allclose(W, W.T))
R = model.rot.weight
print("rot orthogonal", torch.allclose(R @ R.T, torch.eye(32), atol=1e-4))
print("weight_norm g sum", f"{model.out.parametrizations.weight.original0.sum().item():.4f}")

model.eval()
with torch.no_grad():
    u_before = sn._u.clone()
    out = model(x)
    print("eval u unchanged", torch.equal(u_before, sn._u))
print("eval out sum", f"{out.sum().item():.4f}", "abs", f"{out.abs().sum().item():.4f}")
print("eval accuracy", f"{(out.argmax(1) == y).float().mean().item():.4f}")
print("state keys", len(model.state_dict()))
