"""torch.export.export with a dynamic batch dimension, .module() run on a new shape, and the
exported graph's op count."""
import torch
from torch import nn
from torch.export import Dim, export


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x, scale):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)))) * scale


torch.manual_seed(0)
m = Block().eval()
x = torch.randn(2, 8)
scale = torch.tensor(0.5)
batch = Dim("batch", min=1, max=64)
ep = export(m, (x, scale), dynamic_shapes={"x": {0: batch}, "scale": None})
mod = ep.module()
for n in (2, 5, 11):
    inp = torch.randn(n, 8)
    with torch.no_grad():
        ref = m(inp, scale)
    out = mod(inp, scale)
    print(n, tuple(out.shape), f"{out.sum().item():.4f}", bool(torch.allclose(out, ref, atol=1e-6)))
targets = sorted({str(node.target) for node in ep.graph.nodes if node.op == "call_function"})
print("ops", len(targets) > 0, "has linear", any("linear" in t for t in targets))
print("state_dict keys", sorted(ep.state_dict.keys()))
try:
    mod(torch.randn(3, 9), scale)
except Exception as e:
    print("wrong shape raised", type(e).__name__)
