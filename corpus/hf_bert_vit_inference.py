"""Inference of BERT and ViT built from configs (random init): hidden states, pooled output,
attention masks, and argmax predictions."""
import torch
from transformers import BertConfig, BertModel, ViTConfig, ViTForImageClassification
from transformers.utils import logging

logging.set_verbosity_error()
torch.manual_seed(0)
bert = BertModel(BertConfig(vocab_size=100, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=96, max_position_embeddings=40,
                            attn_implementation="eager")).eval()
ids = torch.randint(1, 100, (3, 10))
mask = torch.ones_like(ids)
mask[2, 6:] = 0
with torch.no_grad():
    out = bert(input_ids=ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
print("last_hidden", tuple(out.last_hidden_state.shape), f"{out.last_hidden_state.abs().sum().item():.4f}")
print("pooler", [f"{v:.4f}" for v in out.pooler_output[:, 0].tolist()])
print("hidden states", len(out.hidden_states), "attentions", len(out.attentions) if out.attentions else 0)
if out.attentions:
    print("masked attention zero", bool((out.attentions[0][2, :, :, 6:] < 1e-6).all()))
vit = ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=48,
                                          num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                                          num_labels=5)).eval()
pixels = torch.randn(4, 3, 32, 32)
with torch.inference_mode():
    logits = vit(pixel_values=pixels).logits
print("vit logits", tuple(logits.shape), [f"{v:.4f}" for v in logits[0].tolist()])
print("vit preds", logits.argmax(-1).tolist())
probs = logits.softmax(-1)
print("prob rows sum to 1", bool(torch.allclose(probs.sum(-1), torch.ones(4))))
