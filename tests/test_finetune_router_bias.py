"""The routers' selection bias (aux-loss-free ``expert_bias``, DeepSeek-V3 / GLM-4.5) through fine-tuning: it moves
only while the router trains, and every output a fine-tune writes (adapter, merged, the run directory, a resumed run's
checkpoints) gives back the trained model's logits and expert choices (`moe_core.finetune.selection_bias`)."""

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open

from moe_core import load
from moe_core.finetune import FinetuneConfig, finetune
from moe_core.finetune.methods import unwrap
from moe_core.finetune.parallel import CHECKPOINTS
from moe_core.model import MoEForCausalLM
from tests.finetune_helpers import Crash, CrashAt, instruction_records, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

# 4 experts in 2 groups of 2 (deepseek: one group chosen), or one group (glm4moe); the bias steps by 0.05
PRESETS = {
    "deepseek-tiny": dict(router_groups=2, router_topk_groups=1),
    "glm4moe-tiny": {},
}
RATE = 0.05
IDS = torch.tensor([[1, 5, 9, 14, 20, 33, 41, 57, 60, 71], [3, 8, 13, 21, 34, 55, 89, 144, 200, 250]])


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict:
    """Each preset saved with a nonzero starting bias (a published DeepSeek-V3 checkpoint has one), so "kept" and
    "moved" are both visible."""
    root = tmp_path_factory.mktemp("bases")
    for preset, extra in PRESETS.items():
        model = tiny_model(preset, router_bias_update_rate=RATE, **extra)
        with torch.no_grad():
            for i, router in enumerate(model.routers()):
                router.expert_bias.copy_(torch.tensor([0.02, -0.01, 0.0, 0.03]) * (i + 1))
        model.save_pretrained(root / preset)
    return root


def run(base, out, tokenizer, steps=3, **sections):
    config = FinetuneConfig.build(
        {
            "model": {"path": str(base)},
            "steps": steps,
            "batch_size": 4,
            "optim": {"lr": 5e-2},
            "lora": {"r": 2},
            "export": {"merged": True, "adapters": True},
            **sections,
        }
    )
    return finetune(config, out, tokenizer=tokenizer, records=instruction_records(8))


def biases(model) -> list[torch.Tensor]:
    return [router.expert_bias.clone() for router in model.routers()]


def assert_same_model(loaded, trained) -> None:
    """Same logits and the same experts chosen for every token in every MoE layer."""
    with torch.no_grad():
        ours = loaded.eval()(input_ids=IDS, output_routing=True)
        ref = trained.eval()(input_ids=IDS, output_routing=True)
    for mine, theirs in zip(ours.routing, ref.routing, strict=True):
        assert torch.equal(mine.expert_ids_TK, theirs.expert_ids_TK)
    torch.testing.assert_close(ours.logits, ref.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_trained_routers_moved_bias_is_in_every_output(preset, bases, tokenizer, tmp_path):
    base = bases / preset
    start = biases(MoEForCausalLM.from_pretrained(base))
    result = run(base, tmp_path / "out", tokenizer, freeze={"router": False})
    trained = result.model  # the merged model in memory: what the run evaluated
    assert any(not torch.equal(a, b) for a, b in zip(biases(trained), start, strict=True))  # the bias moved

    # the adapter carries it under the PeftModel's own name for the buffer, beside the trained gate
    with safe_open(str(result.adapter_dir / "adapter_model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys() if k.endswith(".expert_bias")}
    assert list(saved) == [f"base_model.model.model.layers.{i}.mlp.router.expert_bias" for i in (1,)]
    for bias, moved in zip(saved.values(), biases(trained), strict=True):
        assert torch.equal(bias, moved)

    for output in (result.adapter_dir, result.merged_dir, tmp_path / "out"):  # adapter, merged/, the run
        assert_same_model(load(output).model, trained)
    # stock PEFT onto the base checkpoint restores it too (the key names the base buffer)
    stock = PeftModel.from_pretrained(MoEForCausalLM.from_pretrained(base), str(result.adapter_dir))
    assert_same_model(stock.merge_and_unload(), trained)


def test_a_frozen_router_keeps_the_base_bias_and_the_adapter_carries_none(bases, tokenizer, tmp_path):
    base = bases / "deepseek-tiny"
    start = biases(MoEForCausalLM.from_pretrained(base))
    result = run(base, tmp_path / "out", tokenizer)  # lora: the router frozen by default
    assert all(torch.equal(a, b) for a, b in zip(biases(result.model), start, strict=True))
    with safe_open(str(result.adapter_dir / "adapter_model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if "router" in k]
    assert_same_model(load(result.adapter_dir).model, result.model)


def test_router_method_saves_the_moved_bias_in_the_merged_model(bases, tokenizer, tmp_path):
    base = bases / "glm4moe-tiny"
    start = biases(MoEForCausalLM.from_pretrained(base))
    result = run(base, tmp_path / "out", tokenizer, method="router")
    assert any(not torch.equal(a, b) for a, b in zip(biases(result.model), start, strict=True))
    assert_same_model(load(tmp_path / "out").model, result.model)


def test_a_resumed_run_keeps_the_bias_moved_before_the_crash(bases, tokenizer, tmp_path):
    base = bases / "deepseek-tiny"
    config = FinetuneConfig.build(
        {
            "model": {"path": str(base)},
            "steps": 3,
            "batch_size": 4,
            "optim": {"lr": 5e-2},
            "lora": {"r": 2},
            "freeze": {"router": False},
            "checkpoint": {"every": 1},
            "export": {"merged": True, "adapters": False},
        }
    )
    records = instruction_records(8)
    whole = finetune(config, tmp_path / "whole", tokenizer=tokenizer, records=records)
    with pytest.raises(Crash):
        finetune(config, tmp_path / "cut", tokenizer=tokenizer, records=records, sinks=[CrashAt(2)])
    assert sorted(p.name for p in (tmp_path / "cut" / CHECKPOINTS).iterdir()) == ["step_00000001"]
    resumed = finetune(config, tmp_path / "cut", tokenizer=tokenizer, records=records, resume=True)
    for a, b in zip(biases(resumed.model), biases(whole.model), strict=True):
        assert torch.equal(a, b)
    assert_same_model(resumed.model, whole.model)


def test_qlora_output_loads_on_its_quantized_base_with_the_moved_bias(bases, tokenizer, tmp_path):
    base = bases / "glm4moe-tiny"
    start = biases(MoEForCausalLM.from_pretrained(base))
    result = run(
        base,
        tmp_path / "out",
        tokenizer,
        method="qlora",
        quantize={"group_size": 16},
        freeze={"router": False},
        export={"merged": False, "adapters": True},
    )
    trained = unwrap(result.model)  # the 4-bit base with the adapter, unmerged, as training left it
    assert any(not torch.equal(a, b) for a, b in zip(biases(trained), start, strict=True))
    loaded = load(
        tmp_path / "out"
    )  # the quantized base again, the adapter placed (`moe_core.finetune.qlora`)
    assert loaded.kind == "finetuned"
    assert_same_model(loaded.model, trained)
