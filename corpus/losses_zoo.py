"""Loss functions: cross_entropy with label smoothing, ignore_index and probabilities as target,
bce_with_logits with pos_weight, ctc_loss, kl_div, nll_loss with class weights, smooth_l1, huber,
margin ranking, cosine embedding, triplet, each with a gradient."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
logits = torch.randn(6, 5, requires_grad=True)
target = torch.tensor([0, 3, -100, 4, 1, -100])
losses = {
    "ce": F.cross_entropy(logits, target.clamp(min=0)),
    "ce_smooth": F.cross_entropy(logits, target.clamp(min=0), label_smoothing=0.1),
    "ce_ignore": F.cross_entropy(logits, target, ignore_index=-100),
    "ce_ignore_smooth": F.cross_entropy(logits, target, ignore_index=-100, label_smoothing=0.2),
    "ce_probs": F.cross_entropy(logits, torch.softmax(torch.randn(6, 5), -1)),
    "ce_sum": F.cross_entropy(logits, target.clamp(min=0), reduction="sum"),
    "nll_weight": F.nll_loss(F.log_softmax(logits, -1), target.clamp(min=0), weight=torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0])),
    "bce_logits": F.binary_cross_entropy_with_logits(logits, (torch.rand(6, 5) > 0.5).float(), pos_weight=torch.full((5,), 2.0)),
    "bce": F.binary_cross_entropy(torch.sigmoid(logits), torch.rand(6, 5)),
    "kl_div": F.kl_div(F.log_softmax(logits, -1), F.softmax(torch.randn(6, 5), -1), reduction="batchmean"),
    "kl_log_target": F.kl_div(F.log_softmax(logits, -1), F.log_softmax(torch.randn(6, 5), -1), reduction="sum", log_target=True),
    "smooth_l1": F.smooth_l1_loss(logits, torch.randn(6, 5), beta=0.5),
    "huber": F.huber_loss(logits, torch.randn(6, 5), delta=0.7),
    "margin": F.margin_ranking_loss(logits[:, 0], logits[:, 1], torch.tensor([1.0, -1, 1, 1, -1, 1]), margin=0.2),
    "cosine": F.cosine_embedding_loss(logits[:3], logits[3:], torch.tensor([1.0, -1.0, 1.0])),
    "triplet": F.triplet_margin_loss(logits[:2], logits[2:4], logits[4:]),
    "multi_margin": F.multi_margin_loss(logits, target.clamp(min=0)),
    "poisson_nll": F.poisson_nll_loss(logits, torch.rand(6, 5) * 3),
    "gaussian_nll": F.gaussian_nll_loss(logits, torch.randn(6, 5), torch.ones(6, 5) * 0.5),
}
for name, loss in losses.items():
    g, = torch.autograd.grad(loss, logits)
    print(f"{name:18s} {loss.item():.5f} grad {g.abs().sum().item():.5f}")
# CTC: T=12 steps, batch 2, 6 classes (0 = blank)
T, N, C = 12, 2, 6
log_probs = torch.randn(T, N, C).log_softmax(2).detach().requires_grad_()
targets = torch.tensor([[1, 2, 2, 3], [4, 5, 1, 0]])
input_lengths = torch.tensor([12, 10])
target_lengths = torch.tensor([4, 3])
for red in ("mean", "sum", "none"):
    ctc = F.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=red, zero_infinity=True)
    print("ctc", red, [f"{v:.4f}" for v in ctc.reshape(-1).tolist()])
ctc = F.ctc_loss(log_probs, targets, input_lengths, target_lengths)
ctc.backward()
print("ctc grad", f"{log_probs.grad.abs().sum().item():.5f}")
