"""Conversion to and from Hugging Face Mixtral, OLMoE and Qwen2-MoE: exact in both directions.

Tiny random HF models are built here and saved with save_pretrained (the hub is never reached). Weights are
re-drawn at a scale where logits are O(1) and norms are not all ones, so a wrong mapping (swapped w1/w3, a
misplaced q_norm, an expert out of order) moves the logits far beyond the 1e-5 tolerance.
"""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

from moe_core import MoEForCausalLM, get_config
from moe_core.cli import main
from moe_core.convert import ConversionError, from_hf, to_hf
from moe_core.fileio import atomic_directory
from moe_core.router_losses import load_balancing_loss
from tests.helpers import randomize_

ATOL = 1e-5
BASE = dict(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
HF_CASES = {
    # explicit head_dim != hidden/heads, a non-default aux coefficient
    "mixtral": (
        MixtralConfig,
        MixtralForCausalLM,
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=48,
            head_dim=16,
            router_aux_loss_coef=0.02,
        ),
    ),
    # qk-norm, clip_qkv active at this weight scale, K=3 (the coefficient does not round-trip exactly in floats)
    "olmoe": (
        OlmoeConfig,
        OlmoeForCausalLM,
        dict(
            num_experts=8,
            num_experts_per_tok=3,
            intermediate_size=48,
            clip_qkv=0.5,
            pad_token_id=0,
            eos_token_id=1,
        ),
    ),
    # dense layer in the middle (mlp_only_layers), renormalized top-k, q/k/v bias, gated shared expert
    "qwen2_moe": (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        dict(
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            intermediate_size=56,
            mlp_only_layers=[1],
            norm_topk_prob=True,
        ),
    ),
    # decoder_sparse_step=2 plus mlp_only_layers, tied embeddings, no q/k/v bias
    "qwen2_moe_sparse_step": (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        dict(
            num_hidden_layers=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=16,
            intermediate_size=40,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
            tie_word_embeddings=True,
            qkv_bias=False,
            rope_theta=1e6,
        ),
    ),
}
EXPECTED_MOE_LAYERS = {
    "mixtral": [True, True],
    "olmoe": [True, True],
    "qwen2_moe": [True, False, True],
    "qwen2_moe_sparse_step": [False, True, False, False],
}


def logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids, attention_mask=attention_mask).logits.float()


def make_inputs(vocab_size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (2, 12), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 8:] = 0  # right padding in the second row
    return input_ids, attention_mask


def assert_same_logits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.std() > 0.3, "logits too small for the comparison to mean anything"
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, object]]:
    """Each case: the HF model (eval) and the directory it was saved to, with two tokenizer files beside it."""
    built = {}
    for name, (config_cls, model_cls, overrides) in HF_CASES.items():
        torch.manual_seed(0)
        model = model_cls(config_cls(**{**BASE, **overrides})).eval()
        randomize_(model)
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(directory)
        (directory / "tokenizer.json").write_text('{"version": "1.0"}')
        (directory / "tokenizer_config.json").write_text('{"model_max_length": 64}')
        built[name] = (model, directory)
    return built


def hf_config_dict(directory) -> dict:
    data = AutoConfig.from_pretrained(directory).to_dict()
    data.pop("_name_or_path", None)
    data.pop("transformers_version", None)
    return data


def safetensors_dir(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


# ------------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_to_ours_logits_match(hf_checkpoints, case):
    hf_model, directory = hf_checkpoints[case]
    ours = from_hf(directory)
    assert [layer.is_moe for layer in ours.model.layers] == EXPECTED_MOE_LAYERS[case]
    input_ids, attention_mask = make_inputs(hf_model.config.vocab_size)
    assert_same_logits(logits(ours, input_ids), logits(hf_model, input_ids))
    # with padding, only the positions that are real tokens are defined the same way on both sides
    ours_masked, hf_masked = (
        logits(ours, input_ids, attention_mask),
        logits(hf_model, input_ids, attention_mask),
    )
    keep = attention_mask.bool()
    torch.testing.assert_close(ours_masked[keep], hf_masked[keep], atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", list(HF_CASES))
def test_transformers_5_fused_checkpoints_convert_the_same(hf_checkpoints, case, tmp_path):
    """transformers 5 holds experts fused ([E, 2F, D] gate_up_proj, [E, D, F] down_proj) and, by default, writes
    them back per expert (the hub layout, which the fixture's directory has); with save_original_format=False it
    writes them fused: both convert to the same model, with the HF model's logits."""
    hf_model, directory = hf_checkpoints[case]
    assert any(".experts.0." in name for name in safetensors_dir(directory))  # the default: per expert
    hf_model.save_pretrained(tmp_path / "fused", save_original_format=False)
    fused_names = safetensors_dir(tmp_path / "fused")
    first_moe = EXPECTED_MOE_LAYERS[case].index(True)
    assert f"model.layers.{first_moe}.mlp.experts.gate_up_proj" in fused_names
    assert not any(".experts.0." in name for name in fused_names)
    reference, ours = from_hf(directory), from_hf(tmp_path / "fused")
    for name, tensor in reference.state_dict().items():
        assert torch.equal(tensor, ours.state_dict()[name]), name
    input_ids, _ = make_inputs(hf_model.config.vocab_size)
    assert_same_logits(logits(ours, input_ids), logits(hf_model, input_ids))


@pytest.mark.parametrize("case", list(HF_CASES))
def test_ours_to_hf_logits_match(hf_checkpoints, case, tmp_path):
    _, directory = hf_checkpoints[case]
    ours = from_hf(directory)
    randomize_(
        ours, seed=7
    )  # weights that never came from HF: the way back must carry them, not the source's
    to_hf(ours, tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(reloaded).__name__ == HF_CASES[case][1].__name__
    input_ids, _ = make_inputs(ours.config.vocab_size)
    assert_same_logits(logits(reloaded, input_ids), logits(ours, input_ids))


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_ours_hf_round_trip_is_identical(hf_checkpoints, case, tmp_path):
    _, directory = hf_checkpoints[case]
    to_hf(from_hf(directory), tmp_path / "hf")
    before, after = safetensors_dir(directory), safetensors_dir(tmp_path / "hf")
    assert sorted(before) == sorted(after)
    for name in before:
        assert before[name].dtype == after[name].dtype and torch.equal(before[name], after[name]), name
    assert hf_config_dict(tmp_path / "hf") == hf_config_dict(directory)


@pytest.mark.parametrize(
    ("preset", "arch"), [("mixtral-tiny", "mixtral"), ("olmoe-tiny", "olmoe"), ("shared-tiny", "qwen2_moe")]
)
def test_native_presets_export_with_equal_logits(preset, arch, tmp_path):
    torch.manual_seed(0)
    ours = MoEForCausalLM(get_config(preset)).eval()
    randomize_(ours)
    to_hf(ours, tmp_path / "hf", architecture=arch)
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf_model.config.model_type == arch
    input_ids, _ = make_inputs(ours.config.vocab_size)
    assert_same_logits(logits(hf_model, input_ids), logits(ours, input_ids))
    # and back again: the same logits and the same architecture fields
    back = from_hf(tmp_path / "hf")
    assert_same_logits(logits(back, input_ids), logits(ours, input_ids))
    for field in (
        "num_experts",
        "num_experts_per_tok",
        "expert_intermediate_size",
        "qk_norm",
        "attention_bias",
        "norm_topk_prob",
        "num_shared_experts",
        "shared_expert_gate",
        "router_aux_loss_coef",
    ):
        assert getattr(back.config, field) == pytest.approx(getattr(ours.config, field)), field


def test_training_only_settings_that_do_not_carry_are_reported(tmp_path, caplog):
    ours = MoEForCausalLM(get_config("olmoe-tiny", router_z_loss_coef=0.001)).eval()
    with caplog.at_level(logging.WARNING, logger="moe_core.convert"):
        to_hf(ours, tmp_path / "hf", architecture="olmoe")
    assert "router_z_loss_coef" in caplog.text


# ------------------------------------------------------------------------------------------------ aux loss convention
def test_hf_load_balancing_loss_is_k_times_ours_and_the_coefficient_converts(hf_checkpoints):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(0)
    E, K = 8, 3
    logits_TE = torch.randn(50, E)
    expert_ids_TK = logits_TE.softmax(-1).topk(K, dim=-1).indices
    ours = load_balancing_loss(logits_TE.softmax(-1), expert_ids_TK)
    hf = load_balancing_loss_func((logits_TE,), num_experts=E, top_k=K)
    torch.testing.assert_close(hf, K * ours)

    for case in ("mixtral", "olmoe"):
        hf_model, directory = hf_checkpoints[case]
        k, coef = hf_model.config.num_experts_per_tok, hf_model.config.router_aux_loss_coef
        assert from_hf(directory).config.router_aux_loss_coef == pytest.approx(k * coef)


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    ("config", "arch", "expected"),
    [
        (get_config("mixtral-tiny", router="expert_choice"), "mixtral", ["router='expert_choice'"]),
        (get_config("mixtral-tiny", router="aux_free"), "olmoe", ["router='aux_free'", "qk_norm=False"]),
        (
            get_config("switch-tiny"),
            "mixtral",
            ["capacity_factor=1.25", "ffn_activation='gelu'", "renormalizes"],
        ),
        (get_config("olmoe-tiny"), "mixtral", ["qk_norm=True", "use olmoe"]),
        (get_config("shared-tiny"), "mixtral", ["num_shared_experts=1", "attention_bias=True"]),
        (get_config("shared-tiny"), "olmoe", ["num_shared_experts=1", "attention_bias=True"]),
        (get_config("mixtral-tiny"), "qwen2_moe", ["shared expert"]),
        (get_config("mixtral-tiny", moe_every_n=2), "mixtral", ["dense layers", "use qwen2_moe"]),
        (get_config("mixtral-tiny", router_score="sigmoid"), "mixtral", ["router_score='sigmoid'"]),
        (get_config("olmoe-tiny", head_dim=32), "olmoe", ["head_dim=32"]),
        (get_config("dense-tiny"), "mixtral", ["num_experts=0"]),
    ],
)
def test_inexpressible_configs_are_refused_with_every_reason(config, arch, expected, tmp_path):
    with pytest.raises(ConversionError) as err:
        to_hf(MoEForCausalLM(config), tmp_path / "out", architecture=arch)
    for text in expected:
        assert text in str(err.value)
    assert not (tmp_path / "out").exists()


def test_native_model_needs_a_named_architecture(tmp_path):
    with pytest.raises(ConversionError, match="name the target architecture"):
        to_hf(MoEForCausalLM(get_config("mixtral-tiny")), tmp_path / "out")
    with pytest.raises(ConversionError, match="supported: mixtral"):
        to_hf(MoEForCausalLM(get_config("mixtral-tiny")), tmp_path / "out", architecture="dbrx")


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (
            MixtralConfig(**BASE, num_local_experts=4, intermediate_size=48, sliding_window=16),
            "sliding_window=16",
        ),
        (
            MixtralConfig(**BASE, num_local_experts=4, intermediate_size=48, hidden_act="gelu"),
            "hidden_act='gelu'",
        ),
        (
            OlmoeConfig(**BASE, num_experts=4, intermediate_size=48, attention_bias=True, pad_token_id=0),
            "o_proj",
        ),
        (
            Qwen2MoeConfig(**BASE, num_experts=4, rope_scaling={"rope_type": "linear", "factor": 2.0}),
            "rope_scaling",
        ),
        (
            Qwen2MoeConfig(**BASE, num_experts=4, use_sliding_window=True, sliding_window=8),
            "use_sliding_window",
        ),
    ],
)
def test_inexpressible_hf_sources_are_refused(config, expected, tmp_path):
    config.save_pretrained(tmp_path)
    with pytest.raises(ConversionError, match=expected):
        from_hf(tmp_path)


def test_unsupported_source_architecture_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    with pytest.raises(
        ConversionError, match="'llama' is not supported; supported: mixtral.*olmoe.*qwen2_moe"
    ):
        from_hf(tmp_path)


def test_weights_the_config_does_not_place_are_refused(hf_checkpoints, tmp_path):
    from safetensors.torch import save_file

    _, directory = hf_checkpoints["mixtral"]
    tensors = load_file(directory / "model.safetensors")
    tensors["model.layers.0.block_sparse_moe.experts.4.w1.weight"] = torch.zeros(48, 32)  # a 5th expert
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    with pytest.raises(ConversionError, match="no place in the converted model"):
        from_hf(tmp_path)


# ------------------------------------------------------------------------------------------------ files and formats
def test_sharded_safetensors_and_weights_only_bin_load_the_same(hf_checkpoints, tmp_path):
    hf_model, directory = hf_checkpoints["qwen2_moe"]
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    # transformers 5 writes safetensors only: an older checkpoint's pytorch_model.bin, written as 4.x did
    (tmp_path / "bin").mkdir()
    torch.save(load_file(directory / "model.safetensors"), tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "config.json").write_text((directory / "config.json").read_text())
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    reference = from_hf(directory).state_dict()
    for source in ("sharded", "bin"):
        loaded = from_hf(tmp_path / source).state_dict()
        assert all(torch.equal(reference[k], loaded[k]) for k in reference), source


def test_to_hf_writes_sharded_checkpoints_with_an_index(hf_checkpoints, tmp_path):
    hf_model, directory = hf_checkpoints["mixtral"]
    to_hf(from_hf(directory), tmp_path / "hf", max_shard_size=32 * 1024)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    input_ids, _ = make_inputs(hf_model.config.vocab_size)
    assert_same_logits(logits(reloaded, input_ids), logits(hf_model, input_ids))


def test_dtype_is_chosen_on_load_and_kept_on_export(hf_checkpoints, tmp_path):
    _, directory = hf_checkpoints["olmoe"]
    ours = from_hf(directory, dtype="bfloat16")
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    to_hf(ours, tmp_path / "hf")
    assert {t.dtype for t in safetensors_dir(tmp_path / "hf").values()} == {torch.bfloat16}
    assert AutoConfig.from_pretrained(tmp_path / "hf").dtype == torch.bfloat16
    assert from_hf(tmp_path / "hf").dtype == torch.bfloat16  # default: the checkpoint's own dtype


def test_converted_model_saves_and_loads_as_our_own_checkpoint(hf_checkpoints, tmp_path):
    hf_model, directory = hf_checkpoints["qwen2_moe_sparse_step"]
    ours = from_hf(directory)
    ours.save_pretrained(tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == "moe_lab"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert isinstance(reloaded, MoEForCausalLM)
    assert reloaded.config.hf_origin == ours.config.hf_origin
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight  # tied embeddings survive
    input_ids, _ = make_inputs(hf_model.config.vocab_size)
    assert_same_logits(logits(reloaded, input_ids), logits(hf_model, input_ids))
    to_hf(reloaded, tmp_path / "hf")  # hf_origin still knows where it came from
    assert hf_config_dict(tmp_path / "hf") == hf_config_dict(directory)


def test_output_is_atomic_and_never_overwritten_by_accident(hf_checkpoints, tmp_path, monkeypatch):
    _, directory = hf_checkpoints["mixtral"]
    ours = from_hf(directory)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(ConversionError, match="not empty"):
        to_hf(ours, out)
    assert (out / "keep.txt").read_text() == "user data"
    to_hf(ours, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("moe_core.convert._write_safetensors", fail)
    with pytest.raises(OSError):
        to_hf(ours, tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary directories left behind

    with pytest.raises(RuntimeError), atomic_directory(out, overwrite=True) as tmp:
        (tmp / "partial").write_text("half")
        raise RuntimeError("interrupted")
    assert (out / "model.safetensors").is_file()  # the previous complete output is untouched


# ------------------------------------------------------------------------------------------------ hub ids
def test_offline_hub_id_fails_fast_with_a_clear_message(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(ConversionError, match="could not be fetched.*HF_HUB_OFFLINE"):
        from_hf("open-moe-lab-tests/no-such-model-xyz")
    assert time.monotonic() - start < 10


def test_hub_id_downloads_only_config_weights_and_tokenizer(hf_checkpoints, monkeypatch):
    from moe_core import convert

    _, directory = hf_checkpoints["olmoe"]
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(directory)

    monkeypatch.setattr(convert, "snapshot_download", fake_snapshot_download)
    model = from_hf("allenai/OLMoE-tiny-test")
    assert model.config.hf_origin["model_type"] == "olmoe"
    ((repo_id, kwargs),) = calls
    patterns = kwargs["allow_patterns"]
    assert repo_id == "allenai/OLMoE-tiny-test"
    assert {"config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json"} <= set(patterns)
    assert not any(p.endswith(".bin") or p.endswith(".pt") for p in patterns)  # nothing to unpickle


def test_a_path_that_is_neither_directory_nor_hub_id_is_refused(tmp_path):
    with pytest.raises(ConversionError, match="no such directory, and not a Hugging Face hub id"):
        from_hf(str(tmp_path / "missing" / "deeper" / "dir"))


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_round_trip_copies_tokenizer_files(hf_checkpoints, tmp_path, capsys):
    _, directory = hf_checkpoints["qwen2_moe"]
    assert main(["convert", "from-hf", str(directory), "--out", str(tmp_path / "ours")]) == 0
    assert (tmp_path / "ours" / "tokenizer.json").is_file()
    assert main(["convert", "to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer_config.json").read_text() == '{"model_max_length": 64}'
    before, after = safetensors_dir(directory), safetensors_dir(tmp_path / "hf")
    assert sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    assert hf_config_dict(tmp_path / "hf") == hf_config_dict(directory)
    assert "wrote" in capsys.readouterr().out


def test_cli_bad_sources_exit_non_zero_with_a_message(hf_checkpoints, tmp_path, capsys):
    assert main(["convert", "from-hf", str(tmp_path / "missing"), "--out", str(tmp_path / "a")]) != 0
    assert "moe-lab convert: error:" in capsys.readouterr().err
    _, directory = hf_checkpoints["mixtral"]
    assert main(["convert", "to-hf", str(directory), "--out", str(tmp_path / "b")]) != 0
    assert "from-hf" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
