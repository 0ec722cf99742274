"""A bidirectional LSTM over packed sequences, read, then split back with unpad_sequence (its transpose_ in place)."""
import torch
from torch import nn
from torch.nn.utils.rnn import pack_sequence, pad_packed_sequence, unpad_sequence

torch.manual_seed(0)
lstm = nn.LSTM(3, 4, proj_size=2, bidirectional=True, num_layers=2)
for i in range(4):
    seqs = [torch.randn(length, 3) for length in (4, 1 + i, 3)]
    out, (h, c) = lstm(pack_sequence(seqs, enforce_sorted=False))
    padded, lengths = pad_packed_sequence(out)
    print(i, tuple(padded.shape), lengths.tolist(), [f"{v:.4g}" for v in h.sum((1, 2)).tolist()])
    pieces = unpad_sequence(padded, lengths)        # (transposes ``padded`` in place)
    print(i, [tuple(p.shape) for p in pieces], [f"{p.sum().item():.4g}" for p in pieces])
