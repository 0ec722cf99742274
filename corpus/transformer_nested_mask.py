"""TransformerEncoder with enable_nested_tensor=True and a key padding mask, predicting under
torch.inference_mode() (the fast path) and compared with the no-mask path on the valid tokens."""
import torch
from torch import nn

torch.manual_seed(0)
d_model = 16
layer = nn.TransformerEncoderLayer(d_model, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True)
enc.eval()
x = torch.randn(4, 7, d_model)
lengths = torch.tensor([7, 5, 3, 6])
pad = torch.arange(7)[None, :] >= lengths[:, None]
print("pad mask", pad.int().tolist())
with torch.inference_mode():
    out = enc(x, src_key_padding_mask=pad)
    print("out shape", tuple(out.shape), "inference", out.is_inference())
    print("padded positions zero", bool((out[pad] == 0).all()))
    for b in range(4):
        n = int(lengths[b])
        alone = enc(x[b:b + 1, :n])
        diff = (alone[0] - out[b, :n]).abs().max().item()
        print(b, n, f"{out[b, :n, 0].sum().item():.4f}", "match", diff < 1e-4)
with torch.no_grad():
    out2 = enc(x, src_key_padding_mask=pad)
print("no_grad equals inference_mode on valid", bool(torch.allclose(out2[~pad], out[~pad], atol=1e-5)))
# the same in training mode (no fast path), with a gradient
enc.train()
out3 = enc(x, src_key_padding_mask=pad)
probe = torch.randn(d_model)
loss = (out3[~pad] @ probe).pow(2).mean()
loss.backward()
print("train loss", f"{loss.item():.4f}")
print("grad norm", f"{enc.layers[0].linear1.weight.grad.norm().item():.4f}")
