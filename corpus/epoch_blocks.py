"""Epochs over a DataLoader with forked workers, each epoch inside ``with deferfuse.defer():``
when run with ``--block`` (the README's way in), a debug check and a strict metric inside each
step, and two metrics printed from one line: the block's first run finds its loop at the
optimizer step's end, not at the second read of a line."""
import argparse
import contextlib

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--block", action="store_true", help="each epoch in one `with deferfuse.defer():`")
    args = parser.parse_args()
    if args.block:
        import deferfuse
        epoch_block, debug, strict = deferfuse.defer, deferfuse.debug, deferfuse.strict
    else:
        epoch_block = debug = strict = contextlib.nullcontext
    torch.manual_seed(0)
    X = torch.randn(96, 8)
    Y = X[:, :1] * 0.5 - X[:, 1:2]
    loader = DataLoader(TensorDataset(X, Y), batch_size=16, shuffle=True, num_workers=2,
                        generator=torch.Generator().manual_seed(3), multiprocessing_context="fork")
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for epoch in range(4):
        with epoch_block():
            for step, (xb, yb) in enumerate(loader):
                loss = nn.functional.mse_loss(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
                with debug():
                    size = xb.abs().sum()
                with strict():
                    spread = yb.std()
                if step % 2 == 0:
                    print(epoch, step, f"loss {loss.item():.4f} size {size.item():.3f} spread {spread.item():.4f}")
    with torch.no_grad():
        print("final", f"{nn.functional.mse_loss(model(X), Y).item():.4f}")


if __name__ == "__main__":
    main()
