"""DataLoader with num_workers=2 over a TensorDataset (shuffled with a seeded generator), training a
model on the batches the workers produce."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    torch.manual_seed(0)
    X = torch.randn(96, 6)
    Y = (X.sum(1, keepdim=True) > 0).float()
    ds = TensorDataset(X, Y)
    loader = DataLoader(ds, batch_size=16, shuffle=True, num_workers=2,
                        generator=torch.Generator().manual_seed(7))
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for epoch in range(3):
        total, seen = 0.0, 0
        first = None
        for xb, yb in loader:
            if first is None:
                first = f"{xb[0, 0].item():.4f}"
            loss = nn.functional.binary_cross_entropy_with_logits(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(xb)
            seen += len(xb)
        print(epoch, seen, "first", first, f"loss {total / seen:.4f}")
    with torch.no_grad():
        acc = ((model(X) > 0).float() == Y).float().mean().item()
    print("accuracy", f"{acc:.4f}")
    batch = next(iter(DataLoader(ds, batch_size=5, num_workers=2)))
    print("batch types", type(batch).__name__, type(batch[0]).__name__, tuple(batch[0].shape))


if __name__ == "__main__":
    main()
