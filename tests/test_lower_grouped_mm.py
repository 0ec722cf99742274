"""torch._grouped_mm (deferfuse/lower/grouped_mm.py) against strict PyTorch.

The CPU kernel runs float32, bfloat16 and float16 (the meta kernel only bfloat16: our shape rule
answers for the rest), in four layouts; autograd's backward is _grouped_mm again, on transposed
views.  Rows (or columns) that no group covers are left uninitialised by the kernel, so the
tests compare only covered ones.  Shapes keep each operand's leading stride a multiple of 16
bytes, which the kernel requires.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import deferfuse
from oracle import grads, lowered as _lowered, run_both

aten = torch.ops.aten
GROUPED_MM = aten._grouped_mm.default
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
gmm = torch._grouped_mm


def lowered(fn, *inputs):
    """Compared with strict (which must not raise); nothing fell back or was decomposed."""
    return _lowered(fn, *inputs, compared=True)


def same_exception(fn, *inputs):
    expected, actual, _, _ = run_both(fn, *inputs)
    assert expected is None and actual is None


def offsets(*ends, dtype=torch.int32):
    return torch.tensor(ends, dtype=dtype)


def tensors(*shapes, dtype=torch.float32, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)
            for shape in shapes]


def cases(dtype, requires_grad=False):
    """(name, fn, inputs) for the four layouts, every row or column covered."""
    a2, b3 = tensors((10, 16), (3, 16, 8), dtype=dtype, requires_grad=requires_grad)
    a3, b2 = tensors((3, 4, 16), (16, 24), dtype=dtype, seed=1, requires_grad=requires_grad)
    c2, d2 = tensors((8, 24), (24, 16), dtype=dtype, seed=2, requires_grad=requires_grad)
    e3, f3 = tensors((3, 4, 16), (3, 16, 8), dtype=dtype, seed=3, requires_grad=requires_grad)
    return [("2d x 3d", lambda a, b: gmm(a, b, offs=offsets(3, 7, 10)), (a2, b3)),
            ("3d x 2d", lambda a, b: gmm(a, b, offs=offsets(8, 8, 24)), (a3, b2)),
            ("2d x 2d", lambda a, b: gmm(a, b, offs=offsets(5, 16, 24)), (c2, d2)),
            ("3d x 3d", lambda a, b: gmm(a, b), (e3, f3))]


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is GROUPED_MM:
            self.calls.append(tuple(a.dim() for a in args[:2]))
        return func(*args, **(kwargs or {}))


def test_backward_is_grouped_mm():
    """What each case's gradients call: _grouped_mm in the layouts the transposes give."""
    expected = {"2d x 3d": [(2, 3), (2, 2), (2, 3)], "3d x 2d": [(3, 2), (3, 2), (2, 2)],
                "2d x 2d": [(2, 2), (2, 3), (3, 2)], "3d x 3d": [(3, 3), (3, 3), (3, 3)]}
    for name, fn, inputs in cases(torch.float32, requires_grad=True):
        with _Ops() as mode:
            grads(fn)(*inputs)
        assert mode.calls == expected[name], name


@pytest.mark.parametrize("dtype", DTYPES)
def test_layouts(dtype):
    for name, fn, inputs in cases(dtype):
        lowered(fn, *inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients(dtype):
    for name, fn, inputs in cases(dtype, requires_grad=True):
        lowered(lambda *xs: (fn(*xs), *grads(fn)(*xs)), *inputs)


def test_empty_groups():
    a, b = tensors((10, 16), (4, 16, 8))
    a3, b2 = tensors((4, 4, 16), (16, 24))
    c, d = tensors((8, 24), (24, 16))
    lowered(lambda a, b: gmm(a, b, offs=offsets(0, 4, 4, 10)), a, b)
    lowered(lambda a, b: gmm(a, b, offs=offsets(10, 10, 10, 10)), a, b)
    lowered(lambda a, b: gmm(a, b, offs=offsets(0, 0, 12, 24)), a3, b2)
    lowered(lambda c, d: gmm(c, d, offs=offsets(0, 8, 8, 24)), c, d)   # zeros for empty spans
    lowered(lambda c, d: gmm(c, d, offs=offsets()), c, d)              # no groups: (0, 8, 16)


def test_offsets_that_end_early():
    """Only the covered rows (columns) are compared: the kernel leaves the others unwritten.
    The ragged contraction simply leaves the tail out of every sum."""
    a, b = tensors((10, 16), (3, 16, 8))
    a3, b2 = tensors((3, 4, 16), (16, 24))
    c, d = tensors((8, 24), (24, 16))
    lowered(lambda a, b: gmm(a, b, offs=offsets(2, 5, 6))[:6], a, b)
    lowered(lambda a, b: gmm(a, b, offs=offsets(4, 4, 17))[:, :17], a3, b2)
    lowered(lambda c, d: gmm(c, d, offs=offsets(3, 9, 13)), c, d)


def test_unsorted_negative_and_out_of_range_offsets():
    """Spans are slices: negative bounds count from the end, bounds clamp to the size, an end
    before its start is empty, and where spans overlap the later group's rows are kept."""
    a, b = tensors((10, 16), (3, 16, 8))
    for ends, covered in [((6, 2, 8), range(0, 8)),        # group 2 rewrites rows 2..5
                          ((-4, 3, 12), range(0, 10)),     # group 0 is rows 0..5, group 1 empty
                          ((3, 12, 5), range(0, 10))]:     # group 1 clamped at 10, group 2 empty
        rows = torch.tensor(list(covered))
        lowered(lambda a, b: gmm(a, b, offs=offsets(*ends))[rows], a, b)
    c, d = tensors((8, 24), (24, 16))
    lowered(lambda c, d: gmm(c, d, offs=offsets(20, 4, -8, 30)), c, d)


def test_gradients_with_offsets_that_end_early():
    """The weight's gradient (a ragged contraction over the covered rows) is defined; the
    input's gradient has unwritten rows, as the forward has."""
    a, = tensors((10, 16))
    b, = tensors((3, 16, 8), seed=1, requires_grad=True)
    fn = lambda a, b: gmm(a, b, offs=offsets(2, 2, 7))
    lowered(grads(fn), a, b)
    a, b = tensors((10, 16), (3, 16, 8), requires_grad=True)
    lowered(lambda a, b: grads(fn)(a, b)[0][:7], a, b)


def test_output_layout():
    """The kernel pads the output's last dim to 16 bytes in its strides."""
    a, b = tensors((10, 16), (3, 6, 16))
    b = b.transpose(1, 2)              # (3, 16, 6), column-major: N = 6 is allowed
    out = lowered(lambda a, b: gmm(a, b, offs=offsets(3, 7, 10)), a, b)
    assert out.stride() == (8, 1)
    out = lowered(lambda a, b: gmm(a, b), *tensors((3, 5, 16), (3, 6, 16))[:1], b)
    assert out.stride() == (40, 8, 1)


def test_bfloat16_output_layout():
    # torch's meta kernel runs bfloat16 and lays the output out contiguously; capture/meta.py
    # takes the shape rule's padded layout, the CPU kernel's
    a, b = tensors((10, 16), (3, 6, 16), dtype=torch.bfloat16)
    out = lowered(lambda a, b: gmm(a, b.transpose(1, 2), offs=offsets(3, 7, 10)), a, b)
    assert out.stride() == (8, 1)


def test_non_finite_values_stay_in_their_group():
    a, b = tensors((10, 16), (3, 16, 8))
    b[2, 0, 0] = float("inf")
    a[0, 1] = float("nan")
    lowered(lambda a, b: gmm(a, b, offs=offsets(3, 7, 10)), a, b)
    c, d = tensors((8, 24), (24, 16))
    d[20, 3] = float("inf")
    lowered(lambda c, d: gmm(c, d, offs=offsets(5, 12, 24)), c, d)


def test_calls_the_kernel_rejects():
    a, b = tensors((10, 16), (3, 16, 8))
    a3, b3 = tensors((3, 4, 16), (3, 16, 8))
    o = offsets(3, 7, 10)
    rejected = [
        (lambda a, b: gmm(a, b, offs=offsets(3, 7, 10, dtype=torch.int64)), a, b),
        (lambda a, b: gmm(a, b, offs=o, bias=torch.zeros(3, 8)), a, b),
        (lambda a, b: gmm(a.bfloat16(), b.bfloat16(), offs=o, out_dtype=torch.float32), a, b),
        (lambda a, b: gmm(a, b, offs=o, out_dtype=torch.bfloat16), a, b),
        (lambda a, b: gmm(a.double(), b.double(), offs=o), a, b),
        (lambda a, b: gmm(a, b.bfloat16(), offs=o), a, b),                  # mixed dtypes
        (lambda a, b: gmm(a, b[..., :6].contiguous(), offs=o), a, b),       # 24-byte rows
        (lambda a, b: gmm(a[:, ::2], b[:, :8], offs=o), a, b),              # strided rows
        (lambda a, b: gmm(a, b), a, b),                                     # offs missing
        (lambda a, b: gmm(a, b, offs=offsets(3, 10)), a, b),                # G mismatch
        (lambda a, b: gmm(a, b, offs=o[None]), a, b),
        (lambda a, b: gmm(a[:, :8], b, offs=o), a, b),                      # K mismatch
        (lambda a, b: gmm(a, b, offs=o), a3, b3),                           # 3d x 3d with offs
        (lambda a, b: gmm(a[:2], b), a3, b3),
        (lambda a, b: gmm(a[0, 0], b, offs=o), a3, b3),                     # 1-D
    ]
    for fn, *inputs in rejected:
        same_exception(fn, *inputs)


def test_expanded_output_gradient_is_rejected_as_in_strict():
    """``y.sum().backward()`` hands the kernel an expanded gradient (strides 0)."""
    a, b = tensors((10, 16), (3, 16, 8), requires_grad=True)
    same_exception(lambda a, b: gmm(a, b, offs=offsets(3, 7, 10)).sum().backward(), a, b)


def test_offsets_computed_in_the_same_program():
    """As the Hugging Face experts compute them: a histogram of the sorted expert ids,
    cumulated into int32 ends, feeding the product in the same flush."""
    x, w = tensors((12, 16), (4, 16, 8))
    ids = torch.tensor([3, 0, 1, 3, 0, 0, 2, 3, 3, 1, 0, 0])

    def experts(x, w):
        sorted_ids, perm = torch.sort(ids)
        counts = torch.histc(sorted_ids.float(), bins=4, min=0, max=3)
        return gmm(x[perm], w, offs=torch.cumsum(counts, 0, dtype=torch.int32))
    lowered(experts, x, w)


# -- end to end: a tiny Mixtral trains as in strict --------------------------------------------

def _mixtral_losses(block, steps: int = 2) -> list[float]:
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    assert model.config._experts_implementation == "grouped_mm"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        with block():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_mixtral_trains_as_strict_with_no_fallback():
    expected = _mixtral_losses(contextlib.nullcontext)
    deferfuse.reset_stats()
    # compiled from the first step (by default a new program's first run replays eagerly)
    with deferfuse.config.override(always_compile=True):
        actual = _mixtral_losses(deferfuse.defer)
    stats = deferfuse.stats()
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=1e-4, atol=1e-5)
    assert stats["fallbacks"] == {}, stats["fallback_reasons"]
    assert stats["executions"] > 0 and stats["eager_replays"] == 0
