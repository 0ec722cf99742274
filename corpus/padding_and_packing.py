"""Variable-length sequences: pad_sequence, length masks, masked mean pooling, a packed GRU (enforce_sorted=False), last-step gather, trained."""
import torch
from torch import nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence, pack_padded_sequence, pad_packed_sequence

torch.manual_seed(0)
VOCAB, EMB, HID, CLASSES = 20, 8, 12, 3


def make_batch(n):
    lens = torch.randint(1, 9, (n,))
    seqs = [torch.randint(1, VOCAB, (int(L),)) for L in lens]
    labels = torch.stack([s.sum() % CLASSES for s in seqs])
    return seqs, labels


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, EMB, padding_idx=0)
        self.gru = nn.GRU(EMB, HID, batch_first=True)
        self.out = nn.Linear(HID * 2 + EMB, CLASSES)

    def forward(self, padded, lengths):
        max_len = padded.shape[1]
        mask = torch.arange(max_len)[None, :] < lengths[:, None]
        e = self.emb(padded)
        pooled = (e * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        packed = pack_padded_sequence(e, lengths, batch_first=True, enforce_sorted=False)
        out_packed, h_n = self.gru(packed)
        out, out_lens = pad_packed_sequence(out_packed, batch_first=True, total_length=max_len)
        idx = (lengths - 1).view(-1, 1, 1).expand(-1, 1, HID)
        last = out.gather(1, idx).squeeze(1)
        return self.out(torch.cat([last, h_n[-1], pooled], dim=1)), out, out_lens, mask, last, h_n


model = Classifier()
opt = torch.optim.Adam(model.parameters(), lr=0.02)
batches = [make_batch(n) for n in (5, 7, 4, 6)]
for epoch in range(5):
    total = 0.0
    for bi, (seqs, labels) in enumerate(batches):
        padded = pad_sequence(seqs, batch_first=True, padding_value=0)
        lengths = torch.tensor([len(s) for s in seqs])
        logits, out, out_lens, mask, last, h_n = model(padded, lengths)
        loss = F.cross_entropy(logits, labels)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        total += loss.item()
        if epoch in (0, 4):
            print(epoch, bi, "padded", tuple(padded.shape), "lens", lengths.tolist(), "out_lens", out_lens.tolist())
            print("   mask rows", mask.sum(1).tolist(), "pad zeros", int((out.abs().sum(2) == 0).sum()))
            print("   last==h_n", bool(torch.allclose(last, h_n[-1], atol=1e-6)),
                  "pred", logits.argmax(1).tolist(), "labels", labels.tolist())
            print(f"   loss {loss.item():.4f}")
    print("epoch", epoch, f"mean loss {total / len(batches):.4f}")

# sorted and unsorted packing agree; the packed batch's bookkeeping is exact
seqs, labels = batches[1]
lengths = torch.tensor([len(s) for s in seqs])
padded = pad_sequence(seqs, batch_first=True)
with torch.no_grad():
    e = model.emb(padded)
    p = pack_padded_sequence(e, lengths, batch_first=True, enforce_sorted=False)
    print("batch_sizes", p.batch_sizes.tolist(), "sorted", p.sorted_indices.tolist(),
          "unsorted", p.unsorted_indices.tolist(), "data", tuple(p.data.shape))
    order = torch.argsort(lengths, descending=True, stable=True)
    p2 = pack_padded_sequence(e[order], lengths[order], batch_first=True)
    o1, _ = pad_packed_sequence(model.gru(p)[0], batch_first=True)
    o2, l2 = pad_packed_sequence(model.gru(p2)[0], batch_first=True)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(len(order))
    print("agree", bool(torch.allclose(o1, o2[inv], atol=1e-6)), l2.tolist(), tuple(o1.shape))
    unpadded = [o1[i, :L] for i, L in enumerate(lengths.tolist())]
    print("unpadded", [tuple(u.shape) for u in unpadded],
          [f"{u.norm().item():.4g}" for u in unpadded])
