"""Training resumed from a torch.save checkpoint: bit-identical to the uninterrupted run, as in
strict (with torch.use_deterministic_algorithms(True), which deferfuse honours)."""
import io
import torch
from torch import nn

torch.use_deterministic_algorithms(True)


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


g = torch.Generator().manual_seed(1)
data = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(8)]


def train(model, opt, steps):
    losses = []
    for x, y in steps:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


model, opt = make()
straight = train(model, opt, data)
final = [p.detach().clone() for p in model.parameters()]
model, opt = make()
first = train(model, opt, data[:4])
buf = io.BytesIO()
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
buf.seek(0)
model, opt = make()
state = torch.load(buf)
model.load_state_dict(state["model"])
opt.load_state_dict(state["opt"])
second = train(model, opt, data[4:])
print("losses equal", straight == first + second)
print("weights equal", all(torch.equal(a, b.detach()) for a, b in zip(final, model.parameters())))
print("last loss", f"{straight[-1]:.6f}")
