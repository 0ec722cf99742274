"""Strides and memory formats users can see: a channels_last convolution, batch norm and pooling,
permute + view of the activations, *_like and contiguous of permuted tensors."""
import torch
from torch import nn
torch.manual_seed(0)
conv = nn.Conv2d(3, 8, 3, padding=1).to(memory_format=torch.channels_last)
bn = nn.BatchNorm2d(8)
x = torch.randn(2, 3, 16, 16).to(memory_format=torch.channels_last)
for i in range(3):
    y = conv(x)
    print(i, y.stride(), y.is_contiguous(memory_format=torch.channels_last))
    z = nn.functional.max_pool2d(bn(y), 2)
    print(i, z.stride(), z.is_contiguous(memory_format=torch.channels_last))
    flat = y.permute(0, 2, 3, 1).view(-1, 8)
    print(i, flat.shape, f"{flat.sum().item():.4f}")
    p = x.permute(0, 2, 3, 1)
    print(i, p.stride(), torch.empty_like(p).stride(), p.contiguous().stride(), (p * 2).stride())
    t = torch.randn(4, 5).t()
    print(i, (t + 1).stride(), torch.zeros_like(t).stride(), t.clone().stride())
