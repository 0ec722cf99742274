"""Programs people run with no code change: models built under defer mode, Hugging Face's Trainer.

A module built under defer mode (a ``with deferfuse.defer():`` block around its construction,
or ``TORCHTPU_MODE=defer``) has real ``nn.Parameter``s (deferfuse/capture/modules.py), which take
``.data`` assignment, ``.to()``, ``.half()`` and ``load_state_dict``; and Hugging Face's
``Trainer`` runs a whole training script under ``TORCHTPU_MODE=defer`` with strict's losses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

import deferfuse


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parameters_made_under_defer_are_real_parameters():
    """``nn.Parameter(torch.ones(n))`` under defer gives an nn.Parameter over real memory, which
    takes .data assignment, .to(), .half() and load_state_dict as strict's does."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    expected = transformers.LlamaForCausalLM(config)
    torch.manual_seed(0)
    with deferfuse.defer():
        model = transformers.LlamaForCausalLM(config)
        params = dict(model.named_parameters())
        assert all(type(p) is torch.nn.Parameter for p in params.values())
        model.to("cpu")
        model.half()
        model.float()
        norm = model.model.norm
        norm.weight.data = norm.weight.data * 2
    for name, p in expected.named_parameters():
        want = p.half().float() * (2 if name == "model.norm.weight" else 1)
        torch.testing.assert_close(model.get_parameter(name), want, rtol=0, atol=0, msg=name)
    with deferfuse.defer():
        model.load_state_dict(expected.state_dict())
    for name, p in expected.named_parameters():
        assert torch.equal(model.get_parameter(name), p), name


def _encoder_and_ema(copy_module):
    torch.manual_seed(0)
    encoder = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2, enable_nested_tensor=False)
    return encoder, copy_module(encoder)


def test_deep_copies_of_modules_made_under_defer_have_real_parameters():
    """``copy.deepcopy`` of a module puts ``nn.Parameter(p.data.clone())`` straight into the
    copy (past the registration hook): nn.TransformerEncoder copies its layer so, an EMA model
    the whole network.  Under defer those were DeferredTensors: ``.half()`` raised and every op
    on them went through the wrapper.  Now they are real Parameters, with strict's values, and
    the copy trains as strict's."""
    import copy
    expected, expected_ema = _encoder_and_ema(copy.deepcopy)
    with deferfuse.defer():
        encoder, ema = _encoder_and_ema(copy.deepcopy)
        for module in (encoder, ema):
            assert {type(p) for p in module.parameters()} == {torch.nn.Parameter}
        x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
        ema(x).square().mean().backward()
        half = copy.deepcopy(ema).half()
    expected_ema(x).square().mean().backward()
    for (name, p), q in zip(expected_ema.named_parameters(), ema.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    assert {p.dtype for p in half.parameters()} == {torch.float16}
    for p, q in zip(expected.parameters(), encoder.parameters()):
        assert torch.equal(p, q)


def test_parameter_of_a_deferred_value_keeps_requires_grad_and_trains():
    with deferfuse.defer():
        layer = torch.nn.Module()
        layer.scale = torch.nn.Parameter(torch.full((3,), 2.0))
        layer.frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
        assert type(layer.scale) is torch.nn.Parameter and layer.scale.requires_grad
        assert not layer.frozen.requires_grad
        (layer.scale * layer.frozen).sum().backward()
    assert torch.equal(layer.scale.grad, torch.ones(3))


# -- Hugging Face Trainer with no code change -------------------------------------------------------

TRAINER_SCRIPT = textwrap.dedent("""
    import json, sys, torch, transformers as T
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = T.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(0, 128, (16,), generator=g)} for _ in range(8)]
    for row in rows:
        row["labels"] = row["input_ids"].clone()
    losses = []

    class Losses(T.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    args = T.TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=4, num_train_epochs=2,
                               logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                               disable_tqdm=True)
    T.Trainer(model=model, args=args, train_dataset=rows, callbacks=[Losses()]).train()
    print("LOSSES", json.dumps(losses))
""")


def _trainer_losses(tmp_path, mode: str) -> list[float]:
    script = tmp_path / "train.py"
    script.write_text(TRAINER_SCRIPT)
    env = dict(os.environ, TORCHTPU_MODE=mode, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-m", "deferfuse", str(script), str(tmp_path / "out")],
                         capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("LOSSES ")]
    assert lines, out.stdout[-2000:]
    return json.loads(lines[-1][len("LOSSES "):])


def test_hugging_face_trainer_under_torchtpu_mode_defer(tmp_path):
    """``TORCHTPU_MODE=defer python -m deferfuse train.py``: the model is built under defer,
    Trainer moves it with ``model.to()`` (``param.data = ...``) and trains it."""
    strict = _trainer_losses(tmp_path, "strict")
    defer = _trainer_losses(tmp_path, "defer")
    assert len(strict) == 4
    torch.testing.assert_close(torch.tensor(defer), torch.tensor(strict), rtol=1e-5, atol=1e-6)


def test_optimizer_state_and_buffers_made_under_defer_are_plain_tensors():
    """A deferred first step makes AdamW's state with zeros_like: kept as DeferredTensors, every
    later step run at once (the block tier's choice) paid the wrapper's Python dispatch on each
    op.  The state is swapped for plain tensors after the step; values stay strict's."""
    def make():
        torch.manual_seed(0)
        # (no bias before the BatchNorm: its gradient is rounding noise, whose sign AdamW follows)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.BatchNorm1d(8),
                                    torch.nn.Linear(8, 2))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model, opt, k):
        g = torch.Generator().manual_seed(k)
        loss = model(torch.randn(6, 4, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    model, opt = make()
    expected = [step(model, opt, k).item() for k in range(4)]
    with deferfuse.defer():
        model_d, opt_d = make()
        buffers = dict(model_d.named_buffers())
        losses = [step(model_d, opt_d, 0)]
    assert all(type(b) is torch.Tensor for b in buffers.values())
    for state in opt_d.state.values():
        assert all(type(v) is torch.Tensor for v in state.values()), {k: type(v) for k, v in state.items()}
    losses += [step(model_d, opt_d, k) for k in range(1, 3)]        # at once, as strict
    with deferfuse.defer():
        losses.append(step(model_d, opt_d, 3))
    torch.testing.assert_close(torch.tensor([loss.item() for loss in losses]), torch.tensor(expected))
    torch.testing.assert_close(list(model_d.parameters()), list(model.parameters()))
    for a, b in zip(opt.state.values(), opt_d.state.values()):
        torch.testing.assert_close(a["exp_avg_sq"], b["exp_avg_sq"])
