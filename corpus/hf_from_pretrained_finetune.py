"""A Hugging Face model as users get it: saved with save_pretrained, loaded with from_pretrained
(its weights in the safetensors file, mapped privately by torch), fine-tuned a few AdamW steps
printing the loss, saved again and reloaded; and a checkpoint resumed with torch.load(mmap=True)."""
import os
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging

logging.set_verbosity_error()
torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
ids = torch.randint(3, 64, (4, 16))
with tempfile.TemporaryDirectory() as d:
    LlamaForCausalLM(config).save_pretrained(os.path.join(d, "base"))
    model = LlamaForCausalLM.from_pretrained(os.path.join(d, "base"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(5):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(step, f"{loss.item():.4f}")
    model.save_pretrained(os.path.join(d, "tuned"))
    torch.save(opt.state_dict(), os.path.join(d, "opt.pt"))
    tuned = LlamaForCausalLM.from_pretrained(os.path.join(d, "tuned"))
    print("reloaded equal", all(torch.equal(a, b) for a, b in zip(model.parameters(), tuned.parameters())))
    opt2 = torch.optim.AdamW(tuned.parameters(), lr=3e-3)
    opt2.load_state_dict(torch.load(os.path.join(d, "opt.pt"), mmap=True))
    for step in range(5, 8):
        loss = tuned(input_ids=ids, labels=ids).loss
        loss.backward()
        opt2.step()
        opt2.zero_grad()
        print(step, f"{loss.item():.4f}")
    print("weights sum", f"{sum(p.double().sum().item() for p in tuned.parameters()):.6f}")
