"""The contract of DESIGN.md section 1, case by case, against strict PyTorch."""

import pytest
import torch

import deferfuse
from oracle import check


@pytest.fixture(autouse=True)
def _fresh_stats():
    deferfuse.reset_stats()


# -- mutation through views, in program order --------------------------------------------------
VIEW_MUTATIONS = {
    "view": lambda x: x.view(4, 3).add_(1),
    "reshape": lambda x: x.reshape(12).mul_(2),
    "transpose": lambda x: x.t().add_(torch.arange(3.0)),
    "select": lambda x: x.select(1, 2).fill_(7),
    "slice": lambda x: x[1:, ::2].mul_(-1),
    "narrow": lambda x: x.narrow(1, 1, 2).add_(5),
    "diagonal": lambda x: x.diagonal().zero_(),
    "unsqueeze": lambda x: x.unsqueeze(0).add_(1),
    "squeeze": lambda x: x[:1].squeeze(0).add_(3),
    "as_strided": lambda x: x.as_strided((2, 2), (1, 4), 1).add_(100),
    "view_of_view": lambda x: x.t()[1:].view(-1).add_(1) if False else x.t()[1:].reshape(-1).add_(1),
    "setitem_basic": lambda x: x.__setitem__((slice(None), 1), 9.0),
    "copy_into_slice": lambda x: x[0].copy_(torch.tensor([1.0, 2.0, 3.0, 4.0])),
}


@pytest.mark.parametrize("name", list(VIEW_MUTATIONS))
def test_mutation_through_view_reaches_base(name):
    def program(x):
        before = x * 1
        VIEW_MUTATIONS[name](x)
        return before, x * 1, x.sum()
    check(program, torch.arange(12.0).reshape(3, 4))


def test_mutation_of_deferred_tensor_seen_by_its_views():
    def program(x):
        y = x * 2
        v = y[1]
        y.add_(1)
        w = v * 1          # must see the add
        v.mul_(10)         # must reach y
        return y, v, w
    check(program, torch.arange(6.0).reshape(2, 3))


def test_non_contiguous_user_input_written_in_place():
    def program(x):
        xt = x.t()
        xt.mul_(3)
        return xt + 0
    check(program, torch.arange(12.0).reshape(3, 4).t())


def test_program_order_of_reads_and_writes():
    def program(x):
        a = x + 0
        x.mul_(2)
        b = x + 0
        x.add_(a)
        return a, b, x + 0
    check(program, torch.arange(4.0))


def test_out_variant_writes_user_tensor():
    def program(x, out):
        r = torch.add(x, 1, out=out)
        assert r is out
        return out + 0
    check(program, torch.arange(4.0), torch.zeros(4))


def test_inplace_keeps_identity_and_dtype():
    x = torch.arange(4, dtype=torch.int64)
    with deferfuse.defer():
        r = x.add_(2)
        assert r is x
        y = torch.ones(3, dtype=torch.float16)
        y.mul_(torch.tensor(3.0, dtype=torch.float64))
    assert x.tolist() == [2, 3, 4, 5]
    assert y.dtype == torch.float16 and y.tolist() == [3.0, 3.0, 3.0]


# -- promotion -------------------------------------------------------------------------------
PROMOTIONS = [
    (torch.arange(3, dtype=torch.int64), 2.5),
    (torch.arange(3, dtype=torch.int32), 2),
    (torch.arange(3, dtype=torch.int32), torch.tensor(2.0, dtype=torch.float64)),
    (torch.ones(3, dtype=torch.float32), torch.tensor(2.0, dtype=torch.float64)),
    (torch.ones(3, dtype=torch.float32), torch.ones(3, dtype=torch.float64)),
    (torch.tensor([True, False]), True),
    (torch.tensor([True, False]), 3),
    (torch.ones(2, dtype=torch.float16), 1e-3),
    (torch.ones(2, dtype=torch.bfloat16), torch.tensor(3, dtype=torch.int64)),
    (torch.tensor(5, dtype=torch.int64), torch.ones(2, dtype=torch.int8)),
]


@pytest.mark.parametrize("a,b", PROMOTIONS)
def test_dtype_promotion_matches_strict(a, b):
    check(lambda a, b: (a + b, a * b, b * a), a, b)


def test_int64_and_float64_stay_64_bit():
    big = torch.tensor([2**40, -(2**41)], dtype=torch.int64)
    check(lambda x: x * 3 + 1, big)
    check(lambda x: x * 1e-300 + 1e-310, torch.tensor([1.0, 2.0], dtype=torch.float64))
    with deferfuse.defer():
        r = torch.arange(3) * 2**35
    assert r.dtype == torch.int64 and r.tolist() == [0, 2**35, 2**36]


# -- errors ------------------------------------------------------------------------------------
def test_shape_error_raises_same_type_at_record_time():
    x = torch.ones(3)
    with deferfuse.defer():
        with pytest.raises(RuntimeError):
            x + torch.ones(4)
        y = x + 1  # the context is still usable
    assert torch.equal(y, torch.full((3,), 2.0))


def test_inplace_cast_error_matches_strict():
    x = torch.arange(3)
    with pytest.raises(RuntimeError) as strict_err:
        x.clone().add_(torch.tensor([1.5, 1.5, 1.5]))
    with deferfuse.defer():
        with pytest.raises(type(strict_err.value)):
            x.add_(torch.tensor([1.5, 1.5, 1.5]))
    assert x.tolist() == [0, 1, 2]


def test_broadcast_inplace_error_matches_strict():
    x = torch.ones(3)
    with deferfuse.defer():
        with pytest.raises(RuntimeError):
            x.add_(torch.ones(2, 3))


# -- randomness --------------------------------------------------------------------------------
def test_random_stream_matches_strict():
    def program(x):
        torch.manual_seed(0)
        a = torch.rand(4)
        b = torch.randn(2, 3)
        x.uniform_()
        c = torch.randint(0, 10, (5,))
        d = torch.rand_like(x)
        x2 = x * 1
        x2.normal_(1.0, 2.0)
        e = torch.bernoulli(torch.full((6,), 0.5))
        return a, b, c, d, x2, e
    check(program, torch.zeros(3, 2), exact=True)


def test_dropout_reproduces_strict():
    def program(x):
        torch.manual_seed(3)
        return torch.nn.functional.dropout(x * 2, p=0.5, training=True)
    check(program, torch.ones(64))


# -- compile caching and runtime scalars ---------------------------------------------------------
def test_changing_python_scalars_do_not_recompile():
    x = torch.ones(16)
    with deferfuse.config.override(always_compile=True):
        compiles = []
        for step in range(1, 6):
            lr = 0.1 / step
            bias_correction = 1 - 0.9 ** step
            with deferfuse.defer():
                y = x * lr + bias_correction
            assert torch.allclose(y, torch.ones(16) * lr + bias_correction)
            compiles.append(deferfuse.stats()["compiles"])
    assert compiles[-1] == compiles[0], compiles
    assert deferfuse.stats()["cache_hits"] >= 4


def test_changing_zero_dim_tensor_scalars_do_not_recompile():
    x = torch.ones(16)
    step = torch.tensor(0.0)
    with deferfuse.config.override(always_compile=True):
        counts = []
        for _ in range(4):
            step += 1
            with deferfuse.defer():
                y = x * step
            counts.append(deferfuse.stats()["compiles"])
            assert y[0].item() == step.item()
    assert counts[-1] == counts[0]


# -- fallbacks ---------------------------------------------------------------------------------
def test_unlowered_op_falls_back_counted_and_correct():
    def program(x):
        y = x * 2
        # no meta kernel, no lowering: runs eagerly
        z = torch.histogramdd((y + 1).view(-1, 1), [3]).hist
        return z * 3
    deferfuse.reset_stats()
    result = check(program, torch.linspace(0, 1, 5))
    assert deferfuse.stats()["fallbacks"]
    assert result is not None


def test_stats_has_documented_keys():
    s = deferfuse.stats()
    for key in ("ops_recorded", "flushes", "executions", "compiles", "cache_hits", "cache_misses", "fallbacks"):
        assert key in s
    deferfuse.reset_stats()
    assert deferfuse.stats()["ops_recorded"] == 0


def test_plain_writes_between_contexts_are_seen():
    """Plain torch code between two defer blocks can change a tensor; the next block sees it."""
    x = torch.ones(3)
    v = x[1:]                      # a plain view keeps x's storage in use across blocks
    with deferfuse.defer():
        a = x * 2
        b = v * 1
    assert a.tolist() == [2.0, 2.0, 2.0] and b.tolist() == [1.0, 1.0]
    x.mul_(5)                      # strict, outside any block
    with deferfuse.defer():
        c = x * 2
        d = v * 1
        y = a * 1                  # a deferred tensor from the earlier block
    assert c.tolist() == [10.0, 10.0, 10.0]
    assert d.tolist() == [5.0, 5.0]
    assert y.tolist() == [2.0, 2.0, 2.0]


def test_broken_lowering_replays_eagerly_unless_always_compile(monkeypatch):
    from deferfuse.lower import registry, table
    aten = torch.ops.aten
    original = table.get_lowering(aten.mul.Tensor)

    def broken(ctx, *args, **kwargs):
        raise ValueError("simulated lowering bug")

    monkeypatch.setitem(registry.LOWERINGS, aten.mul.Tensor, registry.Lowering(aten.mul.Tensor, broken, original.check))
    from deferfuse.capture import meta
    meta.clear_cache()
    from deferfuse import engine
    engine.clear_cache()
    x = torch.arange(4.0)
    with deferfuse.config.override(always_compile=False, eager_first_runs=0):
        with deferfuse.defer():
            y = x * 3 + 1
    assert y.tolist() == [1.0, 4.0, 7.0, 10.0]
    assert deferfuse.stats()["lowering_failures"] == 1
    with deferfuse.config.override(always_compile=True):
        with pytest.raises(deferfuse.errors.LoweringError, match=r"recorded at .*test_semantics.py:\d+.*simulated lowering bug"):
            with deferfuse.defer():
                y = x * 5 + 1
    meta.clear_cache()
    engine.clear_cache()


def test_reshape_inside_decomposition_copies_when_it_must():
    """Regression: reshape reaching the mode from a decomposition (pixel_shuffle, unfold) was
    treated as a view even when it had to copy, reading the wrong elements."""
    F = torch.nn.functional
    check(lambda x: F.pixel_shuffle(x, 2), torch.randn(2, 12, 1, 5))
    check(lambda x: F.unfold(x, kernel_size=2), torch.randn(1, 2, 4, 5))


def test_inplace_metadata_ops_on_deferred_tensors():
    """Regression: vector @ matrix failed because matmul squeezes its mm output in place."""
    def program(v, m):
        out = v @ m
        y = m * 2
        y.t_()
        y.unsqueeze_(0)
        y.squeeze_(0)
        z = (m + 1).as_strided_((2, 2), (1, 4), 1)
        return out, y, y + 1, z * 1
    check(program, torch.randn(3), torch.randn(3, 4))


@pytest.mark.parametrize("program", [
    lambda x: x.__setitem__((None, slice(None)), x),          # copy_ from a differently-shaped alias
    lambda x: x[1:].add_(x[:-1]),                             # shifted alias
    lambda x: x.reshape(()).div_(x, rounding_mode="trunc") if x.numel() == 1 else x[:1].reshape(()).add_(x),
], ids=["setitem_alias", "shifted_add", "zero_dim_target"])
def test_inplace_errors_torch_kernels_raise(program):
    """Regression (found by the program suite): partial overlap between the written tensor and an
    input, and an in-place result that would need a resize, raise as strict does."""
    check(program, torch.tensor([4.0, 5.0, 6.0]))


@pytest.mark.parametrize("tier", ["eager replay", "xla"])
def test_a_value_error_at_the_flush_names_the_line_that_recorded_the_op(tier):
    """An out-of-range index is found when the flush runs: in a compiled run by an in-graph
    check, in an eager replay (a graph's first run) by torch's kernel. Either way the error
    is the type strict raises, and names the line that recorded the op."""
    x, index = torch.arange(3.0), torch.tensor([5])
    settings = dict(always_compile=True) if tier == "xla" else dict(always_compile=False, eager_first_runs=1)
    deferfuse.reset_stats()
    with deferfuse.config.override(**settings):
        with pytest.raises(IndexError, match=r"out of bounds.*\(recorded at .*test_semantics.py:\d+\)"):
            with deferfuse.defer():
                y = x[index] * 2
    stats = deferfuse.stats()
    assert (stats["executions"], stats["compiles"]) == ((0, 0) if tier == "eager replay" else (1, 1)), stats


def test_an_error_type_with_its_own_constructor_gets_the_line_as_a_note():
    from deferfuse.exec.replay import naming_source

    class TwoArgumentError(RuntimeError):
        def __init__(self, what, where):
            super().__init__(f"{what} at {where}")

    original = TwoArgumentError("bad value", "kernel")
    named = naming_source(original, "user.py:3")
    assert named is original and "recorded at user.py:3" in original.__notes__
    plain = naming_source(ValueError("bad value"), "user.py:4")
    assert type(plain) is ValueError and str(plain) == "bad value (recorded at user.py:4)"
