"""gpt-oss (transformers ``models/gpt_oss``) as a first-class family: attention sinks, alternating sliding-window
and full attention, biased router (top-k of the logits, softmax over those) and biased experts with the clamped
SwiGLU, YaRN RoPE, MXFP4 experts dequantized on load.

Held against transformers' own ``GptOssForCausalLM`` on tiny configs: logits within 1e-5 in fp32 both ways, in a
training forward and in greedy generation with a KV cache (past the sliding window, so the window matters).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from moe_core import MoEForCausalLM, get_config
from moe_core.config import MoEConfig, parameter_counts
from moe_core.convert import ConversionError, dequantize_mxfp4, from_hf, to_hf
from moe_core.experts import clamped_swiglu
from moe_core.model import RotaryEmbedding
from tests.arch_lifecycle import run_lifecycle
from tests.helpers import randomize_

ATOL = 1e-5
YARN = dict(factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=16)
HF_TINY = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=32,  # (MXFP4 blocks hold 32 input features)
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=6,
    num_experts_per_tok=2,
    sliding_window=5,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    max_position_embeddings=64,
    rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, **YARN},
    swiglu_limit=1.5,  # small, so the clamp is active at this weight scale
)


def logits(model, input_ids, attention_mask=None) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids, attention_mask=attention_mask).logits.float()


def assert_same_logits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.std() > 0.3, "logits too small for the comparison to mean anything"
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def input_ids(vocab=128, seed=1, length=14) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def hf_gptoss(tmp_path_factory):
    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**HF_TINY)).eval()
    randomize_(model)
    directory = tmp_path_factory.mktemp("gptoss")
    model.save_pretrained(directory)
    return model, directory


# ------------------------------------------------------------------------------------------------ the pieces
@pytest.mark.parametrize(
    "extra",
    [{}, {"truncate": True}, {"mscale": 1.0, "mscale_all_dim": 0.707}, {"attention_factor": 1.2}],
    ids=["gpt-oss", "truncated", "deepseek-mscale", "explicit-factor"],
)
def test_yarn_frequencies_and_attention_factor_equal_transformers(extra):
    yarn = {**YARN, "factor": 32.0, "original_max_position_embeddings": 4096, **extra}
    hf_config = GptOssConfig(
        head_dim=64, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, **yarn}
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    ours = RotaryEmbedding(64, 150000.0, yarn)
    torch.testing.assert_close(ours.inv_freq, inv_freq, atol=0, rtol=0)
    assert ours.attention_factor == pytest.approx(attention_factor, rel=1e-12)
    assert not torch.equal(inv_freq, RotaryEmbedding(64, 150000.0).inv_freq)  # YaRN moved something
    # cos / sin carry the attention factor
    cos, _ = ours(torch.zeros(1), torch.zeros(1, 1, dtype=torch.long))
    assert cos.max().item() == pytest.approx(attention_factor)


def test_yarn_config_is_checked():
    with pytest.raises(ValueError, match="rope_yarn"):
        MoEConfig(rope_yarn={"factor": 4.0})  # no original_max_position_embeddings
    with pytest.raises(ValueError, match="rope_yarn"):
        MoEConfig(rope_yarn={"factor": 4.0, "original_max_position_embeddings": 16, "mscale_al_dim": 1})


def test_clamped_swiglu_is_gpt_oss_gate():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(GptOssConfig(**HF_TINY))
    gate_up = torch.randn(10, 64) * 4
    expected = experts._apply_gate(gate_up)
    torch.testing.assert_close(clamped_swiglu(gate_up[:, ::2], gate_up[:, 1::2], 1.5, 1.702), expected)
    assert (gate_up.abs() > 1.5).any()  # the clamp mattered


def test_mxfp4_dequantizer_equals_transformers():
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(120, 134, (3, 10, 2), generator=generator, dtype=torch.uint8)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == (3, 64, 10) and ours.dtype == torch.bfloat16
    assert torch.equal(ours, expected)
    with pytest.raises(ConversionError, match="scales"):
        dequantize_mxfp4(blocks, scales[:, :5])


def test_gptoss_preset_and_parameter_counts():
    config = get_config("gptoss-small")
    assert config.attention_window_layers == [0, 2] and config.attention_window == 128
    model = MoEForCausalLM(get_config("gptoss-tiny"))
    assert parameter_counts(model.config)["total"] == sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match="swiglu_limit"):
        MoEConfig(swiglu_limit=-1.0)


def test_reference_and_sorted_expert_paths_agree_forward_and_backward():
    torch.manual_seed(0)
    model = MoEForCausalLM(get_config("gptoss-tiny", num_hidden_layers=1)).train()
    randomize_(model)
    ids = input_ids(vocab=512)
    grads = {}
    for impl in ("reference", "sorted"):
        model.zero_grad()
        out = model(ids, labels=ids, expert_impl=impl)
        out.loss.backward()
        grads[impl] = (out.loss.detach(), model.model.layers[0].mlp.experts.up_proj_bias.grad.clone())
    torch.testing.assert_close(grads["reference"][0], grads["sorted"][0])
    torch.testing.assert_close(grads["reference"][1], grads["sorted"][1])
    assert grads["sorted"][1].abs().sum() > 0


# ------------------------------------------------------------------------------------------------ parity
def test_hf_to_ours_logits_match(hf_gptoss):
    hf_model, directory = hf_gptoss
    ours = from_hf(directory)
    config = ours.config
    assert config.attention_window == 5 and config.attention_window_layers == [0, 2]
    assert config.rope_yarn["factor"] == 4.0 and config.attention_sinks and config.expert_bias
    ids = input_ids()  # 14 tokens: past the window of 5
    assert_same_logits(logits(ours, ids), logits(hf_model, ids))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    keep = mask.bool()
    torch.testing.assert_close(
        logits(ours, ids, mask)[keep], logits(hf_model, ids, mask)[keep], atol=ATOL, rtol=0
    )


def test_window_and_sinks_matter(hf_gptoss):
    """The comparison above can fail: without the window, or without the sinks, the logits move."""
    _, directory = hf_gptoss
    ours = from_hf(directory)
    ids = input_ids()
    reference = logits(ours, ids)
    for layer in ours.model.layers:
        layer.self_attn.window = None
    assert (logits(ours, ids) - reference).abs().max() > 1e-3
    ours = from_hf(directory)
    with torch.no_grad():
        for layer in ours.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    assert (logits(ours, ids) - reference).abs().max() > 1e-3


def test_training_forward_matches_hf(hf_gptoss):
    hf_model, directory = hf_gptoss
    ours = from_hf(directory).train()
    hf_model.train()
    try:
        ids = input_ids()
        out, theirs = ours(ids, labels=ids), hf_model(ids, labels=ids)
        torch.testing.assert_close(out.lm_loss, theirs.loss, atol=ATOL, rtol=0)
        out.loss.backward()
        layer = ours.model.layers[0]
        for grad in (
            layer.self_attn.sinks.grad,
            layer.mlp.router.gate.bias.grad,
            layer.mlp.experts.down_proj_bias.grad,
        ):
            assert grad is not None and grad.abs().sum() > 0
    finally:
        hf_model.eval()


def test_cached_generation_matches_hf_past_the_window(hf_gptoss):
    hf_model, directory = hf_gptoss
    ours = from_hf(directory)
    ids = input_ids()[:1, :4]
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)  # 14 tokens: the window of 5 slides
    ours_out = ours.generate(ids, **kwargs)
    assert torch.equal(ours_out, hf_model.generate(ids, **kwargs))
    with torch.no_grad():
        full = ours(ours_out, use_cache=False).logits
        step = ours(ours_out[:, :-3], use_cache=True)
        cache = step.cache
        for t in range(3, 0, -1):
            last = ours(ours_out[:, -t : ours_out.shape[1] - t + 1], cache=cache, use_cache=True).logits
    torch.testing.assert_close(last[:, -1], full[:, -1], atol=ATOL, rtol=0)


def test_ours_to_hf_and_round_trip(hf_gptoss, tmp_path):
    _, directory = hf_gptoss
    ours = from_hf(directory)
    randomize_(ours, seed=7)
    to_hf(ours, tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(reloaded).__name__ == "GptOssForCausalLM"
    ids = input_ids()
    assert_same_logits(logits(reloaded, ids), logits(ours, ids))
    # HF -> ours -> HF: the same tensors, bit for bit, in the fused layout
    to_hf(from_hf(directory), tmp_path / "back")
    before, after = (
        load_file(directory / "model.safetensors"),
        load_file(tmp_path / "back" / "model.safetensors"),
    )
    assert sorted(before) == sorted(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name


def test_native_preset_exports_as_gpt_oss(tmp_path):
    torch.manual_seed(0)
    config = get_config("gptoss-tiny", num_experts=8, vocab_size=128, attention_window=6, swiglu_limit=2.0)
    ours = MoEForCausalLM(config).eval()
    randomize_(ours)
    to_hf(ours, tmp_path / "hf", architecture="gpt_oss")
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = input_ids()
    assert_same_logits(logits(hf_model, ids), logits(ours, ids))
    assert_same_logits(logits(from_hf(tmp_path / "hf"), ids), logits(ours, ids))


def test_mxfp4_checkpoint_is_dequantized_on_load(hf_gptoss, tmp_path):
    """A checkpoint with MXFP4 experts (as published: ``*_blocks`` / ``*_scales``) loads as its dequantized
    values: the same model as the bf16 checkpoint holding transformers' dequantization of those blocks."""
    hf_model, directory = hf_gptoss
    tensors = load_file(directory / "model.safetensors")
    generator = torch.Generator().manual_seed(3)
    F, D = HF_TINY["intermediate_size"], HF_TINY["hidden_size"]
    dense = dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = 2 * F if name.endswith("gate_up_proj") else D  # MXFP4 rows are the output features
        cols = D if name.endswith("gate_up_proj") else F
        E = tensors[name].shape[0]
        blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=generator, dtype=torch.uint8)
        scales = torch.randint(120, 128, blocks.shape[:-1], generator=generator, dtype=torch.uint8)
        del tensors[name]
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    (tmp_path / "q").mkdir()
    (tmp_path / "d").mkdir()
    for sub, data in (("q", tensors), ("d", dense)):
        save_file(data, tmp_path / sub / "model.safetensors")
        (tmp_path / sub / "config.json").write_text((directory / "config.json").read_text())
    assert hf_model is not None
    ids = input_ids()
    quantized, reference = from_hf(tmp_path / "q", dtype="float32"), from_hf(tmp_path / "d", dtype="float32")
    torch.testing.assert_close(logits(quantized, ids), logits(reference, ids), atol=0, rtol=0)


# ------------------------------------------------------------------------------------------------ refusals
def test_inexpressible_gptoss_configs_are_refused_before_weights(tmp_path):
    config = GptOssConfig(
        **{**HF_TINY, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}
    )
    config.save_pretrained(tmp_path)
    with pytest.raises(ConversionError, match="rope_type=.linear."):
        from_hf(tmp_path)


@pytest.mark.parametrize(
    ("preset", "arch", "expected"),
    [
        ("gptoss-tiny", "mixtral", "attention_sinks=True"),
        ("gptoss-tiny", "qwen3_moe", "rope_yarn"),
        ("mixtral-tiny", "gpt_oss", "attention_sinks=False"),
    ],
)
def test_ours_that_the_target_cannot_express_is_refused(preset, arch, expected, tmp_path):
    with pytest.raises(ConversionError, match=expected):
        to_hf(MoEForCausalLM(get_config(preset)), tmp_path / "out", architecture=arch)


# ------------------------------------------------------------------------------------------------ lifecycle
def test_lifecycle_on_the_tiny_preset(tmp_path, one_thread):
    run_lifecycle("gptoss-tiny", tmp_path, tmp_path / "data", attention_window=8)


def test_gguf_export_takes_the_lab_checkpoint_and_refuses_a_clamp_llama_cpp_hard_codes(tmp_path):
    """GGUF (llama.cpp's 'gpt-oss' layout; the whole export read back: tests/test_gguf_families.py; ONNX export:
    tests/test_arch_gptoss_fast.py): the config.json `to_hf` writes is accepted as it is; a clamped SwiGLU other
    than gpt-oss's limit 7, which the lab trains and transformers runs, is refused before any weight is read,
    as llama.cpp hard-codes the limit."""
    from moe_core.inference.gguf_export import GGUFExportError, export_gguf, layout_for, read_config, refusals

    to_hf(MoEForCausalLM(get_config("gptoss-tiny")), tmp_path / "hf", architecture="gpt_oss")
    cfg = read_config(tmp_path / "hf")
    assert layout_for("gpt_oss").arch_name == "gpt-oss" and refusals(cfg, layout_for("gpt_oss")) == []
    to_hf(
        MoEForCausalLM(get_config("gptoss-tiny", swiglu_limit=5.0)), tmp_path / "hf5", architecture="gpt_oss"
    )
    with pytest.raises(GGUFExportError, match="swiglu_limit=5.0"):
        export_gguf(tmp_path / "hf5", tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()
