"""Sliding-window layers keep only their window (gpt-oss; issue 32), window-aware FLOPs, and the aux-loss-free
bias kept in fp32.

The KV cache: `MoEConfig.layer_types` / `sliding_window` (views of `attention_window`) make transformers'
``DynamicCache(config=)`` give each window layer a ``DynamicSlidingWindowLayer`` that keeps its last window - 1
keys; the model masks each layer against the keys it kept (`window_mask_for`). Held equal, past twice the
window, to the keep-everything cache (plain ``DynamicCache()``: every layer a growing ``DynamicLayer``) and to
transformers' own ``GptOssForCausalLM``.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.cache_utils import (
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticCache,
    StaticLayer,
    StaticSlidingWindowLayer,
)

from moe_core import MoEForCausalLM, load
from moe_core.analytics.cost import cost_report
from moe_core.config import get_config
from moe_core.convert import from_hf, to_hf
from moe_core.flops import flops_per_token
from moe_core.inference.compile import full_attention_layout
from tests.helpers import randomize_

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

ATOL = 1e-5
WINDOW = 4
HF_TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    max_position_embeddings=64,
    rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    swiglu_limit=1.5,
)
PROMPT, NEW = 5, 8  # 13 tokens > 2 x window
GREEDY = dict(
    max_new_tokens=NEW, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.manual_seed(0)
    hf_model = GptOssForCausalLM(GptOssConfig(**HF_TINY)).eval()
    randomize_(hf_model)
    directory = tmp_path_factory.mktemp("gptoss-window")
    hf_model.save_pretrained(directory)
    return hf_model, from_hf(directory)


def prompt(batch=1, seed=3) -> torch.Tensor:
    return torch.randint(
        1, HF_TINY["vocab_size"], (batch, PROMPT), generator=torch.Generator().manual_seed(seed)
    )


def assert_same(a, b) -> None:
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits, strict=True):
        torch.testing.assert_close(x, y, atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------------------------ the KV cache
def test_the_config_speaks_transformers_cache_vocabulary(models):
    _, ours = models
    config = ours.config
    assert config.attention_window == WINDOW and config.sliding_window == WINDOW
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert (
        "layer_types" not in config.to_dict() and "sliding_window" not in config.to_dict()
    )  # views, not saved
    kinds = [type(layer) for layer in DynamicCache(config=config).layers]
    assert kinds == [DynamicSlidingWindowLayer, DynamicLayer, DynamicSlidingWindowLayer]


def test_generation_past_twice_the_window_keeps_only_the_window(models):
    hf_model, ours = models
    ids = prompt()
    with torch.no_grad():
        windowed = ours.generate(ids, **GREEDY)  # generate's own cache, built from the config
        kept = DynamicCache()  # keep everything: every layer a growing DynamicLayer
        everything = ours.generate(ids, cache=kept, **GREEDY)
        theirs = hf_model.generate(ids, **GREEDY)
    assert_same(windowed, everything)
    assert_same(windowed, theirs)
    total = windowed.sequences.shape[1]
    assert total > 2 * WINDOW
    cache = windowed.cache
    lengths = [layer.keys.shape[-2] for layer in cache.layers]
    # the last token is never fed back; a window layer keeps its last window - 1 keys, a full layer all of them
    assert lengths == [WINDOW - 1, total - 1, WINDOW - 1]
    assert [layer.keys.shape[-2] for layer in kept.layers] == [
        total - 1
    ] * 3  # (the comparison meant something)


def test_the_cached_length_stays_within_the_window_at_every_step(models):
    _, ours = models
    ids = torch.randint(1, HF_TINY["vocab_size"], (1, 3 * WINDOW), generator=torch.Generator().manual_seed(5))
    cache = DynamicCache(config=ours.config)
    with torch.no_grad():
        full = ours(ids, use_cache=False).logits
        for t in range(ids.shape[1]):
            step = ours(ids[:, t : t + 1], cache=cache, use_cache=True).logits
            torch.testing.assert_close(step[:, -1], full[:, t], atol=ATOL, rtol=0)
            assert (
                cache.layers[0].keys.shape[-2] <= WINDOW - 1 and cache.layers[2].keys.shape[-2] <= WINDOW - 1
            )
            assert cache.layers[1].keys.shape[-2] == t + 1


def test_a_left_padded_batch_past_the_window_matches_keep_everything_and_transformers(models):
    hf_model, ours = models
    ids = prompt(batch=2, seed=7)
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0  # the second prompt is 2 tokens shorter, padded on the left
    with torch.no_grad():
        windowed = ours.generate(ids, attention_mask=mask, **GREEDY)
        everything = ours.generate(ids, attention_mask=mask, cache=DynamicCache(), **GREEDY)
        theirs = hf_model.generate(ids, attention_mask=mask, **GREEDY)
    assert_same(windowed, everything)
    assert_same(windowed, theirs)
    assert windowed.cache.layers[0].keys.shape[-2] == WINDOW - 1


def test_a_prompt_longer_than_the_window_then_decoding(models):
    """Prefill past the window (the sliding layer hands back every new key once, then keeps window - 1)."""
    hf_model, ours = models
    ids = torch.randint(
        1, HF_TINY["vocab_size"], (1, 2 * WINDOW + 1), generator=torch.Generator().manual_seed(9)
    )
    with torch.no_grad():
        windowed = ours.generate(ids, **{**GREEDY, "max_new_tokens": 3})
        theirs = hf_model.generate(ids, **{**GREEDY, "max_new_tokens": 3})
    assert_same(windowed, theirs)


def test_static_caches_window_layers_and_the_compiled_path_full_layers(models):
    """transformers' static cache (``generate(cache_implementation="static")``) gives a window layer a
    window-sized StaticSlidingWindowLayer, and the model masks against it; the lab's compiled decode keeps
    full-length static layers (`full_attention_layout` says why), masked by the window."""
    _, ours = models
    ids = prompt(seed=11)
    with torch.no_grad():
        dynamic = ours.generate(ids, **GREEDY)
        static = ours.generate(ids, cache_implementation="static", **GREEDY)
    assert_same(static, dynamic)
    assert [type(layer) for layer in static.cache.layers] == [
        StaticSlidingWindowLayer,
        StaticLayer,
        StaticSlidingWindowLayer,
    ]
    assert static.cache.layers[0].keys.shape[-2] == WINDOW

    total = PROMPT + NEW
    cache = StaticCache(config=full_attention_layout(ours.config), max_cache_len=total)
    assert all(type(layer) is StaticLayer for layer in cache.layers)
    sequence = dynamic.sequences
    with torch.no_grad():
        full = ours(sequence, use_cache=False).logits
        ours(sequence[:, :PROMPT], cache=cache, use_cache=True)
        for t in range(PROMPT, total):
            step = ours(sequence[:, t : t + 1], cache=cache, use_cache=True).logits
            torch.testing.assert_close(step[:, -1], full[:, t], atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------------------------ FLOPs
def test_attention_flops_count_each_layers_keys_by_hand():
    """A sliding layer's query sees at most `attention_window` keys, a full layer's the whole context (PaLM's
    count, not halved for causality): 2 (QK^T) + 2 (AV) FLOPs per key per head dim per head."""
    config = get_config("gptoss-tiny", attention_window=4, attention_window_layers=[0])  # 2 layers
    H, Hd = config.num_attention_heads, config.head_dim
    assert (config.num_hidden_layers, H, Hd) == (2, 4, 16)
    # layer 0 (window 4) sees 4 keys at a context of 10, layer 1 (full) all 10
    assert flops_per_token(config, 10).attention_scores == 4 * H * Hd * (4 + 10) == 3584
    # within the window both see the whole context
    assert flops_per_token(config, 3).attention_scores == 4 * H * Hd * (3 + 3)
    every_layer = get_config("gptoss-tiny", attention_window=4, attention_window_layers=None)
    assert flops_per_token(every_layer, 10).attention_scores == 4 * H * Hd * (4 + 4)
    full = get_config("gptoss-tiny", attention_window=None, attention_window_layers=None)
    assert flops_per_token(full, 10).attention_scores == 4 * H * Hd * (10 + 10)
    # the rest of the count does not move, and the cost report reads the same numbers
    windowed, unwindowed = flops_per_token(config, 10), flops_per_token(full, 10)
    assert (
        windowed.forward_active - windowed.attention_scores
        == unwindowed.forward_active - unwindowed.attention_scores
    )
    report = cost_report(config, tokens_per_s=1000.0, device="cpu", seq_len=10)
    assert report.flops.attention_scores == 3584


def test_mla_attention_flops_count_its_own_widths():
    config = get_config("deepseek-tiny")
    L, H = config.num_hidden_layers, config.num_attention_heads
    widths = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    assert flops_per_token(config, 10).attention_scores == 2 * 10 * H * widths * L


# ------------------------------------------------------------------------------------------------ fp32 bias
RATE = 1e-3


@pytest.fixture(scope="module")
def bf16_deepseek():
    torch.manual_seed(0)
    model = MoEForCausalLM(get_config("deepseek-tiny", router_bias_update_rate=RATE)).to(torch.bfloat16)
    with torch.no_grad():  # where bf16's spacing (2**-8 at 0.5) is wider than a step: bf16 would not move
        model.routers()[0].expert_bias.fill_(0.5)
    return model


def expert_biases(model) -> list[torch.Tensor]:
    return [router.expert_bias for router in model.routers()]


def test_the_selection_bias_of_a_bf16_model_moves_by_update_rate_steps(bf16_deepseek):
    model = bf16_deepseek
    assert torch.tensor(0.5, dtype=torch.bfloat16) + RATE == 0.5  # (why it must stay fp32)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert all(bias.dtype == torch.float32 for bias in expert_biases(model))
    model.half().bfloat16()  # every cast keeps it, and keeps its value
    (bias,) = expert_biases(model)
    assert bias.dtype == torch.float32 and torch.equal(bias, torch.full_like(bias, 0.5))
    before = bias.clone()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model.train()
    try:
        model(ids, labels=ids).loss.backward()
        model.update_router_biases()
    finally:
        model.eval()
        model.zero_grad(set_to_none=True)
    (after,) = expert_biases(model)
    steps = (after - before) / RATE
    assert after.dtype == torch.float32
    torch.testing.assert_close(steps.abs(), torch.ones_like(steps), atol=1e-4, rtol=0)  # every expert moved
    assert (steps > 0).any() and (steps < 0).any()


def test_the_fp32_bias_survives_save_load_and_conversion_both_ways(bf16_deepseek, tmp_path):
    model = bf16_deepseek
    with torch.no_grad():
        model.routers()[0].expert_bias.copy_(0.5 + RATE * torch.arange(model.config.num_experts))
    (saved,) = [bias.clone() for bias in expert_biases(model)]
    model.save_pretrained(tmp_path / "ours")
    with safe_open(tmp_path / "ours" / "model.safetensors", "pt") as f:
        stored = [f.get_tensor(k) for k in f.keys() if k.endswith("expert_bias")]
    assert [t.dtype for t in stored] == [torch.float32] and torch.equal(stored[0], saved)
    reloaded = [
        MoEForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.bfloat16),
        load(tmp_path / "ours", dtype=torch.bfloat16).model,
    ]
    to_hf(model, tmp_path / "hf", "deepseek_v3")
    reloaded.append(from_hf(tmp_path / "hf", dtype=torch.bfloat16))
    for loaded in reloaded:
        assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
        (bias,) = expert_biases(loaded)
        assert bias.dtype == torch.float32 and torch.equal(bias, saved)
    with safe_open(next((tmp_path / "hf").glob("*.safetensors")), "pt") as f:
        (name,) = [k for k in f.keys() if k.endswith("e_score_correction_bias")]
        assert f.get_tensor(name).dtype == torch.float32
