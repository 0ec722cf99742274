"""A serving loop under torch.inference_mode(): requests of varying batch size through a small
model, argmax and softmax confidences, plus checks of inference tensors' flags."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4)).eval()
gen = torch.Generator().manual_seed(9)
served = 0
with torch.inference_mode():
    for req in range(8):
        n = 1 + (req * 3) % 5
        batch = torch.randn(n, 10, generator=gen)
        logits = model(batch)
        probs = logits.softmax(-1)
        conf, label = probs.max(-1)
        served += n
        print(req, n, label.tolist(), [f"{c:.4f}" for c in conf.tolist()])
    cached = model(torch.ones(1, 10))
print("served", served)
print("is_inference", cached.is_inference(), "requires_grad", cached.requires_grad)
try:
    (cached * torch.ones(1, 4, requires_grad=True)).sum().backward()
    print("used in autograd: ok")
except RuntimeError as e:
    print("used in autograd:", type(e).__name__)
try:
    cached.add_(1)
    print("inplace outside inference_mode: ok")
except RuntimeError as e:
    print("inplace outside inference_mode:", type(e).__name__)
print("clone is normal", cached.clone().is_inference())
with torch.inference_mode():
    inside = torch.zeros(2)
    inside.add_(1)
print("inside ops ok", inside.tolist())
with torch.inference_mode(mode=False):
    x = torch.ones(2, requires_grad=True)
    print("mode=False grad", (x * 2).requires_grad)


@torch.inference_mode()
def predict(x):
    return model(x).argmax(-1)


print("decorated", predict(torch.randn(3, 10, generator=gen)).tolist())
