"""nn.TransformerEncoder trained a few steps on a toy sequence classification task."""
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
vocab, d_model, seq = 20, 32, 12


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(1, seq, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=64, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, num_layers=2)
        self.head = nn.Linear(d_model, 2)

    def forward(self, ids):
        h = self.enc(self.emb(ids) + self.pos)
        return self.head(h.mean(1))


model = Classifier()
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
ids = torch.randint(0, vocab, (32, seq))
labels = (ids[:, 0] > ids[:, -1]).long()
for step in range(15):
    loss = F.cross_entropy(model(ids), labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 5 == 0 or step == 14:
        print(step, f"{loss.item():.4f}")
model.eval()
with torch.no_grad():
    pred = model(ids).argmax(-1)
print("accuracy", f"{(pred == labels).float().mean().item():.4f}")
print("first preds", pred[:10].tolist())
