"""Hugging Face Trainer with bf16 for a few steps on an in-memory torch Dataset, report_to=[],
into a temporary output_dir; the logged losses and an evaluation."""
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import PrinterCallback, Trainer, TrainingArguments, BertConfig, BertForSequenceClassification
from transformers.utils import logging

logging.set_verbosity_error()


class Toy(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(5, 60, (n, 12), generator=g)
        self.labels = (self.ids[:, 0] > 32).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(12, dtype=torch.long), "labels": self.labels[i]}


torch.manual_seed(0)
config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, max_position_embeddings=32, num_labels=2)
model = BertForSequenceClassification(config)
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, per_device_eval_batch_size=8,
                             num_train_epochs=1, max_steps=6, learning_rate=1e-3, logging_steps=2,
                             bf16=True, report_to=[], save_strategy="no", seed=0, use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Toy(64, 1), eval_dataset=Toy(16, 2))
    trainer.remove_callback(PrinterCallback)  # it prints timings
    result = trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print("step", entry["step"], f"loss {entry['loss']:.3f}")
    print("global_step", result.global_step, f"train_loss {result.training_loss:.3f}")
    metrics = trainer.evaluate()
    print("eval_loss", f"{metrics['eval_loss']:.3f}")
    preds = trainer.predict(Toy(8, 3))
    print("pred shape", preds.predictions.shape, "labels", preds.label_ids.tolist())
