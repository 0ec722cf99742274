"""channels_last convolutions: a model and input in torch.channels_last, output strides and memory
format printed, training a step, and conversion back."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1))
model = model.to(memory_format=torch.channels_last)
print("weight strides", model[0].weight.stride(), model[0].weight.is_contiguous(memory_format=torch.channels_last))
x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
print("input", x.stride(), x.is_contiguous(), x.is_contiguous(memory_format=torch.channels_last))
y = model(x)
print("output", tuple(y.shape), y.stride(), y.is_contiguous(memory_format=torch.channels_last))
r = torch.relu(x)
print("relu keeps format", r.stride())
s = x + 1
print("add keeps format", s.stride())
c = x.contiguous()
print("contiguous", c.stride(), torch.equal(c, x))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(step, f"{loss.item():.5f}", model[0].weight.grad.stride())
print("weight still channels_last", model[0].weight.is_contiguous(memory_format=torch.channels_last))
pooled = nn.functional.max_pool2d(y, 2)
print("pool", pooled.stride(), "upsample", nn.functional.interpolate(y, scale_factor=2).stride())
print("view as flat", y.permute(0, 2, 3, 1).is_contiguous(), tuple(y.permute(0, 2, 3, 1).reshape(-1, 4).shape))
e = torch.empty_like(x)
print("empty_like preserves", e.stride())
z = torch.empty(2, 3, 4, 4, memory_format=torch.channels_last).zero_()
print("empty channels_last", z.stride(), z.sum().item())
x3 = torch.randn(1, 2, 3, 4, 5).to(memory_format=torch.channels_last_3d)
print("channels_last_3d", x3.stride(), nn.Conv3d(2, 2, 1)(x3).stride())
