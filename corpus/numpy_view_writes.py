"""A NumPy view of a tensor's memory sees torch's writes, as in strict."""
import torch

for i in range(3):
    t = torch.arange(3.0)
    a = t.numpy()
    t[0] = -5.0
    print(i, a.tolist())
x = torch.zeros(4)
view = x.numpy()
for k in range(3):
    x.add_(1.0)
    x[1:3] *= 2.0
    print(k, view.tolist())
