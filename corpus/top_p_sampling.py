"""Text-generation sampling over a tiny random model: temperature, top-k, top-p, repetition penalty, multinomial with a seeded generator, EOS stop."""
import torch
from torch import nn
import torch.nn.functional as F

torch.manual_seed(0)
VOCAB, DIM, EOS, PAD = 32, 16, 3, 0


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.rnn = nn.GRUCell(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tok, h):
        h = self.rnn(self.emb(tok), h)
        return self.head(h) * 3.0, h


def apply_repetition_penalty(logits, prev, penalty):
    score = torch.gather(logits, 1, prev)
    score = torch.where(score < 0, score * penalty, score / penalty)
    logits.scatter_(1, prev, score)
    return logits


def top_k_filter(logits, k):
    vals, idx = torch.topk(logits, k, dim=-1)
    out = torch.full_like(logits, float("-inf"))
    return out.scatter(1, idx, vals)


def top_p_filter(logits, p):
    sorted_logits, sorted_idx = torch.sort(logits, descending=True)
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    remove = cum > p
    remove[..., 1:] = remove[..., :-1].clone()
    remove[..., 0] = False
    mask = remove.scatter(1, sorted_idx, remove)
    return logits.masked_fill(mask, float("-inf"))


@torch.no_grad()
def generate(model, prompt, max_new, temperature, k, p, penalty, g):
    B = prompt.shape[0]
    h = torch.zeros(B, DIM)
    for t in range(prompt.shape[1] - 1):
        _, h = model(prompt[:, t], h)
    seqs = prompt.clone()
    done = torch.zeros(B, dtype=torch.bool)
    tok = prompt[:, -1]
    for step in range(max_new):
        logits, h = model(tok, h)
        logits = logits / temperature
        if penalty != 1.0:
            logits = apply_repetition_penalty(logits, seqs, penalty)
        if k:
            logits = top_k_filter(logits, k)
        if p < 1.0:
            logits = top_p_filter(logits, p)
        probs = F.softmax(logits, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=g).squeeze(1)
        nxt = torch.where(done, torch.full_like(nxt, PAD), nxt)
        seqs = torch.cat([seqs, nxt[:, None]], dim=1)
        done = done | (nxt == EOS)
        tok = nxt
        if done.all():
            break
    return seqs, done, step


model = TinyLM().eval()
g = torch.Generator().manual_seed(1234)
configs = [
    (1.0, 0, 1.0, 1.0),
    (0.7, 8, 1.0, 1.0),
    (1.3, 0, 0.9, 1.0),
    (0.9, 10, 0.8, 1.3),
    (0.5, 5, 0.5, 2.0),
]
for rnd in range(3):
    for ci, (temp, k, p, pen) in enumerate(configs):
        prompt = torch.randint(4, VOCAB, (4, 3))
        seqs, done, steps = generate(model, prompt, 12, temp, k, p, pen, g)
        print(rnd, ci, "steps", steps, "shape", tuple(seqs.shape), "done", done.tolist())
        for row in seqs.tolist():
            print("  ", row)
        lens = (seqs != PAD).sum(1)
        print("   lens", lens.tolist(), "eos at", [r.index(EOS) if EOS in r else -1 for r in seqs.tolist()])

# a greedy pass, and top-p alone on fixed logits, printed as masks
logits = torch.randn(3, VOCAB)
for p in (0.1, 0.5, 0.95):
    f = top_p_filter(logits.clone(), p)
    print("top_p", p, torch.isinf(f).sum(1).tolist(), f.argmax(1).tolist())
    probs = F.softmax(f, dim=-1)
    print("  probs max", [f"{v:.4g}" for v in probs.max(1).values.tolist()])
