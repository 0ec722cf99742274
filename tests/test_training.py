"""Training loops under defer mode: the same losses, parameters and optimizer state as strict.

Each loop runs twice from the same seed, under strict and under defer, and everything a user can
observe is compared: the loss of every step, the final parameters, the optimizer state, and that
parameters stay the same Python objects over the same memory.
"""

from __future__ import annotations

import io

import pytest
import torch

import deferfuse
from oracle import assert_same

STEPS = 6


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.LayerNorm(24), torch.nn.GELU(),
                               torch.nn.Linear(24, 5))


def batches(n: int, rows: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 12, generator=g), torch.randint(0, 5, (rows,), generator=g)) for _ in range(n)]


def train(mode: str, make_opt, steps: int = STEPS, *, accumulate: int = 1, clip: float | None = None,
          scheduler=None, set_to_none: bool = True, model: torch.nn.Module | None = None, tiers=None):
    """(losses, model, optimizer) after ``steps`` steps of a small classifier under ``mode``
    (``tiers``: the user_defaults fixture, each step one call of the same defer block)."""
    model = model or make_model()
    opt = make_opt(model.parameters())
    sched = scheduler(opt) if scheduler else None
    data = batches(steps * accumulate)
    losses = []

    def train_step(step: int) -> None:
        opt.zero_grad(set_to_none=set_to_none)
        for micro in range(accumulate):
            x, y = data[step * accumulate + micro]
            loss = torch.nn.functional.cross_entropy(model(x), y) / accumulate
            loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched:
            sched.step()
        losses.append(loss.item())

    if tiers is not None:
        for call in tiers.calls(steps):
            with deferfuse.defer():
                train_step(call - 1)
        return losses, model, opt
    context = deferfuse.defer() if mode == "defer" else deferfuse.strict()
    with context:
        for step in range(steps):
            train_step(step)
    return losses, model, opt


def optimizer_tensors(opt: torch.optim.Optimizer) -> list:
    return [(k, v) for state in opt.state.values() for k, v in sorted(state.items()) if isinstance(v, torch.Tensor)]


def assert_same_training(strict, defer) -> None:
    (ls, ms, os_), (ld, md, od) = strict, defer
    for i, (a, b) in enumerate(zip(ls, ld)):
        assert abs(a - b) <= 1e-4 * abs(a) + 1e-7, f"step {i}: loss {b} != strict {a}"
    assert_same(list(ms.parameters()), list(md.parameters()), path="parameters")
    assert_same([p.grad for p in ms.parameters()], [p.grad for p in md.parameters()], path="grads")
    assert_same(optimizer_tensors(os_), optimizer_tensors(od), path="optimizer state")


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False),
    "sgd-momentum-foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
    "sgd-momentum-fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "sgd-nesterov-wd-maximize": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True,
                                                          weight_decay=0.01, maximize=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False),
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adam-fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adam-wd-amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "adamw-fused-amsgrad-maximize": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True, amsgrad=True,
                                                                maximize=True),
    "adamw-foreach-amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True, amsgrad=True),
}


@pytest.mark.parametrize("always_compile", [True, False], ids=["xla", "tiered"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_matches_strict(name, always_compile):
    make_opt = OPTIMIZERS[name]
    strict = train("strict", make_opt)
    deferfuse.reset_stats()   # (what earlier tests in this process counted is not ours)
    with deferfuse.config.override(always_compile=always_compile):
        defer = train("defer", make_opt)
    assert_same_training(strict, defer)
    assert deferfuse.stats()["fallbacks"] == {}


@pytest.mark.parametrize("set_to_none", [True, False])
def test_accumulation_clipping_and_schedule(set_to_none):
    def run(mode):
        return train(mode, OPTIMIZERS["adamw-foreach"], accumulate=3, clip=0.05, set_to_none=set_to_none,
                     scheduler=lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=STEPS))
    strict = run("strict")
    with deferfuse.config.override(always_compile=True):
        defer = run("defer")
    assert_same_training(strict, defer)


@pytest.mark.parametrize("name", ["adam-wd-amsgrad", "adamw-foreach", "adamw-fused", "sgd-momentum-foreach"])
def test_optimizer_matches_strict_with_the_default_settings(name, user_defaults):
    """Every setting at its default, one defer block per step (tests/user_defaults.py)."""
    strict = train("strict", OPTIMIZERS[name])
    defer = train("defer", OPTIMIZERS[name], tiers=user_defaults)
    assert_same_training(strict, defer)


@pytest.mark.parametrize("user_defaults", ["measuring"], indirect=True)
def test_accumulation_clipping_and_schedule_with_the_default_settings(user_defaults):
    def run(mode, tiers=None):
        return train(mode, OPTIMIZERS["adamw-foreach"], accumulate=3, clip=0.05, tiers=tiers,
                     scheduler=lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=STEPS))
    assert_same_training(run("strict"), run("defer", user_defaults))


def test_convergence_over_30_steps():
    def run(mode):
        return train(mode, OPTIMIZERS["adamw"], steps=30,
                     scheduler=lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=30))
    strict = run("strict")
    defer = run("defer")
    assert_same_training(strict, defer)


def test_parameters_stay_the_same_objects_over_the_same_memory():
    model = make_model()
    params = list(model.parameters())
    ids = [id(p) for p in params]
    pointers = [p.data_ptr() for p in params]
    weight_view = params[0][0]          # an existing view of a parameter
    strict = train("strict", OPTIMIZERS["adamw-foreach"])
    defer = train("defer", OPTIMIZERS["adamw-foreach"], model=model)
    assert [id(p) for p in defer[1].parameters()] == ids
    assert all(isinstance(p, torch.nn.Parameter) and type(p) is torch.nn.Parameter for p in model.parameters())
    assert [p.data_ptr() for p in model.parameters()] == pointers
    assert_same(list(strict[1].parameters()), list(defer[1].parameters()))
    assert torch.equal(weight_view, params[0][0])
    state = defer[2].state[params[0]]
    pointer = state["exp_avg"].data_ptr()
    with deferfuse.defer():
        loss = model(batches(1)[0][0]).sum()
        loss.backward()
        defer[2].step()
    assert state["exp_avg"].data_ptr() == pointer, "optimizer state moved to new memory"


@pytest.mark.parametrize("where", ["inside", "after"])
def test_state_dict_save_and_load(where):
    strict = train("strict", OPTIMIZERS["adam"])
    _, model, opt = defer = train("defer", OPTIMIZERS["adam"])
    assert_same_training(strict, defer)
    buffer = io.BytesIO()
    context = deferfuse.defer() if where == "inside" else deferfuse.strict()
    with context:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer)
        fresh = make_model()
        fresh_opt = OPTIMIZERS["adam"](fresh.parameters())
        fresh.load_state_dict(loaded["model"])
        fresh_opt.load_state_dict(loaded["opt"])
    assert_same(list(strict[1].parameters()), list(fresh.parameters()))
    assert_same(optimizer_tensors(strict[2]), optimizer_tensors(fresh_opt))
    # the loaded copy trains on exactly like the original
    x, y = batches(1)[0]
    for m, o, mode in ((strict[1], strict[2], deferfuse.strict), (fresh, fresh_opt, deferfuse.defer)):
        with mode():
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    assert_same(list(strict[1].parameters()), list(fresh.parameters()))


def _autograd_features(x: torch.Tensor, w: torch.Tensor):
    w.requires_grad_(True)
    y = (x @ w).tanh()
    frozen = y.detach() * 2          # no gradient flows through detach
    loss = (y * frozen).sum()
    (gw,) = torch.autograd.grad(loss, w, retain_graph=True)
    loss.backward()                  # the retained graph is used a second time
    with torch.no_grad():
        w -= 0.1 * w.grad
        inside = (w * 3).requires_grad
    w.requires_grad_(False)
    after = (x @ w).requires_grad
    return gw, w.grad.clone(), w.detach().clone(), inside, after, loss.detach()


def test_no_grad_detach_retain_graph_and_requires_grad_toggles():
    x, w = torch.randn(4, 3), torch.randn(3, 2)
    strict = _autograd_features(x.clone(), w.clone())
    with deferfuse.config.override(always_compile=True), deferfuse.defer():
        defer = _autograd_features(x.clone(), w.clone())
    assert strict[3:5] == (False, False) and defer[3:5] == strict[3:5]
    assert_same(strict, defer)


def _step_counts(make_opt, steps: int, warmup: int):
    """Per-step stats of a training step ending in loss.item(), after ``warmup`` steps."""
    model = make_model()
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)   # a new learning rate every step
    x, y = batches(1)[0]
    counts = []
    with deferfuse.config.override(background_compile=False), deferfuse.defer():
        for step in range(warmup + steps):
            deferfuse.reset_stats()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            sched.step()
            loss.item()
            counts.append(deferfuse.stats())
    return counts[warmup:]


@pytest.mark.parametrize("name", ["adamw", "adamw-foreach", "adamw-fused", "sgd-momentum"])
def test_steady_state_step_compiles_nothing_and_runs_few_computations(name):
    for stats in _step_counts(OPTIMIZERS[name], steps=4, warmup=3):
        assert stats["compiles"] == 0, stats
        assert stats["cache_misses"] == 0, stats
        assert stats["executions"] <= 3, stats
        assert stats["fallbacks"] == {}, stats


AMP_OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    # (fused: GradScaler hands the optimizer grad_scale and found_inf, which its kernel applies)
    "sgd-fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
}


def _amp_training(mode: str, optimizer: str = "sgd-momentum") -> tuple:
    """A bfloat16 autocast step with torch.amp's GradScaler on the CPU, one step of which
    overflows (the scaler skips it and backs the scale off)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    opt = AMP_OPTIMIZERS[optimizer](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    x = torch.randn(5, 4, 6, generator=torch.Generator().manual_seed(1))
    losses, scales = [], []
    with deferfuse.defer() if mode == "defer" else deferfuse.strict():
        for step in range(5):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x[step]).float().square().mean()
            if step == 2:
                loss = loss * float("inf")
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
    return losses, scales, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("optimizer", sorted(AMP_OPTIMIZERS))
@pytest.mark.parametrize("always_compile", [True, False], ids=["xla", "tiered"])
def test_grad_scaler_under_autocast_matches_strict(always_compile, optimizer):
    """torch.amp.GradScaler's unscale writes a list of gradients and found_inf in one op
    (_amp_foreach_non_finite_check_and_unscale_): recorded, it raised AttributeError ('list'
    object has no attribute 'shape'), and with the scale update ran eagerly.  Now both are
    recorded as their kernels' math (capture/unroll.py): equal to strict, the overflowing step
    skipped, no fallback; so are the fused optimizers' steps given grad_scale and found_inf
    (they ran torch's kernel, a fallback)."""
    strict = _amp_training("strict", optimizer)
    deferfuse.reset_stats()
    with deferfuse.config.override(always_compile=always_compile, eager_blocks=False):
        losses, scales, params = _amp_training("defer", optimizer)
    assert deferfuse.stats()["fallbacks"] == {}
    assert losses[2] == float("inf") and losses[:2] == strict[0][:2] and losses[3:] == strict[0][3:]
    assert scales == strict[1]
    assert_same(strict[2], params, path="parameters")


def _amp_ops(mode: str, case: str) -> list:
    """The two GradScaler ops on awkward inputs: half, bfloat16, float64, 0-dim and empty
    gradients, inf, -inf and NaN, a scale whose inverse bfloat16 cannot hold, found_inf already
    set; and the update at and before its growth interval, after an overflow, and where growing
    would overflow the scale itself."""
    nan, inf = float("nan"), float("inf")
    grads = {
        "finite": [torch.tensor([1.5, -3.25, 7.0]), torch.tensor(2.0, dtype=torch.float64),
                   torch.tensor([[0.1, 0.2]], dtype=torch.bfloat16), torch.tensor([3.0, 5.5], dtype=torch.float16),
                   torch.empty(0)],
        "inf": [torch.tensor([1.0, inf]), torch.tensor([[0.5]], dtype=torch.bfloat16)],
        "nan": [torch.tensor([2.0]), torch.tensor([nan, -inf, 1.0], dtype=torch.float16)],
    }[case]
    found = torch.tensor([1.0 if case == "nan" else 0.0])
    inv = torch.tensor([1.0 / 3.0])
    updates = []
    with deferfuse.defer() if mode == "defer" else deferfuse.strict():
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        for scale, tracker, interval, f in ((2.0 ** 16, 1, 2, 0.0), (2.0 ** 16, 0, 3, 0.0),
                                            (1.0, 4, 5, 1.0), (3.0e38, 0, 1, 0.0), (6.0, 2, 9, 1.0)):
            s = torch.tensor([scale])
            t = torch.tensor([tracker], dtype=torch.int32)
            out = torch._amp_update_scale_(s, t, torch.tensor([f]), 2.0, 0.3, interval)
            updates.append((out is s, s.item(), t.item()))
    return [g.clone() for g in grads] + [found.clone(), updates]


@pytest.mark.parametrize("case", ["finite", "inf", "nan"])
def test_grad_scaler_ops_match_their_kernels(case, always_compile):
    strict = _amp_ops("strict", case)
    deferfuse.reset_stats()
    defer = _amp_ops("defer", case)
    assert deferfuse.stats()["fallbacks"] == {}
    assert defer[-1] == strict[-1]
    for a, b in zip(strict[:-1], defer[:-1]):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)


def _norm_training(mode: str, make_norm, channels: int) -> list:
    """A norm layer trained on bfloat16 activations (as under torch.autocast): outputs, input and
    weight gradients of each step, then the parameters and buffers."""
    torch.manual_seed(0)
    norm = make_norm()
    opt = torch.optim.SGD(norm.parameters(), lr=0.1)
    xs = torch.randn(3, 4, channels, 5, 5, generator=torch.Generator().manual_seed(1)).bfloat16()
    seen = []
    with deferfuse.defer() if mode == "defer" else deferfuse.strict():
        for x in xs:
            x = x.requires_grad_()
            out = norm(x)
            opt.zero_grad()
            (out.float() * torch.linspace(-1, 1, channels * 25).reshape(channels, 5, 5)).sum().backward()
            opt.step()
            seen += [out.detach().clone(), x.grad.clone(), norm.weight.grad.clone()]
    return seen + [p.detach().clone() for p in norm.parameters()] + [b.clone() for b in norm.buffers()]


def _batch_norm_training(mode: str, params_dtype: torch.dtype) -> list:
    """BatchNorm2d with float32 parameters (mixed: the CPU kernel keeps the saved statistics
    float32) or bfloat16 ones."""
    return _norm_training(mode, lambda: torch.nn.BatchNorm2d(3).to(params_dtype), 3)


@pytest.mark.parametrize("params_dtype", [torch.float32, torch.bfloat16], ids=["mixed", "bf16"])
@pytest.mark.parametrize("always_compile", [True, False], ids=["xla", "tiered"])
def test_batch_norm_on_bfloat16_activations_trains_as_strict(params_dtype, always_compile):
    """Batch norm in training mode updating running statistics was recorded as torch._decomp's
    decomposition, which on the CPU rounds the saved statistics to the input's type: with
    float32 parameters (mixed) the backward then raised "mixed dtype (CPU): expect parameter to
    have scalar type of Float".  Now its functional twin's lowering: strict's values, no
    fallback."""
    strict = _batch_norm_training("strict", params_dtype)
    deferfuse.reset_stats()
    with deferfuse.config.override(always_compile=always_compile, eager_blocks=False):
        defer = _batch_norm_training("defer", params_dtype)
    assert deferfuse.stats()["fallbacks"] == {}
    if params_dtype is torch.float32:
        assert_same(strict, defer, path="batch norm")
        return
    # All bfloat16: XLA's backward rounds some gradients one bfloat16 step away from the kernel's
    # (0.002 in 0.4 after a step), and the steps after start from parameters one step apart:
    # equal to within a bfloat16 step of each tensor's largest value.
    for i, (a, b) in enumerate(zip(strict, defer)):
        scale = a.abs().max().float().item() if a.numel() else 0.0
        torch.testing.assert_close(b, a, rtol=0.016, atol=0.016 * scale, msg=lambda m: f"[{i}] {m}")


def test_batch_norm_on_bfloat16_activations_with_the_default_settings(user_defaults):
    assert_same(_batch_norm_training("strict", torch.float32), _batch_norm_training("defer", torch.float32),
                path="batch norm")


def _group_norm_training(mode: str) -> list:
    """GroupNorm with float32 parameters (the CPU kernel's mixed type)."""
    return _norm_training(mode, lambda: torch.nn.GroupNorm(2, 6), 6)


@pytest.mark.parametrize("always_compile", [True, False], ids=["xla", "tiered"])
def test_group_norm_on_bfloat16_activations_trains_as_strict(always_compile):
    """Recorded as torch._decomp's decompositions, a mixed group norm rounded its statistics to
    bfloat16 (the kernel keeps them float32) and its backward's grad_input came out float32:
    weight gradients 4.5e-4 off strict's.  Now computed in float32 as the kernel does."""
    strict = _group_norm_training("strict")
    deferfuse.reset_stats()
    with deferfuse.config.override(always_compile=always_compile, eager_blocks=False):
        defer = _group_norm_training("defer")
    assert deferfuse.stats()["fallbacks"] == {}
    assert [t.dtype for t in defer] == [t.dtype for t in strict]
    assert_same(strict, defer, path="group norm")
