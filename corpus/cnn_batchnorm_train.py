"""A small CNN (Conv, BatchNorm, MaxPool, Dropout) trained on random images, evaluated in eval mode."""
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.avg_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = self.drop(torch.flatten(x, 1))
        return self.fc(x)


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
images = torch.randn(64, 3, 16, 16)
labels = torch.randint(0, 10, (64,))
for epoch in range(3):
    model.train()
    total = 0.0
    for i in range(0, 64, 16):
        x, y = images[i:i + 16], labels[i:i + 16]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += loss.item()
    model.eval()
    with torch.no_grad():
        logits = model(images)
        acc = (logits.argmax(1) == labels).float().mean().item()
    print(epoch, f"{total / 4:.4f}", f"{acc:.4f}")
print("running_mean", [f"{v:.4f}" for v in model.bn1.running_mean[:4].tolist()])
print("running_var", [f"{v:.4f}" for v in model.bn2.running_var[:4].tolist()])
print("num_batches_tracked", model.bn1.num_batches_tracked.item())
model.train()
with torch.no_grad():
    a = model(images[:4])
    b = model(images[:4])
print("train-mode outputs differ (dropout):", not torch.equal(a, b))
model.eval()
with torch.no_grad():
    a = model(images[:4])
    b = model(images[:4])
print("eval-mode outputs equal:", torch.equal(a, b))
