"""The model zoo: real client models, built from configs at random init (nothing downloaded).

Each ``ZooModel`` builds a model of Hugging Face ``transformers`` (or of ``torch.nn``) at one of
three sizes and makes its batches:

- ``tiny``: 2 layers, 64 wide, batch 2 x 16 tokens (images 2 x 3 x 32 x 32): what the test
  suite runs (tests/test_zoo.py checks equality with strict and zero fallbacks);
- ``small``: 4 layers, 256 wide, batch 8 x 128 tokens (images 8 x 3 x 64 x 64): what
  ``make bench-zoo`` times (bench/zoo.py); one activation is 1 MiB, within a core's caches;
- ``medium``: 2 layers, 512 wide, 8 heads, batch 8 x 512 tokens (images 8 x 3 x 128 x 128):
  where activations go past the CPU caches, so that fusion can pay: a hidden state is 8 MiB,
  an MLP's inner activation 16 MiB, a layer's attention scores (8 heads x 512 x 512 per
  sequence) 64 MiB, against 1-2 MiB of L2 a core and a 32 MiB L3 shared.  Two layers, not four:
  layers add time, not size, to each op, and with four a ``bench.zoo --size medium`` run would
  take about twice as long (a 2-layer Llama step is 152 GFLOP of matrix products, 8.5 times
  small's; the zoo's 18 steps together 2.1 TFLOP).

The vision models take ``image`` square images (at medium, ViT's 8-pixel patches make 256
tokens an image; Swin's 4-pixel patches, 32 x 32, split into its 4 x 4 windows at both stages);
the CNNs' two stages are ``hidden`` / 4 and / 2 wide, ``layers`` / 2 blocks deep (at least 1).
The recurrent models (lstm, gru) step through ``sequence`` time steps, which stays 128 at
medium: their steps run one after another, and the deferred GRU's program grows with them.
Sequence-to-sequence targets are half the inputs' length; ``generate()`` starts from a prompt of
a quarter of it.

Configs keep each model's own defaults (dropout included) except the sizes; the vocabulary is
small (1024 tokens, 128 tiny) so that the embedding and the LM head do not swamp the layers.
``kind`` says what a step is: ``lm`` (causal LM: labels are the inputs; also ``generate()``),
``masked`` (encoder with an MLM head), ``seq2seq`` (encoder-decoder: labels are a target
sequence; also ``generate()``), ``vision`` (image classification), ``torch`` (torch.nn modules
with a regression loss), ``torch-eval`` (inference only: torch's fast paths run in eval).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

SIZES = ("tiny", "small", "medium")
GENERATE_TOKENS = 32


@dataclasses.dataclass(frozen=True)
class Dims:
    layers: int
    hidden: int
    heads: int
    batch: int
    tokens: int
    image: int
    vocab: int
    sequence: int       # time steps of the recurrent models (lstm, gru)

    @property
    def positions(self) -> int:
        """Learned position tables: 512, or what the batch needs (RoBERTa's start past the
        padding index, at 2)."""
        return max(512, self.tokens + 2)


DIMS = {
    "tiny": Dims(layers=2, hidden=64, heads=4, batch=2, tokens=16, image=32, vocab=128, sequence=16),
    "small": Dims(layers=4, hidden=256, heads=4, batch=8, tokens=128, image=64, vocab=1024, sequence=128),
    "medium": Dims(layers=2, hidden=512, heads=8, batch=8, tokens=512, image=128, vocab=1024, sequence=128),
}


@dataclasses.dataclass(frozen=True)
class ZooModel:
    name: str
    kind: str                                   # lm, masked, seq2seq, vision, torch, torch-eval
    build: Callable[[Dims], torch.nn.Module]    # at random init; torch.manual_seed before
    what: str                                   # what it covers, for the docs' table

    @property
    def generates(self) -> bool:
        return self.kind in ("lm", "seq2seq")

    @property
    def trains(self) -> bool:
        return self.kind != "torch-eval"

    def make(self, size: str, seed: int = 0) -> torch.nn.Module:
        torch.manual_seed(seed)
        model = self.build(DIMS[size])
        model.train(self.trains)
        return model

    def batch(self, size: str, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The keyword arguments of one training (or inference) call, drawn from ``generator``."""
        d = DIMS[size]
        if self.kind == "vision":
            return dict(pixel_values=torch.randn(d.batch, 3, d.image, d.image, generator=generator),
                        labels=torch.randint(0, 10, (d.batch,), generator=generator))
        if self.kind in ("torch", "torch-eval"):
            length = d.sequence if self.kind == "torch" else d.tokens
            return dict(x=torch.randn(d.batch, length, d.hidden, generator=generator))
        ids = torch.randint(0, d.vocab, (d.batch, d.tokens), generator=generator)
        if self.kind == "seq2seq":
            return dict(input_ids=ids, labels=torch.randint(0, d.vocab, (d.batch, d.tokens // 2), generator=generator))
        return dict(input_ids=ids, labels=ids)

    def prompt(self, size: str, generator: torch.Generator) -> torch.Tensor:
        """Token ids to start ``generate()`` from: one sequence of a quarter of the batch's length."""
        d = DIMS[size]
        return torch.randint(0, d.vocab, (1, max(4, d.tokens // 4)), generator=generator)


def loss_of(model: torch.nn.Module, zoo: ZooModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's loss on ``batch`` (Hugging Face models compute it from ``labels``)."""
    if zoo.kind in ("torch", "torch-eval"):
        out = model(batch["x"])
        return out.float().square().mean()
    return model(**batch).loss


# --------------------------------------------------------------------------------------------
# The models.

def _t():
    import transformers
    return transformers


def _decoder(config: str, model: str, **extra: Any) -> Callable[[Dims], torch.nn.Module]:
    def build(d: Dims) -> torch.nn.Module:
        t = _t()
        cfg = getattr(t, config)(vocab_size=d.vocab, hidden_size=d.hidden, intermediate_size=2 * d.hidden,
                                 num_hidden_layers=d.layers, num_attention_heads=d.heads,
                                 max_position_embeddings=d.positions, **extra)
        return getattr(t, model)(cfg)
    return build


def _gpt2(d: Dims) -> torch.nn.Module:
    t = _t()
    return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=d.vocab, n_embd=d.hidden, n_layer=d.layers, n_head=d.heads,
                                          n_positions=d.positions, bos_token_id=0, eos_token_id=0))


def _encoder(config: str, model: str) -> Callable[[Dims], torch.nn.Module]:
    def build(d: Dims) -> torch.nn.Module:
        t = _t()
        cfg = getattr(t, config)(vocab_size=d.vocab, hidden_size=d.hidden, num_hidden_layers=d.layers,
                                 num_attention_heads=d.heads, intermediate_size=2 * d.hidden,
                                 max_position_embeddings=d.positions, pad_token_id=0)
        return getattr(t, model)(cfg)
    return build


def _t5(d: Dims) -> torch.nn.Module:
    t = _t()
    return t.T5ForConditionalGeneration(t.T5Config(
        vocab_size=d.vocab, d_model=d.hidden, d_kv=d.hidden // d.heads, d_ff=2 * d.hidden, num_layers=d.layers,
        num_heads=d.heads, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


def _bart(d: Dims) -> torch.nn.Module:
    t = _t()
    return t.BartForConditionalGeneration(t.BartConfig(
        vocab_size=d.vocab, d_model=d.hidden, encoder_layers=d.layers, decoder_layers=d.layers,
        encoder_attention_heads=d.heads, decoder_attention_heads=d.heads, encoder_ffn_dim=2 * d.hidden,
        decoder_ffn_dim=2 * d.hidden, max_position_embeddings=d.positions, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None))


def _vit(d: Dims) -> torch.nn.Module:
    t = _t()
    return t.ViTForImageClassification(t.ViTConfig(
        image_size=d.image, patch_size=8, hidden_size=d.hidden, num_hidden_layers=d.layers,
        num_attention_heads=d.heads, intermediate_size=2 * d.hidden, num_labels=10))


def _stages(d: Dims) -> tuple[list[int], list[int]]:
    """Widths and depths of a 2-stage CNN whose last stage is ``d.hidden // 2`` wide."""
    return [d.hidden // 4, d.hidden // 2], [max(1, d.layers // 2)] * 2


def _convnext(d: Dims) -> torch.nn.Module:
    t = _t()
    widths, depths = _stages(d)
    return t.ConvNextForImageClassification(t.ConvNextConfig(
        hidden_sizes=widths, depths=depths, num_stages=2, num_labels=10, image_size=d.image))


def _resnet(d: Dims) -> torch.nn.Module:
    t = _t()
    widths, depths = _stages(d)
    return t.ResNetForImageClassification(t.ResNetConfig(
        hidden_sizes=widths, depths=depths, embedding_size=widths[0], num_labels=10))


def _swin(d: Dims) -> torch.nn.Module:
    t = _t()
    return t.SwinForImageClassification(t.SwinConfig(
        image_size=d.image, patch_size=4, embed_dim=d.hidden // 4, depths=[max(1, d.layers // 2)] * 2,
        num_heads=[2, 4], window_size=4, num_labels=10))


class _RecurrentLM(torch.nn.Module):
    """A stacked recurrent network over features with a linear read-out (torch.nn.LSTM/GRU)."""

    def __init__(self, cell: type, d: Dims) -> None:
        super().__init__()
        self.rnn = cell(d.hidden, d.hidden, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(d.hidden, d.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def _encoder_eval(d: Dims) -> torch.nn.Module:
    layer = torch.nn.TransformerEncoderLayer(d.hidden, d.heads, 2 * d.hidden, batch_first=True)
    # (enable_nested_tensor only matters with a padding mask; the fast path runs either way)
    return torch.nn.TransformerEncoder(layer, d.layers, enable_nested_tensor=False)


MODELS: dict[str, ZooModel] = {m.name: m for m in [
    ZooModel("llama", "lm", _decoder("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2),
             "decoder LM: RMSNorm, RoPE, SwiGLU, grouped-query SDPA"),
    ZooModel("qwen3", "lm", _decoder("Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=2, head_dim=16),
             "decoder LM: q/k norms, GQA"),
    ZooModel("mistral", "lm", _decoder("MistralConfig", "MistralForCausalLM", num_key_value_heads=2,
                                       sliding_window=8), "decoder LM: sliding-window attention mask"),
    ZooModel("gemma", "lm", _decoder("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=1, head_dim=16),
             "decoder LM: multi-query attention, GeGLU, scaled embeddings"),
    ZooModel("phi", "lm", _decoder("PhiConfig", "PhiForCausalLM"),
             "decoder LM: partial rotary, parallel attention and MLP, LayerNorm"),
    ZooModel("gpt2", "lm", _gpt2, "decoder LM: learned positions, Conv1D, dropout on"),
    ZooModel("mixtral", "lm", _decoder("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2,
                                       num_local_experts=4, num_experts_per_tok=2),
             "mixture of experts: top-2 routing over 4 experts (grouped matmuls)"),
    ZooModel("bert", "masked", _encoder("BertConfig", "BertForMaskedLM"), "encoder: MLM head, dropout on"),
    ZooModel("roberta", "masked", _encoder("RobertaConfig", "RobertaForMaskedLM"),
             "encoder: padding-offset positions"),
    ZooModel("t5", "seq2seq", _t5, "encoder-decoder: relative position bias, cross-attention"),
    ZooModel("bart", "seq2seq", _bart, "encoder-decoder: learned positions, cross-attention"),
    ZooModel("vit", "vision", _vit, "vision transformer: patch convolution"),
    ZooModel("convnext", "vision", _convnext, "CNN: depthwise convolutions, LayerNorm"),
    ZooModel("resnet", "vision", _resnet, "CNN: BatchNorm (running statistics), max pooling"),
    ZooModel("swin", "vision", _swin, "windowed attention: relative position bias, window shifts"),
    ZooModel("lstm", "torch", lambda d: _RecurrentLM(torch.nn.LSTM, d), "torch.nn.LSTM, 2 layers"),
    ZooModel("gru", "torch", lambda d: _RecurrentLM(torch.nn.GRU, d), "torch.nn.GRU, 2 layers"),
    ZooModel("encoder-eval", "torch-eval", _encoder_eval,
             "torch.nn.TransformerEncoder in eval (its fast path: _transformer_encoder_layer_fwd)"),
]}


# --------------------------------------------------------------------------------------------
# What the bench times and the tests compare.

def train_step(model: torch.nn.Module, zoo: ZooModel, optimizer: torch.optim.Optimizer | None,
               batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One step: forward, backward and AdamW (inference under no_grad for ``torch-eval``).
    Returns the loss, not read: the caller decides when to look."""
    if not zoo.trains:
        with torch.no_grad():
            return loss_of(model, zoo, batch)
    loss = loss_of(model, zoo, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def optimizer_for(model: torch.nn.Module, zoo: ZooModel) -> torch.optim.Optimizer | None:
    return torch.optim.AdamW(model.parameters(), lr=1e-3) if zoo.trains else None


def generate(model: torch.nn.Module, prompt: torch.Tensor, tokens: int = GENERATE_TOKENS) -> torch.Tensor:
    """Greedy decoding with the KV cache: ``tokens`` new ids, exactly that many."""
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                              use_cache=True, pad_token_id=0)
