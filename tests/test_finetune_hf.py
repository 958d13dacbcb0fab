"""A fine-tuned model of Hugging Face origin: converted in, LoRA-trained on experts, merged, exported back as its
own architecture, and loaded by transformers with the same logits as our merged model."""

import pytest
import torch
from peft import PeftModel
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
)

from moe_core.finetune import FinetuneConfig, finetune
from tests.finetune_helpers import instruction_records, tiny_tokenizer

BASE = dict(
    vocab_size=300,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    intermediate_size=32,
    num_experts_per_tok=2,
)
CASES = {
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(num_local_experts=4)),
    "olmoe": (OlmoeConfig, OlmoeForCausalLM, dict(num_experts=4)),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def hf_checkpoint(tmp_path, name: str):
    config_cls, model_cls, extra = CASES[name]
    torch.manual_seed(0)
    model = model_cls(config_cls(**BASE, **extra))
    directory = tmp_path / f"hf_{name}"
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


@pytest.mark.parametrize("name", ["mixtral", "olmoe"])
def test_finetuned_hf_model_exports_back_and_loads_in_transformers(tmp_path, name):
    source = hf_checkpoint(tmp_path, name)
    config = FinetuneConfig.build(
        {
            "model": {"path": str(source)},
            "steps": 3,
            "batch_size": 4,
            "optim": {"lr": 5e-2},
            "lora": {"r": 4, "experts": "list", "expert_ids": [1, 2]},
        }
    )
    result = finetune(config, tmp_path / "run", records=instruction_records(8))
    assert result.hf_dir is not None and result.adapter_dir is not None and result.merged_dir is not None
    assert result.model.config.hf_origin["model_type"] == name

    hf = AutoModelForCausalLM.from_pretrained(result.hf_dir).eval()
    assert type(hf).__name__ == CASES[name][1].__name__
    original = AutoModelForCausalLM.from_pretrained(source).eval()
    x = torch.randint(0, 300, (2, 12))
    with torch.no_grad():
        ours = result.model(input_ids=x).logits
        torch.testing.assert_close(hf(input_ids=x).logits, ours, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(original(input_ids=x).logits, ours, atol=1e-4)  # the fine-tune is in there
        # the adapter is in the HF architecture's names: stock PEFT puts it on the HF model (issue 31)
        fresh = AutoModelForCausalLM.from_pretrained(source)
        stock = PeftModel.from_pretrained(fresh, str(result.adapter_dir)).eval()
        torch.testing.assert_close(stock(input_ids=x).logits, ours, atol=1e-5, rtol=1e-5)
    # untouched experts are bitwise the source's in the exported checkpoint
    w_src = original.state_dict()
    w_out = hf.state_dict()
    # (transformers 5 holds each layer's experts fused, [E, ...]: experts 0 and 3 are rows 0 and 3)
    untouched = [k for k in w_src if ".mlp.experts." in k]
    assert untouched and all(torch.equal(w_src[k][[0, 3]], w_out[k][[0, 3]]) for k in untouched)
