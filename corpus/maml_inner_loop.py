"""MAML on sine regression: a functional inner loop (autograd.grad create_graph + functional_call), outer Adam."""
import math

import torch
from torch import nn
from torch.func import functional_call

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1))
meta_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
inner_lr, inner_steps, tasks_per_batch = 0.01, 2, 4


def sample_task():
    amp = torch.empty(1).uniform_(0.1, 5.0)
    phase = torch.empty(1).uniform_(0.0, math.pi)

    def draw(n):
        x = torch.empty(n, 1).uniform_(-5.0, 5.0)
        return x, amp * torch.sin(x + phase)
    return draw


for meta_step in range(20):
    meta_opt.zero_grad()
    meta_loss = 0.0
    for _ in range(tasks_per_batch):
        draw = sample_task()
        x_s, y_s = draw(10)
        x_q, y_q = draw(10)
        params = dict(model.named_parameters())
        for _ in range(inner_steps):
            loss = nn.functional.mse_loss(functional_call(model, params, (x_s,)), y_s)
            grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
            params = {name: p - inner_lr * g for (name, p), g in zip(params.items(), grads)}
        meta_loss = meta_loss + nn.functional.mse_loss(functional_call(model, params, (x_q,)), y_q)
    meta_loss = meta_loss / tasks_per_batch
    meta_loss.backward()
    meta_opt.step()
    if meta_step % 5 == 4:
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        print(meta_step, f"meta-loss {meta_loss.item():.4f}", f"grad norm {gnorm.item():.4f}")
x = torch.linspace(-5, 5, 7).unsqueeze(1)
with torch.no_grad():
    print("pred", [f"{v:.3f}" for v in model(x).squeeze(1).tolist()])
