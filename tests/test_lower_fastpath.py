"""The transformer fast-path ops (deferfuse/lower/fastpath.py) against strict PyTorch.

In eval mode under no_grad, nn.TransformerEncoder(Layer) reaches aten as
_transformer_encoder_layer_fwd and nn.MultiheadAttention (self-attention, batch_first, boolean
masks) as _native_multi_head_attention; test_which_ops pins this, so that each case below is
known to exercise what it says.
"""

from __future__ import annotations

import pytest
import torch

import deferfuse
from oracle import assert_same, ops_of, run_both
from oracle import lowered as _lowered

aten = torch.ops.aten
ENCODER_LAYER = aten._transformer_encoder_layer_fwd.default
MHA = aten._native_multi_head_attention.default
EMBED, HEADS, HIDDEN = 16, 4, 24


def lowered(fn, *inputs):
    """Compared with strict at torch.testing's default tolerances; nothing fell back."""
    return _lowered(fn, *inputs, compared=True)


def fell_back(fn, *inputs) -> dict:
    """The fallbacks of ``fn`` under defer, its results compared with strict's."""
    deferfuse.reset_stats()
    expected, actual, _, _ = run_both(fn, *inputs)
    assert_same(expected, actual)
    return dict(deferfuse.stats()["fallbacks"])


def encoder(activation="relu", norm_first=False, layers=2, dtype=torch.float32, nested=False):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(EMBED, HEADS, HIDDEN, activation=activation,
                                             norm_first=norm_first, batch_first=True)
    return torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=nested).eval().to(dtype)


def attention(dtype=torch.float32):
    torch.manual_seed(1)
    return torch.nn.MultiheadAttention(EMBED, HEADS, batch_first=True).eval().to(dtype)


def inputs(batch=3, length=5, dtype=torch.float32, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, length, EMBED, generator=g, dtype=torch.float64).to(dtype)


def padding(batch=3, length=5, full_row=None):
    """A left-aligned key padding mask (True: padded), one row per batch entry shorter."""
    mask = torch.arange(length)[None, :] >= (length - torch.arange(batch))[:, None]
    if full_row is not None:
        mask[full_row] = True
    return mask


def causal(length=5, dtype=torch.float32):
    return torch.nn.Transformer.generate_square_subsequent_mask(length, dtype=dtype)


def no_grad(fn):
    def run(*xs):
        with torch.no_grad():
            return fn(*xs)
    return run


def test_which_ops():
    x, pad = inputs(), padding()
    enc = encoder()
    for kwargs in ({}, dict(src_key_padding_mask=pad), dict(mask=causal()),
                   dict(mask=causal(), src_key_padding_mask=pad)):
        assert ENCODER_LAYER in ops_of(no_grad(lambda x: enc(x, **kwargs)), x)
    assert ENCODER_LAYER in ops_of(no_grad(encoder(norm_first=True, activation="gelu")), x)
    assert ENCODER_LAYER in ops_of(no_grad(encoder(dtype=torch.float64)), x.double())
    mha = attention()
    for kwargs in ({}, dict(key_padding_mask=pad), dict(need_weights=False),
                   dict(attn_mask=causal().isinf(), average_attn_weights=False)):
        assert MHA in ops_of(no_grad(lambda x: mha(x, x, x, **kwargs)), x)
    # a float attention mask, or grad, takes the slow path
    assert MHA not in ops_of(no_grad(lambda x: mha(x, x, x, attn_mask=causal())), x)
    assert MHA not in ops_of(lambda x: mha(x, x, x), x)


# -- nn.TransformerEncoder -----------------------------------------------------------------------

@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder(activation, norm_first):
    enc = encoder(activation, norm_first)
    pad = padding()
    # no mask; a boolean padding mask (mask_type 1); a causal float mask (expanded to
    # (B, H, T, T), mask_type 2); both, added (the kernel masks wherever the sum is nonzero)
    lowered(no_grad(lambda x: (enc(x), enc(x, src_key_padding_mask=pad), enc(x, mask=causal()),
                               enc(x, mask=causal(), src_key_padding_mask=pad.float() * -1e9))),
            inputs())


def test_encoder_shapes():
    enc = encoder("gelu")
    # batch 1; sequence length 1 (with a padding mask that keeps it); a boolean causal mask
    lowered(no_grad(lambda a, b: (enc(a), enc(a, mask=causal(4).isinf()), enc(b),
                                  enc(b, src_key_padding_mask=torch.zeros(3, 1, dtype=torch.bool)))),
            inputs(batch=1, length=4), inputs(length=1))


def test_encoder_float64():
    enc = encoder(norm_first=True, dtype=torch.float64)
    lowered(no_grad(lambda x: enc(x, src_key_padding_mask=padding())), inputs(dtype=torch.float64))


def test_fully_masked_rows_give_nan():
    # the kernel's masked softmax gives NaN (not 0) for a row with every key masked: a sequence
    # padded throughout is NaN through the rest of the layer, and the rest is not
    enc = encoder()
    pad = padding(full_row=1)
    out = lowered(no_grad(lambda x: enc(x, src_key_padding_mask=pad)), inputs())
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()


def test_nested_tensors():
    # enable_nested_tensor with a left-aligned padding mask runs the layers on a nested tensor:
    # those ops run eagerly (counted), and the result is strict's
    enc = encoder(nested=True)
    assert fell_back(no_grad(lambda x: enc(x, src_key_padding_mask=padding())), inputs())


def test_half_types_fall_back():
    enc = encoder(dtype=torch.bfloat16)
    assert fell_back(no_grad(lambda x: enc(x)), inputs(dtype=torch.bfloat16)) == {str(ENCODER_LAYER): 2}


# -- nn.MultiheadAttention -----------------------------------------------------------------------

def test_multi_head_attention():
    mha = attention()
    pad = padding()
    lowered(no_grad(lambda x: (mha(x, x, x), mha(x, x, x, average_attn_weights=False),
                               mha(x, x, x, key_padding_mask=pad),
                               mha(x, x, x, key_padding_mask=pad, average_attn_weights=False),
                               mha(x, x, x, attn_mask=causal().isinf()),
                               mha(x, x, x, attn_mask=causal().isinf(), key_padding_mask=pad))),
            inputs())


def test_multi_head_attention_float64_and_fully_masked():
    mha = attention(torch.float64)
    out = lowered(no_grad(lambda x: mha(x, x, x, key_padding_mask=padding(full_row=0))),
                  inputs(dtype=torch.float64))
    assert out[0][0].isnan().all() and not out[0][1:].isnan().any()


def test_without_weights():
    # without need_weights the CPU kernel's weights are None (the meta kernel's an empty tensor,
    # corrected by capture/meta.py)
    mha = attention()
    out = lowered(no_grad(lambda x: (mha(x, x, x, need_weights=False, key_padding_mask=padding()),
                                     mha(x, x, x, need_weights=False))), inputs())
    assert out[0][1] is None and out[1][1] is None


# -- the ops called directly ---------------------------------------------------------------------

def mha_args(batch=2, length=3, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, EMBED, generator=g)
    weights = [torch.randn(shape, generator=g) / 4 for shape in
               [(3 * EMBED, EMBED), (3 * EMBED,), (EMBED, EMBED), (EMBED,)]]
    return x, weights


def test_masks_as_the_kernel_reads_them():
    x, (qkv_w, qkv_b, proj_w, proj_b) = mha_args()

    def call(x, mask, mask_type, proj_w=proj_w, proj_b=proj_b):
        return MHA(x, x, x, EMBED, HEADS, qkv_w, qkv_b, proj_w, proj_b, mask, True, False, mask_type)

    keys = torch.tensor([[0.0, 0.5, 0.0], [0.0, 0.0, float("nan")]])   # any nonzero value masks
    square = torch.tensor([[False, True, True], [False, False, True], [True, True, True]])
    full = torch.rand(2, HEADS, 3, 3, generator=torch.Generator().manual_seed(4)) > 0.6
    lowered(lambda x: (call(x, keys, 1), call(x, square, 0), call(x, square.int(), 0),
                       call(x, full, None), call(x, full.double(), 1), call(x, None, None),
                       call(x, None, None, proj_w[:5], proj_b[:5])), x)


def test_invalid_calls_raise_torchs_errors():
    x, (qkv_w, qkv_b, proj_w, proj_b) = mha_args()
    square = torch.zeros(3, 3, dtype=torch.bool)
    calls = [lambda x: MHA(x, x, x, EMBED, HEADS, qkv_w, qkv_b, proj_w, proj_b, square, True, True, None),
             lambda x: MHA(x, x, x, EMBED, HEADS, qkv_w, qkv_b, proj_w, proj_b, square, True, True, 1),
             lambda x: MHA(x, x, x, EMBED, HEADS, qkv_w, qkv_b, proj_w, proj_b, square[None], True, True, 2),
             lambda x: MHA(x, x, x, EMBED, 3, qkv_w, qkv_b, proj_w, proj_b, None, True, True, None),
             lambda x: MHA(x, x, x, EMBED, HEADS, qkv_w[:, :4], qkv_b, proj_w, proj_b),
             lambda x: MHA(x, x, x, EMBED, HEADS, qkv_w.double(), qkv_b, proj_w, proj_b)]
    for fn in calls:
        expected, actual, _, _ = run_both(fn, x)
        assert expected is None and actual is None


def test_encoder_layer_edge_layouts():
    enc = encoder(layers=1)
    layer = enc.layers[0]
    attn = layer.self_attn
    params = (attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight, attn.out_proj.bias, True, False,
              1e-5, layer.norm1.weight, layer.norm1.bias, layer.norm2.weight, layer.norm2.bias,
              layer.linear1.weight, layer.linear1.bias, layer.linear2.weight, layer.linear2.bias)

    def call(src):
        return ENCODER_LAYER(src, EMBED, HEADS, *params)

    with torch.no_grad():
        # an empty src comes back cloned; a transposed one gives a contiguous output, as the CPU
        # kernel lays it out (the meta kernel keeps src's layout: capture/meta.py asks the kernel)
        lowered(lambda x: call(x[:, :0]), inputs())
        lowered(lambda x: call(x.transpose(0, 1).contiguous().transpose(0, 1)), inputs())
