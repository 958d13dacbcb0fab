"""A fine-tuning output that holds its adapter alone loads on the base as it trained, unmerged
(`moe_core.finetune.as_trained`): a LoRA fine-tune's on its memory-mapped base, with no copy of the base and no
merge (which needs the whole base in memory: none at all for a base larger than it), QLoRA's on its 4-bit base.
What rewrites weights (quantize, prune, ONNX export, conversion to Hugging Face) reads the adapter merged into
the full-precision base (``load(..., merged=True)``): on a QLoRA output those had written a checkpoint that did not
load (quantize), or stopped with an internal error (convert) or a dispatch error (ONNX)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from moe_core import load
from moe_core.finetune import FinetuneConfig, finetune
from moe_core.finetune.methods import unwrap
from moe_core.hf_export import convert_to_hf
from moe_core.inference.quantize.weight_only import quantize_checkpoint
from moe_core.loading import LoadError
from moe_core.mapped import MappedExperts
from moe_core.quantized import QuantConfig, QuantizedExperts
from tests.finetune_helpers import SMALL_LORA_RUN, instruction_records
from tests.test_finetune_hf import hf_checkpoint


def adapter_only_finetune(tmp_path, model=None, source=None, **fields):
    source = source or hf_checkpoint(tmp_path, "olmoe")
    config = FinetuneConfig.build(
        {
            **SMALL_LORA_RUN,
            "model": {"path": str(source), **(model or {})},
            "export": {"merged": False, "hf": False},
            **fields,
        }
    )
    result = finetune(config, tmp_path / "out", records=instruction_records(16))
    assert result.merged_dir is None and not (tmp_path / "out" / "merged").exists()
    return source, result


def has_lora(model) -> bool:
    return any("lora_" in name for name, _ in model.named_parameters())


def test_an_adapter_only_lora_output_loads_unmerged_on_its_mapped_base(tmp_path):
    source, result = adapter_only_finetune(tmp_path)
    out = tmp_path / "out"
    x = torch.randint(0, 300, (2, 10))
    loaded = load(out)
    assert loaded.kind == "finetuned"
    # the base's experts as views of its files, the adapter unmerged on top
    assert any(isinstance(m, MappedExperts) for m in loaded.model.modules())
    assert has_lora(loaded.model) and not any(p.requires_grad for p in loaded.model.parameters())
    merged = load(out, merged=True).model
    assert not has_lora(merged) and not any(isinstance(m, MappedExperts) for m in merged.modules())
    trained = unwrap(result.model).eval()
    with torch.no_grad():
        ours = loaded.model(input_ids=x).logits
        torch.testing.assert_close(ours, trained(input_ids=x).logits)  # the very computation training ran
        torch.testing.assert_close(ours, merged(input_ids=x).logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            ours, load(out / "adapter").model(input_ids=x).logits, atol=1e-5, rtol=1e-5
        )
        original = AutoModelForCausalLM.from_pretrained(source).eval()
        assert not torch.allclose(original(input_ids=x).logits, ours, atol=1e-4)  # the adapter acts
        prompt = loaded.tokenizer("hello", return_tensors="pt")
        tokens = loaded.model.generate(**prompt, max_new_tokens=6, do_sample=False)
        assert torch.equal(tokens, trained.generate(**prompt, max_new_tokens=6, do_sample=False))

    # a writer reads the merged weights: the HF checkpoint it writes holds the fine-tuned model
    hf_dir = convert_to_hf(out, tmp_path / "hf")
    with torch.no_grad():
        written = AutoModelForCausalLM.from_pretrained(hf_dir).eval()(input_ids=x).logits
    torch.testing.assert_close(written, ours, atol=1e-5, rtol=1e-5)


def test_model_mmap_false_loads_its_base_copied_and_still_unmerged(tmp_path):
    _, result = adapter_only_finetune(tmp_path, model={"mmap": False})
    loaded = load(tmp_path / "out")
    assert has_lora(loaded.model) and not any(isinstance(m, MappedExperts) for m in loaded.model.modules())
    x = torch.randint(0, 300, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.model(input_ids=x).logits, unwrap(result.model).eval()(input_ids=x).logits
        )


def test_quantize_merges_an_adapter_only_output_one_expert_slice_at_a_time(tmp_path, monkeypatch):
    """``moe-lab quantize`` of a LoRA output that holds its adapter alone: the adapter is merged into each expert
    slice of the memory-mapped base as that slice is quantized, giving the codes of quantizing the merged model.
    Before, the whole base was loaded and merged first: 26.7 GiB for a fine-tune of Qwen1.5-MoE-A2.7B, more than
    the 24 GiB machine it fine-tuned on holds."""
    from peft.tuners.lora import layer as peft_lora

    from moe_core import loading
    from moe_core.inference.quantize.weight_only import quantize_experts
    from moe_core.quantized import expert_modules

    adapter_only_finetune(tmp_path)
    out = tmp_path / "out"
    config = QuantConfig(bits=4, group_size=16)
    reference = load(out, merged=True).model  # the adapter merged into the whole base, then quantized
    quantize_experts(reference, config)

    mapped, original = [], loading.base_as_trained

    def base_as_trained(*args):
        base = original(*args)
        mapped.append(any(isinstance(m, MappedExperts) for m in base.modules()))
        return base

    def merged_whole(self, *args, **kwargs):
        raise AssertionError("an expert stack was merged whole")

    monkeypatch.setattr(loading, "base_as_trained", base_as_trained)
    monkeypatch.setattr(peft_lora.ParamWrapper, "merge", merged_whole)
    report = quantize_checkpoint(out, tmp_path / "int4", config)
    monkeypatch.undo()
    assert mapped == [True]  # the base as the fine-tune held it: views of its files

    quantized = load(tmp_path / "int4")
    assert quantized.kind == "quantized" and not has_lora(quantized.model)
    pairs = list(zip(expert_modules(quantized.model), expert_modules(reference), strict=True))
    assert report.experts_quantized == sum(m.num_experts for _, m in expert_modules(reference))
    for (name, ours), (ref_name, ref) in pairs:
        assert name == ref_name and isinstance(ours, QuantizedExperts)
        for p in ref.projections:
            assert torch.equal(getattr(ours, f"{p}_q"), getattr(ref, f"{p}_q")), (name, p)
            assert torch.equal(getattr(ours, f"{p}_scale"), getattr(ref, f"{p}_scale")), (name, p)
    x = torch.randint(0, 300, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(quantized.model(input_ids=x).logits, reference(input_ids=x).logits)
    # the fine-tune's tokenizer and prompt framing travel with it (generate frames prompts as training did)
    assert (tmp_path / "int4" / "prompt_framing.json").is_file()
    assert quantized.tokenizer.chat_template == load(out).tokenizer.chat_template


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_convert_to_hf_merges_an_adapter_only_output_as_it_writes(tmp_path, monkeypatch, stored):
    """``moe-lab convert to-hf OUT`` of an output holding its adapter alone writes from the memory-mapped base, the
    adapter merged into each expert projection as it is written (never stacked into memory): the same files as
    converting the adapter merged into a copy of the whole base, in the dtype the base's files hold (a float32
    fine-tune, the default, of a bf16 checkpoint is written in bf16, as before)."""
    from safetensors.torch import load_file

    source = hf_checkpoint(tmp_path, "olmoe")
    if stored is torch.bfloat16:
        AutoModelForCausalLM.from_pretrained(source, dtype=stored).save_pretrained(source)
    adapter_only_finetune(tmp_path, source=source)
    out = tmp_path / "out"
    reference = convert_to_hf(out / "adapter", tmp_path / "reference")  # merged into the whole base first

    def stacked_in_memory(self):
        raise AssertionError("a memory-mapped experts module was stacked into memory")

    monkeypatch.setattr(MappedExperts, "densified", stacked_in_memory)
    written = convert_to_hf(out, tmp_path / "hf")
    monkeypatch.undo()
    ours, theirs = load_file(written / "model.safetensors"), load_file(reference / "model.safetensors")
    assert ours.keys() == theirs.keys() and {t.dtype for t in ours.values()} == {stored}
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert sorted(p.name for p in written.iterdir()) == sorted(p.name for p in reference.iterdir())


@pytest.mark.parametrize("criterion", ["frequency", "reap"])
def test_prune_ranks_an_adapter_only_output_as_it_trained_and_merges_the_kept_experts_as_it_writes(
    tmp_path, monkeypatch, criterion
):
    """``moe-lab prune OUT`` of an output holding its adapter alone: its experts are ranked by the routing (REAP:
    and the outputs, the adapter's LoRA in them) of the adapter over the memory-mapped base, and the adapter is
    merged into the kept experts as they are written (never stacked into memory): the same experts kept and the
    same weights written as pruning the adapter merged into a copy of the whole base. REAP had loaded and merged
    the whole base."""
    import json

    from safetensors.torch import load_file

    from moe_core.inference.prune import PruneConfig, prune_checkpoint

    adapter_only_finetune(tmp_path)
    out = tmp_path / "out"
    batches = [torch.randint(0, 300, (4, 16)) for _ in range(2)]
    prune = PruneConfig(keep_experts=2, criterion=criterion)
    reference = prune_checkpoint(out / "adapter", None, tmp_path / "reference", prune, calibration=batches)

    def stacked_in_memory(*args, **kwargs):
        raise AssertionError(
            "a memory-mapped experts module was stacked into memory, or a stack merged whole"
        )

    from peft.tuners.lora import layer as peft_lora

    monkeypatch.setattr(MappedExperts, "densified", stacked_in_memory)
    monkeypatch.setattr(peft_lora.ParamWrapper, "merge", stacked_in_memory)
    report = prune_checkpoint(out, None, tmp_path / "pruned", prune, calibration=batches)
    monkeypatch.undo()
    assert report.kept == reference.kept
    ours, theirs = (
        load_file(tmp_path / "pruned" / "model.safetensors"),
        load_file(tmp_path / "reference" / "model.safetensors"),
    )
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    pruned = load(tmp_path / "pruned")
    assert pruned.kind == "pruned" and pruned.config.num_experts == 2
    assert json.loads((tmp_path / "pruned" / "pruning.json").read_text())["experts_after"] == 2
    assert (tmp_path / "pruned" / "prompt_framing.json").is_file()  # the fine-tune's framing travels with it


@pytest.mark.slow
def test_writers_read_a_qlora_output_merged_into_its_full_precision_base(tmp_path):
    """quantize and convert on a QLoRA output: the adapter merged into the bf16/fp32 base they came from (before:
    a quantized checkpoint of PEFT-wrapped keys that did not load, and an internal conversion error)."""
    _, result = adapter_only_finetune(tmp_path, method="qlora", quantize={"group_size": 16})
    out = tmp_path / "out"
    assert any(isinstance(m, QuantizedExperts) for m in load(out).model.modules())  # as it trained
    with pytest.raises(LoadError, match="a QLoRA fine-tune loads on its quantized base, not memory-mapped"):
        load(out, memory_map=True)
    reference = load(out / "adapter").model  # the adapter merged into the full-precision base
    x = torch.randint(0, 300, (2, 10))
    with torch.no_grad():
        expected = reference(input_ids=x).logits
        hf_dir = convert_to_hf(out, tmp_path / "hf")
        written = AutoModelForCausalLM.from_pretrained(hf_dir).eval()(input_ids=x).logits
        torch.testing.assert_close(written, expected, atol=1e-5, rtol=1e-5)
        report = quantize_checkpoint(out, tmp_path / "int8", QuantConfig(bits=8))
        quantized = load(tmp_path / "int8").model
        assert report.experts_quantized > 0 and not has_lora(quantized)
        drift = (quantized(input_ids=x).logits - expected).abs().max()
        assert drift < 0.05 * expected.abs().max(), drift  # int8 of the merged model, not of the 4-bit base


def test_eval_reads_a_model_above_1b_parameters_in_its_stored_dtype(tmp_path, monkeypatch, capsys):
    """``moe-lab eval`` / ``analyze`` (``--dtype auto``): float32 up to 1 B parameters, as before; above, the
    checkpoint's own dtype, said in one line (a float32 copy of a published bf16 MoE is twice its size, and an
    adapter-only fine-tune's base maps only in the dtype its files hold); ``--dtype`` overrides."""
    from argparse import Namespace

    from moe_core.eval.cli import model_dtype
    from moe_core.finetune import sizing

    source = hf_checkpoint(tmp_path, "olmoe")
    assert model_dtype(Namespace(dtype="auto"), str(source)) is torch.float32
    monkeypatch.setattr(sizing, "LARGE_MODEL_PARAMS", 1000)
    assert model_dtype(Namespace(dtype="auto"), str(source)) is None
    assert "evaluated in the dtype its checkpoint holds" in capsys.readouterr().err
    assert model_dtype(Namespace(dtype="float32"), str(source)) is torch.float32
    assert model_dtype(Namespace(dtype="bfloat16"), str(source)) is torch.bfloat16


def test_a_moved_base_is_named_with_the_file_that_recorded_it(tmp_path):
    """The base was moved after the fine-tune: loading says which file named it and how to give its new place,
    and ``base=`` loads it from there."""
    from moe_core.finetune.config import FinetuneError

    source, _ = adapter_only_finetune(tmp_path)
    out = tmp_path / "out"
    moved = source.rename(tmp_path / "moved")
    with pytest.raises(
        FinetuneError, match=r"model.path in .*out/finetune_config.json: .*hf_olmoe\) does not load"
    ):
        load(out)
    with pytest.raises(LoadError, match=r"base_model_name_or_path in .*adapter/adapter_config.json"):
        load(out / "adapter")
    assert has_lora(load(out, base=moved).model)
    # (merging through PEFT, it says the adapter's recorded base was renamed: here it was, on purpose)
    with pytest.warns(UserWarning, match="base_model_name_or_path` was renamed"):
        assert not has_lora(load(out / "adapter", base=moved).model)
    # the commands that run an output as it trained take it as --base (the message names it)
    from moe_lab.cli import main

    with pytest.raises(FinetuneError, match="--base DIR for moe-lab generate, eval and analyze"):
        load(out)
    assert (
        main(["generate", str(out), "--prompt", "the red", "--max-new-tokens", "2", "--base", str(moved)])
        == 0
    )
    report = main(["eval", "--model", str(out), "--generate", "--max-new-tokens", "2", "--base", str(moved)])
    assert report == 0


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_quantization_of_an_adapter_only_output_merges_as_it_quantizes(
    tmp_path, monkeypatch, method
):
    """``moe-lab quantize --method gptq|awq`` of a LoRA output holding its adapter alone calibrates on the adapter
    as it trained (unmerged, over the memory-mapped base) and quantizes each expert from its slices with the
    adapter's deltas added as they are read: it had merged the adapter into the whole base first (what a fine-tune
    of Qwen1.5-MoE-A2.7B, 26.7 GiB, cannot do on the 24 GiB machine it trained on). The codes are those of the
    merged model: the calibration inputs differ from the merged model's by rounding alone (float32 here), and
    every expert's weights are the merged ones."""
    from peft.tuners.lora import layer as peft_lora

    from moe_core.inference.quantize.weight_only import quantize_experts
    from moe_core.quantized import expert_modules
    from tests.helpers import token_ids

    adapter_only_finetune(tmp_path)
    out = tmp_path / "out"
    config = QuantConfig(bits=4, group_size=16, method=method, min_tokens=8)
    torch.manual_seed(1)
    calibration = [token_ids(4, 16) for _ in range(2)]
    reference = load(out, merged=True).model  # the adapter merged into the whole base, then quantized
    reference_report = quantize_experts(reference, config, calibration)

    def merged_whole(self, *args, **kwargs):
        raise AssertionError("an expert stack was merged whole")

    monkeypatch.setattr(peft_lora.ParamWrapper, "merge", merged_whole)
    monkeypatch.setattr(MappedExperts, "densified", merged_whole)
    report = quantize_checkpoint(out, tmp_path / "int4", config, calibration)
    monkeypatch.undo()

    quantized = load(tmp_path / "int4")
    assert quantized.kind == "quantized" and not has_lora(quantized.model)
    assert report.calibration_tokens == reference_report.calibration_tokens  # the same routing
    assert report.experts_quantized == reference_report.experts_quantized
    for (name, ours), (_, ref) in zip(
        expert_modules(quantized.model), expert_modules(reference), strict=True
    ):
        for p in ref.projections:
            same = (getattr(ours, f"{p}_q") == getattr(ref, f"{p}_q")).float().mean()
            assert same > 0.999, (name, p, same)  # (all equal here; a rounding apart may flip one)
            for k in ("scale", "in_scale"):  # equal up to the calibration inputs' rounding
                if hasattr(ref, f"{p}_{k}"):
                    torch.testing.assert_close(getattr(ours, f"{p}_{k}"), getattr(ref, f"{p}_{k}"))
    x = torch.randint(0, 300, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(
            quantized.model(input_ids=x).logits, reference(input_ids=x).logits, atol=1e-3, rtol=1e-3
        )
