"""gpt-oss adapters in Hugging Face names: its fused ``gate_up_proj`` is [E, D, 2F] with gate and up interleaved
on the last axis (transformers 5.24 ``GptOssExperts``), unlike the [E, 2F, D] halves of OLMoE/Mixtral/Qwen; the
fused LoRA factors must follow that order (`moe_core.finetune.hf_adapter.gate_up_rows`), else stock PEFT on
``GptOssForCausalLM`` applies gate's update to up's features. hidden (48) != 2F (2 x 32), so a transposed or
misordered layout cannot pass by a shape coincidence."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from transformers import GptOssConfig, GptOssForCausalLM

from moe_core import load
from moe_core.convert import from_hf
from moe_core.finetune.config import FinetuneConfig
from moe_core.finetune.export import save_adapter
from moe_core.finetune.methods import apply_method
from tests.helpers import randomize_
from tests.test_hf_adapter import randomize_our_adapter_

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

HF_TINY = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=5,
    layer_types=["sliding_attention", "full_attention"],
    max_position_embeddings=64,
    swiglu_limit=1.5,
)


def logits(model) -> torch.Tensor:
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_our_gpt_oss_adapter_gives_our_logits_in_stock_peft_and_reads_back(tmp_path):
    torch.manual_seed(0)
    hf = GptOssForCausalLM(GptOssConfig(**HF_TINY)).eval()
    randomize_(hf)
    hf.save_pretrained(tmp_path / "hf")

    model = from_hf(tmp_path / "hf")
    config = FinetuneConfig.build({"lora": {"r": 2, "alpha": 5.0, "experts": "all"}})
    peft_model, plan = apply_method(model, config)
    randomize_our_adapter_(peft_model, plan.expert_selection)
    peft_model.eval()
    ours = logits(peft_model)
    adapter_dir = save_adapter(peft_model, tmp_path / "adapter", plan)
    targets = json.loads((adapter_dir / "adapter_config.json").read_text())["target_parameters"]
    assert {t for t in targets if ".experts." in t} == {
        f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")
    }

    fresh = GptOssForCausalLM.from_pretrained(tmp_path / "hf").eval()
    base = logits(fresh)
    stock = PeftModel.from_pretrained(fresh, str(adapter_dir)).eval()
    assert ours.std() > 0.3 and not torch.allclose(base, ours, atol=1e-3)  # the adapter acts
    torch.testing.assert_close(logits(stock), ours, atol=1e-5, rtol=0)

    loaded = load(adapter_dir)  # and back onto our converted model (merged)
    torch.testing.assert_close(logits(loaded.model), ours, atol=1e-4, rtol=0)
