"""torch.distributions: a small VAE with rsample and kl_divergence, log_prob/entropy, seeded Categorical/multinomial samples, Independent, Tanh-transformed Normal."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import (Bernoulli, Categorical, Dirichlet, Independent, MultivariateNormal, Normal,
                                 TransformedDistribution, kl_divergence)
from torch.distributions.transforms import TanhTransform


def r(x):
    return float(f"{x:.4g}")


def rl(t):
    return [r(v) for v in t.flatten().tolist()]


torch.manual_seed(0)

# a VAE-like loop: encoder -> Normal posterior, rsample, decoder -> Bernoulli likelihood
data = (torch.rand(64, 12) > 0.5).float()
enc = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))
dec = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 12))
opt = torch.optim.Adam(list(enc.parameters()) + list(dec.parameters()), lr=1e-2)
prior = Normal(torch.zeros(2), torch.ones(2))
for step in range(40):
    h = enc(data)
    mu, logvar = h[:, :2], h[:, 2:]
    q = Normal(mu, torch.exp(0.5 * logvar))
    z = q.rsample()
    px = Bernoulli(logits=dec(z))
    rec = px.log_prob(data).sum(-1)
    kl = kl_divergence(q, prior).sum(-1)
    loss = (kl - rec).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 10 == 9:
        print(step, "loss", r(loss.item()), "kl", r(kl.mean().item()), "rec", r(rec.mean().item()),
              "z shape", tuple(z.shape), z.requires_grad)
with torch.no_grad():
    mu, logvar = enc(data[:3]).split(2, dim=1)
    try:
        Normal(mu, logvar)
    except ValueError as e:
        print("validate:", str(e).split(", but")[0].split(" of shape ")[1])
    q = Normal(mu, (0.5 * logvar).exp())
print("batch/event", q.batch_shape, q.event_shape, Independent(q, 1).batch_shape, Independent(q, 1).event_shape)

# log_prob and entropy
for i in range(3):
    loc = torch.randn(3)
    scale = torch.rand(3) + 0.5
    d = Normal(loc, scale)
    x = torch.randn(3)
    ind = Independent(d, 1)
    print(i, "lp", rl(d.log_prob(x)), "ent", rl(d.entropy()), "ind lp", r(ind.log_prob(x).item()),
          "ind ent", r(ind.entropy().item()), "cdf", rl(d.cdf(x)), "icdf", rl(d.icdf(torch.tensor([0.1, 0.5, 0.9]))))

# Categorical: seeded samples, log_prob, entropy
logits = torch.randn(4, 6)
for i in range(4):
    cat = Categorical(logits=logits)
    torch.manual_seed(100 + i)
    s = cat.sample()
    torch.manual_seed(100 + i)
    s2 = cat.sample((3,))
    print(i, "sample", s.tolist(), s2.tolist(), s.dtype, "lp", rl(cat.log_prob(s)), "ent", rl(cat.entropy()),
          "probs sum", rl(cat.probs.sum(-1)))
    logits = logits + 0.5 * torch.randn(4, 6)
cat = Categorical(probs=torch.tensor([0.1, 0.2, 0.3, 0.4]))
torch.manual_seed(7)
counts = torch.bincount(cat.sample((2000,)), minlength=4)
print("counts", counts.tolist(), "mode", cat.mode.item() if hasattr(cat, "mode") else None)

# multinomial with and without replacement
w = torch.tensor([[1.0, 2.0, 3.0, 4.0, 0.0], [0.0, 0.0, 5.0, 1.0, 1.0]])
for i in range(3):
    torch.manual_seed(200 + i)
    a = torch.multinomial(w, 3, replacement=False)
    torch.manual_seed(200 + i)
    b = torch.multinomial(w, 8, replacement=True)
    c = torch.multinomial(w[0], 4)
    print(i, a.tolist(), b.tolist(), c.tolist(), a.dtype)
try:
    torch.manual_seed(5)
    print("4 of 3 nonzero", torch.multinomial(w, 4, replacement=False).tolist())
    torch.multinomial(w, 6, replacement=False)
except RuntimeError as e:
    print("multinomial error:", str(e).splitlines()[0])

# Bernoulli, Dirichlet, MultivariateNormal
for i in range(3):
    torch.manual_seed(300 + i)
    bern = Bernoulli(probs=torch.tensor([0.1, 0.5, 0.9]))
    bs = bern.sample((4,))
    dirich = Dirichlet(torch.tensor([0.5, 1.0, 2.0]))
    ds = dirich.sample()
    cov = torch.tensor([[1.0, 0.5], [0.5, 2.0]])
    mvn = MultivariateNormal(torch.zeros(2), covariance_matrix=cov)
    ms = mvn.rsample((5,))
    print(i, "bern", bs.tolist(), "lp", r(bern.log_prob(bs).sum().item()), "ent", rl(bern.entropy()))
    print("  dir", rl(ds), r(ds.sum().item()), "lp", r(dirich.log_prob(ds).item()), "ent", r(dirich.entropy().item()))
    print("  mvn", rl(ms[0]), "lp", rl(mvn.log_prob(ms)[:2]), "ent", r(mvn.entropy().item()),
          "scale_tril", rl(mvn.scale_tril), tuple(ms.shape))
mvn2 = MultivariateNormal(torch.ones(2), scale_tril=torch.tensor([[1.0, 0.0], [0.3, 0.8]]))
print("kl mvn", r(kl_divergence(mvn, mvn2).item()), "kl dir", r(kl_divergence(Dirichlet(torch.ones(3)), dirich).item()),
      "kl cat", r(kl_divergence(Categorical(logits=torch.zeros(6)), Categorical(logits=logits[0])).item()))

# TransformedDistribution with TanhTransform (a squashed Gaussian policy)
mu = torch.zeros(2, requires_grad=True)
log_std = torch.zeros(2, requires_grad=True)
popt = torch.optim.SGD([mu, log_std], lr=0.1)
target = torch.tensor([0.5, -0.3])
for step in range(30):
    base = Normal(mu, log_std.exp())
    pol = TransformedDistribution(base, [TanhTransform(cache_size=1)])
    a = pol.rsample((16,))
    lp = pol.log_prob(a).sum(-1)
    loss = ((a - target) ** 2).sum(-1).mean() + 0.01 * lp.mean()
    popt.zero_grad()
    loss.backward()
    popt.step()
    if step % 10 == 9:
        print(step, "loss", r(loss.item()), "mu", rl(mu.detach()), "std", rl(log_std.detach().exp()),
              "range ok", bool((a.abs() < 1).all()))
print("support", pol.support, pol.event_shape, pol.batch_shape)
