"""state_dict/load_state_dict (strict and non-strict), copy.deepcopy of a trained model and of an
optimizer, pickle of tensors and modules, and parameters shared between modules."""
import copy
import pickle

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
x = torch.randn(10, 4)
for _ in range(3):
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("loss", f"{loss.item():.5f}")
sd = model.state_dict()
print("state_dict keys", list(sd.keys()))
print("state_dict types", sorted({type(v).__name__ for v in sd.values()}), "requires_grad", sd["0.weight"].requires_grad)
clone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
res = clone.load_state_dict(sd)
print("load strict", res.missing_keys, res.unexpected_keys)
clone.eval()
model.eval()
print("same outputs", torch.equal(clone(x), model(x)))
partial = {k: v for k, v in sd.items() if k.startswith("0.")}
res = clone.load_state_dict(partial, strict=False)
print("non-strict missing", len(res.missing_keys))
try:
    clone.load_state_dict({"0.weight": torch.zeros(2, 2)}, strict=False)
except RuntimeError as e:
    print("shape mismatch", type(e).__name__, "size mismatch" in str(e))
model.train()
twin = copy.deepcopy(model)
opt_twin = copy.deepcopy(opt)
print("deepcopy params are new", twin[0].weight is not model[0].weight, type(twin[0].weight).__name__)
print("deepcopy optimizer state", f"{opt_twin.state_dict()['state'][0]['exp_avg'].sum().item():.6f}")
with torch.no_grad():
    twin[0].weight.add_(1.0)
print("original untouched", not torch.equal(twin[0].weight, model[0].weight))
blob = pickle.dumps({"t": torch.arange(6.0).view(2, 3) * 1.5, "model": model})
back = pickle.loads(blob)
print("pickled tensor", back["t"].tolist(), back["t"].stride())
print("pickled model", torch.equal(back["model"][0].weight, model[0].weight), back["model"][0].weight.requires_grad)
a = torch.randn(6)
v = a[2:5]
c = copy.deepcopy([a, v])
c[1].fill_(0)
print("deepcopy keeps view relation", c[0][2:5].tolist(), "original", f"{a[2].item():.4f}")
shared = nn.Linear(3, 3)
tied = nn.ModuleDict({"a": shared, "b": shared})
print("shared params counted once", len(list(tied.parameters())), len(tied.state_dict()))
tc = copy.deepcopy(tied)
print("deepcopy keeps sharing", tc["a"].weight is tc["b"].weight)
buf = torch.randn(3).requires_grad_()
y = buf * 2
try:
    copy.deepcopy(y)
except RuntimeError as e:
    print("deepcopy non-leaf", type(e).__name__)
