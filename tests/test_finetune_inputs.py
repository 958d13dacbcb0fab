"""Fine-tuning checks its cheap inputs before the model loads, and a base model without a chat template
fine-tunes with one given in the config (saved with the outputs, so generate and eval frame prompts alike)."""

import pytest

from moe_core.data.chat_template import ChatTemplateError
from moe_core.data.tokenizer import load_tokenizer
from moe_core.finetune import FinetuneConfig, FinetuneError, finetune
from tests.finetune_helpers import instruction_records, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def base_tokenizer():
    """A tokenizer as OLMoE-1B-7B's and Mixtral-8x7B's base checkpoints ship: no chat template."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    return tokenizer


def test_a_tokenizer_without_a_template_is_refused_before_the_model_loads(tmp_path):
    config = FinetuneConfig.build({"steps": 1, "model": {"path": str(tmp_path / "not-loaded")}})
    with pytest.raises(FinetuneError, match=r"has no chat template.*data.chat_template.*lab, chatml"):
        finetune(config, tmp_path / "out", tokenizer=base_tokenizer(), records=instruction_records(4))


def test_a_template_from_the_config_frames_the_data_and_travels_with_the_adapter(tmp_path):
    config = FinetuneConfig.build(
        {"steps": 1, "batch_size": 2, "data": {"chat_template": "chatml"}, "export": {"merged": False}}
    )
    result = finetune(
        config,
        tmp_path / "out",
        model=tiny_model(),
        tokenizer=base_tokenizer(),
        records=instruction_records(4),
    )
    tokenizer = load_tokenizer(result.adapter_dir)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n"


def test_a_template_file_that_is_missing_is_named(tmp_path):
    data = {"chat_template": str(tmp_path / "nope.jinja")}
    config = FinetuneConfig.build({"steps": 1, "model": {"path": str(tmp_path / "not-loaded")}, "data": data})
    with pytest.raises(
        ChatTemplateError, match=r"nope.jinja' is neither a built-in template \(lab, chatml\) nor a file"
    ):
        finetune(config, tmp_path / "out", tokenizer=base_tokenizer(), records=instruction_records(4))


def test_prompts_longer_than_max_length_are_refused_before_the_model_loads(tmp_path):
    """Every prompt at least data.max_length tokens: torch used to say 'num_samples should be a positive
    integer value, but got num_samples=0' after the model had loaded."""
    records = [{"instruction": "describe " * 40, "input": "", "output": "ok"} for _ in range(4)]
    config = FinetuneConfig.build(
        {"steps": 1, "model": {"path": str(tmp_path / "not-loaded")}, "data": {"max_length": 16}}
    )
    with pytest.raises(FinetuneError, match=r"every example's prompt fills data.max_length=16 tokens"):
        finetune(config, tmp_path / "out", tokenizer=tiny_tokenizer(), records=records)
