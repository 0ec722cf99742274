"""torch.func: grad, grad_and_value, vmap (per-sample gradients), jacrev, jacfwd, hessian,
functional_call with a swapped parameter dict, and an ensemble with stack_module_state."""
import copy

import torch
from torch import nn
from torch.func import functional_call, grad, grad_and_value, hessian, jacfwd, jacrev, stack_module_state, vmap

torch.manual_seed(0)


def f(x):
    return (x.sin() * x.cos()).sum() + (x ** 3).sum() * 0.1


x = torch.randn(4)
print("grad", [f"{v:.5f}" for v in grad(f)(x).tolist()])
g, val = grad_and_value(f)(x)
print("value", f"{val.item():.5f}")
print("jacrev", [f"{v:.5f}" for v in jacrev(torch.sin)(x).diagonal().tolist()])
print("jacfwd==jacrev", bool(torch.allclose(jacfwd(torch.tanh)(x), jacrev(torch.tanh)(x))))
H = hessian(f)(x)
print("hessian diag", [f"{v:.5f}" for v in H.diagonal().tolist()], "offdiag zero", bool((H - torch.diag(H.diagonal())).abs().max() < 1e-6))
print("vmap", [f"{v:.5f}" for v in vmap(lambda r: (r * r).sum())(torch.randn(3, 5)).tolist()])
model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
params = {k: v.detach() for k, v in model.named_parameters()}
X = torch.randn(6, 3)
Y = torch.randn(6, 1)


def loss_fn(p, xi, yi):
    out = functional_call(model, p, (xi.unsqueeze(0),))
    return nn.functional.mse_loss(out, yi.unsqueeze(0))


per_sample = vmap(grad(loss_fn), in_dims=(None, 0, 0))(params, X, Y)
print("per-sample grad shapes", {k: tuple(v.shape) for k, v in sorted(per_sample.items())})
mean_grad = per_sample["0.weight"].mean(0)
model.zero_grad()
nn.functional.mse_loss(model(X), Y).backward()
print("mean per-sample == batch grad", bool(torch.allclose(mean_grad, model[0].weight.grad, atol=1e-6)))
zeros = {k: torch.zeros_like(v) for k, v in params.items()}
print("functional_call with zeros", functional_call(model, zeros, (X,)).abs().sum().item())
models = [copy.deepcopy(model) for _ in range(3)]
for i, m in enumerate(models):
    with torch.no_grad():
        m[2].bias.fill_(float(i))
stacked, buffers = stack_module_state(models)
base = copy.deepcopy(model).to("meta")


def run_one(p, b, xx):
    return functional_call(base, (p, b), (xx,))


ens = vmap(run_one, in_dims=(0, 0, None))(stacked, buffers, X)
print("ensemble", tuple(ens.shape), [f"{v:.4f}" for v in ens[:, 0, 0].tolist()])
