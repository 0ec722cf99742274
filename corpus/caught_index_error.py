"""An indexing error caught by the program, then a loop that must not see it again."""
import torch

torch.manual_seed(0)
x = torch.randn(5)
try:
    y = x[torch.tensor([10])]
    print(y.tolist())
except IndexError as e:
    print("caught", type(e).__name__)
for step in range(4):
    s = (x * step).sum()
    print(step, f"{s:.4f}")
