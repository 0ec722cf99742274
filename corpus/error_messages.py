"""The errors users search for, caught and printed: their type and message must be strict's."""
import torch
from torch import nn

torch.manual_seed(0)
cases = {
    "linear": lambda: nn.Linear(3, 2)(torch.randn(4, 5)),
    "matmul": lambda: torch.randn(4, 5) @ torch.randn(3, 2),
    "bmm": lambda: torch.bmm(torch.randn(2, 4, 5), torch.randn(2, 3, 2)),
    "cat": lambda: torch.cat([torch.randn(2, 3), torch.randn(2, 4)]),
    "stack": lambda: torch.stack([torch.randn(2, 3), torch.randn(3, 3)]),
    "view": lambda: torch.randn(4, 6).t().view(24),
    "reshape": lambda: torch.randn(4, 6).reshape(5, 5),
    "broadcast": lambda: torch.randn(4, 3) + torch.randn(5, 3),
    "conv_channels": lambda: nn.Conv2d(3, 4, 3)(torch.randn(1, 2, 8, 8)),
    "embedding_float": lambda: nn.Embedding(10, 3)(torch.randn(4)),
    "mse_shapes": lambda: nn.functional.mse_loss(torch.randn(4, 3), torch.randn(4, 2)),
    "cross_entropy_shapes": lambda: nn.functional.cross_entropy(torch.randn(4, 3), torch.zeros(5, dtype=torch.long)),
}
for _ in range(2):
    for name, case in cases.items():
        try:
            case()
            print(name, "no error")
        except Exception as e:
            print(name, type(e).__name__, str(e).split("\n")[0])
