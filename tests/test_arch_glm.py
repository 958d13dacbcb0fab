"""GLM-4.5 / GLM-4.5-Air (issue 32; transformers 5.24 ``models/glm4_moe``): DeepSeek-V3's routing (sigmoid scores,
the aux-loss-free selection bias, group-limited top-k, routed scaling, shared experts, dense first layers) on
grouped-query attention with q/k/v biases, optional per-head q/k norm and partial rotary embeddings.

Held against transformers' own ``Glm4MoeForCausalLM`` on tiny configs: logits within 1e-5 in fp32 both ways, in a
training forward and in greedy generation with a KV cache; the multi-token-prediction layer is skipped as
transformers skips it; what the lab cannot express is refused before any weight is read; the lifecycle on the
``glm4moe-tiny`` preset; GLM-4.5-Air's published config (shrunk; full width: benchmarks/README.md) through
`moe_core.load`.

Tiny random HF models are built here and saved with save_pretrained (the hub is never reached); weights are drawn
at a scale where logits are O(1) and the selection bias is drawn too, so a bias used for the weights, a wrong group
score, the wrong rotated dims or interleaved pairs instead of rotate-half move the logits far beyond the tolerance.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding, apply_rotary_pos_emb

import moe_core
from moe_core import MoEForCausalLM, get_config
from moe_core.config import MoEConfig, parameter_counts
from moe_core.convert import ConversionError, from_hf, to_hf
from moe_core.model import RotaryEmbedding, apply_partial_rope, apply_rope
from moe_core.routing import DeepSeekRouter
from tests.arch_lifecycle import run_lifecycle
from tests.helpers import randomize_

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

ATOL = 1e-5
BASE = dict(
    vocab_size=128,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # != hidden / heads, as GLM-4.5 (128 vs 42.7)
    max_position_embeddings=64,
    intermediate_size=48,
    moe_intermediate_size=16,
    rope_theta=1e6,
)
HF_CASES = {
    # GLM-4.5-Air's shape: the first layer dense, one group, renormalized, biased q/k/v, no q/k norm, RoPE on half
    "air": dict(
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        attention_bias=True,
        use_qk_norm=False,
        partial_rotary_factor=0.5,
    ),
    # GLM-4.5's: per-head q/k norm, scaling 2.5; here also 4 groups of which 2, no renormalization, 2 shared
    # experts, a quarter of each head rotated, tied embeddings, and a multi-token-prediction layer in the files
    "full": dict(
        num_hidden_layers=3,
        first_k_dense_replace=2,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=False,
        attention_bias=False,
        use_qk_norm=True,
        partial_rotary_factor=0.25,
        tie_word_embeddings=True,
        num_nextn_predict_layers=1,
    ),
    # YaRN on the rotated half (positions past the original 16 are in the inputs)
    "yarn": dict(
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        attention_bias=True,
        partial_rotary_factor=0.5,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ),
}
EXPECTED_MOE_LAYERS = {"air": [False, True, True], "full": [False, False, True], "yarn": [False, True]}


def hf_config(case: str, **overrides) -> Glm4MoeConfig:
    return Glm4MoeConfig(**{**BASE, **HF_CASES[case], **overrides})


def logits(model, input_ids, attention_mask=None) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids, attention_mask=attention_mask).logits.float()


def make_inputs(vocab_size: int = 128, seed: int = 1, length: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = torch.randint(0, vocab_size, (2, length), generator=torch.Generator().manual_seed(seed))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 14:] = 0  # right padding in the second row
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


def add_mtp_layer_(directory, layer: int) -> list[str]:
    """Write a multi-token-prediction layer's weights into a saved checkpoint as the hub files carry it, as
    ``model.layers.{L}.*`` after the L decoder layers (its own norms and projection besides a decoder layer's).
    Returns their names."""
    file = directory / "model.safetensors"
    tensors = load_file(file)
    prefix = f"model.layers.{layer - 1}."
    mtp = {
        k.replace(prefix, f"model.layers.{layer}.", 1): v.clone()
        for k, v in tensors.items()
        if k.startswith(prefix)
    }
    D = BASE["hidden_size"]
    mtp.update(
        {
            f"model.layers.{layer}.enorm.weight": torch.ones(D),
            f"model.layers.{layer}.hnorm.weight": torch.ones(D),
            f"model.layers.{layer}.eh_proj.weight": torch.randn(D, 2 * D),
            f"model.layers.{layer}.shared_head.norm.weight": torch.ones(D),
        }
    )
    save_file({**tensors, **mtp}, str(file), metadata={"format": "pt"})
    return sorted(mtp)


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    built = {}
    for case in HF_CASES:
        torch.manual_seed(0)
        model = Glm4MoeForCausalLM(hf_config(case)).eval()
        randomize_(model)
        randomize_bias_(model)
        directory = tmp_path_factory.mktemp(case)
        model.save_pretrained(directory)
        if case == "full":
            add_mtp_layer_(directory, HF_CASES[case]["num_hidden_layers"])
        built[case] = (model, directory)
    return built


# ------------------------------------------------------------------------------------------------ partial RoPE
@pytest.mark.parametrize(
    ("factor", "rope"),
    [
        (0.5, {"rope_type": "default"}),
        (0.25, {"rope_type": "default"}),
        (0.5, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
        (1.0, {"rope_type": "default"}),
    ],
    ids=["half", "quarter", "half-yarn", "whole"],
)
def test_partial_rope_equals_transformers_glm4_moe(factor, rope):
    """Our RotaryEmbedding over rotary_dim and `apply_partial_rope` equal Glm4MoeRotaryEmbedding and its
    apply_rotary_pos_emb: the first int(head_dim * factor) dims of each head rotated (rotate-half within them),
    the rest passed through unchanged."""
    head_dim = 16
    config = Glm4MoeConfig(
        **{**BASE, "head_dim": head_dim},
        rope_parameters={**rope, "rope_theta": 1e6, "partial_rotary_factor": factor},
    )
    ours_config = MoEConfig(
        hidden_size=32,
        num_attention_heads=4,
        head_dim=head_dim,
        rope_partial_factor=factor,
        num_experts=0,
    )
    R = ours_config.rotary_dim
    assert R == int(head_dim * factor)
    yarn = {k: v for k, v in rope.items() if k != "rope_type"} or None
    ours_rope = RotaryEmbedding(R, 1e6, yarn)
    hf_rope = Glm4MoeRotaryEmbedding(config)
    torch.testing.assert_close(ours_rope.inv_freq, hf_rope.inv_freq, atol=0, rtol=0)

    generator = torch.Generator().manual_seed(0)
    q_BHSHd = torch.randn(2, 4, 24, head_dim, generator=generator)
    k_BGSHd = torch.randn(2, 2, 24, head_dim, generator=generator)
    positions = torch.arange(24)[None].expand(2, 24)
    cos, sin = ours_rope(q_BHSHd, positions)
    hf_cos, hf_sin = hf_rope(q_BHSHd, positions)
    torch.testing.assert_close(cos, hf_cos, atol=1e-6, rtol=0)
    rope_fn = apply_partial_rope if R < head_dim else apply_rope
    q, k = rope_fn(q_BHSHd, k_BGSHd, cos, sin)
    hf_q, hf_k = apply_rotary_pos_emb(q_BHSHd, k_BGSHd, hf_cos, hf_sin)
    torch.testing.assert_close(q, hf_q, atol=1e-6, rtol=0)
    torch.testing.assert_close(k, hf_k, atol=1e-6, rtol=0)
    assert torch.equal(q[..., R:], q_BHSHd[..., R:])  # the unrotated part passes through
    assert not torch.allclose(q[..., :R], q_BHSHd[..., :R])


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (dict(rope_partial_factor=0.0), "must be in \\(0, 1\\]"),
        (dict(rope_partial_factor=1.5), "must be in \\(0, 1\\]"),
        (dict(rope_partial_factor=0.3), "= 9 dims"),  # int(32 * 0.3) = 9: odd
        (dict(attention_type="mla", attention_bias=False, head_dim=None), "multi-head latent attention"),
    ],
)
def test_partial_rope_config_is_checked(overrides, expected):
    with pytest.raises(ValueError, match=f"rope_partial_factor.*{expected}"):
        get_config("glm4moe-tiny", **overrides)


def test_glm_preset_is_deepseek_routing_on_gqa_with_half_rope():
    config = get_config("glm4moe-tiny")
    assert config.rotary_dim * 2 == config.head_dim == 2 * config.hidden_size // config.num_attention_heads
    assert (config.attention_type, config.attention_bias, config.router, config.router_score) == (
        "mha",
        True,
        "deepseek",
        "sigmoid",
    )
    assert config.dense_layers == [0] and config.moe_layer_ids == [1]
    model = MoEForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == parameter_counts(config)["total"]
    assert isinstance(model.routers()[0], DeepSeekRouter) and model.routers()[0].balancing == "bias"
    assert all(layer.self_attn.partial_rope for layer in model.model.layers)


# ------------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_to_ours_logits_match(hf_checkpoints, case):
    hf_model, directory = hf_checkpoints[case]
    ours = from_hf(directory)
    assert [layer.is_moe for layer in ours.model.layers] == EXPECTED_MOE_LAYERS[case]
    assert isinstance(ours.routers()[0], DeepSeekRouter)
    assert ours.config.rotary_dim == int(16 * HF_CASES[case]["partial_rotary_factor"])
    input_ids, attention_mask = make_inputs()
    assert_same_logits(logits(ours, input_ids), logits(hf_model, input_ids))
    keep = attention_mask.bool()
    torch.testing.assert_close(
        logits(ours, input_ids, attention_mask)[keep],
        logits(hf_model, input_ids, attention_mask)[keep],
        atol=ATOL,
        rtol=0,
    )


def test_the_mtp_layer_is_skipped_as_transformers_skips_it(hf_checkpoints, tmp_path):
    """The "full" checkpoint holds a multi-token-prediction layer after its 3 decoder layers: read as transformers
    reads it (not at all), never written back, and nothing beyond it is dropped silently."""
    _, directory = hf_checkpoints["full"]
    ours = from_hf(directory)
    assert ours.config.hf_origin["config"]["num_nextn_predict_layers"] == 1
    to_hf(ours, tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written.get("num_nextn_predict_layers", written.get("num_mtp_layers")) == 0
    assert not any(
        name.startswith("model.layers.3.") for name in load_file(tmp_path / "hf" / "model.safetensors")
    )
    # a weight past the MTP layers has no place: refused, as before
    stray = tmp_path / "stray"
    stray.mkdir()
    for file in directory.iterdir():
        (stray / file.name).write_bytes(file.read_bytes())
    tensors = load_file(stray / "model.safetensors")
    tensors["model.layers.4.eh_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(stray / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match="model.layers.4.eh_proj.weight"):
        from_hf(stray)


def test_training_forward_matches_hf(hf_checkpoints):
    """In train mode (dropout 0) with gradients on: the same logits, and our loss's LM part is HF's loss."""
    hf_model, directory = hf_checkpoints["air"]
    ours = from_hf(directory).train()
    hf_model.train()
    try:
        input_ids, _ = make_inputs()
        out, hf_out = ours(input_ids, labels=input_ids), hf_model(input_ids, labels=input_ids)
        assert_same_logits(out.logits.float().detach(), hf_out.logits.float().detach())
        torch.testing.assert_close(out.lm_loss, hf_out.loss, atol=ATOL, rtol=0)
        out.loss.backward()
        assert ours.model.layers[1].self_attn.q_proj.bias.grad.abs().sum() > 0
        assert ours.model.layers[1].mlp.experts.up_proj.grad.abs().sum() > 0
    finally:
        hf_model.eval()


@pytest.mark.parametrize("case", ["air", "full"])
def test_cached_generation_matches_hf_and_uncached_logits(hf_checkpoints, case):
    hf_model, directory = hf_checkpoints[case]
    ours = from_hf(directory)
    prompt, _ = make_inputs(length=10)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ours_tokens = ours.generate(prompt, **kwargs)
        hf_tokens = hf_model.generate(prompt, **kwargs)
    assert torch.equal(ours_tokens, hf_tokens)
    with torch.no_grad():  # step by step through our cache: each step's logits equal the uncached forward
        full = ours(ours_tokens, use_cache=False).logits
        out = ours(ours_tokens[:, :10], use_cache=True)
        for s in range(10, ours_tokens.shape[1]):
            out = ours(ours_tokens[:, s : s + 1], cache=out.cache)
            torch.testing.assert_close(out.logits[:, -1], full[:, s], atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", list(HF_CASES))
def test_ours_to_hf_logits_match_and_the_config_round_trips(hf_checkpoints, case, tmp_path):
    _, directory = hf_checkpoints[case]
    ours = from_hf(directory)
    randomize_(ours, seed=7)  # weights that never came from HF: the way back must carry them
    randomize_bias_(ours, seed=8)
    to_hf(ours, tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(reloaded).__name__ == "Glm4MoeForCausalLM"
    input_ids, _ = make_inputs()
    assert_same_logits(logits(reloaded, input_ids), logits(ours, input_ids))
    # HF -> ours -> HF: the same config (but the MTP layers, which are not written)
    to_hf(from_hf(directory), tmp_path / "back")
    skip = ("transformers_version", "_name_or_path", "num_nextn_predict_layers", "num_mtp_layers")
    before = {k: v for k, v in Glm4MoeConfig.from_pretrained(directory).to_dict().items() if k not in skip}
    after = {
        k: v for k, v in Glm4MoeConfig.from_pretrained(tmp_path / "back").to_dict().items() if k not in skip
    }
    assert before == after


def test_native_preset_exports_as_glm4_moe(tmp_path):
    torch.manual_seed(0)
    ours = MoEForCausalLM(get_config("glm4moe-tiny", num_experts=8, vocab_size=128)).eval()
    randomize_(ours)
    randomize_bias_(ours)
    to_hf(ours, tmp_path / "hf", architecture="glm4_moe")
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    input_ids, _ = make_inputs()
    assert_same_logits(logits(hf_model, input_ids), logits(ours, input_ids))
    assert_same_logits(logits(from_hf(tmp_path / "hf"), input_ids), logits(ours, input_ids))


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_type='dynamic'"),
        (dict(partial_rotary_factor=0.3125), "= 5 dims"),  # int(16 * 0.3125) = 5: odd
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(n_shared_experts=0), "n_shared_experts=0"),
        (dict(n_group=3, topk_group=1), "n_group=3"),
        (dict(quantization_config={"quant_method": "fp8"}), "quant_method='fp8'"),
    ],
)
def test_inexpressible_glm_configs_are_refused_before_any_weight(tmp_path, overrides, expected):
    config = hf_config("air", **overrides)
    config.save_pretrained(tmp_path)  # no weights at all: the refusal comes first
    with pytest.raises(ConversionError, match=expected):
        from_hf(tmp_path)


@pytest.mark.parametrize(
    ("preset", "overrides", "arch", "expected"),
    [
        ("glm4moe-tiny", {}, "mixtral", ["rope_partial_factor=0.5", "router='deepseek'"]),
        ("glm4moe-tiny", {}, "deepseek_v3", ["attention_type='mha'"]),
        ("deepseek-tiny", {}, "glm4_moe", ["attention_type='mla'"]),
        ("glm4moe-tiny", dict(qk_norm=True), "glm4_moe", ["qk_norm_per_head=False"]),
        ("glm4moe-tiny", dict(shared_expert_gate=True), "glm4_moe", ["shared_expert_gate=True"]),
        ("glm4moe-tiny", dict(dense_layers=[1], num_hidden_layers=3), "glm4_moe", ["dense layers"]),
        ("qwen3-tiny", {}, "glm4_moe", ["router='topk'"]),
    ],
)
def test_native_configs_glm_cannot_express_are_refused(preset, overrides, arch, expected, tmp_path):
    with pytest.raises(ConversionError) as err:
        to_hf(MoEForCausalLM(get_config(preset, **overrides)), tmp_path / "out", architecture=arch)
    for text in expected:
        assert text in str(err.value)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ lifecycle
def test_lifecycle_on_the_tiny_preset(tmp_path):
    run_lifecycle("glm4moe-tiny", tmp_path, tmp_path / "data")


def test_gguf_export_accepts_the_glm_checkpoint_the_lab_writes(tmp_path):
    """GGUF: the config.json `to_hf` writes is one llama.cpp's 'glm4moe' layout runs as written (no refusal);
    the whole export, read back against llama.cpp's layout, is in tests/test_gguf_families.py."""
    from moe_core.inference.gguf_export import layout_for, read_config, refusals

    torch.manual_seed(0)
    to_hf(MoEForCausalLM(get_config("glm4moe-tiny")), tmp_path / "hf", architecture="glm4_moe")
    cfg = read_config(tmp_path / "hf")
    assert layout_for(cfg["model_type"]).arch_name == "glm4moe"
    assert refusals(cfg, layout_for(cfg["model_type"])) == []


# ------------------------------------------------------------------------------------------------ published
def test_air_stand_in_with_its_moe_layer_loads_with_transformers_logits(tmp_path):
    """GLM-4.5-Air's published config shrunk (`tiny_overrides`: head_dim still != hidden / heads) to its dense first
    layer and one MoE layer: transformers and `moe_core.load` give the same logits."""
    from moe_core.published import PUBLISHED, build_published

    directory = build_published(
        "glm-4.5-air",
        layers=2,
        overrides=PUBLISHED["glm-4.5-air"].tiny_overrides,
        cache_dir=tmp_path,
        tokenizer_vocab=300,
    )
    hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    loaded = moe_core.load(directory, dtype="float32")
    config = loaded.model.config
    assert loaded.kind == "hf" and config.moe_layer_ids == [1] and config.rotary_dim == 16
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(loaded.model, ids), logits(hf_model, ids), atol=1e-5, rtol=1e-5)
