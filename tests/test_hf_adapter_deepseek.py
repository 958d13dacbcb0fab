"""LoRA adapters in the HF architecture's own names (`moe_core.finetune.hf_adapter`) for DeepSeek-V3, DeepSeek-V2
and GLM-4.5, both ways, held against stock PEFT on transformers' own classes (logits within 1e-5 in fp32):

(a) our adapter (LoRA on the attention projections, MLA's included, on the dense layers' FFNs, the shared experts
    and a subset of the routed experts, plus the trained router) written by `save_adapter` loads with stock
    ``PeftModel.from_pretrained(<HF model>, dir)`` and gives our logits; the router's saved copy carries the
    selection bias our router selects with (moved by aux-loss-free balancing while it trained), as
    ``mlp.gate.e_score_correction_bias`` (stock PEFT requires that key of a saved router copy, and routes by it);
(b) a stock PEFT adapter trained on the HF model (the same modules, the fused experts through target_parameters,
    the router as modules_to_save with its bias) gives the HF PeftModel's logits on ours, through
    `apply_hf_adapter` (unmerged) and `moe_core.load` (merged).

Tiny random HF models (tests/helpers.randomize_, the selection bias drawn too), saved with save_pretrained.
"""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
)

from moe_core import load
from moe_core.convert import from_hf
from moe_core.finetune.config import FinetuneConfig
from moe_core.finetune.export import save_adapter
from moe_core.finetune.hf_adapter import AdapterConversionError, apply_hf_adapter, hf_adapter_state, name_map
from moe_core.finetune.methods import apply_method, layer_of, lora_wrappers
from tests.helpers import randomize_

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

ATOL = 1e-5
# merged weights (`moe_core.load` merges an adapter; PEFT's merge_and_unload): W + s B A rounds differently on each
# side's layout (ours per expert [E, O, I], HF's fused), ~2e-5 in the logits here; unmerged logits hold ATOL
MERGED_ATOL = 1e-4
VOCAB = 96
MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    max_position_embeddings=64,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    intermediate_size=40,
    moe_intermediate_size=16,
)
CASES = {
    # the q bottleneck (q_a_proj, q_a_layernorm, q_b_proj), 2 groups of which 1, scaled weights
    "deepseek_v3": (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        dict(
            **MLA, num_key_value_heads=4, q_lora_rank=12, n_group=2, topk_group=1, routed_scaling_factor=2.5
        ),
    ),
    # V2-Lite's shape: a full-rank q_proj, softmax greedy routing, no selection bias
    "deepseek_v2": (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        dict(**MLA, num_key_value_heads=4, q_lora_rank=None, topk_method="greedy"),
    ),
    "glm4_moe": (
        Glm4MoeConfig,
        Glm4MoeForCausalLM,
        dict(num_key_value_heads=2, head_dim=16, attention_bias=True, n_group=1, topk_group=1),
    ),
}
ATTENTION = {
    "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    "deepseek_v2": ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    "glm4_moe": ["q_proj", "k_proj", "v_proj", "o_proj"],
}
HAS_BIAS = {"deepseek_v3": True, "deepseek_v2": False, "glm4_moe": True}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict:
    dirs = {}
    for name, (config_cls, model_cls, extra) in CASES.items():
        torch.manual_seed(0)
        model = model_cls(config_cls(**COMMON, **extra))
        randomize_(model)
        randomize_bias_(model, seed=4)
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(directory)
        dirs[name] = directory
    return dirs


def randomize_bias_(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "router.expert_bias")):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))


def hf_model(name: str, directory):
    return CASES[name][1].from_pretrained(directory).eval()


def inputs() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=inputs()).logits.float()


def assert_same(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> None:
    assert a.std() > 0.3, "logits too small for the comparison to mean anything"
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


@torch.no_grad()
def randomize_our_adapter_(peft_model, selection: dict[int, list[int]], seed: int = 3) -> None:
    """Random non-zero LoRA factors and router copy; experts outside ``selection`` stay exactly zero (as
    ExpertLoraMask keeps them in training)."""
    generator = torch.Generator().manual_seed(seed)
    for param in peft_model.parameters():
        if param.requires_grad:
            param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    for name, wrapper in lora_wrappers(peft_model):
        A, B = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight
        E = wrapper.num_experts
        keep_E = torch.zeros(E)
        keep_E[selection.get(layer_of(name), [])] = 1.0
        A.mul_(keep_E.repeat_interleave(A.shape[0] // E)[:, None])
        B.mul_(keep_E.repeat(B.shape[1] // E)[None, :])


# ------------------------------------------------------------------------------------------------ (a) ours -> HF
@pytest.mark.parametrize("name", list(CASES))
def test_our_adapter_loads_in_stock_peft_on_the_hf_model_with_our_logits(hf_dirs, tmp_path, name):
    model = from_hf(hf_dirs[name])
    lora = {
        "r": 2,
        "alpha": 5.0,
        "attention": ATTENTION[name],
        "experts": "list",
        "expert_ids": {1: [0, 3], 2: [2]},
        "shared_expert": True,
        "dense_ffn": True,
    }
    config = FinetuneConfig.build({"lora": lora, "freeze": {"router": False}})
    peft_model, plan = apply_method(model, config)
    randomize_our_adapter_(peft_model, plan.expert_selection)
    if HAS_BIAS[name]:  # the router trained with aux-loss-free balancing moves its bias (`MoEStepCallback`)
        randomize_bias_(model, seed=9)
    peft_model.eval()
    ours = logits(peft_model)
    adapter_dir = save_adapter(peft_model, tmp_path / "adapter", plan)

    written = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert written["modules_to_save"] == ["model.layers.1.mlp.gate", "model.layers.2.mlp.gate"]
    assert sorted(t for t in written["target_parameters"] if ".experts." in t) == [
        f"model.layers.{i}.mlp.experts.{p}" for i in (1, 2) for p in ("down_proj", "gate_up_proj")
    ]
    # the dense and shared-expert FFNs by their weights, where stock PEFT does not take them for the experts
    assert "model.layers.0.mlp.gate_proj.weight" in written["target_parameters"]
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in written["target_parameters"]
    assert not any(t.endswith("_proj") and ".mlp." in t for t in written["target_modules"])
    factors = load_file(adapter_dir / "adapter_model.safetensors")
    modules = {k.removeprefix("base_model.model.").split(".lora_")[0] for k in factors if ".lora_" in k}
    for attention in ATTENTION[name]:
        assert f"model.layers.0.self_attn.{attention}" in modules
    assert "model.layers.0.mlp.gate_proj" in modules  # the dense layer's FFN
    assert "model.layers.1.mlp.shared_experts.down_proj" in modules  # HF's name of the shared experts
    bias_keys = sorted(k for k in factors if k.endswith("e_score_correction_bias"))
    if HAS_BIAS[name]:
        assert bias_keys == [
            f"base_model.model.model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2)
        ]
        torch.testing.assert_close(factors[bias_keys[0]], model.model.layers[1].mlp.router.expert_bias)
    else:
        assert bias_keys == []

    stock = PeftModel.from_pretrained(hf_model(name, hf_dirs[name]), str(adapter_dir)).eval()
    assert_same(logits(stock), ours)
    loaded = load(adapter_dir)  # our loader reads it back onto the converted base, merged
    assert loaded.kind == "adapter"
    assert_same(logits(loaded.model), logits(stock.merge_and_unload()), MERGED_ATOL)

    if HAS_BIAS[name]:  # stock PEFT needs the key; with the base checkpoint's bias there, it routes otherwise
        base = hf_model(name, hf_dirs[name])
        for key in bias_keys:
            factors[key] = base.get_buffer(key.removeprefix("base_model.model."))
        save_file(factors, str(adapter_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
        stale = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
        assert not torch.allclose(logits(stale), ours, atol=1e-3)


def test_a_deepseek_v2_router_with_a_moved_bias_is_refused(hf_dirs):
    """DeepSeek-V2's router has no selection bias: a trained router whose bias moved cannot be written for it."""
    model = from_hf(hf_dirs["deepseek_v2"])
    config = FinetuneConfig.build({"lora": {"r": 2, "attention": ["o_proj"]}, "freeze": {"router": False}})
    peft_model, _ = apply_method(model, config)
    hf_adapter_state(peft_model)  # a zero bias: fine
    randomize_bias_(model, seed=9)
    with pytest.raises(AdapterConversionError, match="nonzero selection bias.*deepseek_v3"):
        hf_adapter_state(peft_model)


def test_the_router_bias_is_no_module_of_its_own(hf_dirs):
    names = name_map(from_hf(hf_dirs["deepseek_v3"]).config)
    assert names.hf_modules["model.layers.1.mlp.gate"] == "model.layers.1.mlp.router.gate"
    assert names.router_biases == {
        f"model.layers.{i}.mlp.router": f"model.layers.{i}.mlp.gate" for i in (1, 2)
    }
    assert name_map(from_hf(hf_dirs["deepseek_v2"]).config).router_biases == {}


# ------------------------------------------------------------------------------------------------ (b) HF -> ours
def stock_lora_config(name: str) -> LoraConfig:
    """What a user of stock PEFT trains on the transformers 5 model: the attention projections by regex; the dense
    FFN and the shared experts by their weights (target_parameters: named in target_modules, stock PEFT would take
    them for the experts, see `test_stock_peft_takes_ffn_names_in_target_modules_for_the_experts`); layer 1's
    fused experts and layer 2's gate_up_proj; the router as a trained copy (modules_to_save)."""
    ffn = [f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    ffn += [f"model.layers.{i}.mlp.shared_experts.{p}_proj.weight" for i in (1, 2) for p in ("up", "down")]
    return LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=rf"model\.layers\.\d+\.self_attn\.({'|'.join(ATTENTION[name])})",
        target_parameters=[
            *ffn,
            "model.layers.1.mlp.experts.gate_up_proj",
            "model.layers.1.mlp.experts.down_proj",
            "model.layers.2.mlp.experts.gate_up_proj",
        ],
        modules_to_save=["mlp.gate"],
    )


@pytest.mark.parametrize("name", list(CASES))
def test_stock_peft_adapter_of_the_hf_model_loads_onto_ours_with_its_logits(hf_dirs, tmp_path, name):
    peft_model = get_peft_model(hf_model(name, hf_dirs[name]), stock_lora_config(name))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in peft_model.parameters():
            if param.requires_grad:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
        if HAS_BIAS[name]:  # a copy that selects unlike the base: the bias must come from the adapter
            for module_name, buffer in peft_model.named_buffers():
                if module_name.endswith("modules_to_save.default.e_score_correction_bias"):
                    buffer.add_(0.5 * torch.randn(buffer.shape, generator=generator))
    peft_model.save_pretrained(str(tmp_path / "stock"))
    saved = load_file(tmp_path / "stock" / "adapter_model.safetensors")
    assert any(k.endswith("e_score_correction_bias") for k in saved) == HAS_BIAS[name]
    expected = logits(peft_model.eval())
    expected_merged = logits(peft_model.merge_and_unload())
    assert not torch.allclose(logits(hf_model(name, hf_dirs[name])), expected, atol=1e-3)

    ours = apply_hf_adapter(from_hf(hf_dirs[name]), tmp_path / "stock")  # unmerged: our PEFT path
    assert_same(logits(ours.eval()), expected)
    loaded = load(tmp_path / "stock")  # base from base_model_name_or_path, converted; adapter merged
    assert loaded.kind == "adapter" and loaded.config.hf_origin["model_type"] == name
    assert_same(logits(loaded.model), expected_merged, MERGED_ATOL)


# ------------------------------------------------------------------------------------------------ stock PEFT
def test_stock_peft_takes_ffn_names_in_target_modules_for_the_experts():
    """Why FFN Linears are written as target_parameters (`hf_adapter.renamed_by_stock_peft`): PEFT 0.21 on transformers
    5 rewrites a dense layer's ``mlp.gate_proj`` (any name ending in an expert projection's) in target_modules into
    the fused experts of every layer. When an upgrade stops doing so, this fails: the workaround can go."""
    config_cls, model_cls, extra = CASES["deepseek_v3"]
    with torch.device("meta"):
        model = model_cls(config_cls(**COMMON, **extra))
    targets = [f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")]
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=targets))
    adapted = {name for name, module in peft_model.named_modules() if hasattr(module, "lora_A")}
    assert not any(".layers.0.mlp." in name for name in adapted)
    assert any(".layers.2.mlp.experts" in name for name in adapted)


def test_lora_on_a_linear_weight_is_lora_on_the_linear():
    """PEFT's ParamWrapper on a Linear's weight (target_parameters) has LoRA's keys, shapes and output."""
    torch.manual_seed(0)
    linear, wrapped = torch.nn.Sequential(torch.nn.Linear(8, 6)), torch.nn.Sequential(torch.nn.Linear(8, 6))
    wrapped.load_state_dict(linear.state_dict())
    as_module = get_peft_model(linear, LoraConfig(r=2, lora_alpha=5, target_modules=["0"]))
    as_param = get_peft_model(wrapped, LoraConfig(r=2, lora_alpha=5, target_parameters=["0.weight"]))
    keys = sorted(k for k in as_module.state_dict() if "lora_" in k)
    assert keys == sorted(k for k in as_param.state_dict() if "lora_" in k)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for key in keys:
            factor = torch.randn(as_module.state_dict()[key].shape, generator=generator)
            as_module.state_dict()[key].copy_(factor)
            as_param.state_dict()[key].copy_(factor)
    x = torch.randn(3, 8, generator=generator)
    torch.testing.assert_close(as_param(x), as_module(x))
    assert not torch.allclose(as_module(x), linear[0].base_layer(x))  # (the factors act)
