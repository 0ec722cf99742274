"""Learning-rate schedulers: StepLR, OneCycleLR and ReduceLROnPlateau stepping on a float loss."""
import torch
from torch import nn

torch.manual_seed(0)
X = torch.randn(40, 6)
Y = X @ torch.randn(6, 1)


def run(make_sched, steps, plateau=False):
    model = nn.Linear(6, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = make_sched(opt)
    lrs = []
    for step in range(steps):
        loss = nn.functional.mse_loss(model(X), Y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if plateau:
            sched.step(loss.item() if step < 6 else 1.0)
        else:
            sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return loss.item(), lrs


loss, lrs = run(lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5), 10)
print("StepLR", f"{loss:.5f}", [f"{v:.4f}" for v in lrs])
loss, lrs = run(lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=12), 12)
print("OneCycleLR", f"{loss:.5f}", [f"{v:.4f}" for v in lrs])
loss, lrs = run(lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, mode="min", factor=0.5, patience=1), 14, plateau=True)
print("ReduceLROnPlateau", f"{loss:.5f}", [f"{v:.4f}" for v in lrs])
loss, lrs = run(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=8), 8)
print("CosineAnnealingLR", f"{loss:.5f}", [f"{v:.4f}" for v in lrs])
