"""Mixed precision on CPU: autocast to bfloat16 and torch.amp.GradScaler, with dtypes printed."""
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
x = torch.randn(32, 16)
y = torch.randint(0, 4, (32,))
for step in range(8):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model[0](x)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
    if step == 0:
        print("dtypes", h.dtype, logits.dtype, loss.dtype)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    print(step, f"{loss.item():.3f}", f"grad norm {gn.item():.3f}", "scale", scaler.get_scale())
with torch.autocast("cpu", dtype=torch.bfloat16):
    out = model(x[:2])
print("out", out.dtype, [f"{v:.2f}" for v in out.float().flatten().tolist()])
print("params dtype", next(model.parameters()).dtype)
