"""Pinned regressions: each test is a minimal program that defer mode once got wrong.

Most were found by the random-program suite (test_programs.py) and shrunk by hand.  A test
still failing carries ``xfail(strict=True)``: when the bug is fixed it XPASSes, the run goes
red, and the marker should be removed so the test guards the fix from then on.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import deferfuse
from oracle import check


def _nonfinite() -> torch.Tensor:
    return torch.tensor([math.nan, math.inf, -math.inf, 1.5])


def test_binary_ops_broadcast_a_zero_dim_tensor_operand():
    """sub/div/pow/maximum/comparisons/where/clamp with one 0-dim tensor operand and one
    n-dim operand raised 'Shape torch.Size([]) is not the expected shape torch.Size([3])' at
    record time (add and mul worked)."""
    check(lambda a, s: (a - s, a / s, s / a, a ** s, torch.maximum(a, s), a < s,
                        torch.clamp(a, s, a), torch.where(a > 0, a, s), torch.where(a > 0, a, 0.0)),
          torch.tensor([1.0, -2.0, 3.0]), torch.tensor(4.0))


def test_bool_times_nonfinite_float_is_nan():
    """A bool tensor (an input, or a comparison/logical result made in the graph) multiplied
    by nan/inf gave 0 where strict gives nan (False * nan, False * inf)."""
    check(lambda b, x: (b * x, x * b, (b | b) * math.nan, b.float() * x),
          torch.tensor([False, True, False, True]), _nonfinite())


def test_converted_bool_divided_by_zero_is_nan():
    """(v < v).double() divided by 0 (true or trunc division) gave 0.0 where strict gives nan."""
    check(lambda v: (torch.div((v < v).double(), 0, rounding_mode="trunc"),
                     torch.div((v < v).double(), torch.argmax(v))),
          torch.tensor([2.5], dtype=torch.float64))


def test_log_of_pow_with_negative_base_is_nan():
    """log(a ** e) with negative a gave e * log(|a|) (finite) where strict gives nan."""
    check(lambda a, e: torch.log(a ** e),
          torch.tensor([-1.0, -2.0, -2.0], dtype=torch.float64),
          torch.tensor([-1.0, 2.0, 3.0], dtype=torch.float64))


@pytest.mark.xfail(strict=True, reason="subnormal intermediates are flushed to zero in XLA")
def test_subnormal_intermediate_is_kept():
    """exp(-91) is a float32 subnormal in strict; inside a compiled group it became 0, so
    fmod(x, exp(-91)) gave nan instead of a tiny remainder."""
    check(lambda x, n: torch.fmod(x, torch.exp(n)),
          torch.tensor([5.0, 3.0]), torch.tensor([-91, -95], dtype=torch.int32))


def test_floor_divide_float_tensor_by_python_int():
    """x // 2 on a float64 tensor failed at flush: 'lax.rem requires arguments to have the same
    dtypes, got float64, int64'."""
    check(lambda x: (x // 2, torch.floor_divide(x, 3)),
          torch.tensor([3.0, -3.5, 7.25], dtype=torch.float64))


def test_python_bool_divisor():
    """remainder/fmod/div(rounding_mode) of a float tensor by True/False failed at flush:
    'rem does not accept dtype bool'."""
    check(lambda x: (torch.remainder(x, True), torch.fmod(x, False),
                     torch.div(x, False, rounding_mode="floor")),
          torch.tensor([3.0, -3.5], dtype=torch.float64))


@pytest.mark.parametrize("program", [
    lambda v: v.unsqueeze(0).add_(v),
    lambda v: v[1:].copy_(v[:-1]),
    lambda v: v.view(2, 2).add_(v.view(2, 2).t()),
])
def test_inplace_op_reading_overlapping_memory_raises(program):
    """Strict raises RuntimeError ('some elements of the input tensor and the written-to tensor
    refer to a single memory location') when an in-place op reads memory it partially
    overwrites; defer ran the op."""
    check(program, torch.tensor([-4.0, 3.0, 5.0, 1.0]))


def test_inplace_view_ops_on_deferred_tensor():
    """squeeze_/unsqueeze_/t_ on a tensor made inside defer() raised NotImplementedError."""
    def program(x):
        y = x * 2
        y.unsqueeze_(0)
        z = x + 1
        z.t_()
        w = (x - 1).unsqueeze(0)
        w.squeeze_(0)
        return y, z, w
    check(program, torch.arange(6.0).reshape(2, 3))


def test_softmax_of_bool_raises_like_strict():
    """softmax on a bool tensor: strict raises NotImplementedError at the call; defer raised a
    LoweringError ('sub does not accept dtype bool') when leaving the context."""
    check(lambda b: torch.softmax(b, dim=-1), torch.tensor([False, True]))


def test_python_bool_and_int_scalars_are_different_keys():
    """After b * True was recorded, b * 1 (which strict promotes to int64) came back as bool:
    True == 1 and hash(True) == hash(1), so the metadata cache returned the bool result."""
    b = torch.tensor([True, False])
    with deferfuse.config.override(always_compile=True), deferfuse.defer():
        as_bool = b * True
        as_int = b * 1
        as_zero = b + 0
    assert as_bool.dtype == torch.bool
    assert as_int.dtype == torch.int64 and torch.equal(as_int, torch.tensor([1, 0]))
    assert as_zero.dtype == torch.int64


@pytest.mark.parametrize("shape", [(), (3,)])
def test_observing_a_mutated_input_sees_the_mutation(shape):
    """x *= -3 on a user tensor, then x.tolist() inside defer() returned the old values (the
    in-place write was still pending and tolist() on a plain tensor does not flush)."""
    x = torch.full(shape, -84, dtype=torch.int32)
    with deferfuse.config.override(always_compile=True), deferfuse.defer():
        x *= -3
        seen = x.tolist()
        shown = repr(x)
    assert seen == torch.full(shape, 252, dtype=torch.int32).tolist()
    assert "252" in shown


def test_numpy_of_a_plain_tensor_inside_defer():
    """x.numpy() on a user tensor inside defer() (mutated or not) returned unrelated memory,
    e.g. [-2.65e36, 6.5e-27, 9.3e-41] for [2., 2., 2.]."""
    x = torch.full((3,), 2.0)
    y = torch.full((3,), 2.0)
    with deferfuse.config.override(always_compile=True), deferfuse.defer():
        untouched = x.numpy().tolist()
        y.add_(1)
        mutated = y.numpy().tolist()
    assert untouched == [2.0, 2.0, 2.0]
    assert mutated == [3.0, 3.0, 3.0]


@pytest.mark.parametrize("method", ["pow_", "remainder_", "fmod_", "atan2_", "div_floor"])
def test_inplace_op_on_zero_dim_target_with_one_element_operand_raises(method):
    """x.pow_(y) with x 0-dim and y of shape (1,): strict raises 'output with shape [] doesn't
    match the broadcast shape [1]'; defer ran it (torch's reference resized the output, with a
    deprecation UserWarning), and a later op on x failed to lower ('gave shape (1,), torch
    gives ()')."""
    def program(x, y):
        if method == "div_floor":
            x.div_(y, rounding_mode="floor")
        else:
            getattr(x, method)(y)
        return x.clamp(min=1.0)
    check(program, torch.tensor(3.0), torch.tensor([2.0]))


def test_inplace_shape_error_warns_nothing():
    """x.pow_(y) with x 0-dim and y of shape (1,) raises in both modes, but defer also emitted
    torch's 'An output with one or more elements was resized' UserWarning, which strict does not.
    (float64 here: metadata no other test records, since a cached result skips the warning.)
    Metadata inference now silences that warning; the recorder gives it when it resizes.)"""
    x, y = torch.tensor(3.0, dtype=torch.float64), torch.tensor([2.0], dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError):
            with deferfuse.config.override(always_compile=True), deferfuse.defer():
                x.pow_(y)
    assert [str(w.message) for w in caught] == []


@pytest.mark.parametrize("program", [
    lambda x: x.__setitem__(slice(None), x[0]),
    lambda x: x.copy_(x[0].expand(3, 1)),
    lambda x: x.__setitem__(slice(None), x.diagonal(0, -1, 0)),
])
def test_copy_from_a_broadcast_view_of_the_target_is_allowed(program):
    """x[:] = x[0] (and x.copy_(x[0].expand(...))) runs in strict: the expanded source has
    internal overlap, so torch's partial-overlap check gives up and allows it.  Defer raised
    'some elements of the input tensor and the written-to tensor refer to a single memory
    location'."""
    check(program, torch.tensor([[-4.0], [2.5], [-1.5]], dtype=torch.float64))


@pytest.mark.xfail(strict=True, reason="index_put_ does not check its mask against the target")
def test_boolean_mask_assignment_through_an_aliasing_mask_raises():
    """t.view(3, 2)[t.t()] = True: the bool mask is a view of the written tensor, which strict
    rejects ('some elements of the input tensor and the written-to tensor refer to a single
    memory location'); defer wrote it."""
    def program(t):
        t.view(3, 2)[t.t()] = True
    check(program, torch.tensor([[True, False, True], [False, False, False]]))


def test_pending_read_survives_a_write_flushed_by_an_observation():
    """y = x * 2; x.mul_(0); x.sum().item(): the .item() flushed x's write but not y, which was
    then computed from the overwritten x (y == 0 instead of 4)."""
    def program(x):
        y = x * 2
        x.mul_(0)
        total = x.sum().item()
        return y, total
    check(program, torch.tensor([2.0]))


def test_pending_value_is_not_recomputed_from_flushed_storage():
    """x += x; y = x * 1; x.add_(0.0); x.sum().item() on a (2, 1) input: y came out as 4 * x
    instead of 2 * x -- after the .item() flush wrote x, the pending y re-ran x + x on the
    already doubled storage."""
    def program(x):
        x += x
        y = x * 1
        x.add_(0.0)
        total = x.sum().item()
        return y, total
    check(program, torch.tensor([[1.0, -2.0]]).t())


@pytest.mark.parametrize("program", [
    lambda w, b, f: w.mul_(1.5),
    lambda w, b, f: w.mul_(f),
    lambda w, b, f: b.mul_(2),
    lambda w, b, f: w.unsqueeze(-1).mul_(0.0),
])
def test_inplace_mul_that_would_promote_raises(program):
    """int64.mul_(1.5) raises in strict ("result type Float can't be cast to the desired output
    type Long"), as does bool.mul_(2); defer ran them (add_, sub_ and div_ did raise)."""
    check(program, torch.tensor([68, 3]), torch.tensor([True, False]), torch.tensor([1.5, 2.5]))


def test_inplace_chain_through_zero_over_zero_keeps_nan():
    """x.zero_(); x.div_(x); x.add_(0.5); x.exp_() must leave nan (0/0, then nan + 0.5, then
    exp(nan)); defer left 0.0 or a different number on each run (1.2e-27, 2.7e+23, ...).  XLA
    folds 0/0 into a constant nan, and its CPU code for a float32 exp gives garbage where its
    argument is provably nan (jax.jit of ``jnp.exp(s + jnp.float32(nan))`` on a float32 ``s``,
    jax 0.10.2); a nan passed in as data gives nan.  Lowerings use ``xla_fixes.exp``, which
    selects the nan."""
    def program(x):
        x.zero_()
        x.div_(x)
        x.add_(0.5)
        x.exp_()
    check(program, torch.tensor([4.0, 2.0]))


def test_pending_read_survives_a_boolean_mask_assignment():
    """y = exp(x); x.add_(1); x[x > 0] = 2 on a 0-dim input: the boolean-mask assignment (a
    data-dependent op, so a partial flush) wrote x, and the pending y was then computed from
    the updated x (exp(5) instead of exp(4))."""
    def program(x):
        y = torch.exp(x)
        x.add_(1)
        x[x > 0] = 2
        return y
    check(program, torch.tensor(4.0))


def test_storages_from_one_node_keep_one_signature():
    # Storages whose contents come from the same multi-output node were ordered by the address
    # of their state (a WeakSet), so the same program got different signatures and recompiled.
    x = torch.randn(6, 5)
    with deferfuse.config.override(always_compile=True):
        deferfuse.reset_stats()
        for _ in range(30):
            with deferfuse.defer():
                values, indices = (x * 2).max(dim=0)
                mean, var = torch.var_mean(x + 1, dim=1)
        assert deferfuse.stats()["compiles"] <= 1


@pytest.mark.parametrize("program", [
    lambda x: x.sum(0).conj(),
    lambda x: (x * 2).conj() + 1,
    lambda x: torch.fft.ifft(x.real * 3),
    lambda x: x.sum(0).conj().imag,
    lambda x: x.conj().add_(1j),
    lambda x: x.conj().mul_(x * 2),
])
def test_conjugate_view_of_a_pending_complex_tensor(program):
    # the conj bit was dropped: x.sum(0).conj() came back unconjugated
    check(program, torch.randn(3, 4, dtype=torch.complex64))


@pytest.mark.parametrize("program", [
    lambda x: torch.nn.functional.layer_norm(x, (x.shape[-1],)),   # one op, three outputs, two unused
    lambda x: x * 2,                                                # one op
    lambda x: (x * 2 + 1).tanh(),                                   # a chain, replayed eagerly
], ids=["layer_norm", "mul", "chain"])
def test_a_dropped_result_is_freed_without_the_cycle_collector(program):
    """Reference cycles (a Value and its Node; the eager replay's recursive closure) kept every
    computed tensor alive until Python's cycle collector ran: a loop of lone 16 MB layer norms
    grew by 16 MB per call and page-faulted fresh memory each time (4x slower than strict).
    (The last result may stay referenced from the last call's frames until the next call.)"""
    import gc
    import weakref
    x = torch.randn(64, 32)
    results = []
    gc.collect()
    gc.disable()
    try:
        with deferfuse.config.override(always_compile=False):
            for _ in range(5):
                with deferfuse.defer():
                    y = program(x)
                result = y._storage.buffer
                results.append(weakref.ref(result if result._base is None else result._base))
                torch.testing.assert_close(y, program(x))
                del y, result
        alive = sum(r() is not None for r in results)
        assert alive <= 1, f"{alive} of 5 computed tensors outlived their last user"
    finally:
        gc.enable()


@pytest.mark.parametrize("always_compile", [False, True], ids=["eager-first", "xla"])
def test_an_inplace_update_loop_leaves_no_cyclic_garbage(always_compile):
    """An optimizer-style loop (in-place updates, reads of what was just written, a write-back
    into user memory) left its executed intermediates in Value <-> Node cycles, and the defer
    context's recorder and mode referred to each other.  The cycles held the computed results,
    38 MB per AdamW step over 50 tensors, until a full collection, which gc.freeze() inside the
    block put off: memory grew by that much every step.  Nodes now hold their outputs weakly."""
    import gc
    from deferfuse.capture.mode import DeferMode
    from deferfuse.capture.recorder import Recorder
    from deferfuse.ir.graph import Node, Value
    params = [torch.randn(8, 16) for _ in range(3)]
    grads = [torch.randn(8, 16) for _ in range(3)]
    moments = [torch.rand(8, 16) for _ in range(3)]

    def step():
        with deferfuse.defer():
            for p, g, v in zip(params, grads, moments):
                p.mul_(0.99)
                v.mul_(0.9).addcmul_(g, g, value=0.1)
                p.addcdiv_(g / 3.0, (v / 3.0).sqrt().add_(1e-8), value=-0.1)

    expected = [p.clone() for p in params], [v.clone() for v in moments]
    for _ in range(5):
        for p, g, v in zip(*expected[:1], grads, expected[1]):
            p.mul_(0.99)
            v.mul_(0.9).addcmul_(g, g, value=0.1)
            p.addcdiv_(g / 3.0, (v / 3.0).sqrt().add_(1e-8), value=-0.1)
    with deferfuse.config.override(always_compile=always_compile):
        for _ in range(2):
            step()   # (first use imports parts of torch, whose import leaves cycles of its own)
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(3):
                step()
            gc.collect()
            ours = [o for o in gc.garbage if isinstance(o, (Node, Value, Recorder, DeferMode, torch.Tensor))]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert not ours, f"{len(ours)} graph objects were left in reference cycles, e.g. {ours[:3]}"
    for got, want in zip(params + moments, expected[0] + expected[1]):
        torch.testing.assert_close(got, want)


def test_xla_does_not_fold_log_of_exp_or_sqrt_of_a_square():
    """XLA's algebraic simplifier rewrites log(exp(a)) -> a and sqrt(a * a) -> |a| as if floats
    could not overflow: exp(100.0) is inf in float32, so torch's log of it is inf, not 100.
    Found by the deep program suite (log of exp of an int64 tensor holding 100)."""
    x = torch.tensor([100.0, 1.0, -50.0, 3e38, -2.0])
    ints = torch.tensor([[100, 38, 70], [-7, 18, -50]])

    def program(x, ints):
        return [torch.log(torch.exp(x)), torch.log2(torch.exp(x)), torch.log10(torch.exp(x)),
                torch.sqrt(x * x), torch.rsqrt(x * x), torch.log(torch.exp(ints))]

    with deferfuse.config.override(always_compile=True), deferfuse.defer():
        deferred = program(x, ints)
    for got, want in zip(deferred, program(x, ints)):
        torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_power_of_an_exponential_keeps_ieee_special_cases(dtype):
    """Found by the deep program suite: ``exp(v0) ** v7`` with v0 = inf and v7 = False gave nan
    for strict's 1.0.  XLA's simplifier rewrites pow(exp(a), y) as exp(a * y): inf * 0 and
    0 * nan are nan, where x ** 0 and 1 ** y are 1 for every x and y."""
    big = 800.0 if dtype == torch.float64 else 100.0   # exp overflows; exp(big * 0.5) does not
    x = torch.tensor([math.inf, 0.0, -math.inf, math.nan, 1.5, 0.0, math.inf, big], dtype=dtype)
    y = torch.tensor([0.0, math.nan, 0.0, 0.0, 2.0, math.inf, -1.0, 0.5], dtype=dtype)
    check(lambda x, y: (torch.exp(x) ** y, torch.exp(x) ** (y == 0), torch.exp(x).pow(0.0)), x, y)


@pytest.mark.parametrize("fn", [torch.exp, torch.exp2, torch.sinh, torch.cosh, torch.sigmoid,
                                torch.nn.functional.silu, torch.nn.functional.softplus,
                                torch.nn.functional.elu, lambda x: torch.softmax(x, 0),
                                lambda x: torch.logsumexp(x, 0)])
def test_exp_of_a_folded_nan_is_nan(fn):
    """Every lowering that computes an exp keeps a nan that XLA can prove at compile time
    (a zeroed tensor divided by itself), as strict does; float32 exp gave garbage there."""
    def program(x):
        x.zero_()
        x.div_(x)
        return fn(x + 0.5)
    check(program, torch.tensor([4.0, 2.0, 1.0]))


@pytest.mark.parametrize("write, strict_raises", [
    (lambda t, y: t.add_(1), True), (lambda t, y: t.exp_(), True), (lambda t, y: t.clamp_(0, 1), True),
    (lambda t, y: t.copy_(y), True), (lambda t, y: torch.sub(y, 1, out=t), True),
    (lambda t, y: t.uniform_(), True), (lambda t, y: t.fill_(2.0), False), (lambda t, y: t.zero_(), False),
    (lambda t, y: t.masked_fill_(y > 0, 3.0), False), (lambda t, y: t[0].add_(1), False)])
@pytest.mark.parametrize("deferred", [False, True])
def test_writes_into_expanded_tensors_do_what_strict_does(write, strict_raises, deferred):
    """Found by the deep program suite: ``v0.expand((2, 1, 1, 1)).add_(v1)`` raised in strict
    ("more than one element of the written-to tensor refers to a single memory location") and
    ran under defer.  Meta kernels do not check; torch's CPU kernels raise for most writes into
    an expanded tensor and run a few (fill_, zero_, masked_fill_); defer must do the same, on
    a user tensor and on a deferred one (``check`` requires the same exception type)."""
    def program(x, y):
        base = x * 1 if deferred else x
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # (masked_fill_ on an expanded tensor is deprecated)
            write(base.expand(3, 2), y)
        return base
    inputs = (torch.tensor([[1.0, -2.0]]), torch.tensor([[1.0, 2.0]] * 3))
    raised = False
    try:
        program(*(t.clone() for t in inputs))
    except RuntimeError:
        raised = True
    assert raised == strict_raises
    check(program, *inputs)


def test_a_refused_random_write_draws_no_numbers():
    """Deciding that ``uniform_`` into an expanded tensor raises runs torch's kernel on stand-ins;
    the user's generator must be where strict leaves it."""
    torch.manual_seed(0)
    with pytest.raises(RuntimeError):
        torch.zeros(1, 2).expand(3, 2).uniform_()
    expected = torch.rand(4)
    torch.manual_seed(0)
    with pytest.raises(RuntimeError), deferfuse.config.override(always_compile=True), deferfuse.defer():
        (torch.zeros(1, 2) * 1).expand(3, 2).uniform_()
    assert torch.equal(torch.rand(4), expected)


def test_an_inplace_view_of_a_deferred_tensor_raises_what_strict_raises():
    """Found by the deep program suite: ``(v0 * v0).t_()`` on a 3-D tensor raised AssertionError
    (from t_'s meta kernel) where strict raises RuntimeError."""
    with pytest.raises(RuntimeError, match="t_"):
        with deferfuse.config.override(always_compile=True), deferfuse.defer():
            x = torch.zeros(1, 2, 2)
            (x * x).t_()


@pytest.mark.parametrize("settings", [dict(always_compile=True), dict(always_compile=False, eager_first_runs=1)],
                         ids=["compiled", "replayed"])
def test_a_flush_inside_a_torch_func_transform_computes_plain_tensors(settings):
    """Found by corpus/torch_func_transforms.py: jacfwd's first use imports torch's forward-mode
    decompositions, which run torch.jit.script, which computes everything pending first; under
    the transform's level even ``detach()`` of a plain input returned its wrapper, which has no
    memory for DLPack (``Cannot access data pointer of Tensor that doesn't have storage``).  And
    hessian's decompositions run prims ops on meta scalars, which deferred stood for memory that
    never exists."""
    from torch.func import hessian, jacfwd, jacrev
    x = torch.randn(4)

    def f(t):
        return (t.sin() * t.cos()).sum() + (t ** 3).sum() * 0.1

    expected = (jacfwd(torch.tanh)(x * 2), hessian(f)(x), jacrev(torch.sin)(x))
    with deferfuse.config.override(cache_dir="", background_compile=False, **settings):
        with deferfuse.defer():
            y = x * 2
            got = (jacfwd(torch.tanh)(y), hessian(f)(x), jacrev(torch.sin)(x))
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e)


def test_a_model_moved_to_the_meta_device_under_defer():
    """Found by corpus/torch_func_transforms.py (an ensemble's stateless base): ``.to("meta")`` of
    a model whose parameters were deferred re-pointed each parameter through ``.data`` at a
    deferred meta tensor, which torch refused (``incompatible tensor type``).  Ops on meta
    tensors, or making them, run at once: they cost nothing and hold no data."""
    import copy
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    with deferfuse.config.override(cache_dir="", always_compile=True), deferfuse.defer():
        twin = copy.deepcopy(model)
        with torch.no_grad():
            twin[0].weight.mul_(2)
        base = copy.deepcopy(twin).to("meta")
        assert all(p.device.type == "meta" and type(p) is torch.nn.Parameter for p in base.parameters())
        out = base(torch.randn(2, 3, device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 1)
    torch.testing.assert_close(twin[0].weight, model[0].weight * 2)
