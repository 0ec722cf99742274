"""CPU autocast bfloat16 training, then float16/bfloat16 models and tensors used directly: finfo, overflow, casts, promotion, default dtype."""
import torch
import torch.nn.functional as F
from torch import nn


def r(x):
    return float(f"{x:.4g}")


torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc1 = nn.Linear(4 * 8 * 8, 32)
        self.fc2 = nn.Linear(32, 3)

    def forward(self, x):
        h = F.relu(self.conv(x))
        h = F.max_pool2d(h, 1).flatten(1)
        return self.fc2(F.gelu(self.fc1(h)))


model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
x = torch.randn(16, 1, 8, 8)
y = torch.randint(0, 3, (16,))
for step in range(12):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
        loss = F.cross_entropy(logits.float(), y)
    if step == 0:
        print("logits dtype", logits.dtype, "loss dtype", loss.dtype, tuple(logits.shape))
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 3 == 2:
        gdt = {p.grad.dtype for p in model.parameters()}
        print(step, "loss", r(loss.item()), "grad dtypes", sorted(str(d) for d in gdt))
with torch.no_grad():
    acc = (model(x).argmax(1) == y).float().mean()
print("train acc", r(acc.item()))

# low-precision models in eval
half_model = Net()
half_model.load_state_dict(model.state_dict())
half_model = half_model.half().eval()
bf_model = Net()
bf_model.load_state_dict(model.state_dict())
bf_model = bf_model.to(torch.bfloat16).eval()
for i in range(3):
    xb = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        out32 = model(xb)
        out16 = half_model(xb.half())
        outbf = bf_model(xb.to(torch.bfloat16))
    print(i, out16.dtype, outbf.dtype, out16.type(), outbf.type(),
          "argmax", out32.argmax(1).tolist(), out16.argmax(1).tolist(),
          "err16<0.05", bool((out16.float() - out32).abs().max() < 0.05),
          "errbf<0.2", bool((outbf.float() - out32).abs().max() < 0.2))
print("param dtypes", {str(p.dtype) for p in half_model.parameters()}, next(bf_model.parameters()).dtype)

# finfo limits
for dt in (torch.float16, torch.bfloat16, torch.float32):
    fi = torch.finfo(dt)
    print(dt, fi.bits, r(fi.max), r(fi.eps), r(fi.tiny), r(fi.min))

# overflow in float16
for k in range(4):
    a = torch.full((5,), 60000.0, dtype=torch.float16)
    b = a * (k + 1)
    print(k, "inf?", torch.isinf(b).tolist(), b.dtype, r(b[0].item()))
big = torch.tensor([65504.0, 65520.0, 70000.0, -1e6, 1e-8])
h = big.half()
print("half", h.tolist(), "back", h.float().tolist())
print("bf16", [r(v) for v in big.to(torch.bfloat16).tolist()])
print("isfinite", torch.isfinite(h).tolist(), "nan_to_num", h.nan_to_num().tolist())

# casts back and forth
v = torch.linspace(0, 1, 11)
for it in range(3):
    v16 = v.half()
    vbf = v.bfloat16()
    back = vbf.float()
    print(it, [r(t) for t in back.tolist()[:4]], "diff", r((back - v).abs().max().item()),
          "eq16", (v16.float() == v).tolist().count(True))
    v = v * 1.5
print(v.half().type(), v.type(torch.float16).dtype, v.to(torch.bfloat16).type(), v.double().type())
print("int to half", torch.arange(2040, 2052).half().tolist())
print("half to int", torch.tensor([2.5, -2.5, 3.7, 65504.0], dtype=torch.float16).long().tolist())

# promotion
print(torch.promote_types(torch.float16, torch.bfloat16), torch.promote_types(torch.float16, torch.float32),
      torch.promote_types(torch.bfloat16, torch.int64), torch.promote_types(torch.uint8, torch.int8))
hh = torch.ones(3, dtype=torch.float16)
bb = torch.ones(3, dtype=torch.bfloat16)
print((hh + bb).dtype, (hh + 1.5).dtype, (hh * torch.tensor(2.0)).dtype, (bb + torch.ones(3)).dtype,
      (hh + torch.ones(3, dtype=torch.int32)).dtype, torch.result_type(hh, 2.0))

# sums of low-precision tensors
for n in (100, 1000, 5000):
    ones16 = torch.full((n,), 0.1, dtype=torch.float16)
    onesbf = torch.full((n,), 0.1, dtype=torch.bfloat16)
    s16 = ones16.sum()
    sbf = onesbf.sum()
    print(n, s16.dtype, r(s16.item()), sbf.dtype, r(sbf.item()),
          "sum f32", r(ones16.sum(dtype=torch.float32).item()), "mean", r(onesbf.mean().item()))
cs = torch.full((3000,), 1.0, dtype=torch.float16).cumsum(0)
print("cumsum16 last", r(cs[-1].item()), "exact", int((cs.float() == torch.arange(1, 3001).float()).sum()))

# default dtype section
torch.set_default_dtype(torch.float64)
d_model = nn.Linear(3, 2)
for i in range(3):
    z = torch.randn(5, 3)
    t = torch.tensor([1.5, 2.5])
    print(i, z.dtype, t.dtype, torch.arange(3.0).dtype, d_model.weight.dtype, d_model(z).dtype,
          r(d_model(z).sum().item()), torch.get_default_dtype())
torch.set_default_dtype(torch.float32)
print("back", torch.get_default_dtype(), torch.tensor([1.0]).dtype, torch.zeros(2).dtype,
      (torch.ones(2) + torch.ones(2, dtype=torch.float64)).dtype)
