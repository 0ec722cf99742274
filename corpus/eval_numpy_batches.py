"""An evaluation loop over batches a NumPy pipeline makes (decoded images, features from a
preprocessing library): each batch goes to torch with torch.from_numpy, through the model, and
its loss is read with .item().  Run long, such a loop must free each batch once it is done with
it: the program counts the batches whose arrays are still alive (weakly referenced) and says
whether that count grows with the batches read, as a long-running evaluation service watching
its memory would (a batch or two in flight is no growth).  Under TORCHTPU_MODE=defer the
process-wide context once held every batch it had read (it found that leak)."""
import gc
import weakref

import numpy as np
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 1)).eval()
rng = np.random.default_rng(3)
held, total = [], 0.0
with torch.no_grad():
    for step in range(60):
        features = rng.standard_normal((256, 64)).astype(np.float32)   # 64 KiB a batch
        targets = rng.standard_normal((256, 1)).astype(np.float32)
        held.append(weakref.ref(features))
        x, y = torch.from_numpy(features), torch.from_numpy(targets)
        total += nn.functional.mse_loss(model(x), y).item()
        del features, targets, x, y
        if step % 20 == 19:
            gc.collect()
            alive = sum(r() is not None for r in held)
            print(step, f"{total / (step + 1):.4f}", "memory grows with the batches:", "yes" if alive > 4 else "no")
