"""Errors caught mid-loop (bad in-place shapes, out-of-range indices, view of a transpose, backward twice, NaN checks): the tensors keep their values and the loop goes on."""
import torch
from torch import nn

torch.manual_seed(0)


def r(t):
    return [round(v, 4) for v in t.flatten().tolist()]


def show(tag, e):
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    print(tag, type(e).__name__, msg[:90])


a = torch.arange(6.0).reshape(2, 3)
acc = torch.zeros(2, 3)
idx_ok = torch.tensor([0, 2])
for step in range(5):
    a.mul_(1.5)
    view = a[:, 1:]
    view.add_(1)
    try:
        a.add_(torch.ones(4))
    except RuntimeError as e:
        show(f"{step} add_", e)
    try:
        view.copy_(torch.ones(3, 2))
    except RuntimeError as e:
        show(f"{step} copy_", e)
    try:
        a.index_select(1, torch.tensor([0, 3 + step]))
    except IndexError as e:
        show(f"{step} index_select", e)
    except RuntimeError as e:
        show(f"{step} index_select", e)
    try:
        torch.gather(a, 1, torch.tensor([[0, 1], [2, 5]]))
    except RuntimeError as e:
        show(f"{step} gather", e)
    try:
        at = a.t()
        at.view(6)
    except RuntimeError as e:
        show(f"{step} view", e)
    try:
        a[:, :2] += torch.ones(3)
    except RuntimeError as e:
        show(f"{step} slice +=", e)
    try:
        torch.zeros(3, dtype=torch.long).mul_(0.5)
    except RuntimeError as e:
        show(f"{step} int mul_", e)
    try:
        a.unsqueeze(0).expand(2, 2, 3).add_(1)
    except RuntimeError as e:
        show(f"{step} expand add_", e)
    acc.add_(a.index_select(1, idx_ok).sum(1, keepdim=True))
    acc += a.gather(1, torch.tensor([[2, 0, 1], [1, 1, 0]]))
    print(step, "a", r(a), "acc", r(acc), "view", r(view), view.stride(), view.storage_offset())

# a failed in-place op on a view must not touch the base
for step in range(3):
    base = torch.arange(12.0).reshape(3, 4) + step
    col = base[:, 1]
    col.mul_(10)
    try:
        col.add_(torch.ones(4))
    except RuntimeError as e:
        show(f"{step} col add_", e)
    try:
        base[torch.tensor([0, 3])] = 0.0
    except IndexError as e:
        show(f"{step} index_put", e)
    try:
        base.index_fill_(0, torch.tensor([5]), -1.0)
    except (IndexError, RuntimeError) as e:
        show(f"{step} index_fill_", e)
    try:
        base.scatter_add_(1, torch.tensor([[0, 9]]), torch.ones(1, 2))
    except RuntimeError as e:
        show(f"{step} scatter_add_", e)
    base[torch.tensor([0, 2])] = -1.0
    print(step, "base", r(base), "col", r(col), col.stride())

# autograd errors: backward twice, grad of a non-leaf, in-place on a leaf that requires grad
w = torch.ones(3, requires_grad=True)
for step in range(4):
    y = (w * torch.arange(3.0)).exp().sum()
    y.backward(retain_graph=step % 2 == 0)
    try:
        y.backward()
    except RuntimeError as e:
        show(f"{step} backward twice", e)
    try:
        w.add_(1)
    except RuntimeError as e:
        show(f"{step} leaf add_", e)
    try:
        h = w * 2
        h.sum().backward()
        print(step, "h.grad", h.grad)
    except RuntimeError as e:
        show(f"{step} h", e)
    with torch.no_grad():
        w.sub_(0.01 * w.grad)
    print(step, "w", r(w), "grad", r(w.grad), w.grad.data_ptr() == w.grad.data_ptr())
    w.grad.zero_()

# an in-place op that breaks the graph for backward
for step in range(3):
    p = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    q = p.sigmoid()
    s = q * 2
    q.mul_(3)
    try:
        s.sum().backward()
        print(step, "backward ok", r(p.grad))
    except RuntimeError as e:
        show(f"{step} version", e)
    print(step, "q", r(q.detach()), "version", q._version)

# NaN checks driving control flow; skipped steps keep parameters
model = nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
skipped = 0
for step in range(8):
    x = torch.randn(5, 3)
    if step in (2, 5):
        x[1, 1] = float("nan")
    if step == 6:
        x[0] = float("inf")
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    if torch.isnan(loss).any() or not torch.isfinite(model.weight.grad).all():
        skipped += 1
        bad = torch.isnan(x).sum().item(), torch.isinf(x).sum().item()
        print(step, "skip", bad, r(model.weight.detach()))
        continue
    opt.step()
    print(step, f"loss {loss.item():.4f}", r(model.weight.detach()))
print("skipped", skipped)
