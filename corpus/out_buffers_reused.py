"""Preallocated out= buffers reused in a loop: resize_(0) then out= (as torch's warning advises), and out= of another shape."""
import warnings

import torch

warnings.simplefilter("ignore", UserWarning)   # (torch warns when it resizes a non-empty out=)
torch.manual_seed(0)
features = torch.randn(6, 4)
for step in range(4):
    batch = features * (step + 1)
    pool = torch.zeros(64)                      # one buffer, reused for every result below
    pool.resize_(0)
    torch.cat([batch[:2].flatten(), batch[-1]], out=pool)
    print(step, "cat", tuple(pool.shape), [round(v, 3) for v in pool[:5].tolist()])
    column_sums = torch.zeros(4)
    torch.sum(batch, 0, keepdim=True, out=column_sums)   # (1, 4): same elements, another shape
    print(step, "sum", tuple(column_sums.shape), column_sums.stride(), [round(v, 3) for v in column_sums.flatten().tolist()])
    means = torch.zeros(12)
    means.resize_(0)
    torch.mean(batch.view(3, 2, 4), 1, out=means)
    print(step, "mean", tuple(means.shape), round(means.sum().item(), 3))
    top = torch.zeros(10)
    indices = torch.zeros(10, dtype=torch.long)
    top.resize_(0), indices.resize_(0)
    torch.sort(batch[:, 0], descending=True, out=(top, indices))
    print(step, "sort", tuple(top.shape), indices.tolist())
