"""Scaled dot-product attention (deferfuse/lower/attention.py) against strict PyTorch.

On the CPU, F.scaled_dot_product_attention reaches aten as the flash-attention kernel
(_scaled_dot_product_flash_attention_for_cpu, and its backward) for 4-D inputs with contiguous
rows (last stride 1), one head size, no dropout and a mask that does not require grad, and as
the math path (matmuls around _safe_softmax) otherwise; empty inputs reach neither.
test_which_ops pins this, so that each case below is known to exercise what it says.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import deferfuse
from oracle import assert_same, ops_of, run_both
from oracle import lowered as _lowered

aten = torch.ops.aten
FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
SAFE_SOFTMAX = aten._safe_softmax.default
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INF = float("inf")
sdpa = F.scaled_dot_product_attention


@pytest.fixture(autouse=True, params=[True, False], ids=["host-kernel", "xla"])
def host_kernels(request):
    """Each case twice: on the CPU the flash-attention ops call torch's own kernel inside the
    program (lower/host_products.py); elsewhere, or with host_kernels off, they lower to XLA."""
    with deferfuse.config.override(host_kernels=request.param):
        yield request.param


def lowered(fn, *inputs):
    """Compared with strict at torch.testing's default tolerances for the dtype; nothing fell
    back to eager torch or went through a decomposition."""
    return _lowered(fn, *inputs, compared=True)


def same_exception(fn, *inputs):
    expected, actual, _, _ = run_both(fn, *inputs)
    assert expected is None and actual is None


def grads(fn):
    """``fn``'s output and the gradients of its inputs that require grad, for the output
    gradient ``weight``, an input (made outside, so that both runs use the same tensor)."""
    def run(weight, *xs):
        y = fn(*xs)
        wanted = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
        return (y, *torch.autograd.grad(y, wanted, weight)) if wanted else y
    return run


def attention_inputs(dtype, b=2, h=4, l=5, s=6, e=8, kv_heads=None, seed=0, requires_grad=(True,) * 3):
    """(output gradient, q, k, v) of shapes (b, h, l, e), (b, kv_heads, s, e) twice."""
    g = torch.Generator().manual_seed(seed)
    kv = kv_heads or h
    shapes = [(b, h, l, e), (b, kv, s, e), (b, kv, s, e), (b, h, l, e)]
    q, k, v, weight = (torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for shape in shapes)
    return (weight, *(t.requires_grad_(r) for t, r in zip((q, k, v), requires_grad)))


def masks(dtype, b=2, l=5, s=6, seed=1):
    """A boolean (l, s) mask with a fully masked row, and a float (b, 1, l, s) additive mask
    with -inf entries and a fully masked row in batch 1."""
    g = torch.Generator().manual_seed(seed)
    boolean = torch.rand(l, s, generator=g) > 0.4
    boolean[1] = False
    boolean[3] = True
    additive = torch.randn(b, 1, l, s, generator=g, dtype=torch.float64).to(dtype)
    additive[torch.rand(b, 1, l, s, generator=g) < 0.3] = -INF
    additive[1, 0, 2] = -INF
    return boolean, additive


def test_which_ops():
    w, q, k, v = attention_inputs(torch.float32)
    boolean, additive = masks(torch.float32)
    _, kg, vg = attention_inputs(torch.float32, kv_heads=2)[1:]
    flash = [lambda q, k, v: sdpa(q, k, v),
             lambda q, k, v: sdpa(q, k, v, is_causal=True, scale=0.3),
             lambda q, k, v: sdpa(q, k, v, attn_mask=boolean),
             lambda q, k, v: sdpa(q, k, v, attn_mask=additive),
             lambda q, k, v: sdpa(q.transpose(1, 2).contiguous().transpose(1, 2), k, v)]
    for fn in flash:
        seen = ops_of(grads(fn), w, q, k, v)
        assert {FLASH, FLASH_BACKWARD} <= seen and SAFE_SOFTMAX not in seen
    assert FLASH in ops_of(grads(lambda q, k, v: sdpa(q, k, v, enable_gqa=True)), w, q, kg, vg)
    math = [lambda q, k, v: sdpa(q[0], k[0], v[0]), lambda q, k, v: sdpa(q, k, v[..., :3]),
            lambda q, k, v: sdpa(q, k, v, dropout_p=0.5),
            lambda q, k, v: sdpa(q.transpose(2, 3).contiguous().transpose(2, 3), k, v),   # strided rows
            lambda q, k, v: sdpa(q, k, v, attn_mask=additive.detach().requires_grad_())]
    for fn in math:
        seen = ops_of(lambda q, k, v: fn(q, k, v).sum().backward(), q, k, v)
        assert SAFE_SOFTMAX in seen and FLASH not in seen
    for fn in [lambda q, k, v: sdpa(q[:0], k[:0], v[:0]), lambda q, k, v: sdpa(q[:, :, :0], k, v),
               lambda q, k, v: sdpa(q, k[:, :, :0], v[:, :, :0])]:
        seen = ops_of(lambda q, k, v: fn(q, k, v).sum().backward(), q, k, v)
        assert not {FLASH, SAFE_SOFTMAX} & seen


# -- the flash kernel, through F.scaled_dot_product_attention --------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_attention(dtype):
    w, q, k, v = attention_inputs(dtype)
    boolean, additive = masks(dtype)
    broadcast_row = additive[:1, :, :1]               # (1, 1, 1, s)
    cases = [lambda q, k, v: sdpa(q, k, v),
             lambda q, k, v: sdpa(q, k, v, is_causal=True),
             lambda q, k, v: sdpa(q, k, v, scale=0.3),
             lambda q, k, v: sdpa(q, k, v, attn_mask=boolean),     # row 1 fully masked
             lambda q, k, v: sdpa(q, k, v, attn_mask=additive),    # -inf entries, a fully masked row
             lambda q, k, v: sdpa(q, k, v, attn_mask=broadcast_row, scale=1.5)]
    lowered(lambda w, q, k, v: [grads(fn)(w, q, k, v) for fn in cases], w, q, k, v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_attention_shapes(dtype):
    # grouped-query attention, other query and key lengths (causal is aligned top-left), single
    # queries and keys
    cases = [(dict(kv_heads=2), dict(enable_gqa=True)),
             (dict(kv_heads=1, l=7, s=4), dict(enable_gqa=True, is_causal=True)),
             (dict(l=3, s=9), dict(is_causal=True)),
             (dict(l=1, s=1), dict()),
             (dict(l=1, s=6, b=1, h=2), dict(is_causal=True)),
             (dict(l=6, s=1, e=4), dict(scale=0.7))]
    for shapes, options in cases:
        lowered(grads(lambda q, k, v: sdpa(q, k, v, **options)), *attention_inputs(dtype, **shapes))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_attention_layouts_and_subsets(dtype):
    # q, k, v as Hugging Face models pass them: (b, l, h, e) projections viewed as (b, h, l, e)
    g = torch.Generator().manual_seed(2)
    projected = [torch.randn(2, n, 4, 8, generator=g).to(dtype).requires_grad_() for n in (5, 6, 6)]
    w = torch.randn(2, 4, 5, 8, generator=g).to(dtype)
    lowered(grads(lambda q, k, v: sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True)), w, *projected)
    # the output gradient of .sum().backward(): a scalar expanded (strides 0)
    _, q, k, v = attention_inputs(dtype)
    lowered(lambda q, k, v: torch.autograd.grad(sdpa(q, k, v, is_causal=True).sum(), [q, k, v]), q, k, v)
    # gradients of a subset of q, k, v
    for requires_grad in [(True, False, False), (False, True, True), (False, False, True)]:
        lowered(grads(lambda q, k, v: sdpa(q, k, v)), *attention_inputs(dtype, requires_grad=requires_grad))
    # forward only
    _, q, k, v = attention_inputs(dtype, requires_grad=(False,) * 3)
    lowered(lambda q, k, v: sdpa(q, k, v, is_causal=True), q, k, v)


def test_flash_attention_outputs_and_strides():
    # the aten ops themselves: the output laid out like the query, the logsumexp as (b, l, h)
    # transposed to (b, h, l) in the accumulation type, 2-D and 4-D masks that broadcast, a
    # float32 mask with a bfloat16 query, causal with a mask, and grouped heads in the backward
    for dtype in (torch.float32, torch.bfloat16):
        w, q, k, v = attention_inputs(dtype, requires_grad=(False,) * 3)
        boolean, additive = masks(torch.float32)
        qt = q.transpose(1, 2).contiguous().transpose(1, 2)
        float_mask = torch.zeros(5, 6).masked_fill(~boolean, -INF)

        def forward(q, qt, k, v):
            return (FLASH(q, k, v), FLASH(qt, k, v, is_causal=True), FLASH(q, k, v, attn_mask=float_mask),
                    FLASH(q, k, v, attn_mask=additive[:, :, :1].to(dtype), is_causal=True, scale=0.25),
                    FLASH(q, k, v, attn_mask=float_mask[:, :1]))
        deferred, strict = lowered(forward, q, qt, k, v), forward(q, qt, k, v)
        for (out, lse), (out_strict, lse_strict) in zip(deferred, strict):
            assert out.stride() == out_strict.stride() and lse.stride() == lse_strict.stride()
            assert lse.dtype == lse_strict.dtype == (torch.float32 if dtype == torch.bfloat16 else dtype)

    w, q, k, v = attention_inputs(torch.float64, kv_heads=2, l=7, s=9, requires_grad=(False,) * 3)

    def backward(w, q, k, v):
        out, lse = FLASH(q, k, v, is_causal=True)
        return FLASH_BACKWARD(w, q, k, v, out, lse, 0.0, True, scale=None)
    grads_ = lowered(backward, w, q, k, v)
    assert [tuple(g.shape) for g in grads_] == [(2, 4, 7, 8), (2, 2, 9, 8), (2, 2, 9, 8)]


def test_flash_attention_errors_match_torch():
    # calls the meta kernel accepts and the CPU kernel rejects: torch's own errors, at record time
    _, q, k, v = attention_inputs(torch.float32, requires_grad=(False,) * 3)
    boolean, _ = masks(torch.float32)
    same_exception(lambda q, k, v: FLASH(q, k, v, 0.2), q, k, v)                      # dropout
    same_exception(lambda q, k, v: FLASH(q, k, v, attn_mask=boolean), q, k, v)        # bool mask
    same_exception(lambda q, k, v: FLASH(q, k, v, attn_mask=boolean.double()), q, k, v)
    same_exception(lambda q, k, v: FLASH(q, k, v, attn_mask=boolean[None].float()), q, k, v)
    same_exception(lambda q, k, v: FLASH(q[0], k[0], v[0]), q, k, v)                  # 3-D
    same_exception(lambda q, k, v: FLASH(q, k, v[..., :3]), q, k, v)                  # head sizes
    same_exception(lambda q, k, v: FLASH(q.int(), k.int(), v.int()), q, k, v)


# -- fully masked rows, empty inputs -------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fully_masked_rows_give_zeros(dtype):
    # the CPU kernel gives 0 (not NaN) for a row with every key masked, logsumexp 0, gradient 0
    w, q, k, v = attention_inputs(dtype)
    nothing = torch.zeros(5, 6, dtype=torch.bool)
    minus_inf = torch.full((2, 4, 5, 6), -INF, dtype=dtype)
    out = lowered(lambda w, q, k, v: (grads(lambda q, k, v: sdpa(q, k, v, attn_mask=nothing))(w, q, k, v),
                                      grads(lambda q, k, v: sdpa(q, k, v, attn_mask=minus_inf))(w, q, k, v),
                                      FLASH(q.detach(), k.detach(), v.detach(), attn_mask=minus_inf)[1]),
                  w, q, k, v)
    for part in (*out[0], *out[1], out[2]):
        assert not part.isnan().any() and not part.any()


def test_empty_inputs():
    # the composite returns zeros itself for an empty batch, query or key sequence
    for shapes in (dict(b=0), dict(l=0), dict(s=0), dict(l=0, s=0)):
        inputs = attention_inputs(torch.float32, **shapes)
        lowered(grads(lambda q, k, v: sdpa(q, k, v)), *inputs)
        lowered(grads(lambda q, k, v: sdpa(q, k, v, is_causal=True)), *inputs)


# -- the math path -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_math_path(dtype):
    w, q, k, v = attention_inputs(dtype)
    _, additive = masks(dtype)
    additive.requires_grad_()
    # 3-D inputs, a value head size of its own, a mask that requires grad (its gradient too)
    unbatched = [t.detach()[0].requires_grad_() for t in (q, k, v)]
    lowered(grads(lambda q, k, v: sdpa(q, k, v, is_causal=True)), w[0], *unbatched)
    lowered(grads(lambda q, k, v: sdpa(q, k, v)), w[..., :3], q, k, v.detach()[..., :3].requires_grad_())
    lowered(grads(lambda q, k, v, m: sdpa(q, k, v, attn_mask=m)), w, q, k, v, additive)


def test_safe_softmax():
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    x[0, 1] = -INF          # a row that is all -inf: 0, not NaN
    x[1, :, 2] = -INF
    x[2, 0, 0] = INF        # +inf: NaN, as softmax gives
    lowered(lambda x: (SAFE_SOFTMAX(x, -1), SAFE_SOFTMAX(x, 1), SAFE_SOFTMAX(x.float(), 0),
                       SAFE_SOFTMAX(x.bfloat16(), -1), SAFE_SOFTMAX(x.bfloat16(), -1, torch.float32),
                       SAFE_SOFTMAX(x[0, 0, 0], 0), SAFE_SOFTMAX(x[:0], -1)), x)
    same_exception(lambda x: SAFE_SOFTMAX(x, 0), torch.arange(4))


# -- dropout -------------------------------------------------------------------------------------

def test_dropout_draws_from_torchs_generator():
    # No CPU kernel takes dropout: the composite takes the math path, whose mask is drawn by
    # bernoulli_, which the recorder draws from torch's generator.  The same seed gives the same
    # values, and the generator ends in the same state.
    w, q, k, v = attention_inputs(torch.float32)

    def fn(w, q, k, v):
        return (grads(lambda q, k, v: sdpa(q, k, v, dropout_p=0.3))(w, q, k, v),
                grads(lambda q, k, v: sdpa(q, k, v, dropout_p=0.5, is_causal=True))(w, q, k, v),
                torch.rand(3))
    torch.manual_seed(7)
    expected = fn(w, q, k, v)
    deferfuse.reset_stats()
    torch.manual_seed(7)
    with deferfuse.config.override(always_compile=True), deferfuse.defer():
        actual = fn(w, q, k, v)
    assert_same(expected, actual)
    assert not deferfuse.stats()["fallbacks"]


# -- a Llama-style attention block, trained ------------------------------------------------------

class Attention(torch.nn.Module):
    """Llama's attention without rotary embeddings: q/k/v projections, grouped-query heads
    (shared by ``enable_gqa`` or repeated as Hugging Face's repeat_kv does), causal SDPA on
    transposed views, output projection."""

    def __init__(self, dim=32, heads=4, kv_heads=2, repeat_kv=False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.repeat_kv = heads, kv_heads, dim // heads, repeat_kv
        self.q_proj = torch.nn.Linear(dim, heads * self.head_dim, bias=False)
        self.k_proj = torch.nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v_proj = torch.nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o_proj = torch.nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x):
        b, l, _ = x.shape
        q = self.q_proj(x).view(b, l, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, l, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, l, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.repeat_kv:
            group = self.heads // self.kv_heads
            k, v = (t[:, :, None].expand(b, self.kv_heads, group, l, self.head_dim)
                    .reshape(b, self.heads, l, self.head_dim) for t in (k, v))
        out = sdpa(q, k, v, is_causal=True, enable_gqa=not self.repeat_kv)
        return self.o_proj(out.transpose(1, 2).reshape(b, l, -1))


class RMSNorm(torch.nn.Module):
    """Llama's, as Hugging Face writes it."""

    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Block(torch.nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.attn1, self.attn2 = Attention(dim), Attention(dim, repeat_kv=True)

    def forward(self, x):
        x = x + self.attn1(self.norm1(x))
        return x + self.attn2(self.norm2(x))


def train_block(defer: bool, steps: int = 3):
    torch.manual_seed(0)
    model = Block()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 7, 32, generator=g), torch.randn(2, 7, 32, generator=g)) for _ in range(steps)]
    losses = []
    for x, target in data:
        with deferfuse.defer() if defer else deferfuse.strict():
            opt.zero_grad()
            loss = F.mse_loss(model(x), target)
            loss.backward()
            opt.step()
        losses.append(loss.item())
    return losses, model, opt


def test_llama_attention_block_trains():
    strict = train_block(defer=False)
    deferfuse.reset_stats()
    with deferfuse.config.override(always_compile=True):
        deferred = train_block(defer=True)
    assert not deferfuse.stats()["fallbacks"], deferfuse.stats()["fallbacks"]
    (losses, model, opt), (losses_d, model_d, opt_d) = strict, deferred
    assert_same(torch.tensor(losses), torch.tensor(losses_d), path="losses")
    assert_same(list(model.parameters()), list(model_d.parameters()), path="parameters")
    assert_same([s["exp_avg_sq"] for s in opt.state.values()],
                [s["exp_avg_sq"] for s in opt_d.state.values()], path="optimizer state")
