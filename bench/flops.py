"""The matrix FLOPs of a zoo model's step, for the model FLOPs utilization (MFU) columns.

A step's FLOPs are counted once per model with ``torch.utils.flop_counter.FlopCounterMode`` over
one strict step (forward and backward for training, AdamW included but uncounted: it has no
matrix products; the forward alone for inference and ``generate()``), outside any deferfuse mode.
MFU is then ``flops / seconds / peak``, the peak being what a large float32 GEMM reaches on
this machine (bench/harness.py, ``peak_gflops``).

FlopCounterMode knows torch's matrix products (mm, addmm, bmm, baddbmm, convolutions, the CUDA
attention kernels) but not the CPU kernels some zoo models reach, which would count as zero:
SDPA's flash attention on CPU (Llama, ViT...), ``_grouped_mm`` (Mixtral's experts), oneDNN's
LSTM layer and the fused ``_transformer_encoder_layer_fwd`` (the whole of ``encoder-eval``).
``EXTRA_FORMULAS`` counts them as torch counts their equivalents: attention as torch counts its
flash kernels (two batched products forward, five backward, which recomputes the scores; causal
masks not discounted), a recurrent layer as its input and hidden products at every time step
(twice that backward), the encoder layer as its linear layers and attention (what torch counts
on the layer's unfused path).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from bench import zoo_models as zoo

aten = torch.ops.aten
Shape = tuple[int, ...]


def _cpu_attention(query: Shape, key: Shape, value: Shape, *args: Any, **kwargs: Any) -> int:
    return flop_counter.sdpa_flop_count(query, key, value)


def _cpu_attention_backward(grad_out: Shape, query: Shape, key: Shape, value: Shape, *args: Any,
                            **kwargs: Any) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)


def _grouped_mm(a: Shape, b: Shape, *args: Any, **kwargs: Any) -> int:
    """Each row of ``a`` (or column of ``b``) meets one group's matrix: the products' sizes
    multiply once, whichever operand the offsets split."""
    if len(a) == 2 and len(b) == 2:         # (M, K) @ (K, N), K split: out (G, M, N)
        return 2 * a[0] * a[1] * b[1]
    if len(a) == 2:                         # (M, K) @ (G, K, N), M split
        return 2 * a[0] * a[1] * b[2]
    if len(b) == 2:                         # (G, M, K) @ (K, N), N split
        return 2 * a[1] * a[2] * b[1]
    return 2 * a[0] * a[1] * a[2] * b[2]    # (G, M, K) @ (G, K, N)


def _rnn_layer(input: Shape, weight_ih: Shape, weight_hh: Shape, *args: Any, **kwargs: Any) -> int:
    """One LSTM layer: at every (time step, sequence), the input and hidden products."""
    rows = math.prod(input[:-1])
    return 2 * rows * (math.prod(weight_ih) + math.prod(weight_hh))


def _rnn_layer_backward(input: Shape, weight_ih: Shape, weight_hh: Shape, *args: Any,
                        **kwargs: Any) -> int:
    """The gradients of the inputs and of the weights: twice the forward's products."""
    return 2 * _rnn_layer(input, weight_ih, weight_hh)


def _encoder_layer(src: Shape, embed_dim: int, num_heads: int, qkv_weight: Shape, qkv_bias: Shape,
                   proj_weight: Shape, proj_bias: Shape, *rest: Any, **kwargs: Any) -> int:
    """torch.nn.TransformerEncoderLayer's fused forward: the QKV, output and two feed-forward
    linears at every token, and attention over each sequence."""
    ffn_weight_1, ffn_weight_2 = rest[7], rest[9]
    batch, tokens = math.prod(src[:-2]), src[-2]
    weights = sum(math.prod(w) for w in (qkv_weight, proj_weight, ffn_weight_1, ffn_weight_2))
    head = embed_dim // num_heads
    attention = flop_counter.sdpa_flop_count((batch, num_heads, tokens, head),
                                             (batch, num_heads, tokens, head),
                                             (batch, num_heads, tokens, head))
    return 2 * batch * tokens * weights + attention


EXTRA_FORMULAS: dict[Any, Callable[..., int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
    aten._grouped_mm: _grouped_mm,
    aten.mkldnn_rnn_layer: _rnn_layer,
    aten.mkldnn_rnn_layer_backward: _rnn_layer_backward,
    aten._transformer_encoder_layer_fwd: _encoder_layer,
}


def counter() -> FlopCounterMode:
    """torch's FLOP counter, with EXTRA_FORMULAS."""
    return FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS)


def count(call: Callable[[], Any]) -> int:
    """The matrix FLOPs of ``call()``, run once (strict: call it outside any deferfuse mode)."""
    with counter() as flops:
        call()
    return flops.get_total_flops()


def step_flops(model: zoo.ZooModel, size: str, seed: int = 0, batch_seed: int = 1) -> int:
    """One strict step of ``model`` at ``size`` (zoo_models.train_step: forward and backward, or
    the forward alone for inference), on a fresh copy and batch."""
    network = model.make(size, seed=seed)
    optimizer = zoo.optimizer_for(network, model)
    batch = model.batch(size, torch.Generator().manual_seed(batch_seed))
    return count(lambda: zoo.train_step(network, model, optimizer, batch))


def generate_flops(model: zoo.ZooModel, size: str, tokens: int, seed: int = 0,
                   prompt_seed: int = 2) -> int:
    """One strict ``generate()`` call of ``tokens`` new tokens from the zoo's prompt."""
    network = model.make(size, seed=seed).eval()
    prompt = model.prompt(size, torch.Generator().manual_seed(prompt_seed))
    return count(lambda: zoo.generate(network, prompt, tokens))
