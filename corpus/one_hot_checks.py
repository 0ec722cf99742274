"""one_hot of labels computed by earlier ops, one of them out of range, every iteration."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
for i in range(3):
    labels = (torch.arange(4) + 2) % 6       # 2, 3, 4, 5: 5 is out of range for 3 classes
    try:
        print(i, F.one_hot(labels, num_classes=3).tolist())
    except RuntimeError as e:
        print(i, "raised", type(e).__name__)
for i in range(3):
    targets = torch.tensor([0, 1, 4]) % (5 - i)
    try:
        print(i, f"{F.cross_entropy(torch.randn(3, 3), targets).item():.4f}")
    except IndexError as e:
        print(i, "raised", type(e).__name__)
try:
    q = torch.tensor([4, 6]) // torch.tensor([2, 0])
    print("no error", q.tolist())
except RuntimeError as e:
    print("division", type(e).__name__, str(e)[:40])
