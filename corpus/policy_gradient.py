"""REINFORCE on a toy bandit-like environment: Categorical log_prob, actions sampled with a seeded
generator, discounted returns, and a baseline."""
import torch
from torch import nn
from torch.distributions import Categorical

torch.manual_seed(0)
policy = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 3))
opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
gen = torch.Generator().manual_seed(123)
target = torch.tensor([[1.0, 0.0, -1.0, 0.5], [0.0, 1.0, 0.0, -0.5], [-1.0, 0.0, 1.0, 0.0]])


def env_step(state, action):
    reward = (state * target[action]).sum()
    next_state = torch.randn(4, generator=gen)
    return next_state, reward


for episode in range(12):
    state = torch.randn(4, generator=gen)
    log_probs, rewards = [], []
    for t in range(10):
        logits = policy(state)
        dist = Categorical(logits=logits)
        action = torch.multinomial(dist.probs, 1, generator=gen).squeeze(0)
        log_probs.append(dist.log_prob(action))
        state, reward = env_step(state, action)
        rewards.append(reward.item())
    returns, running = [], 0.0
    for r in reversed(rewards):
        running = r + 0.9 * running
        returns.insert(0, running)
    returns = torch.tensor(returns)
    advantages = (returns - returns.mean()) / (returns.std() + 1e-8)
    loss = -(torch.stack(log_probs) * advantages).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    ent = Categorical(logits=policy(state)).entropy()
    print(episode, f"return {sum(rewards):.4f}", f"loss {loss.item():.4f}", f"entropy {ent.item():.4f}")
dist = Categorical(logits=policy(torch.zeros(4)))
print("sample with global seed", dist.sample((8,)).tolist())
