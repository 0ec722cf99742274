"""A tiny LlamaForCausalLM built from its config: a few AdamW steps, then greedy generate()."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging

logging.set_verbosity_error()
torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2)
model = LlamaForCausalLM(config)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
ids = torch.randint(3, 64, (4, 16))
attn = torch.ones_like(ids)
attn[1, :3] = 0
for step in range(6):
    out = model(input_ids=ids, attention_mask=attn, labels=ids)
    opt.zero_grad()
    out.loss.backward()
    opt.step()
    print(step, f"{out.loss.item():.4f}", tuple(out.logits.shape))
model.eval()
prompt = ids[:2, :5]
gen = model.generate(prompt, max_new_tokens=8, do_sample=False)
print("greedy", gen[:, 5:].tolist())
with torch.no_grad():
    logits = model(prompt).logits
print("next token", logits[:, -1].argmax(-1).tolist(), "matches generate", gen[:, 5].tolist() == logits[:, -1].argmax(-1).tolist())
