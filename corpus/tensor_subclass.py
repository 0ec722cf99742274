"""A user's own Tensor subclass: as_subclass, __torch_function__ that tags results and counts
calls, and the subclass surviving ops, autograd and torch.cat."""
import torch


class Tagged(torch.Tensor):
    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        Tagged.calls += 1
        return super().__torch_function__(func, types, args, kwargs)


class Meters(torch.Tensor):
    def to_km(self):
        return (self / 1000).as_subclass(Meters)

    def __repr__(self):
        return f"Meters({self.as_subclass(torch.Tensor).tolist()})"


torch.manual_seed(0)
t = torch.randn(4).as_subclass(Tagged)
print("type", type(t).__name__, isinstance(t, torch.Tensor), type(t) is torch.Tensor)
u = (t * 2 + 1).relu()
print("result type", type(u).__name__, [f"{v:.4f}" for v in u.tolist()])
print("sum type", type(u.sum()).__name__, f"{u.sum().item():.4f}")
print("cat type", type(torch.cat([t, torch.ones(2)])).__name__)
print("calls > 0", Tagged.calls > 0)
w = torch.randn(4, requires_grad=True)
p = w.as_subclass(Tagged)
loss = (p * p).sum()
loss.backward()
print("grad through subclass", [f"{v:.4f}" for v in w.grad.tolist()], type(loss).__name__)
d = torch.tensor([1500.0, 250.0]).as_subclass(Meters)
print(repr(d.to_km()), type(d + d).__name__)
plain = d.as_subclass(torch.Tensor)
print("back to plain", type(plain).__name__, plain.tolist())


class Logged(torch.Tensor):
    log = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.add or func is torch.add:
            Logged.log.append("add")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        return out


a = torch.arange(3.0).as_subclass(Logged)
r = torch.add(a, 1)
print("logged", Logged.log, type(r).__name__, r.tolist())
