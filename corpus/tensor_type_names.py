"""type(t).__name__ and `type(x) is torch.Tensor` checks on results of many ops, parameters, and
outputs of modules, as libraries do."""
import torch
from torch import nn

torch.manual_seed(0)
x = torch.randn(3, 4)
lin = nn.Linear(4, 2)
cases = {
    "randn": x,
    "add": x + 1,
    "matmul": x @ x.T,
    "sum": x.sum(),
    "view": x.view(12),
    "slice": x[1:],
    "index": x[torch.tensor([0, 2])],
    "detach": x.detach(),
    "clone": x.clone(),
    "linear": lin(x),
    "param": lin.weight,
    "param*2": lin.weight * 2,
    "param.data": lin.weight.data,
    "param.detach": lin.weight.detach(),
    "requires_grad_": torch.zeros(2).requires_grad_(),
    "split0": torch.split(x, 2)[0],
    "max.values": x.max(1).values,
    "unbind": x.unbind()[0],
    "float()": torch.arange(3).float(),
    "to": x.to(torch.float64),
    "nonzero": (x > 0).nonzero(),
}
for name, t in cases.items():
    print(f"{name:15s} {type(t).__name__:10s} is Tensor: {type(t) is torch.Tensor}  isinstance: {isinstance(t, torch.Tensor)}")
print("max type", type(x.max(1)).__name__, "tuple?", isinstance(x.max(1), tuple))
print("buffer type", type(nn.BatchNorm1d(2).running_mean).__name__)
y = lin(x).sum()
y.backward()
print("grad type", type(lin.weight.grad).__name__, type(lin.weight.grad) is torch.Tensor)
print("item type", type(y.item()).__name__, type(x.tolist()).__name__, type(x[0, 0].tolist()).__name__)
print("size type", type(x.shape).__name__, type(x.shape[0]).__name__, type(x.numel()).__name__)
print("dtype type", type(x.dtype).__name__, type(x.device).__name__, x.device)
print("is_leaf", x.is_leaf, lin.weight.is_leaf, y.is_leaf, "grad_fn", type(y.grad_fn).__name__)
with torch.no_grad():
    z = lin(x)
print("no_grad result", type(z).__name__, z.requires_grad, z.grad_fn)
