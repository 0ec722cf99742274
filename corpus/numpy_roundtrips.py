"""NumPy interop: t.numpy() views written by torch, torch.from_numpy written by numpy, np.asarray of
results, dtypes on the way back, and a batch buffer refilled by numpy each step."""
import numpy as np
import torch

torch.manual_seed(0)
t = torch.zeros(5)
view = t.numpy()
t += torch.arange(5.0)
t.mul_(2)
print("numpy view sees torch writes", view.tolist())
arr = np.arange(6, dtype=np.float32).reshape(2, 3)
shared = torch.from_numpy(arr)
y = shared * 10
arr[0, 0] = 100.0
print("from_numpy sees numpy writes", shared[0, 0].item(), "earlier product", y[0, 0].item())
z = shared.sum(0)
arr += 1
print("sum before +=", z.tolist(), "after", shared.sum(0).tolist())
shared.add_(1)
print("numpy sees torch in-place", arr.tolist())
res = torch.randn(3, 3) @ torch.randn(3, 3)
a = np.asarray(res)
print("asarray", a.dtype, a.shape, f"{a.sum():.4f}", f"{res.sum().item():.4f}")
print("np ufunc on tensor", f"{np.exp(res).sum():.4f}")
print("float64 round trip", torch.from_numpy(np.linspace(0, 1, 3)).dtype, torch.tensor(np.int16(7)).dtype)
print("as_tensor shares", torch.as_tensor(arr).data_ptr() == shared.data_ptr())
buffer = np.zeros((4, 3), dtype=np.float32)
batch = torch.from_numpy(buffer)
w = torch.randn(3, 2, requires_grad=True)
opt = torch.optim.SGD([w], lr=0.1)
rng = np.random.default_rng(0)
for step in range(4):
    buffer[:] = rng.standard_normal((4, 3))
    loss = (batch @ w).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print("refilled batch", step, f"{loss.item():.5f}")
g = w.detach().numpy()
print("detach().numpy() view", g.shape, np.shares_memory(g, w.detach().numpy()))
try:
    w.numpy()
except RuntimeError as e:
    print("numpy on requires_grad", type(e).__name__)
print("bool tensor to numpy", (torch.arange(4) > 1).numpy().tolist(), torch.tensor([1.5]).numpy().dtype)
nc = torch.arange(12.0).view(3, 4).t()
print("non-contiguous numpy", nc.numpy().strides, nc.numpy()[1].tolist())
