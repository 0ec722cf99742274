"""An embedding lookup with an out-of-range id inside try: the except branch must run."""
import torch
from torch import nn

torch.manual_seed(0)
table = nn.Embedding(10, 4)
for ids in (torch.tensor([1, 2, 3]), torch.tensor([1, 12, 3]), torch.tensor([0, 9])):
    try:
        emb = table(ids)
    except IndexError:
        emb = None
    print(None if emb is None else f"{emb.sum().item():.4f}")
x = torch.randn(6)
for idx in (torch.tensor([1, 2]), torch.tensor([1, 8])):
    try:
        print(f"{x.index_select(0, idx).sum().item():.4f}")
    except IndexError as e:
        print("index_select raised", type(e).__name__)
    try:
        print(f"{x.gather(0, idx).sum().item():.4f}")
    except RuntimeError as e:
        print("gather raised", type(e).__name__)
