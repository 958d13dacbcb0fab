"""Fine-tuning defaults that suit billion-parameter models, on tiny configs: gradient checkpointing and adapter-only
exports chosen from the model's config (the published sizes' configs are built, never their weights), a merged
export that holds no second copy of the model, plain framing for base models without a chat template (trained,
saved and used again by generate and eval), and every input check before the weights load."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import moe_core.finetune.run as run_module
from moe_core.config import get_config, parameter_counts
from moe_core.convert import copy_companion_files
from moe_core.data.framing import FRAMING_FILE, PromptFraming, read_framing
from moe_core.data.tokenizer import load_tokenizer
from moe_core.eval.generate import PromptSetConfig, generate_samples
from moe_core.eval.prompts import Prompt
from moe_core.finetune import FinetuneConfig, FinetuneError, finetune, sizing
from moe_core.finetune.objectives import MoESFTTrainer, dpo_dataset, sft_dataset, trainer_args
from moe_core.finetune.sizing import LARGE_MODEL_PARAMS, resolve_size_defaults
from moe_core.inference import generate as generate_module
from moe_core.loading import load
from tests.finetune_helpers import instruction_records, preference_records, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
REPO = Path(__file__).resolve().parents[1]

# OLMoE-1B-7B's published shape (the config only: 6.9 B parameters, never built here)
OLMOE_1B_7B = dict(
    vocab_size=50304,
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=16,
    num_experts=64,
    num_experts_per_tok=8,
    expert_intermediate_size=1024,
    intermediate_size=1024,
    max_position_embeddings=4096,
)


def base_tokenizer():
    """As OLMoE-1B-7B's and Mixtral-8x7B's base checkpoints ship: no chat template."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    return tokenizer


def saved_base(tmp_path, tokenizer=None, **overrides):
    """A tiny base model on disk with its tokenizer (what model.path names)."""
    directory = tmp_path / "base"
    tiny_model(**overrides).save_pretrained(directory)
    (tokenizer or tiny_tokenizer()).save_pretrained(directory)
    return directory


# ------------------------------------------------------------------------------------------------ 1, 2: defaults
def test_auto_defaults_keep_the_old_ones_at_toy_size_and_follow_a_large_model():
    tiny = get_config("mixtral-tiny")
    small = resolve_size_defaults(FinetuneConfig(), tiny)
    assert (small.gradient_checkpointing, small.export_merged, small.export_hf) == (False, True, False)
    assert small.notes == []
    tiny_hf = get_config("mixtral-tiny", hf_origin={"model_type": "mixtral"})
    assert resolve_size_defaults(FinetuneConfig(), tiny_hf).export_hf is True

    large_config = get_config("olmoe-tiny", **OLMOE_1B_7B, hf_origin={"model_type": "olmoe"})
    assert parameter_counts(large_config)["total"] > LARGE_MODEL_PARAMS
    large = resolve_size_defaults(FinetuneConfig(), large_config)
    assert (large.gradient_checkpointing, large.export_merged, large.export_hf) == (True, False, False)
    checkpointing, exports = large.notes
    assert "gradient checkpointing on" in checkpointing and "6.9" in checkpointing
    assert "--set gradient_checkpointing=false" in checkpointing
    assert "not writing merged/ and hf/" in exports
    assert "--set export.merged=true --set export.hf=true" in exports

    # what the user set wins, and is not announced
    asked = FinetuneConfig.build({"gradient_checkpointing": False, "export": {"merged": True, "hf": True}})
    kept = resolve_size_defaults(asked, large_config)
    assert (kept.gradient_checkpointing, kept.export_merged, kept.export_hf) == (False, True, True)
    assert kept.notes == []
    # no adapter (full fine-tuning): merged/ is the only output, written at any size
    assert resolve_size_defaults(FinetuneConfig.build({"method": "full"}), large_config).export_merged is True


def test_full_fine_tuning_that_cannot_fit_is_refused_before_the_weights_load(tmp_path, monkeypatch):
    """``method=full`` of the full OLMoE-1B-7B on this 24 GiB machine loaded 12.9 GiB and was then killed for
    memory: its weights and its experts' gradients and AdamW moments need at least 6.9 B x 2 + 6.4 B x 3 x 2 bytes.
    It is refused from the config alone, pointing at LoRA; what fits is not refused."""
    large_config = get_config("olmoe-tiny", **OLMOE_1B_7B)
    full = FinetuneConfig.build({"method": "full", "model": {"dtype": "bfloat16"}})
    total = parameter_counts(large_config)["total"]
    experts = 16 * 64 * 3 * 2048 * 1024
    assert sizing.full_training_floor(full, large_config) == (total + 3 * experts) * 2
    assert sizing.full_training_floor(FinetuneConfig(), large_config) == 0  # LoRA: the base is frozen
    with pytest.raises(
        FinetuneError, match=r"method=full trains every weight .* at least 4[0-9.]+ GiB in bfloat16"
    ):
        sizing.check_full_training_fits(full, large_config, 24 * 2**30, "this machine")
    sizing.check_full_training_fits(full, large_config, 80 * 2**30, "the GPU")  # fits: nothing said
    sizing.check_full_training_fits(full, large_config, None, "this machine")  # unknown: nothing checked

    # through finetune(): before any weight loads
    def no_weights(*args, **kwargs):
        raise AssertionError("the weights loaded before the memory was checked")

    monkeypatch.setattr(run_module, "load", no_weights)
    monkeypatch.setattr(run_module, "process_memory_bytes", lambda on_cuda, processes: 1024)
    config = FinetuneConfig.build(
        {"method": "full", "model": {"path": str(saved_base(tmp_path))}, "steps": 1}
    )
    with pytest.raises(FinetuneError, match="more than the 0.0 GiB this machine holds; use method=lora"):
        finetune(config, tmp_path / "out", records=instruction_records(4))


def test_an_hf_export_of_a_model_without_hf_origin_is_refused_before_the_weights_load():
    config = FinetuneConfig.build({"export": {"hf": True}})
    with pytest.raises(FinetuneError, match="export.hf=true, but the base model did not come from"):
        resolve_size_defaults(config, get_config("mixtral-tiny"))


def test_checkpointing_follows_large_activations_and_stays_off_with_the_task_bias():
    tiny = get_config("mixtral-tiny")
    long = FinetuneConfig.build({"batch_size": 64, "data": {"max_length": 8192}})
    resolved = resolve_size_defaults(long, tiny)
    assert resolved.gradient_checkpointing and "GiB of activations" in resolved.notes[0]

    large_config = get_config("olmoe-tiny", **OLMOE_1B_7B)
    biased = FinetuneConfig.build({"routing": {"task_bias": True}, "data": {"task_column": "task"}})
    off = resolve_size_defaults(biased, large_config)
    assert off.gradient_checkpointing is False
    assert "left off" in off.notes[0] and "task-conditioned router bias" in off.notes[0]
    with pytest.raises(FinetuneError, match="gradient_checkpointing does not work with the task-conditioned"):
        FinetuneConfig.build({**biased.model_dump(), "gradient_checkpointing": True})


def test_a_large_base_trains_with_checkpointing_and_writes_the_adapter_only(tmp_path, monkeypatch, capsys):
    """The threshold lowered to the tiny model's size: the defaults of a large model, end to end."""
    monkeypatch.setattr(sizing, "LARGE_MODEL_PARAMS", 1000)
    base = saved_base(tmp_path)
    config = FinetuneConfig.build({"model": {"path": str(base)}, "steps": 2, "batch_size": 2})
    result = finetune(config, tmp_path / "out", records=instruction_records(4))
    printed = capsys.readouterr().out
    assert "moe-lab finetune: gradient checkpointing on" in printed
    assert "not writing merged/" in printed and "--set export.merged=true" in printed

    assert result.adapter_dir == tmp_path / "out" / "adapter" and result.merged_dir is None
    assert not (tmp_path / "out" / "merged").exists() and not (tmp_path / "out" / "hf").exists()
    assert result.model.base_model.model.model.gradient_checkpointing  # the trainer recomputed activations
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["size_defaults"]["gradient_checkpointing"] is True
    assert summary["size_defaults"]["export_merged"] is False
    saved = json.loads((tmp_path / "out" / "finetune_config.json").read_text())
    assert saved["gradient_checkpointing"] is None and saved["export"]["merged"] is None  # asked: auto

    # the adapter-only output is a model: moe_core.load applies its adapter to the base it names
    loaded = load(tmp_path / "out")
    assert loaded.kind == "finetuned"
    ids = torch.tensor([[5, 6, 7, 8]])
    merged = result.model.merge_and_unload().eval()
    torch.testing.assert_close(loaded.model(ids).logits, merged(ids).logits)


def test_a_rank_other_than_the_first_loads_without_saying_the_defaults(tmp_path, monkeypatch, capsys):
    """Under ``--nproc N`` every rank loads the inputs; the lines saying what the size chose (and why the base is
    copied) come once, from rank 0 (`_finetune` passes ``announce=place.is_main``; the progress display likewise)."""
    from moe_core.finetune.run import load_inputs

    monkeypatch.setattr(sizing, "LARGE_MODEL_PARAMS", 1000)
    config = FinetuneConfig.build({"model": {"path": str(saved_base(tmp_path))}, "steps": 2, "batch_size": 2})
    load_inputs(config, records=instruction_records(4), announce=False)
    assert "moe-lab finetune:" not in capsys.readouterr().out
    load_inputs(config, records=instruction_records(4))
    assert "moe-lab finetune: gradient checkpointing on" in capsys.readouterr().out


def test_checkpointing_gives_the_same_lora_step_as_without(tmp_path):
    def one_step(flag: bool, out):
        config = FinetuneConfig.build(
            {"steps": 1, "batch_size": 2, "gradient_checkpointing": flag, "export": {"merged": False}}
        )
        result = finetune(
            config, out, model=tiny_model(), tokenizer=tiny_tokenizer(), records=instruction_records(4)
        )
        return {k: v.detach().clone() for k, v in result.model.named_parameters() if v.requires_grad}

    plain, recomputed = one_step(False, tmp_path / "a"), one_step(True, tmp_path / "b")
    assert plain.keys() == recomputed.keys()
    for name in plain:
        torch.testing.assert_close(recomputed[name], plain[name], atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ 3: memory
MEMORY_PROBE = textwrap.dedent(
    """
    import gc, json, sys, torch
    from pathlib import Path
    from moe_core.config import get_config
    from moe_core.finetune import FinetuneConfig
    from moe_core.finetune import export
    from moe_core.finetune.methods import apply_method
    from moe_core.model import MoEForCausalLM

    torch.set_num_threads(1)
    out = Path(sys.argv[1])

    def status():
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}

    def tiny(**over):
        fields = dict(vocab_size=1024, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                      num_experts=8, num_experts_per_tok=2, expert_intermediate_size=512,
                      intermediate_size=512, num_hidden_layers=16, max_position_embeddings=128,
                      hf_origin={"model_type": "mixtral"})
        fields.update(over)
        return MoEForCausalLM(get_config("mixtral-tiny", **fields))

    # warm up: the first save imports and caches what every later one uses
    warm = tiny(num_hidden_layers=1, hidden_size=32, expert_intermediate_size=32, intermediate_size=32)
    export.save_merged(warm, out / "warm_merged")
    export.save_hf(warm, out / "warm_hf")
    model = tiny()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    peft_model, plan = apply_method(model, FinetuneConfig())
    with torch.no_grad():
        for p in peft_model.parameters():
            if p.requires_grad:
                p.add_(0.01)  # a non-zero adapter: merging changes every adapted weight
    del warm
    gc.collect()
    open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
    before = status()["VmRSS"]
    merged = export.merged_model(peft_model, plan)
    export.save_merged(merged, out / "merged", max_shard_bytes=model_bytes // 4)
    export.save_hf(merged, out / "hf", max_shard_bytes=model_bytes // 4)
    print(json.dumps({"model_bytes": model_bytes, "growth": status()["VmHWM"] - before}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")
def test_merge_and_both_exports_hold_no_second_copy_and_write_shards(tmp_path):
    """A ~200 MB model merged and written as merged/ and hf/ in a fresh process: its peak memory grows by well
    under one model copy (before to_hf stopped cloning each shard it grew by a whole copy), and both are
    sharded at the size asked for."""
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,  # this checkout's moe_core
    )
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    model_bytes = figures["model_bytes"]
    assert model_bytes > 150e6
    assert figures["growth"] < 0.25 * model_bytes, figures  # one layer's merge at a time: ~10% here
    for name in ("merged", "hf"):
        index = json.loads((tmp_path / name / "model.safetensors.index.json").read_text())
        shards = set(index["weight_map"].values())
        assert len(shards) >= 4
        assert all((tmp_path / name / shard).stat().st_size <= model_bytes // 4 + 2**20 for shard in shards)


# ------------------------------------------------------------------------------------------------ 4: plain framing
def test_plain_framing_trains_on_the_answer_tokens_only(tmp_path):
    tokenizer = base_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    records = instruction_records(4)
    config = FinetuneConfig.build({"steps": 1, "batch_size": 2, "data": {"chat_template": "plain"}})
    dataset = sft_dataset(records, plain=True)
    assert dataset[0] == {"prompt": records[0]["instruction"] + "\n", "completion": records[0]["output"]}
    trainer = MoESFTTrainer(
        tiny_model(), args=trainer_args(config, tmp_path), train_dataset=dataset, processing_class=tokenizer
    )
    batch = trainer.data_collator([trainer.train_dataset[0]])
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    prompt_ids = tokenizer(records[0]["instruction"] + "\n")["input_ids"]
    assert ids[: len(prompt_ids)].tolist() == prompt_ids  # the prompt as generate will frame it
    assert (labels[: len(prompt_ids)] == -100).all()
    answer = labels[len(prompt_ids) :]
    assert (answer != -100).all()  # every answer token trains, its EOS too
    assert tokenizer.decode(answer) == records[0]["output"] + tokenizer.eos_token


def test_plain_framing_is_saved_and_generate_frames_prompts_with_it(tmp_path, monkeypatch):
    base = saved_base(tmp_path, base_tokenizer())
    config = FinetuneConfig.build(
        {"model": {"path": str(base)}, "steps": 1, "batch_size": 2, "data": {"chat_template": "plain"}}
    )
    result = finetune(config, tmp_path / "out", records=instruction_records(4))
    for directory in (result.adapter_dir, result.merged_dir):
        assert read_framing(directory) == PromptFraming("plain")
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["framing"] == "plain"

    seen = []
    real = generate_module.batch_generate
    monkeypatch.setattr(
        generate_module,
        "batch_generate",
        lambda model, prompts, *a, **k: seen.append(prompts) or real(model, prompts, *a, **k),
    )
    generate_module.generate_cli(
        tmp_path / "out",
        ["Name the color in: the red cat."],
        generate_module.GenerationConfig(max_new_tokens=2),
    )
    tokenizer = load_tokenizer(result.merged_dir)
    assert seen == [[tokenizer("Name the color in: the red cat.\n")["input_ids"]]]


def test_a_chat_template_fine_tune_is_prompted_through_its_template(tmp_path, monkeypatch):
    base = saved_base(tmp_path, base_tokenizer())
    config = FinetuneConfig.build(
        {"model": {"path": str(base)}, "steps": 1, "batch_size": 2, "data": {"chat_template": "chatml"}}
    )
    finetune(config, tmp_path / "out", records=instruction_records(4))
    assert read_framing(tmp_path / "out" / "merged") == PromptFraming("chat_template")
    seen = []
    real = generate_module.batch_generate
    monkeypatch.setattr(
        generate_module,
        "batch_generate",
        lambda model, prompts, *a, **k: seen.append(prompts) or real(model, prompts, *a, **k),
    )
    generate_module.generate_cli(tmp_path / "out", ["hi"], generate_module.GenerationConfig(max_new_tokens=2))
    tokenizer = load_tokenizer(tmp_path / "out" / "merged")
    assert tokenizer.decode(seen[0][0]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_eval_generations_frame_the_prompt_set_like_training(monkeypatch):
    tokenizer, model = base_tokenizer(), tiny_model()
    seen = []
    real = model.generate
    monkeypatch.setattr(model, "generate", lambda ids, **k: seen.append(ids[0].tolist()) or real(ids, **k))
    prompt = Prompt("p", "prose", "Name the color in: the red cat.")
    config = PromptSetConfig(max_new_tokens=1, modes=("greedy",))
    generate_samples(model, tokenizer, [prompt], config, framing=PromptFraming("plain"))
    generate_samples(model, tokenizer, [prompt], config)
    assert seen == [tokenizer(prompt.text + "\n")["input_ids"], tokenizer(prompt.text)["input_ids"]]


def test_a_model_without_a_framing_file_is_prompted_as_before(tmp_path):
    assert read_framing(tmp_path) is None
    (tmp_path / FRAMING_FILE).write_text('{"framing": "jinja"}')
    with pytest.raises(Exception, match="framing='jinja'; expected 'chat_template' or 'plain'"):
        read_framing(tmp_path)


def test_the_framing_travels_with_quantized_pruned_and_converted_copies(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    PromptFraming("plain").save(tmp_path / "a")
    assert FRAMING_FILE in copy_companion_files(tmp_path / "a", tmp_path / "b")
    assert read_framing(tmp_path / "b") == PromptFraming("plain")


def test_plain_framing_trains_dpo(tmp_path):
    tokenizer = base_tokenizer()
    records = preference_records(4)
    rows = dpo_dataset(records, plain=True)
    assert rows[0]["prompt"] == records[0]["prompt"] + "\n" and rows[0]["chosen"] == records[0]["chosen"]
    config = FinetuneConfig.build(
        {
            "objective": "dpo",
            "steps": 1,
            "batch_size": 2,
            "data": {"chat_template": "plain"},
            "export": {"merged": False},
        }
    )
    result = finetune(config, tmp_path / "out", model=tiny_model(), tokenizer=tokenizer, records=records)
    assert result.steps_done == 1 and read_framing(result.adapter_dir) == PromptFraming("plain")


# ------------------------------------------------------------------------------------------------ 5: input order
def test_every_input_check_runs_before_the_weights_load(tmp_path, monkeypatch):
    def no_weights(*args, **kwargs):
        raise AssertionError("the weights loaded before the inputs were checked")

    monkeypatch.setattr(run_module, "load", no_weights)
    small_vocab = saved_base(tmp_path, vocab_size=100)  # the tokenizer has 300 tokens
    config = FinetuneConfig.build({"model": {"path": str(small_vocab)}, "steps": 1})
    with pytest.raises(FinetuneError, match="the tokenizer has 300 tokens but the model's vocab_size is 100"):
        finetune(config, tmp_path / "out", records=instruction_records(4))
    with pytest.raises(FinetuneError, match="has no chat template"):
        finetune(config, tmp_path / "out", tokenizer=base_tokenizer(), records=instruction_records(4))
