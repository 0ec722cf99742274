"""Full-batch LBFGS with a closure: how many evaluations it takes must not change from run to run."""
import torch
from torch import nn

torch.manual_seed(0)
x = torch.randn(64, 5)
w_true = torch.randn(5, 1)
y = x @ w_true + 0.01 * torch.randn(64, 1)
model = nn.Linear(5, 1)
opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=50, tolerance_grad=1e-9, tolerance_change=1e-12)
evals = 0


def closure():
    global evals
    evals += 1
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss


for _ in range(2):
    loss = opt.step(closure)
print("evaluations", evals)
print("loss", f"{loss.item():.6f}")
