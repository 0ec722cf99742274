"""TorchScript (script, trace, save, load) and torch.export (export, .module() on a new shape,
save, load) of a model built and run under the mode: the saved model holds its real weights."""
import io, torch
from torch import nn
from torch.export import Dim
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3)).eval()
x = torch.randn(5, 6)
with torch.no_grad():
    ref = m(x)
buf = io.BytesIO(); torch.jit.save(torch.jit.script(m), buf); buf.seek(0)
out = torch.jit.load(buf)(x)
print("script", torch.allclose(out, ref, atol=1e-6), f"{out.abs().max().item():.4f}")
traced = torch.jit.trace(m, (x,))
buf = io.BytesIO(); torch.jit.save(traced, buf); buf.seek(0)
print("trace", torch.allclose(torch.jit.load(buf)(x), ref, atol=1e-6))
ep = torch.export.export(m, (torch.randn(4, 6),), dynamic_shapes={"input": {0: Dim("b", min=1, max=64)}})
print("export", torch.allclose(ep.module()(x), ref, atol=1e-6))
buf = io.BytesIO(); torch.export.save(ep, buf); buf.seek(0)
ep2 = torch.export.load(buf)
print("export save/load", torch.allclose(ep2.module()(torch.randn(7, 6)).shape == (7, 3) and ep2.module()(x), ref, atol=1e-6))
