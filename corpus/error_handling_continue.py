"""A script that tries ops that raise (bad indices, mismatched shapes, dtype errors, a NaN check),
catches each, prints the error type, and keeps computing with the values made before and after."""
import torch
from torch import nn

torch.manual_seed(0)
x = torch.randn(4, 5)
acc = torch.zeros(5)
attempts = [
    ("index out of range", lambda: x[10]),
    ("tensor index", lambda: x[torch.tensor([0, 7])]),
    ("negative index ok", lambda: x[-1]),
    ("index_select", lambda: x.index_select(1, torch.tensor([5]))),
    ("scatter index", lambda: torch.zeros(3).scatter_(0, torch.tensor([4]), 1.0)),
    ("bad view", lambda: x.view(3, 7)),
    ("mm shapes", lambda: x @ x),
    ("float index", lambda: x[torch.tensor([0.5])]),
    ("long + bool mask shape", lambda: x[torch.tensor([True, False])]),
    ("cat dtypes ok", lambda: torch.cat([x[:1], torch.ones(1, 5, dtype=torch.float64)])),
    ("in-place dtype", lambda: torch.zeros(3, dtype=torch.long).add_(0.5)),
    ("requires_grad int", lambda: torch.zeros(2, dtype=torch.long).requires_grad_()),
    ("item of many", lambda: x.item()),
    ("embedding", lambda: nn.Embedding(3, 2)(torch.tensor([3]))),
    ("one_hot", lambda: nn.functional.one_hot(torch.tensor([1, 5]), 3)),
    ("put_ out of range", lambda: torch.zeros(4).put_(torch.tensor([9]), torch.tensor([1.0]))),
]
for i, (name, fn) in enumerate(attempts):
    acc += x[i % 4]
    try:
        r = fn()
        shape = tuple(r.shape) if isinstance(r, torch.Tensor) else r
        print(f"{name:24s} ok {shape}")
    except (IndexError, RuntimeError, ValueError, TypeError) as e:
        print(f"{name:24s} {type(e).__name__}")
    acc.mul_(0.9)
print("acc", [f"{v:.4f}" for v in acc.tolist()])
model = nn.Linear(5, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(6):
    inp = x if step != 3 else torch.randn(4, 6)
    try:
        loss = model(inp).pow(2).mean()
        if step == 4:
            loss = loss * float("nan")
        if torch.isnan(loss):
            raise FloatingPointError("nan loss")
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(step, f"{loss.item():.5f}")
    except RuntimeError as e:
        print(step, "shape error", type(e).__name__)
    except FloatingPointError as e:
        print(step, "skipped:", e)
print("weight", [f"{v:.4f}" for v in model.weight.flatten().tolist()])
