"""deferfuse.jax_op: JAX functions and Pallas kernels as torch ops, in every mode, against the
same computation in torch ops (strict PyTorch is the oracle)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from typing import Optional

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F
from jax.experimental import pallas as pl

import deferfuse
from deferfuse import config
from oracle import seeded_randn
from zoo_training import assert_trains_as
from deferfuse.kernels import KernelError, pallas_interpret
from deferfuse.kernels.examples import attention as attention_example
from deferfuse.kernels.examples import rmsnorm as rmsnorm_example
from deferfuse.kernels.examples import top2 as top2_example

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@deferfuse.jax_op("test_kernels::gated")
def gated(x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    return x * jax.nn.sigmoid(y) * scale


def gated_torch(x, y, scale):
    return x * torch.sigmoid(y) * scale


@deferfuse.jax_op("test_kernels::log")
def log(x: torch.Tensor) -> torch.Tensor:
    return jnp.log(x)


def _double_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2


@deferfuse.jax_op("test_kernels::pallas_double")
def pallas_double(x: torch.Tensor) -> torch.Tensor:
    """A Pallas kernel with no bwd=: JAX cannot differentiate pallas_call."""
    return pl.pallas_call(_double_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret=pallas_interpret())(x)


@deferfuse.jax_op("test_kernels::combo")
def combo(xs: list[torch.Tensor], bias: Optional[torch.Tensor], axis: int, *, alpha: float = 2.0,
          flip: bool = False) -> torch.Tensor:
    total = sum(xs) if bias is None else sum(xs) + bias
    total = jnp.cumsum(total, axis=axis) * alpha
    return total[::-1] if flip else total


def combo_torch(xs, bias, axis, *, alpha=2.0, flip=False):
    total = sum(xs) if bias is None else sum(xs) + bias
    total = torch.cumsum(total, axis) * alpha
    return total.flip(0) if flip else total


MODES = {"strict": contextlib.nullcontext, "defer": deferfuse.defer, "debug": deferfuse.debug}

pytestmark = pytest.mark.usefixtures("always_compile")


@pytest.mark.parametrize("mode", MODES)
def test_op_equals_torch_in_every_mode(mode):
    x, y = seeded_randn(4, 8), seeded_randn(4, 8, seed=1)
    with MODES[mode]():
        out = gated(x, y, 0.5)
        via_ops = torch.ops.test_kernels.gated(x, y, 0.25)
    torch.testing.assert_close(out, gated_torch(x, y, 0.5))
    torch.testing.assert_close(via_ops, gated_torch(x, y, 0.25))
    assert out.dtype == torch.float32


@pytest.mark.parametrize("mode", MODES)
def test_lists_optional_tensors_and_keyword_arguments_with_gradients(mode):
    a, b, c = (seeded_randn(3, 4, dtype=torch.float64, seed=i).requires_grad_() for i in range(3))
    strict = [t.detach().clone().requires_grad_() for t in (a, b, c)]
    want = combo_torch(strict[:2], strict[2], 0, alpha=1.5, flip=True)
    want.sin().sum().backward()
    with MODES[mode]():
        got = combo([a, b], c, 0, alpha=1.5, flip=True)
        got.sin().sum().backward()
        no_bias = combo([a[:, ::2]], None, 1)       # (a strided input)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(no_bias, combo_torch([a[:, ::2]], None, 1))
    for leaf, strict_leaf in zip((a, b, c), strict):
        torch.testing.assert_close(leaf.grad, strict_leaf.grad)


def test_float64_and_int64_keep_their_dtypes():
    x = seeded_randn(3, 5, dtype=torch.float64)
    out = gated(x, x, 0.5)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, gated_torch(x, x, 0.5), rtol=1e-12, atol=1e-12)
    big = torch.tensor([[2**40, 3, 2**40 + 1], [-(2**50), 7, 5]], dtype=torch.int64)
    for mode in MODES.values():
        with mode():
            values, indices = top2_example.top2(big + 1)
        assert values.dtype == torch.int64 and torch.equal(values, torch.topk(big + 1, 2)[0])


@deferfuse.jax_op("test_kernels::twice")
def twice(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x, x


def test_results_never_alias_the_inputs_or_each_other():
    x = seeded_randn(6)
    first, second = twice(x)
    assert len({x.data_ptr(), first.data_ptr(), second.data_ptr()}) == 3
    first.add_(1)
    assert torch.equal(second, x) and torch.equal(first, x + 1)
    assert set(torch.library.opcheck(twice.op, (x.requires_grad_(),)).values()) == {"SUCCESS"}


def test_fake_and_meta_tensors_never_run_the_kernel():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        a, b = torch.empty(3, 7), torch.empty(3, 7)
        out = gated(a, b, 2.0)
    assert out.shape == (3, 7) and out.dtype == torch.float32
    values, indices = top2_example.top2(torch.empty(5, 9, device="meta"))
    assert values.shape == (5, 2) and indices.shape == (5, 2) and indices.dtype == torch.int64


@pytest.mark.parametrize("case", ["gated", "rmsnorm", "top2", "attention", "combo"])
def test_opcheck(case):
    x = seeded_randn(2, 4, 8, 16).requires_grad_()
    if case == "gated":
        op, args = gated.op, (x, seeded_randn(2, 4, 8, 16, seed=1), 0.5)
    elif case == "rmsnorm":
        op, args = rmsnorm_example.rmsnorm.op, (x, seeded_randn(16, seed=1).requires_grad_(), 1e-5)
    elif case == "top2":
        op, args = top2_example.top2.op, (x,)
    elif case == "combo":
        op, args = combo.op, ([x, seeded_randn(2, 4, 8, 16, seed=1)], seeded_randn(16, seed=2), 1)
    else:
        op, args = attention_example.attention.op, (x, seeded_randn(2, 2, 8, 16, seed=1), seeded_randn(2, 2, 8, 16, seed=2),
                                                    None, 0.3, True)
    results = torch.library.opcheck(op, args)
    assert set(results.values()) == {"SUCCESS"}, results


def test_gradcheck_float64_through_jax_vjp_and_through_bwd():
    x, y = seeded_randn(3, 4, dtype=torch.float64).requires_grad_(), seeded_randn(3, 4, dtype=torch.float64, seed=1).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: gated(a, b, 0.7), (x, y))
    w = seeded_randn(4, dtype=torch.float64, seed=2).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: rmsnorm_example.rmsnorm(a, b, 1e-5), (x, w))


def test_sin_op_add_sum_is_one_xla_execution_with_no_fallback():
    x, y = seeded_randn(16, 32), seeded_randn(16, 32, seed=1)
    deferfuse.reset_stats()
    with deferfuse.defer():
        total = (gated(torch.sin(x), y, 0.5) + 1).sum()
    stats = deferfuse.stats()
    torch.testing.assert_close(total, (gated_torch(torch.sin(x), y, 0.5) + 1).sum())
    assert stats["executions"] == 1 and stats["fallbacks"] == {} and stats["eager_replays"] == 0, stats


def test_a_changing_float_is_a_runtime_scalar_and_static_argnames_compile_in():
    x, y = seeded_randn(8, 8), seeded_randn(8, 8, seed=1)
    deferfuse.reset_stats()
    for scale in (0.5, 1.5, -2.0):
        with deferfuse.defer():
            out = (gated(x, y, scale) + 1).sum()
        torch.testing.assert_close(out, (gated_torch(x, y, scale) + 1).sum())
    assert deferfuse.stats()["compiles"] == 1
    w = seeded_randn(8, seed=2)
    deferfuse.reset_stats()
    for eps in (1e-5, 1e-5, 1e-2):
        with deferfuse.defer():
            out = rmsnorm_example.rmsnorm(x * 2, w, eps)
        torch.testing.assert_close(out, rmsnorm_example.rmsnorm_reference(x * 2, w, eps))
    assert deferfuse.stats()["compiles"] == 2     # (eps is static: a new value compiles anew)


@pytest.mark.parametrize("mode", MODES)
def test_training_step_gradients_equal_torch(mode):
    x, y = seeded_randn(6, 16).requires_grad_(), seeded_randn(6, 16, seed=1).requires_grad_()
    w = seeded_randn(16, seed=2).requires_grad_()

    def step(kernel_gated, kernel_rmsnorm, x, y, w):
        loss = kernel_rmsnorm(kernel_gated(torch.tanh(x), y, 0.5), w, 1e-5).square().mean()
        loss.backward()
        return loss

    strict_leaves = [t.detach().clone().requires_grad_() for t in (x, y, w)]
    expected = step(gated_torch, rmsnorm_example.rmsnorm_reference, *strict_leaves)
    deferfuse.reset_stats()
    with MODES[mode]():
        loss = step(gated, rmsnorm_example.rmsnorm, x, y, w)
    torch.testing.assert_close(loss, expected)
    for got, want in zip((x, y, w), strict_leaves):
        torch.testing.assert_close(got.grad, want.grad)
    if mode == "defer":
        assert deferfuse.stats()["fallbacks"] == {}


def test_with_the_user_defaults_every_tier_runs_the_kernel(user_defaults):
    """First sightings at once, eager replays while compiling, then compiled: each runs the op."""
    x, y, w = seeded_randn(6, 16).requires_grad_(), seeded_randn(6, 16, seed=1), seeded_randn(16, seed=2)
    for call in user_defaults.calls(5):
        x.grad = None
        with deferfuse.defer():
            loss = rmsnorm_example.rmsnorm(gated(torch.tanh(x), y, float(call)), w, 1e-5).square().mean()
            loss.backward()
        strict_x = x.detach().clone().requires_grad_()
        want = rmsnorm_example.rmsnorm_reference(gated_torch(torch.tanh(strict_x), y, float(call)), w, 1e-5)
        want.square().mean().backward()
        torch.testing.assert_close(loss, want.square().mean())
        torch.testing.assert_close(x.grad, strict_x.grad)
    stats = deferfuse.stats()
    assert stats["fallbacks"] == {}
    if user_defaults.block_tier == "deferred":
        assert stats["unseen_ops_run"] and stats["eager_replays"] and stats["executions"], stats


@pytest.mark.parametrize("mode", MODES)
def test_two_outputs_one_integer(mode):
    x = seeded_randn(5, 12).requires_grad_()
    with MODES[mode]():
        values, indices = top2_example.top2(x * 3)
        (values.sin().sum()).backward()
    want_values, want_indices = torch.topk(x.detach() * 3, 2)
    torch.testing.assert_close(values, want_values)
    assert torch.equal(indices, want_indices) and indices.dtype == torch.int64
    assert not indices.requires_grad
    strict_x = x.detach().clone().requires_grad_()
    torch.topk(strict_x * 3, 2)[0].sin().sum().backward()
    torch.testing.assert_close(x.grad, strict_x.grad)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["the kernel's own check", "JAX's shape check"])
def test_bad_input_names_the_op_and_the_line_and_leaves_nothing_pending(mode, case):
    x = seeded_randn(4, 8)
    with MODES[mode]():
        before = x * 2
        if case == "the kernel's own check":
            with pytest.raises(ValueError) as error:
                rmsnorm_example.rmsnorm(before, torch.ones(5))
            name = "deferfuse_examples::rmsnorm"
        else:
            with pytest.raises(TypeError) as error:
                gated(before, seeded_randn(3, 8), 0.5)
            name = "test_kernels::gated"
        after = before + 1
    text = str(error.value) + " ".join(getattr(error.value, "__notes__", ()))
    assert name in text and f"{os.path.basename(__file__)}:" in text, text
    torch.testing.assert_close(after, x * 2 + 1)


@pytest.mark.parametrize("mode", MODES)
def test_pallas_without_bwd_raises_at_backward_naming_the_op(mode):
    x = seeded_randn(8, 8).requires_grad_()
    with MODES[mode]():
        out = pallas_double(x)
        torch.testing.assert_close(out, x * 2)
        with pytest.raises(KernelError, match="test_kernels::pallas_double.*bwd="):
            out.sum().backward()


def test_debug_mode_checks_the_kernel_outputs_for_nans():
    x = torch.tensor([1.0, -1.0])
    with config.override(check_nans=True), pytest.raises(FloatingPointError):
        with deferfuse.debug():
            log(x)


def test_jax_attention_drops_in_for_sdpa():
    q, k, v = seeded_randn(2, 4, 8, 16), seeded_randn(2, 2, 8, 16, seed=1), seeded_randn(2, 2, 8, 16, seed=2)
    mask = seeded_randn(2, 1, 8, 8, seed=3) > -0.5
    for kwargs, args in [(dict(is_causal=True), (None, None, True)), (dict(attn_mask=mask, scale=0.3), (mask, 0.3))]:
        want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
        for mode in MODES.values():
            with mode():
                got = attention_example.attention(q, k, v, *args)
            torch.testing.assert_close(got, want)


def test_tiny_llama_with_jax_attention_trains_as_strict():
    name = attention_example.register_with_transformers()
    assert_trains_as(name, None, blocks=(deferfuse.defer,))      # against torch's SDPA


def test_torch_compile_treats_the_op_as_an_opaque_custom_op():
    def step(kernel_gated, kernel_rmsnorm, x, y, w):
        loss = kernel_rmsnorm(kernel_gated(x.sin(), y, 0.5), w, 1e-5).square().mean()
        loss.backward()
        return loss

    torch._dynamo.reset()
    forward = torch.compile(lambda x, y, w: step(gated, rmsnorm_example.rmsnorm, x, y, w).detach(),
                            backend="aot_eager")
    compiled_loss = torch.compile(lambda x, y, w: rmsnorm_example.rmsnorm(gated(x.sin(), y, 0.5), w, 1e-5),
                                  backend="aot_eager", fullgraph=True)
    x, y, w = seeded_randn(4, 8).requires_grad_(), seeded_randn(4, 8, seed=1), seeded_randn(8, seed=2).requires_grad_()
    strict = [x.detach().clone().requires_grad_(), y, w.detach().clone().requires_grad_()]
    want = step(gated_torch, rmsnorm_example.rmsnorm_reference, *strict)
    torch.testing.assert_close(forward(x, y, w), want)
    torch.testing.assert_close(x.grad, strict[0].grad)
    torch.testing.assert_close(w.grad, strict[2].grad)
    torch.testing.assert_close(compiled_loss(x, y, w),
                               rmsnorm_example.rmsnorm_reference(gated_torch(x.sin(), y, 0.5), w, 1e-5))


def test_backend_deferfuse_inlines_the_op_into_one_xla_computation_per_graph():
    """torch.compile(backend="deferfuse"): the kernel (and its vjp op in the backward graph) is
    lowered with the ops around it, one XLA partition per graph, no fallback."""
    def loss_of(kernel_gated, x, y):
        return (kernel_gated(x.sin(), y, 0.5) + 1).square().sum()

    torch._dynamo.reset()
    deferfuse.reset_stats()
    compiled = torch.compile(lambda x, y: loss_of(gated, x, y), backend="deferfuse", fullgraph=True)
    x, y = seeded_randn(4, 8).requires_grad_(), seeded_randn(4, 8, seed=1)
    strict_x = x.detach().clone().requires_grad_()
    loss = compiled(x, y)
    loss.backward()
    want = loss_of(gated_torch, strict_x, y)
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(x.grad, strict_x.grad)
    stats = deferfuse.stats()
    assert stats["compiled_graphs"] == 2 and stats["compiled_partitions"] == 2, stats
    assert not stats["compiled_fallbacks"], stats["compiled_fallbacks"]
    text = str(deferfuse.compile.explain())
    assert "gated.default" in text and "gated_jaxvjp.default" in text, text


def test_import_deferfuse_does_not_import_jax():
    code = "import sys, deferfuse; deferfuse.jax_op; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


# -- an edited kernel never runs an old cached executable -----------------------------------------
def test_fingerprints_follow_the_code_closures_and_version():
    from deferfuse.kernels.jax_op import fingerprint

    def make(scale):
        def kernel(x):
            return x * scale
        return kernel

    assert fingerprint(make(2.0), None, None) == fingerprint(make(2.0), None, None)
    assert fingerprint(make(2.0), None, None) != fingerprint(make(3.0), None, None)
    assert fingerprint(make(2.0), None, "7") == fingerprint(make(3.0), None, "7") == "v7"
    assert gated.fingerprint != combo.fingerprint or gated.fn.__code__ is combo.fn.__code__



KERNEL = textwrap.dedent("""
    import jax, torch, deferfuse

    @deferfuse.jax_op("edited::scaled")
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * FACTOR
""")
PROGRAM = textwrap.dedent("""
    import json, sys, torch, deferfuse
    sys.path.insert(0, sys.argv[1])
    import kernel
    x = torch.arange(4.0)
    with deferfuse.defer():
        y = (kernel.scaled(x.sin()) + 1).sum()
    s = deferfuse.stats()
    print(json.dumps({"value": float(y), "hits": s["disk_cache_hits"], "compiles": s["compiles"]}))
""")


def test_an_edited_kernel_never_runs_an_old_cached_executable(tmp_path):
    folder = tmp_path / "src"
    folder.mkdir()
    env = dict(os.environ, DEFERFUSE_CACHE_DIR=str(tmp_path / "cache"), DEFERFUSE_ALWAYS_COMPILE="1",
               PYTHONPATH=REPO)
    reports = []
    for factor in ("2.0", "2.0", "3.0"):
        (folder / "kernel.py").write_text(KERNEL.replace("FACTOR", factor))
        out = subprocess.run([sys.executable, "-c", PROGRAM, str(folder)], capture_output=True, text=True,
                             env=env, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        reports.append(json.loads(out.stdout.strip().splitlines()[-1]))
    x = torch.arange(4.0)
    assert [r["value"] for r in reports] == pytest.approx([float((x.sin() * f + 1).sum()) for f in (2, 2, 3)])
    # the same source loads the first process's executable; the edited one compiles its own
    assert (reports[1]["hits"], reports[1]["compiles"]) == (1, 0), reports
    assert (reports[2]["hits"], reports[2]["compiles"]) == (0, 1), reports
