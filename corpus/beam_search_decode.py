"""Beam search over a tiny random language model: stable-sort selection with ties (topk values checked), floor div/mod beam indices, end tokens, length penalty."""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
V, H, BEAM, EOS, MAXLEN = 12, 16, 4, 0, 7


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.rnn = nn.GRUCell(H, H)
        self.out = nn.Linear(H, V)

    def forward(self, tok, h):
        h = self.rnn(self.emb(tok), h)
        logits = self.out(h)
        # quantize so several scores tie exactly
        logits = torch.round(logits * 2) / 2
        logits[:, EOS] += 0.25
        return logits, h


model = TinyLM().eval()


def beam_search(bos, alpha=0.7):
    tokens = torch.full((BEAM, 1), bos, dtype=torch.long)
    scores = torch.zeros(BEAM)
    scores[1:] = float("-inf")          # only the first beam is live at the start
    finished = torch.zeros(BEAM, dtype=torch.bool)
    lengths = torch.ones(BEAM, dtype=torch.long)
    h = torch.zeros(BEAM, H)
    for step in range(MAXLEN):
        logits, h = model(tokens[:, -1], h)
        logp = F.log_softmax(logits, dim=-1)
        # a finished beam can only extend with EOS at no cost
        eos_only = torch.full((V,), float("-inf"))
        eos_only[EOS] = 0.0
        logp = torch.where(finished.unsqueeze(1), eos_only.expand(BEAM, V), logp)
        cand = scores.unsqueeze(1) + logp
        flat = cand.reshape(-1)
        # topk's order among equal scores is unspecified (torch's CPU kernel picks any): select with
        # a stable sort for a defined order, and check topk's values agree with it
        sorted_scores, sorted_idx = flat.sort(descending=True, stable=True)
        top_scores, top_idx = sorted_scores[:BEAM], sorted_idx[:BEAM]
        topk_vals = flat.topk(BEAM).values
        agree = torch.equal(topk_vals, top_scores)
        if not agree:
            print("topk values disagree at step", step)
        beam_idx = torch.div(top_idx, V, rounding_mode="floor")
        tok_idx = top_idx % V
        tokens = torch.cat([tokens.index_select(0, beam_idx), tok_idx.unsqueeze(1)], dim=1)
        h = h.gather(0, beam_idx.unsqueeze(1).expand(-1, H))
        was_finished = finished.gather(0, beam_idx)
        lengths = lengths.gather(0, beam_idx) + (~was_finished).long()
        finished = was_finished | (tok_idx == EOS)
        scores = top_scores
        if bool(finished.all()):
            break
    penalty = ((5.0 + lengths.float()) / 6.0) ** alpha
    normed = scores / penalty
    normed = normed.masked_fill(torch.isinf(scores), float("-inf"))
    order = normed.argsort(descending=True, stable=True)
    return tokens[order], normed[order], lengths[order], finished[order], step


with torch.no_grad():
    for it in range(4):
        bos = (it * 5 + 3) % V
        toks, sc, lens, fin, steps = beam_search(bos)
        print("iter", it, "bos", bos, "steps", steps)
        print(" tokens", toks.tolist())
        print(" lengths", lens.tolist(), "finished", fin.tolist(), fin.sum().item(), fin.dtype)
        print(" scores", [round(s, 4) for s in sc.tolist()])
        best = toks[0]
        eos_pos = (best == EOS).nonzero()
        print(" best eos positions", eos_pos.flatten().tolist(), "best len", int(lens[0]))
        # tie check: how many equal raw scores among candidates at the last step
        print(" unique scores", torch.unique(sc).numel())
