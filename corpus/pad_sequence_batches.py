"""pad_sequence of variable-length sequences (batch_first and not, padding_value, left padding),
masks built from lengths, a GRU over the padded batch with masked mean pooling, and unpad."""
import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence, unpad_sequence

torch.manual_seed(0)
seqs = [torch.randint(1, 20, (n,)) for n in (5, 2, 7, 3)]
padded = pad_sequence(seqs, batch_first=True, padding_value=0)
print("padded", padded.tolist())
print("time-major", tuple(pad_sequence(seqs).shape))
print("left padding", pad_sequence(seqs, batch_first=True, padding_side="left")[1].tolist())
lengths = torch.tensor([len(s) for s in seqs])
mask = torch.arange(padded.size(1))[None] < lengths[:, None]
print("mask sums", mask.sum(1).tolist())
emb = nn.Embedding(20, 8, padding_idx=0)
gru = nn.GRU(8, 6, batch_first=True)
head = nn.Linear(6, 1)
opt = torch.optim.Adam(list(emb.parameters()) + list(gru.parameters()) + list(head.parameters()), lr=1e-2)
target = torch.tensor([1.0, 0.0, 1.0, 0.0])
for step in range(5):
    h, _ = gru(emb(padded))
    pooled = (h * mask[..., None]).sum(1) / lengths[:, None]
    loss = nn.functional.binary_cross_entropy_with_logits(head(pooled).squeeze(-1), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(step, f"{loss.item():.5f}")
print("padding row grad zero", bool((emb.weight.grad[0] == 0).all()))
vecs = [torch.randn(n, 3) for n in (4, 1, 2)]
pv = pad_sequence(vecs, batch_first=True, padding_value=-1.0)
print("float padded", tuple(pv.shape), pv[1, 1:].tolist())
back = unpad_sequence(pv, torch.tensor([4, 1, 2]), batch_first=True)
print("unpad", [tuple(b.shape) for b in back], all(torch.equal(a, b) for a, b in zip(vecs, back)))
