"""A tiny GPT2LMHeadModel from config: generate() greedy, with seeded sampling (top-k/top-p),
beam search, and a manual KV-cache decode loop checked against a full forward."""
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging

logging.set_verbosity_error()
torch.manual_seed(0)
config = GPT2Config(vocab_size=50, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                    bos_token_id=0, eos_token_id=49, pad_token_id=49)
model = GPT2LMHeadModel(config).eval()
prompt = torch.tensor([[5, 6, 7, 8], [10, 11, 12, 13]])
greedy = model.generate(prompt, max_new_tokens=6, do_sample=False)
print("greedy", greedy[:, 4:].tolist())
torch.manual_seed(42)
sampled = model.generate(prompt, max_new_tokens=6, do_sample=True, top_k=10, top_p=0.9, temperature=0.8)
print("sampled", sampled[:, 4:].tolist())
torch.manual_seed(42)
again = model.generate(prompt, max_new_tokens=6, do_sample=True, top_k=10, top_p=0.9, temperature=0.8)
print("sampling reproducible", torch.equal(sampled, again))
beams = model.generate(prompt, max_new_tokens=5, num_beams=3, num_return_sequences=2, do_sample=False,
                       output_scores=True, return_dict_in_generate=True)
print("beam", beams.sequences[:, 4:].tolist())
print("beam scores", [f"{s:.3f}" for s in beams.sequences_scores.tolist()])
# manual decoding with past_key_values
with torch.no_grad():
    out = model(prompt, use_cache=True)
    past = out.past_key_values
    tok = out.logits[:, -1:].argmax(-1)
    seq = [tok]
    for _ in range(5):
        out = model(tok, past_key_values=past, use_cache=True)
        past = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
        seq.append(tok)
manual = torch.cat(seq, dim=1)
print("manual cache decode", manual.tolist())
print("matches greedy", torch.equal(manual, greedy[:, 4:]))
with torch.no_grad():
    full = model(greedy[:, :-1]).logits[:, -1]
    print("last logits", [f"{v:.4f}" for v in full[0, :5].tolist()])
