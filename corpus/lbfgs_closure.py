"""LBFGS with a closure fitting a small regression, with strong-Wolfe line search and without."""
import torch
from torch import nn

torch.manual_seed(0)
X = torch.randn(100, 5)
w_true = torch.tensor([1.0, -2.0, 0.5, 3.0, 0.0])
y = X @ w_true + 0.1 * torch.sin(X[:, 0] * 3) + 0.05 * torch.randn(100)
for line_search in (None, "strong_wolfe"):
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=10, history_size=5, line_search_fn=line_search)
    calls = 0

    def closure():
        global calls
        calls += 1
        opt.zero_grad()
        loss = (model(X).squeeze(-1) - y).pow(2).mean()
        loss.backward()
        return loss

    for step in range(5):
        loss = opt.step(closure)
        print(line_search, step, f"{loss.item():.5f}")
    print(line_search, "closure calls", calls, "n_iter", opt.state[opt._params[0]]["n_iter"])
