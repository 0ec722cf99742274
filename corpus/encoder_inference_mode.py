"""A TransformerEncoder with nested tensors (a padding mask) trained, then served under
torch.inference_mode(), then pad_sequence under no_grad."""
import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence
torch.manual_seed(0)
layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
opt = torch.optim.Adam(enc.parameters(), lr=1e-3)
x = torch.randn(3, 5, 16)
mask = torch.tensor([[False]*5, [False]*3 + [True]*2, [False]*4 + [True]])
for step in range(3):
    out = enc(x, src_key_padding_mask=mask)
    loss = out.masked_fill(mask[..., None], 0).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    print(step, f"{loss.item():.5f}")
enc.eval()
for i in range(2):
    with torch.inference_mode():
        y = enc(x, src_key_padding_mask=mask)
        print("infer", i, f"{y.masked_fill(mask[..., None], 0).abs().sum().item():.4f}", type(y).__name__)
with torch.no_grad():
    seqs = [torch.randn(n, 4) for n in (3, 1, 2)]
    p = pad_sequence(seqs, batch_first=True)
    print("pad", tuple(p.shape), f"{p.sum().item():.4f}")
