"""Variable-length sequences: pack_padded_sequence, a packed LSTM trained a few steps, and
pad_packed_sequence back."""
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

torch.manual_seed(0)
lstm = nn.LSTM(5, 7, batch_first=True)
head = nn.Linear(7, 1)
opt = torch.optim.Adam(list(lstm.parameters()) + list(head.parameters()), lr=1e-2)
x = torch.randn(3, 4, 5)
lengths = torch.tensor([4, 1, 3])
for step in range(4):
    packed = pack_padded_sequence(x * (1 + step * 0.1), lengths, batch_first=True, enforce_sorted=False)
    out, (h, c) = lstm(packed)
    padded, lens = pad_packed_sequence(out, batch_first=True)
    loss = head(padded).pow(2).sum() / lens.sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(step, f"{loss.item():.5f}", padded.shape, lens.tolist())
