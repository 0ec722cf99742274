"""A training loop that skips a batch whose labels are out of range, as a data pipeline with a
bad record forces it to."""
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(1)
skipped = 0
for step in range(12):
    x = torch.randn(6, 8, generator=g)
    labels = torch.randint(0, 3, (6,), generator=g)
    if step == 4:
        labels[2] = 7          # a bad record
    try:
        loss = F.cross_entropy(model(x), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(step, f"{loss.item():.4f}")
    except IndexError:
        skipped += 1
        print(step, "skipped")
print("skipped", skipped, "weight sum", f"{model[0].weight.sum().item():.4f}")
