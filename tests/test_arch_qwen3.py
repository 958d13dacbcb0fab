"""Qwen3-MoE (transformers ``models/qwen3_moe``) as a first-class family: per-head q/k RMSNorm, 128 experts
top-8 without a shared expert, ``norm_topk_prob``, ``decoder_sparse_step`` / ``mlp_only_layers``.

Held against transformers' own ``Qwen3MoeForCausalLM`` on tiny configs: logits within 1e-5 in fp32 both ways,
in a training forward (gradients flow, same loss) and in greedy generation with a KV cache.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from moe_core import MoEForCausalLM, get_config
from moe_core.config import MoEConfig, parameter_counts
from moe_core.convert import ConversionError, from_hf, to_hf
from tests.arch_lifecycle import run_lifecycle
from tests.helpers import randomize_

ATOL = 1e-5
HF_TINY = dict(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # != hidden / heads, as Qwen3-30B-A3B (128 vs 64)
    max_position_embeddings=64,
    num_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=24,
    intermediate_size=40,
    mlp_only_layers=[1],
    norm_topk_prob=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    router_aux_loss_coef=0.001,
)


def logits(model, input_ids, attention_mask=None) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids, attention_mask=attention_mask).logits.float()


def assert_same_logits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.std() > 0.3, "logits too small for the comparison to mean anything"
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def input_ids(vocab=128, seed=1) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def hf_qwen3(tmp_path_factory):
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**HF_TINY)).eval()
    randomize_(model)
    directory = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(directory)
    return model, directory


# ------------------------------------------------------------------------------------------------ the pieces
def test_per_head_qk_norm_normalizes_each_head_and_needs_qk_norm():
    config = get_config("qwen3-tiny")
    assert config.qk_norm and config.qk_norm_per_head
    attn = MoEForCausalLM(config).model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (config.head_dim,)
    assert attn.k_norm.weight.shape == (config.head_dim,)
    # OLMoE's qk-norm is unchanged: one weight over the whole projection
    olmoe = MoEForCausalLM(get_config("olmoe-tiny")).model.layers[0].self_attn
    assert olmoe.q_norm.weight.shape == (get_config("olmoe-tiny").hidden_size,)
    with pytest.raises(ValueError, match="qk_norm_per_head"):
        MoEConfig(qk_norm=False, qk_norm_per_head=True)


def test_parameter_counts_match_the_built_model():
    config = get_config("qwen3-tiny")
    model = MoEForCausalLM(config)
    assert parameter_counts(config)["total"] == sum(p.numel() for p in model.parameters())


def test_qwen3_preset_is_128_experts_top8_renormalized_without_shared_expert():
    config = get_config("qwen3-tiny")
    assert (config.num_experts, config.num_experts_per_tok) == (128, 8)
    assert config.norm_topk_prob and config.num_shared_experts == 0


# ------------------------------------------------------------------------------------------------ parity
def test_hf_to_ours_logits_match(hf_qwen3):
    hf_model, directory = hf_qwen3
    ours = from_hf(directory)
    assert [layer.is_moe for layer in ours.model.layers] == [True, False, True]
    assert ours.config.head_dim == 16 and ours.config.qk_norm_per_head
    ids = input_ids()
    assert_same_logits(logits(ours, ids), logits(hf_model, ids))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    keep = mask.bool()
    torch.testing.assert_close(
        logits(ours, ids, mask)[keep], logits(hf_model, ids, mask)[keep], atol=ATOL, rtol=0
    )


def test_training_forward_matches_hf(hf_qwen3):
    """Train mode, labels given: the LM loss equals HF's and gradients reach every expert weight."""
    hf_model, directory = hf_qwen3
    ours = from_hf(directory).train()
    hf_model = hf_model.train()
    try:
        ids = input_ids()
        out = ours(ids, labels=ids)
        theirs = hf_model(ids, labels=ids)
        torch.testing.assert_close(out.lm_loss, theirs.loss, atol=ATOL, rtol=0)
        torch.testing.assert_close(out.logits, theirs.logits, atol=ATOL, rtol=0)
        out.loss.backward()
        grad = ours.model.layers[0].mlp.experts.gate_proj.grad
        assert grad is not None and grad.abs().sum() > 0
        assert ours.model.layers[0].self_attn.q_norm.weight.grad.abs().sum() > 0
    finally:
        hf_model.eval()


def test_cached_generation_matches_hf(hf_qwen3):
    hf_model, directory = hf_qwen3
    ours = from_hf(directory)
    ids = input_ids()[:1, :6]
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    ours_out = ours.generate(ids, **kwargs)
    hf_out = hf_model.generate(ids, **kwargs)
    assert torch.equal(ours_out, hf_out)
    # and the cached logits equal the uncached ones
    with torch.no_grad():
        full = ours(ours_out, use_cache=False).logits
        step = ours(ours_out[:, :-1], use_cache=True)
        last = ours(ours_out[:, -1:], cache=step.cache, use_cache=True).logits
    torch.testing.assert_close(last[:, -1], full[:, -1], atol=ATOL, rtol=0)


def test_ours_to_hf_and_round_trip(hf_qwen3, tmp_path):
    _, directory = hf_qwen3
    ours = from_hf(directory)
    randomize_(ours, seed=7)
    to_hf(ours, tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(reloaded).__name__ == "Qwen3MoeForCausalLM"
    ids = input_ids()
    assert_same_logits(logits(reloaded, ids), logits(ours, ids))
    # HF -> ours -> HF: the same config.json fields
    to_hf(from_hf(directory), tmp_path / "back")
    keep = lambda d: {k: v for k, v in d.items() if k not in ("transformers_version", "_name_or_path")}  # noqa: E731
    before = keep(AutoModelForCausalLM.from_pretrained(directory).config.to_dict())
    after = keep(AutoModelForCausalLM.from_pretrained(tmp_path / "back").config.to_dict())
    assert before == after


def test_native_preset_exports_as_qwen3_moe(tmp_path):
    torch.manual_seed(0)
    ours = MoEForCausalLM(get_config("qwen3-tiny", num_experts=16, vocab_size=128)).eval()
    randomize_(ours)
    to_hf(ours, tmp_path / "hf", architecture="qwen3_moe")
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = input_ids()
    assert_same_logits(logits(hf_model, ids), logits(ours, ids))
    assert_same_logits(logits(from_hf(tmp_path / "hf"), ids), logits(ours, ids))


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ({"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window=True"),
        ({"attention_bias": True}, "attention_bias=True"),
    ],
)
def test_inexpressible_qwen3_configs_are_refused_before_weights(tmp_path, override, expected):
    config = Qwen3MoeConfig(**{**HF_TINY, **override})
    config.save_pretrained(tmp_path)  # no weights at all: the refusal comes first
    with pytest.raises(ConversionError, match=expected):
        from_hf(tmp_path)


@pytest.mark.parametrize(
    ("preset", "expected"),
    [("olmoe-tiny", "Qwen3-MoE always normalizes q and k per head"), ("shared-tiny", "num_shared_experts=1")],
)
def test_ours_that_qwen3_cannot_express_is_refused(preset, expected, tmp_path):
    with pytest.raises(ConversionError, match=expected):
        to_hf(MoEForCausalLM(get_config(preset)), tmp_path / "out", architecture="qwen3_moe")
    with pytest.raises(ConversionError, match="OLMoE always normalizes the whole"):
        to_hf(MoEForCausalLM(get_config("qwen3-tiny")), tmp_path / "out2", architecture="olmoe")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ lifecycle
def test_lifecycle_on_the_tiny_preset(tmp_path, one_thread):
    run_lifecycle("qwen3-tiny", tmp_path, tmp_path / "data")


def test_onnx_export_validates(tmp_path):
    """ONNX export (torch.onnx dynamo) of qwen3-tiny: `export_onnx` itself checks every expert at several shapes
    and a cached step against PyTorch, and raises on any difference (per-head qk-norm is plain ops)."""
    from moe_core.inference.onnx_export import export_onnx

    torch.manual_seed(0)
    model = MoEForCausalLM(get_config("qwen3-tiny", num_experts=8, vocab_size=128)).eval()
    out = export_onnx(model, tmp_path / "onnx")
    assert (out / "model.onnx").is_file()
