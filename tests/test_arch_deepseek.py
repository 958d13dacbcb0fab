"""DeepSeek-V3 and DeepSeek-V2 (issue 32): multi-head latent attention, the group-limited 'deepseek' router, shared
experts and dense leading layers, held equal to transformers 5.24's own DeepseekV3ForCausalLM /
DeepseekV2ForCausalLM both ways (logits within 1e-5 in fp32, training forward and cached generation), the
compressed-latent KV cache, refusals, and the lab's lifecycle on the ``deepseek-tiny`` preset.

Tiny random HF models are built here and saved with save_pretrained (the hub is never reached); weights are
re-drawn at a scale where logits are O(1), and the V3 selection bias is drawn too, so a bias used for the weights
(not only the choice), a wrong group score or a swapped RoPE layout moves the logits far beyond the tolerance.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
)

from moe_core import MoEForCausalLM, get_config
from moe_core.convert import ConversionError, config_from_hf, from_hf, get_architecture, to_hf
from moe_core.model import MultiHeadLatentAttention
from moe_core.routing import AuxLossFreeRouter, DeepSeekRouter, build_router
from tests.helpers import randomize_

ATOL = 1e-5
MLA = dict(
    vocab_size=128,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=12,  # != qk head dim: the value width is its own
    intermediate_size=48,
    moe_intermediate_size=16,
)
HF_CASES = {
    # q through the low-rank bottleneck, 8 experts in 4 groups (top-2 groups), sigmoid + bias, renormalized and
    # scaled weights, 2 shared experts, first layer dense, interleaved RoPE
    "v3": (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        dict(
            num_hidden_layers=3,
            q_lora_rank=24,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            n_shared_experts=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_interleave=True,
        ),
    ),
    # full-rank q, rotate_half RoPE, no renormalization, one group
    "v3_plain": (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        dict(
            num_hidden_layers=2,
            q_lora_rank=None,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=0,
            routed_scaling_factor=1.5,
            norm_topk_prob=False,
            rope_interleave=False,
            tie_word_embeddings=True,
        ),
    ),
    # DeepSeek-V2: softmax, group_limited_greedy (group score = its best expert), complex (interleaved) RoPE
    "v2": (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        dict(
            num_hidden_layers=3,
            q_lora_rank=24,
            n_routed_experts=8,
            num_experts_per_tok=2,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            n_shared_experts=2,
            first_k_dense_replace=1,
            routed_scaling_factor=1.7,
        ),
    ),
    # DeepSeek-V2-Lite's shape of routing: greedy top-k over all experts, full-rank q
    "v2_greedy": (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        dict(
            num_hidden_layers=2,
            q_lora_rank=None,
            n_routed_experts=4,
            num_experts_per_tok=2,
            topk_method="greedy",
            n_shared_experts=1,
            first_k_dense_replace=1,
        ),
    ),
    # YaRN as the published V2/V3 configs give it (factor, mscale = mscale_all_dim): the RoPE frequencies, its
    # attention factor and MLA's softmax scale times mscale^2 (positions past the original 16 are in the inputs)
    "v3_yarn": (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        dict(
            num_hidden_layers=2,
            q_lora_rank=24,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            rope_interleave=True,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
        ),
    ),
    "v2_yarn": (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        dict(
            num_hidden_layers=2,
            q_lora_rank=None,
            n_routed_experts=4,
            num_experts_per_tok=2,
            topk_method="greedy",
            n_shared_experts=1,
            first_k_dense_replace=1,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
        ),
    ),
}
EXPECTED_MOE_LAYERS = {
    "v3": [False, True, True],
    "v3_plain": [True, True],
    "v2": [False, True, True],
    "v2_greedy": [False, True],
    "v3_yarn": [False, True],
    "v2_yarn": [False, True],
}


def logits(model, input_ids, attention_mask=None) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids, attention_mask=attention_mask).logits.float()


def make_inputs(vocab_size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = torch.randint(0, vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 8:] = 0  # right padding in the second row
    return input_ids, attention_mask


def assert_same_logits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.std() > 0.3, "logits too small for the comparison to mean anything"
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def randomize_bias_(model: torch.nn.Module, seed: int = 3) -> None:
    """A selection bias large enough to change which experts are chosen (HF's e_score_correction_bias, ours)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "router.expert_bias")):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    built = {}
    for name, (config_cls, model_cls, overrides) in HF_CASES.items():
        torch.manual_seed(0)
        model = model_cls(config_cls(**{**MLA, **overrides})).eval()
        randomize_(model)
        randomize_bias_(model)
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(directory)
        built[name] = (model, directory)
    return built


# ------------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_to_ours_logits_match(hf_checkpoints, case):
    hf_model, directory = hf_checkpoints[case]
    ours = from_hf(directory)
    assert [layer.is_moe for layer in ours.model.layers] == EXPECTED_MOE_LAYERS[case]
    assert all(isinstance(layer.self_attn, MultiHeadLatentAttention) for layer in ours.model.layers)
    assert isinstance(ours.routers()[0], DeepSeekRouter)
    input_ids, attention_mask = make_inputs(hf_model.config.vocab_size)
    assert_same_logits(logits(ours, input_ids), logits(hf_model, input_ids))
    keep = attention_mask.bool()
    torch.testing.assert_close(
        logits(ours, input_ids, attention_mask)[keep],
        logits(hf_model, input_ids, attention_mask)[keep],
        atol=ATOL,
        rtol=0,
    )


@pytest.mark.parametrize("case", ["v3", "v2"])
def test_training_forward_matches_hf(hf_checkpoints, case):
    """In train mode (dropout 0) with gradients on: the same logits, and our loss's LM part is HF's loss."""
    hf_model, directory = hf_checkpoints[case]
    ours = from_hf(directory).train()
    hf_model.train()
    try:
        input_ids, _ = make_inputs(hf_model.config.vocab_size)
        out, hf_out = ours(input_ids, labels=input_ids), hf_model(input_ids, labels=input_ids)
        assert_same_logits(out.logits.float().detach(), hf_out.logits.float().detach())
        torch.testing.assert_close(out.lm_loss, hf_out.loss, atol=ATOL, rtol=0)
        out.loss.backward()
        assert ours.model.layers[1].self_attn.kv_b_proj.weight.grad.abs().sum() > 0
    finally:
        hf_model.eval()


@pytest.mark.parametrize("case", ["v3", "v2_greedy"])
def test_cached_generation_matches_hf_and_uncached_logits(hf_checkpoints, case):
    hf_model, directory = hf_checkpoints[case]
    ours = from_hf(directory)
    prompt, _ = make_inputs(hf_model.config.vocab_size)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ours_tokens = ours.generate(prompt, **kwargs)
        hf_tokens = hf_model.generate(prompt, **kwargs)
    assert torch.equal(ours_tokens, hf_tokens)
    # step by step through our cache: each step's logits equal the uncached forward over the whole sequence
    with torch.no_grad():
        full = ours(ours_tokens, use_cache=False).logits
        out = ours(ours_tokens[:, :8], use_cache=True)
        for s in range(8, ours_tokens.shape[1]):
            out = ours(ours_tokens[:, s : s + 1], cache=out.cache)
            torch.testing.assert_close(out.logits[:, -1], full[:, s], atol=ATOL, rtol=0)


def test_the_cache_holds_the_compressed_latent_and_the_shared_rope_key():
    config = get_config("deepseek-tiny")
    model = MoEForCausalLM(config).eval()
    with torch.no_grad():
        cache = model(torch.randint(0, config.vocab_size, (2, 10)), use_cache=True).cache
    for layer in cache.layers:
        # one "head" of the latent (R) and one of the RoPE key (P) per token, not H heads of k and v
        assert tuple(layer.keys.shape) == (2, 1, 10, config.kv_lora_rank)
        assert tuple(layer.values.shape) == (2, 1, 10, config.qk_rope_head_dim)
    per_token = config.kv_lora_rank + config.qk_rope_head_dim
    full = config.num_attention_heads * (
        config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    )
    assert per_token * 4 <= full


@pytest.mark.parametrize("case", list(HF_CASES))
def test_ours_to_hf_logits_match(hf_checkpoints, case, tmp_path):
    _, directory = hf_checkpoints[case]
    ours = from_hf(directory)
    randomize_(ours, seed=7)  # weights that never came from HF: the way back must carry them
    if get_architecture(ours.config.hf_origin["model_type"]).router_bias == "stored":
        randomize_bias_(ours, seed=8)
    to_hf(ours, tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(reloaded).__name__ == HF_CASES[case][1].__name__
    input_ids, _ = make_inputs(ours.config.vocab_size)
    assert_same_logits(logits(reloaded, input_ids), logits(ours, input_ids))


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_ours_hf_round_trip_is_identical(hf_checkpoints, case, tmp_path):
    _, directory = hf_checkpoints[case]
    to_hf(from_hf(directory), tmp_path / "hf")
    from safetensors.torch import load_file

    before, after = (
        load_file(directory / "model.safetensors"),
        load_file(tmp_path / "hf" / "model.safetensors"),
    )
    assert sorted(before) == sorted(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name
    config_before = json.loads((directory / "config.json").read_text())
    config_after = json.loads((tmp_path / "hf" / "config.json").read_text())
    for data in (config_before, config_after):
        data.pop("transformers_version", None)
    assert config_after == config_before


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_native_preset_exports_with_equal_logits(arch, tmp_path):
    overrides = (
        {}
        if arch == "deepseek_v3"
        else dict(
            router_score="softmax",
            router_group_score="max",
            norm_topk_prob=False,
            router_bias_update_rate=0.0,
        )
    )
    torch.manual_seed(0)
    ours = MoEForCausalLM(get_config("deepseek-tiny", **overrides)).eval()
    randomize_(ours)
    if arch == "deepseek_v3":
        randomize_bias_(ours)
    to_hf(ours, tmp_path / "hf", architecture=arch)
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    input_ids, _ = make_inputs(ours.config.vocab_size)
    assert_same_logits(logits(hf_model, input_ids), logits(ours, input_ids))
    back = from_hf(tmp_path / "hf")
    assert_same_logits(logits(back, input_ids), logits(ours, input_ids))


# ------------------------------------------------------------------------------------------------ routing
def test_deepseek_router_equals_hf_routers_on_random_logits():
    """Our router's choice and weights against transformers' DeepseekV3TopkRouter and DeepseekV2TopkRouter."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(0)
    x_TD = torch.randn(64, 32)
    for hf_cls, hf_config, ours_fields in (
        (
            DeepseekV3TopkRouter,
            DeepseekV3Config(**{**MLA, **HF_CASES["v3"][2]}),
            dict(router_score="sigmoid", router_group_score="top2_sum", norm_topk_prob=True),
        ),
        (
            DeepseekV2TopkRouter,
            DeepseekV2Config(**{**MLA, **HF_CASES["v2"][2]}),
            dict(router_score="softmax", router_group_score="max", norm_topk_prob=False),
        ),
    ):
        hf_router = hf_cls(hf_config)
        config = get_config(
            "deepseek-tiny",
            hidden_size=32,
            num_experts=8,
            num_experts_per_tok=hf_config.num_experts_per_tok,
            router_groups=4,
            router_topk_groups=2,
            routed_scaling_factor=hf_config.routed_scaling_factor,
            **ours_fields,
        )
        ours = build_router(config)
        with torch.no_grad():
            ours.gate.weight.copy_(torch.randn(8, 32))
            hf_router.weight.copy_(ours.gate.weight)
            if hasattr(hf_router, "e_score_correction_bias"):
                ours.expert_bias.copy_(torch.randn(8))
                hf_router.e_score_correction_bias.copy_(ours.expert_bias)
        _, hf_weights_TK, hf_ids_TK = hf_router(x_TD)
        record = ours(x_TD)
        dense_hf = torch.zeros(64, 8).scatter(1, hf_ids_TK, hf_weights_TK)
        dense_ours = torch.zeros(64, 8).scatter(1, record.expert_ids_TK, record.weights_TK)
        torch.testing.assert_close(dense_ours, dense_hf, atol=1e-6, rtol=0)
        assert int(record.tokens_per_expert_E.sum()) == 64 * config.num_experts_per_tok


def test_group_limit_keeps_every_choice_inside_the_chosen_groups():
    config = get_config(
        "deepseek-tiny", num_experts=16, router_groups=4, router_topk_groups=1, num_experts_per_tok=3
    )
    router = build_router(config)
    record = router(torch.randn(100, config.hidden_size))
    groups_TK = record.expert_ids_TK // 4
    assert (groups_TK == groups_TK[:, :1]).all()  # one group per token
    # the weights are the scores (not score + bias), renormalized, times the scaling factor
    torch.testing.assert_close(record.weights_TK.sum(-1), torch.full((100,), config.routed_scaling_factor))


def test_selection_bias_is_the_aux_loss_free_bias_and_moves_with_the_load():
    config = get_config("deepseek-tiny")
    router = build_router(config)
    assert isinstance(router, AuxLossFreeRouter) and router.balancing == "bias"
    assert build_router(get_config("deepseek-tiny", router_bias_update_rate=0.0)).balancing == "loss"
    router.train()
    record = router(torch.randn(64, config.hidden_size))
    router.observe(record)
    load = record.tokens_per_expert_E.float()
    router.update_bias()
    expected = config.router_bias_update_rate * torch.sign(load.mean() - load)
    torch.testing.assert_close(router.expert_bias, expected)
    assert "expert_bias" in router.state_dict()  # saved with the checkpoint


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (dict(router_groups=3), "router_groups=3"),
        (dict(router_topk_groups=5), "router_topk_groups=5"),
        (dict(router_topk_groups=1, num_experts_per_tok=5), "exceeds"),
        (dict(capacity_factor=1.0), "dropless"),
        (dict(router_group_score="mean"), "router_group_score"),
        (dict(head_dim=16), "head_dim"),
        (dict(attention_type="gqa"), "attention_type"),
        (dict(qk_rope_head_dim=7, head_dim=7), "qk_rope_head_dim"),
        (dict(attention_bias=True), "attention_type"),
    ],
)
def test_bad_deepseek_configs_are_refused_naming_the_field(overrides, expected):
    with pytest.raises(ValueError, match=expected):
        get_config("deepseek-tiny", **overrides)


# ------------------------------------------------------------------------------------------------ refusals
def _hf(config_cls, **overrides):
    return config_cls(
        **{**MLA, "num_hidden_layers": 2, "n_routed_experts": 4, "num_experts_per_tok": 2, **overrides}
    )


@pytest.mark.parametrize(
    ("arch", "hf", "expected"),
    [
        (
            "deepseek_v3",
            _hf(
                DeepseekV3Config,
                n_group=1,
                topk_group=1,
                rope_scaling={"rope_type": "dynamic", "factor": 4.0},
            ),
            ["rope_type='dynamic'", "supported 'yarn' and 'default'"],
        ),
        ("deepseek_v2", _hf(DeepseekV2Config, topk_method="noaux_tc"), ["topk_method='noaux_tc'", "greedy"]),
        ("deepseek_v2", _hf(DeepseekV2Config, norm_topk_prob=True), ["norm_topk_prob=True"]),
        ("deepseek_v2", _hf(DeepseekV2Config, moe_layer_freq=2), ["moe_layer_freq=2"]),
        (
            "deepseek_v3",
            _hf(DeepseekV3Config, n_group=1, topk_group=1, scoring_func="softmax"),
            ["scoring_func"],
        ),
        ("deepseek_v3", _hf(DeepseekV3Config, n_group=3, topk_group=1), ["n_group=3"]),
        (
            "deepseek_v3",
            _hf(DeepseekV3Config, n_group=1, topk_group=1, quantization_config={"quant_method": "fp8"}),
            ["quantization_config", "fp8"],
        ),
        (
            "deepseek_v3",
            _hf(DeepseekV3Config, n_group=1, topk_group=1, num_key_value_heads=2),
            ["num_key_value_heads"],
        ),
    ],
)
def test_inexpressible_hf_configs_are_refused_before_any_weight(arch, hf, expected):
    with pytest.raises(ConversionError) as err:
        config_from_hf(get_architecture(arch), hf)
    for text in expected:
        assert text in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "arch", "expected"),
    [
        (dict(), "deepseek_v2", ["router_score='sigmoid'", "norm_topk_prob=True", "router_bias_update_rate"]),
        (dict(dense_layers=[1]), "deepseek_v3", ["dense layers"]),
        (dict(shared_expert_intermediate_size=48), "deepseek_v3", ["shared_expert_intermediate_size=48"]),
        (dict(), "mixtral", ["attention_type='mla'", "router='deepseek'"]),
    ],
)
def test_native_configs_deepseek_cannot_express_are_refused(overrides, arch, expected, tmp_path):
    with pytest.raises(ConversionError) as err:
        to_hf(MoEForCausalLM(get_config("deepseek-tiny", **overrides)), tmp_path / "out", architecture=arch)
    for text in expected:
        assert text in str(err.value)
    assert not (tmp_path / "out").exists()


def test_v2_export_refuses_a_selection_bias_it_would_lose(tmp_path):
    ours = MoEForCausalLM(
        get_config(
            "deepseek-tiny",
            router_score="softmax",
            router_group_score="max",
            norm_topk_prob=False,
            router_bias_update_rate=0.0,
        )
    )
    randomize_bias_(ours)
    with pytest.raises(ConversionError, match="nonzero selection bias"):
        to_hf(ours, tmp_path / "out", architecture="deepseek_v2")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ lifecycle
def test_pretraining_steps_move_the_bias_and_the_export_loads(tmp_path):
    """A few steps of `moe_core.train.train` on deepseek-tiny: finite losses, the aux-loss-free bias moved by the
    trainer's update (not by a gradient), and the exported model loads through `moe_core.load` unchanged."""
    from safetensors.torch import load_file

    from moe_core import load
    from moe_core.train import TrainConfig, train

    config = TrainConfig.build(
        {
            "model": {"preset": "deepseek-tiny"},
            "steps": 4,
            "batch_size": 4,
            "data": {"source": "synthetic", "seq_len": 32, "synthetic_blocks": 64},
            "optim": {"warmup_steps": 1},
            "log": {"every": 2, "progress": "off"},
            "checkpoint": {"every": 4, "keep_last": 1},
            "eval": {"batches": 1},
        }
    )
    result = train(config, tmp_path / "run")
    assert result.val_loss == result.val_loss and result.val_loss < 10
    weights = load_file(result.export_dir / "model.safetensors")
    bias = weights["model.layers.1.mlp.router.expert_bias"]
    assert bias.abs().max() > 0  # moved by sign(mean load - load) * 0.001 after each step
    torch.testing.assert_close(bias.abs().max(), torch.tensor(4 * 0.001), atol=4 * 0.001, rtol=0)
    model = load(result.export_dir).model
    assert model.config.attention_type == "mla" and model.config.router == "deepseek"
    assert torch.equal(model.state_dict()["model.layers.1.mlp.router.expert_bias"], bias)


def test_save_load_round_trip_keeps_logits_and_the_bias(tmp_path):
    from moe_core import load

    torch.manual_seed(0)
    model = MoEForCausalLM(get_config("deepseek-tiny")).eval()
    randomize_(model)
    randomize_bias_(model)
    model.save_pretrained(tmp_path / "m")
    input_ids, _ = make_inputs(model.config.vocab_size)
    for memory_map in (
        False,
        True,
    ):  # from_pretrained, and the memory-mapped streaming loader (`moe_core.mapped`)
        again = load(tmp_path / "m", memory_map=memory_map).model
        assert_same_logits(logits(again, input_ids), logits(model, input_ids))
        assert torch.equal(again.routers()[0].expert_bias, model.routers()[0].expert_bias)


def test_lora_on_experts_and_mla_projections_trains_only_the_adapters(tmp_path):
    """The `moe_core.finetune` API on a DeepSeek model: LoRA on every routed expert and on MLA's projections (by
    their names), a few SFT steps lower nothing but the adapters, and the router's bias is untouched."""
    from moe_core.finetune import FinetuneConfig, finetune
    from tests.finetune_helpers import instruction_records, state, tiny_model, tiny_tokenizer

    model = tiny_model(
        "deepseek-tiny",
        num_experts=4,
        router_groups=2,
        router_topk_groups=1,
        num_experts_per_tok=2,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        head_dim=None,
        router_bias_update_rate=0.0,
    )
    before = state(model)
    config = FinetuneConfig.build(
        {
            "steps": 3,
            "batch_size": 4,
            "optim": {"lr": 1e-2},
            "lora": {
                "r": 4,
                "alpha": 8.0,
                "experts": "all",
                "attention": ["q_b_proj", "kv_b_proj", "o_proj"],
            },
            "export": {"merged": False},
        }
    )
    result = finetune(
        config, tmp_path, model=model, tokenizer=tiny_tokenizer(), records=instruction_records(8)
    )
    rows = [r for r in result.metrics if "lm_loss" in r]
    assert len(rows) == 3 and all(math.isfinite(r["loss"]) for r in rows)
    trained = {n for n, p in result.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert any("experts" in n for n in trained) and any("kv_b_proj" in n for n in trained)
    after = state(result.model)
    for name, tensor in before.items():
        if "expert_bias" in name:
            match = [k for k in after if k.endswith(name.removeprefix("model."))]
            assert match and torch.equal(after[match[0]], tensor)


def test_router_profile_reads_the_deepseek_routing():
    from moe_core.analytics.profile import collect_profile

    torch.manual_seed(0)
    model = MoEForCausalLM(get_config("deepseek-tiny")).eval()
    input_ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    profile = collect_profile(model, [input_ids])
    assert profile.model["moe_layer_ids"] == [1]
    assert profile.model["router"] == "deepseek"
    load_LE = profile.load_matrix_LE()
    assert load_LE.shape == (1, 16)  # the dense first layer has no profile
    # the shares are the router's own record's (nothing re-derives routing)
    with torch.no_grad():
        record = model(input_ids, output_routing=True, use_cache=False).routing[0]
    expected_E = record.tokens_per_expert_E.double() / (2 * 16 * 4)
    np.testing.assert_allclose(load_LE[0], expected_E.numpy(), atol=1e-9)


def test_onnx_export_refuses_mla_before_tracing(tmp_path):
    from moe_core.inference.onnx_export import OnnxExportError, export_onnx

    with pytest.raises(OnnxExportError, match="attention_type='mla'"):
        export_onnx(MoEForCausalLM(get_config("deepseek-tiny")), tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()


def test_gguf_export_accepts_the_deepseek_checkpoint_the_lab_writes(tmp_path):
    """GGUF: the config.json `to_hf` writes is one llama.cpp's 'deepseek2' layout runs as written (no refusal);
    the whole export, read back against llama.cpp's layout, is in tests/test_gguf_families.py."""
    from moe_core.inference.gguf_export import layout_for, read_config, refusals

    torch.manual_seed(0)
    to_hf(MoEForCausalLM(get_config("deepseek-tiny")), tmp_path / "hf", architecture="deepseek_v3")
    cfg = read_config(tmp_path / "hf")
    assert layout_for(cfg["model_type"]).arch_name == "deepseek2"
    assert refusals(cfg, layout_for(cfg["model_type"])) == []


# ------------------------------------------------------------------------------------------------ published
@pytest.mark.slow
def test_moonlight_at_full_width_loads_through_moe_core_load(tmp_path):
    """Moonlight-16B-A3B's published config at full width (hidden 2048, MLA and FFN widths as published), cut to
    its dense first layer and one MoE layer with 8 of its 64 experts and a 4096-token vocabulary (~380 MiB of
    bf16), loads through `moe_core.load` as the lab's DeepSeek model, memory-mapped too."""
    import moe_core
    from moe_core.published import build_published

    directory = build_published(
        "moonlight-16b-a3b",
        layers=2,
        overrides=dict(n_routed_experts=8, vocab_size=4096),
        cache_dir=tmp_path,
        tokenizer_vocab=300,
    )
    ids = torch.randint(0, 300, (1, 8), generator=torch.Generator().manual_seed(0))
    outputs = []
    for memory_map in (False, True):
        loaded = moe_core.load(directory, memory_map=memory_map)
        config = loaded.model.config
        assert loaded.kind == "hf" and config.attention_type == "mla" and config.q_lora_rank is None
        assert (config.hidden_size, config.kv_lora_rank, config.qk_rope_head_dim) == (2048, 512, 64)
        assert config.dense_layers == [0] and config.moe_layer_ids == [1]
        assert (config.router, config.router_score, config.routed_scaling_factor) == (
            "deepseek",
            "sigmoid",
            2.446,
        )
        assert config.num_shared_experts == 2 and config.intermediate_size == 11264
        with torch.no_grad():
            outputs.append(loaded.model(ids).logits.float())
        del loaded
    assert torch.isfinite(outputs[0]).all()
    torch.testing.assert_close(outputs[1], outputs[0], atol=0, rtol=0)
