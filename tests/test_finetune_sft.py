"""SFT through TRL on a 16-example instruction set: the loss falls, the router losses stay in it, frozen weights
stay bitwise, merged LoRA equals the adapted model, the adapter loads back through PEFT, multi-task bias trains."""

import os
import signal

import pytest
import torch

from moe_core import load
from moe_core.finetune import FinetuneConfig, finetune
from moe_core.finetune.export import merged_model, save_adapter
from moe_core.finetune.methods import TaskRouterBias
from tests.finetune_helpers import instruction_records, state, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def answer_loss(model, tokenizer, records) -> float:
    """Mean LM loss on the answer tokens (what SFT trains), in eval mode: a fixed yardstick before/after."""
    input_ids, labels = [], []
    for r in records:
        prompt = [{"role": "user", "content": r["instruction"]}]
        prompt_ids = tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        full_ids = tokenizer.apply_chat_template(
            prompt + [{"role": "assistant", "content": r["output"]}], tokenize=True, return_dict=False
        )
        input_ids.append(torch.tensor(full_ids))
        labels.append(torch.tensor([-100] * len(prompt_ids) + full_ids[len(prompt_ids) :]))
    pad = torch.nn.utils.rnn.pad_sequence
    ids = pad(input_ids, batch_first=True, padding_value=tokenizer.pad_token_id)
    mask = pad([torch.ones_like(t) for t in input_ids], batch_first=True, padding_value=0)
    was = model.training
    model.eval()
    with torch.no_grad():
        loss = model(
            input_ids=ids, attention_mask=mask, labels=pad(labels, batch_first=True, padding_value=-100)
        )
    model.train(was)
    return float(loss.lm_loss)


def test_sft_lowers_the_loss_and_keeps_the_router_losses_in_it(tmp_path, tokenizer):
    records = instruction_records(16)
    model = tiny_model(router_aux_loss_coef=0.05, router_z_loss_coef=0.01)
    start = answer_loss(model, tokenizer, records)
    config = FinetuneConfig.build(
        {"method": "full", "steps": 12, "batch_size": 4, "optim": {"lr": 1e-2}, "export": {"merged": False}}
    )
    result = finetune(config, tmp_path, model=model, tokenizer=tokenizer, records=records)
    end = answer_loss(result.model, tokenizer, records)
    assert end < start - 1.0

    rows = [r for r in result.metrics if "lm_loss" in r]
    assert len(rows) == 12 and all(r["aux_loss"] > 0.5 and r["z_loss"] > 0 for r in rows)
    for r in rows:  # the logged loss is the model's: LM + 0.05 * aux + 0.01 * z (Trainer rounds it to 1e-4)
        assert r["loss"] == pytest.approx(r["lm_loss"] + 0.05 * r["aux_loss"] + 0.01 * r["z_loss"], abs=2e-4)
        assert r["loss"] - r["lm_loss"] > 0.04
    assert any(k.startswith("moe/layer_1/") for k in rows[0])  # routing telemetry through the same sink
    saved = FinetuneConfig.load(tmp_path / "finetune_config.json")
    assert saved == config


def test_with_zero_coefficients_the_loss_is_the_lm_loss(tmp_path, tokenizer):
    model = tiny_model(router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
    config = FinetuneConfig.build({"steps": 2, "batch_size": 4, "export": {"merged": False}})
    result = finetune(config, tmp_path, model=model, tokenizer=tokenizer, records=instruction_records(8))
    rows = [r for r in result.metrics if "lm_loss" in r]
    assert rows and all(r["loss"] == pytest.approx(r["lm_loss"], abs=1e-4) for r in rows)


def test_full_sft_leaves_frozen_experts_and_frozen_router_bitwise_unchanged(tmp_path, tokenizer):
    model = tiny_model(router="aux_free", router_bias_update_rate=0.05)
    before = state(model)
    config = FinetuneConfig.build(
        {
            "method": "full",
            "steps": 4,
            "batch_size": 4,
            "optim": {"lr": 1e-2, "weight_decay": 0.1},
            "freeze": {"router": True, "experts": {1: [0, 3]}},
            "export": {"merged": False},
        }
    )
    result = finetune(config, tmp_path, model=model, tokenizer=tokenizer, records=instruction_records(8))
    after = state(result.model)
    for layer in (0, 1):
        for key in ("mlp.router.gate.weight", "mlp.router.expert_bias"):
            assert torch.equal(after[f"model.layers.{layer}.{key}"], before[f"model.layers.{layer}.{key}"])
    for proj in ("gate_proj", "up_proj", "down_proj"):
        name = f"model.layers.1.mlp.experts.{proj}"
        for e in range(4):
            assert torch.equal(after[name][e], before[name][e]) == (e in (0, 3)), (name, e)
        assert not torch.equal(
            after[f"model.layers.0.mlp.experts.{proj}"], before[f"model.layers.0.mlp.experts.{proj}"]
        )
    rows = {r.name: r for r in result.report.rows}
    assert rows["model.layers.1.mlp.experts.up_proj"].experts == [1, 2]
    assert not any(r.kind == "router" for r in result.report.rows)


def test_merged_lora_equals_the_adapted_model_and_the_adapter_loads_in_peft(tmp_path, tokenizer):
    from peft import PeftModel

    from moe_core.model import MoEForCausalLM

    base = tiny_model()
    base.save_pretrained(tmp_path / "base")
    config = FinetuneConfig.build(
        {
            "steps": 3,
            "batch_size": 4,
            "optim": {"lr": 5e-2},
            "lora": {"r": 4, "experts": "list", "expert_ids": [2]},
            "freeze": {"router": False},
            "export": {"merged": False, "adapters": False},
        }
    )
    result = finetune(
        config, tmp_path / "run", model=base, tokenizer=tokenizer, records=instruction_records(8)
    )
    x = torch.randint(0, 300, (2, 10))
    peft_model = result.model.eval()
    with torch.no_grad():
        adapted = peft_model(input_ids=x).logits
    adapter_dir = save_adapter(peft_model, tmp_path / "adapter", result.plan)
    merged = merged_model(peft_model, result.plan)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, adapted, atol=1e-5, rtol=1e-5)
        reloaded = PeftModel.from_pretrained(
            MoEForCausalLM.from_pretrained(tmp_path / "base"), str(adapter_dir)
        )
        torch.testing.assert_close(reloaded.eval()(input_ids=x).logits, adapted, atol=1e-5, rtol=1e-5)
        fresh = MoEForCausalLM.from_pretrained(tmp_path / "base").eval()
        assert not torch.allclose(fresh(input_ids=x).logits, adapted, atol=1e-4)  # the adapter did something


def test_multitask_router_bias_trains_only_the_bias_and_is_saved_beside_the_weights(tmp_path, tokenizer):
    model = tiny_model()
    before = state(model)
    config = FinetuneConfig.build(
        {
            "method": "router_bias",
            "steps": 4,
            "batch_size": 4,
            "optim": {"lr": 5e-2},
            "data": {"task_column": "task"},
        }
    )
    result = finetune(
        config, tmp_path, model=model, tokenizer=tokenizer, records=instruction_records(8, task=True)
    )
    assert [r.kind for r in result.report.rows] == ["task_router_bias"]
    assert result.summary["tasks"] == {"animal": 4, "color": 4}
    after = state(result.model)
    assert all(torch.equal(after[k], before[k]) for k in before)
    bias = TaskRouterBias.load(result.merged_dir)
    assert bias.task_names == ["animal", "color"] and bias.bias_LNE.abs().sum() > 0
    reloaded = load(result.merged_dir).model
    x = torch.randint(0, 300, (2, 6))
    with reloaded.task_router_bias.tasks(torch.tensor([0, 1])), torch.no_grad():
        biased = reloaded(input_ids=x).logits
    with torch.no_grad():
        plain = reloaded(input_ids=x).logits
    assert not torch.allclose(biased, plain)


def test_merged_model_carries_the_tokenizers_special_ids_and_generates_from_its_output(tmp_path, tokenizer):
    import json

    from transformers import AutoTokenizer

    base = tiny_model()  # its config names no special tokens, as pretraining wrote them before
    assert base.config.eos_token_id is None
    config = FinetuneConfig.build({"method": "full", "steps": 1, "batch_size": 4, "export": {"merged": True}})
    result = finetune(config, tmp_path, model=base, tokenizer=tokenizer, records=instruction_records(4))
    expected = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    for name in ("config.json", "generation_config.json"):
        saved = json.loads((result.merged_dir / name).read_text())
        eos = saved.get("eos_token_id")  # transformers' Trainer turns the generation config's EOS into a list
        saved["eos_token_id"] = eos[0] if isinstance(eos, list) and len(eos) == 1 else eos
        assert {k: saved.get(k) for k in expected} == expected, name
    saved_tokenizer = AutoTokenizer.from_pretrained(result.merged_dir)
    inputs = saved_tokenizer("hello", return_tensors="pt")
    assert set(inputs) == {"input_ids", "attention_mask"}
    loaded = load(result.merged_dir)
    with torch.no_grad():
        out = loaded.model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]


class SignalAt:
    """A metrics sink that sends this process ``signals`` when step ``step`` is logged (each is handled before
    `os.kill` returns)."""

    def __init__(self, step: int, *signals: int) -> None:
        self.step, self.signals = step, signals

    def log(self, step, metrics) -> None:
        if step == self.step and "loss" in metrics:
            for signum in self.signals:
                os.kill(os.getpid(), signum)

    def close(self) -> None:
        pass


def test_ctrl_c_stops_after_the_step_and_writes_the_outputs_of_the_steps_done(tmp_path, tokenizer, capfd):
    import json

    config = FinetuneConfig.build({"method": "full", "steps": 6, "batch_size": 4, "export": {"merged": True}})
    handler = signal.getsignal(signal.SIGINT)
    result = finetune(
        config,
        tmp_path / "a",
        model=tiny_model(),
        tokenizer=tokenizer,
        records=instruction_records(8),
        sinks=[SignalAt(2, signal.SIGINT)],
    )
    assert (result.stopped_by, result.steps_done, result.exit_code) == ("SIGINT", 2, 130)
    assert "SIGINT: finishing this step, then writing the outputs of the steps done" in capfd.readouterr().err
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert (summary["stopped_by"], summary["steps_done"], summary["steps"]) == ("SIGINT", 2, 6)
    assert (result.merged_dir / "config.json").is_file()
    assert signal.getsignal(signal.SIGINT) is handler  # given back

    with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C: at once, nothing written
        finetune(
            config,
            tmp_path / "b",
            model=tiny_model(),
            tokenizer=tokenizer,
            records=instruction_records(8),
            sinks=[SignalAt(2, signal.SIGINT, signal.SIGINT)],
        )
    assert "SIGINT again: stopping now; nothing written" in capfd.readouterr().err
    assert not (tmp_path / "b" / "summary.json").exists()


def test_compiled_layers_train_as_eager_with_the_routed_experts(tmp_path, tokenizer, monkeypatch):
    """``compile=true`` (every decoder layer through torch.compile, inductor) gives eager's losses step for step,
    under activation checkpointing too, with the experts on their routed tokens: never ``static``."""
    import json

    from moe_core.experts import StackedExperts

    def losses(out, **fields):
        torch.manual_seed(0)
        config = FinetuneConfig.build(
            {"steps": 3, "batch_size": 4, "optim": {"lr": 1e-2}, "export": {"merged": False}, **fields}
        )
        finetune(
            config, tmp_path / out, model=tiny_model(), tokenizer=tokenizer, records=instruction_records(8)
        )
        saved = json.loads((tmp_path / out / "finetune_config.json").read_text())
        assert saved["compile"] == config.compile  # saved with the run
        rows = (tmp_path / out / "metrics.jsonl").read_text().splitlines()
        return [json.loads(r)["loss"] for r in rows if '"loss"' in r]

    eager = losses("eager")

    def no_static(*args, **kwargs):
        raise AssertionError("the static path ran under torch.compile")

    monkeypatch.setattr(StackedExperts, "forward_static", no_static)
    compiled_modules = []
    module_compile = torch.nn.Module.compile

    def spy(module, *args, **kwargs):
        compiled_modules.append(type(module).__name__)
        return module_compile(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", spy)
    compiled = losses("compiled", compile=True, gradient_checkpointing=True)
    assert compiled_modules == ["DecoderLayer"] * tiny_model().config.num_hidden_layers
    assert len(eager) == len(compiled) == 3 and compiled == pytest.approx(eager, rel=1e-5)
