"""Activation checkpointing: checkpoint (reentrant and not) and checkpoint_sequential, dropout replayed."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

torch.manual_seed(0)
d_model, seq, batch = 32, 8, 16


class Block(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 2 * d_model)
        self.fc2 = nn.Linear(2 * d_model, d_model)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, d_model)
        self.blocks = nn.ModuleList([Block(p=0.2), Block(), Block()])
        self.tail = nn.Sequential(Block(), nn.GELU(), Block(p=0.1), nn.LayerNorm(d_model))
        self.head = nn.Linear(d_model, 1)

    def forward(self, x):
        h = self.inp(x)
        h = checkpoint(self.blocks[0], h, use_reentrant=False)  # dropout inside: mask must be replayed
        h = checkpoint(self.blocks[1], h, use_reentrant=True)
        h = checkpoint(self.blocks[2], h, use_reentrant=False)
        h = checkpoint_sequential(self.tail, 2, h, use_reentrant=False)
        return self.head(h).squeeze(-1)


model = Model()
opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
x = torch.randn(batch, seq, 4)
target = x.sum(-1).cumsum(-1) * 0.1
for step in range(30):
    x_in = x.clone().requires_grad_(True)  # the reentrant checkpoint wants an input that needs grad
    loss = F.mse_loss(model(x_in), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 10 == 9:
        print(step, f"loss {loss.item():.4f}")
gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
print("grad norm", f"{gnorm.item():.4f}")
print("input grad abs sum", f"{x_in.grad.abs().sum().item():.4f}")

# the replay must use the same dropout mask: gradient through checkpoint == gradient without it
torch.manual_seed(1)
block = Block(p=0.5)
h = torch.randn(4, d_model, requires_grad=True)
state = torch.get_rng_state()
out = checkpoint(block, h, use_reentrant=False)
out.sum().backward()
g_ckpt = h.grad.clone()
h.grad = None
torch.set_rng_state(state)
block(h).sum().backward()
print("replayed mask matches", torch.allclose(g_ckpt, h.grad, atol=1e-5))
print("ckpt grad through block", f"{(g_ckpt - 1).abs().sum().item():.4f}")
