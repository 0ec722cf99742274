"""nn.MultiheadAttention with key_padding_mask and a float causal attn_mask, per-head weights, and SDPA masks."""
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
vocab, d_model, heads, seq, batch = 12, 32, 4, 10, 16


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.1)
        self.attn = nn.MultiheadAttention(d_model, heads, dropout=0.1, batch_first=True)
        self.norm = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids, pad, need_weights=False):
        h = self.emb(ids) + self.pos
        causal = torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1)
        a, w = self.attn(h, h, h, key_padding_mask=pad, attn_mask=causal,
                         need_weights=need_weights, average_attn_weights=False)
        h = self.norm(h + a)
        q, k, v = self.qkv(h).view(ids.shape[0], seq, 3, heads, d_model // heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        s = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + s.transpose(1, 2).reshape(ids.shape[0], seq, d_model)
        return self.head(h), w


model = Model()
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
ids = torch.randint(1, vocab, (batch, seq))
lengths = torch.randint(3, seq + 1, (batch,))
lengths[:3] = 1  # rows padded everywhere but the first position
pad = torch.arange(seq)[None, :] >= lengths[:, None]  # True where padded
ids = ids.masked_fill(pad, 0)
target = torch.cummax(ids, dim=1).values  # running maximum: needs looking back
for step in range(30):
    logits, _ = model(ids, pad)
    loss = F.cross_entropy(logits[~pad], target[~pad])
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 10 == 9:
        print(step, f"loss {loss.item():.4f}")

model.eval()
with torch.no_grad():
    logits, w = model(ids, pad, need_weights=True)
print("weights shape", tuple(w.shape))
print("weights per head", [f"{v:.3f}" for v in w.sum(dim=(0, 2, 3)).tolist()])
print("squared weights per head", [f"{v:.3f}" for v in w.pow(2).sum(dim=(0, 2, 3)).tolist()])
print("diagonal weight per head", [f"{v:.3f}" for v in w.diagonal(dim1=2, dim2=3).sum(dim=(0, 2)).tolist()])
print("weights nan", bool(torch.isnan(w).any()))
print("padded-key weight", f"{w.masked_select(pad[:, None, None, :].expand_as(w)).abs().sum().item():.4f}")
print("row 0 head 0 last query", [f"{v:.3f}" for v in w[0, 0, -1].tolist()])
acc = (logits.argmax(-1)[~pad] == target[~pad]).float().mean()
print("eval accuracy", f"{acc.item():.4f}")

# SDPA with a boolean mask (True = may attend) against the causal flag and an explicit float mask
q, k, v = torch.randn(3, 2, heads, seq, 8).unbind(0)
keep = torch.ones(seq, seq, dtype=torch.bool).tril()
a1 = F.scaled_dot_product_attention(q, k, v, is_causal=True)
a2 = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
a3 = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(seq, seq).masked_fill(~keep, float("-inf")))
print("sdpa causal == bool mask", torch.allclose(a1, a2, atol=1e-5), torch.allclose(a1, a3, atol=1e-5))
kpm = torch.ones(2, 1, 1, seq, dtype=torch.bool)
kpm[1, ..., 6:] = False
a4 = F.scaled_dot_product_attention(q, k, v, attn_mask=kpm & keep)
print("sdpa padded sum", f"{a4.sum().item():.4f}", f"{a4[1, :, -1].abs().sum().item():.4f}")
