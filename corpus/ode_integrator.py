"""An RK4 integrator of a damped pendulum ensemble and a neural ODE field: 300 steps with no
reads inside the loop, the state read only at the end."""
import torch
from torch import nn

torch.manual_seed(0)


def pendulum(state, damping=0.1):
    theta, omega = state[:, 0], state[:, 1]
    return torch.stack([omega, -torch.sin(theta) - damping * omega], dim=1)


def rk4(f, y, dt):
    k1 = f(y)
    k2 = f(y + 0.5 * dt * k1)
    k3 = f(y + 0.5 * dt * k2)
    k4 = f(y + dt * k3)
    return y + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)


y = torch.stack([torch.linspace(-2.5, 2.5, 64), torch.zeros(64)], dim=1).double()
energy0 = (0.5 * y[:, 1] ** 2 - torch.cos(y[:, 0])).sum()
for _ in range(300):
    y = rk4(pendulum, y, 0.05)
energy = (0.5 * y[:, 1] ** 2 - torch.cos(y[:, 0])).sum()
print("theta", [f"{v:.6f}" for v in y[::16, 0].tolist()])
print("energy", f"{energy0.item():.6f}", "->", f"{energy.item():.6f}")

field = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 2))
with torch.no_grad():
    z = torch.randn(128, 2)
    traj_sum = torch.zeros(2)
    for step in range(300):
        z = z + 0.01 * field(z)
        traj_sum += z.mean(0)
print("neural ode end", [f"{v:.5f}" for v in z.mean(0).tolist()], [f"{v:.4f}" for v in traj_sum.tolist()])
# in-place Euler on a preallocated state
state = torch.zeros(16)
vel = torch.linspace(-1, 1, 16)
for _ in range(300):
    state.add_(vel, alpha=0.01)
    vel.mul_(0.99)
print("euler", f"{state.abs().sum().item():.6f}", f"{vel.abs().max().item():.6f}")
