"""Hooks: forward hooks collecting activations, a forward pre-hook rewriting the input, a full
backward hook, tensor hooks on gradients (one scaling the gradient), and hook removal."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 2))
acts = {}


def save(name):
    def hook(module, inputs, output):
        acts[name] = output.detach()
    return hook


handles = [model[i].register_forward_hook(save(f"layer{i}")) for i in (1, 3)]
pre = model[0].register_forward_pre_hook(lambda m, inp: (inp[0] * 2,))
grads_out = []
bh = model[2].register_full_backward_hook(lambda m, gi, go: grads_out.append(go[0].norm().item()))
x = torch.randn(5, 6)
out = model(x)
for name in sorted(acts):
    a = acts[name]
    print(name, tuple(a.shape), f"mean {a.mean().item():.4f}", f"dead {(a == 0).float().mean().item():.4f}")
seen = []
h = out.register_hook(lambda g: seen.append(g.sum().item()))
w = model[4].weight
wh = w.register_hook(lambda g: g * 0.5)
out.pow(2).sum().backward()
print("out grad via hook", [f"{v:.4f}" for v in seen])
print("backward hook grad_out norm", [f"{v:.4f}" for v in grads_out])
print("scaled weight grad", f"{w.grad.sum().item():.5f}")
wh.remove()
model.zero_grad()
out2 = model(x)
out2.pow(2).sum().backward()
print("unscaled weight grad", f"{w.grad.sum().item():.5f}")
for hd in handles + [pre, bh, h]:
    hd.remove()
acts.clear()
plain = model(x)
print("hooks removed", len(acts), f"{plain.sum().item():.4f}", f"{out2.sum().item():.4f}")
leaf = torch.ones(3, requires_grad=True)
mid = leaf * 3
mid.retain_grad()
mid.register_hook(lambda g: g + 1)
(mid ** 2).sum().backward()
print("retain_grad", mid.grad.tolist(), "leaf grad", leaf.grad.tolist())
feats = []
m2 = nn.Conv2d(1, 2, 3)
m2.register_forward_hook(lambda m, i, o: feats.append(o.shape))
m2(torch.randn(1, 1, 5, 5))
print("conv hook shapes", [tuple(s) for s in feats])
post = []
acc = torch.zeros(2, requires_grad=True)
acc.register_post_accumulate_grad_hook(lambda p: post.append(p.grad.tolist()))
(acc * torch.tensor([2.0, 3.0])).sum().backward()
print("post accumulate", post)
