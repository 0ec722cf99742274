"""An integer division by zero whose result nobody reads still raises, as in strict."""
import torch

a = torch.tensor([4, 6])
b = torch.tensor([2, 0])
try:
    q = a // b
    print("no error")
except RuntimeError as e:
    print("caught", type(e).__name__, str(e)[:20])
print("after", (a * 2).tolist())
