"""Custom autograd.Functions: a straight-through round, a clamp with save_for_backward/needs_input_grad, two outputs with mark_non_differentiable."""
import torch
from torch import nn


class RoundSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


class ClampWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lo, hi):
        ctx.save_for_backward(x)
        ctx.lo, ctx.hi = lo, hi
        return x.clamp(lo, hi)

    @staticmethod
    def backward(ctx, grad_output):
        x, = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            inside = (x >= ctx.lo) & (x <= ctx.hi)
            # a leaky gradient outside the range so clamped units can recover
            grad_x = grad_output * torch.where(inside, torch.ones_like(x), torch.full_like(x, 0.1))
        return grad_x, None, None


class SortWithIndices(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        values, indices = torch.sort(x, dim=-1, descending=True)
        ctx.mark_non_differentiable(indices)
        ctx.save_for_backward(indices)
        return values, indices

    @staticmethod
    def backward(ctx, grad_values, grad_indices):
        indices, = ctx.saved_tensors
        grad_x = torch.zeros_like(grad_values)
        grad_x.scatter_(-1, indices, grad_values)
        return grad_x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 16)
        self.fc3 = nn.Linear(16, 1)

    def forward(self, x):
        h = ClampWithGrad.apply(self.fc1(x), -1.0, 1.0)
        h = RoundSTE.apply(h * 4) / 4          # quantize activations to quarters
        h, idx = SortWithIndices.apply(self.fc2(h))
        return self.fc3(torch.relu(h)), idx


# sanity: one custom backward on a fixed input
x = torch.tensor([-2.0, -0.5, 0.0, 0.7, 3.0], requires_grad=True)
ClampWithGrad.apply(x, -1.0, 1.0).sum().backward()
print("clamp grad", x.grad.tolist())
v = torch.tensor([[0.3, -1.0, 2.0, 0.5]], requires_grad=True)
vals, idx = SortWithIndices.apply(v)
(vals * torch.tensor([[1.0, 2.0, 3.0, 4.0]])).sum().backward()
print("sort grad", v.grad.tolist(), "idx", idx.tolist(), "idx requires_grad", idx.requires_grad)

torch.manual_seed(0)
net = Net()
opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
X = torch.randn(128, 8)
y = (X[:, :3].sum(1, keepdim=True) > 0).float() * 2 - 1 + 0.1 * torch.randn(128, 1)
for step in range(30):
    pred, idx = net(X)
    loss = nn.functional.mse_loss(pred, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 10 == 9:
        gnorm = torch.sqrt(sum(p.grad.pow(2).sum() for p in net.parameters()))
        print(step, f"loss {loss.item():.4f}", f"grad norm {gnorm.item():.4f}", "top idx", idx[0, :3].tolist())
