"""``generate()`` with a compiled forward, as Hugging Face users run it: a static KV cache
(``cache_implementation="static"``) and ``model.forward = torch.compile(model.forward,
backend="deferfuse")``.  Greedy decoding gives strict's tokens (eager with the same cache, and
eager with the default dynamic cache), the prefill and the decode step are one graph each (the
decode step does not recompile per token: the static cache keeps its shapes, and the position
is a tensor), and a second ``generate`` compiles nothing."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import deferfuse
from bench import zoo_models as zoo

TOKENS = 32
# what one generate may make: the prefill's graph and the decode step's (a third for slack:
# a model whose prefill breaks once more)
MOST_GRAPHS = 3
COUNTED = ("compiled_graphs", "compiled_specializations", "compiled_partitions", "compiles",
           "disk_cache_hits", "compiled_rule_calls", "compiled_fallbacks")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    deferfuse.reset_stats()
    yield
    torch._dynamo.reset()


def generate(model: torch.nn.Module, prompt: torch.Tensor, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False,
                              pad_token_id=0, **kwargs)


def counted() -> dict:
    s = deferfuse.stats()
    found = {k: s[k] for k in COUNTED}
    found["compiled_fallbacks"] = dict(found["compiled_fallbacks"])
    found["dynamo_graphs"] = counters["stats"]["unique_graphs"]
    return found


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_compiled_generate_with_a_static_cache_gives_strict_tokens_from_two_graphs(name):
    model = zoo.MODELS[name].make("tiny").eval()
    prompt = zoo.MODELS[name].prompt("tiny", torch.Generator().manual_seed(2))
    dynamic = generate(model, prompt)
    static = generate(model, prompt, cache_implementation="static")
    assert torch.equal(static, dynamic)

    model.forward = torch.compile(model.forward, backend="deferfuse")
    first = generate(model, prompt, cache_implementation="static")
    assert torch.equal(first, static)
    after_first = counted()
    assert after_first["compiled_fallbacks"] == {}
    assert 1 <= after_first["dynamo_graphs"] <= MOST_GRAPHS
    assert 1 <= after_first["compiled_graphs"] <= MOST_GRAPHS
    # one plan per graph, and an executable per partition (compiled now or found on disk)
    assert after_first["compiled_specializations"] == after_first["compiled_graphs"]
    assert after_first["compiles"] + after_first["disk_cache_hits"] <= after_first["compiled_partitions"] \
        <= MOST_GRAPHS

    second = generate(model, prompt, cache_implementation="static")
    assert torch.equal(second, static)
    assert counted() == after_first, "a second generate compiled, planned or traced again"


def test_transformers_compile_config_compiles_the_decode_step_with_deferfuse():
    """transformers' own route: ``compile_config`` (its automatic compile of the decode step,
    which it only makes on accelerators unless told ``_compile_all_devices``)."""
    from transformers import CompileConfig
    model = zoo.MODELS["llama"].make("tiny").eval()
    prompt = zoo.MODELS["llama"].prompt("tiny", torch.Generator().manual_seed(2))
    static = generate(model, prompt, cache_implementation="static")
    config = CompileConfig(backend="deferfuse")
    config._compile_all_devices = True
    ours = [generate(model, prompt, cache_implementation="static", compile_config=config) for _ in range(2)]
    assert all(torch.equal(ids, static) for ids in ours)
    found = counted()
    # the prefill runs eagerly on this route: one graph, the decode step, planned once
    assert found["compiled_graphs"] == found["compiled_specializations"] == 1
    assert found["compiled_fallbacks"] == {}
