"""`moe_core.load`: every checkpoint kind the lab writes or converts comes back as the model that was saved
(same logits), with its tokenizer, and a directory that holds none says what it found."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_core import load
from moe_core.convert import to_hf
from moe_core.finetune import FinetuneConfig, finetune
from moe_core.inference.prune import PruneConfig, prune_checkpoint
from moe_core.inference.quantize import (
    QuantConfig,
    QuantizationError,
    QuantizedExperts,
    quantize_experts,
    save_quantized,
)
from moe_core.loading import LoadError
from moe_core.model import MoEForCausalLM
from moe_core.train import TrainConfig, train
from moe_core.train.checkpoint import export_checkpoint
from tests.finetune_helpers import instruction_records, tiny_model, tiny_tokenizer
from tests.helpers import tiny_mixtral, token_ids

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def logits(model, ids_BS):
    with torch.no_grad():
        return model(input_ids=ids_BS).logits


def test_our_model_directory_loads_with_its_tokenizer_in_the_requested_dtype(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    loaded = load(tmp_path, dtype=torch.float32)
    assert loaded.kind == "model" and loaded.path == tmp_path and not loaded.model.training
    assert loaded.tokenizer is not None and loaded.config.num_experts == model.config.num_experts
    ids = token_ids(vocab=300)
    torch.testing.assert_close(logits(loaded.model, ids), logits(model.eval(), ids), atol=0, rtol=0)
    assert load(tmp_path, dtype="bfloat16").model.dtype == torch.bfloat16


def test_training_checkpoint_and_output_directory(tmp_path, monkeypatch):
    config = TrainConfig.build(
        {
            "model": {"preset": "switch-tiny"},
            "steps": 2,
            "batch_size": 2,
            "data": {"source": "synthetic", "seq_len": 16, "synthetic_blocks": 32},
            "log": {"every": 1, "progress": "off"},
            "checkpoint": {"every": 2},
            "eval": {"batches": 1},
        }
    )
    result = train(config, tmp_path)
    # a training checkpoint's model is built on the meta device and given its tensors, as read (a float32 model
    # initialized at random first would hold 4 bytes a parameter more: 26 GiB for a 7 B model), when it is loaded
    # and when it is exported to a model directory
    built_on, build = [], MoEForCausalLM.__init__

    def recorded(self, *args, **kwargs):
        built_on.append(torch.empty(()).device.type)
        build(self, *args, **kwargs)

    monkeypatch.setattr(MoEForCausalLM, "__init__", recorded)
    from_checkpoint = load(result.checkpoint)
    export_checkpoint(result.checkpoint, tmp_path / "exported")
    monkeypatch.undo()
    assert built_on == ["meta", "meta"]
    from_run = load(tmp_path)
    assert from_checkpoint.kind == "checkpoint" and from_checkpoint.path == result.checkpoint
    assert from_run.kind == "model" and from_run.path == result.export_dir  # the run's exported final/
    ids = token_ids(vocab=from_run.config.vocab_size)
    torch.testing.assert_close(
        logits(from_checkpoint.model, ids), logits(from_run.model, ids), atol=0, rtol=0
    )
    exported = load(tmp_path / "exported").model
    torch.testing.assert_close(logits(exported, ids), logits(from_run.model, ids), atol=0, rtol=0)


def test_finetuned_output_merged_and_adapter_load_the_same_model(tmp_path):
    base = tiny_model()
    base.save_pretrained(tmp_path / "base")
    tiny_tokenizer().save_pretrained(tmp_path / "base")
    config = FinetuneConfig.build(
        {
            "model": {"path": str(tmp_path / "base")},
            "steps": 2,
            "batch_size": 4,
            "optim": {"lr": 5e-2},
            "lora": {"r": 4},
        }
    )
    result = finetune(config, tmp_path / "ft", records=instruction_records(8))
    root, merged, adapter = (
        load(tmp_path / "ft"),
        load(result.merged_dir),
        load(result.adapter_dir, base=tmp_path / "base"),
    )
    assert (root.kind, merged.kind, adapter.kind) == ("finetuned", "model", "adapter")
    assert root.tokenizer is not None and adapter.tokenizer is not None  # the adapter's: its base model's
    ids = token_ids(vocab=300)
    expected = logits(merged.model, ids)
    torch.testing.assert_close(logits(root.model, ids), expected, atol=0, rtol=0)
    torch.testing.assert_close(logits(adapter.model, ids), expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits(base.eval(), ids), expected, atol=1e-4)  # the fine-tune changed it

    # an adapter file that lacks a tensor is refused (PEFT would keep that tensor's random initial value)
    torn = tmp_path / "torn"
    shutil.copytree(result.adapter_dir, torn)
    state = load_file(torn / "adapter_model.safetensors")
    first = next(k for k in state if "lora_A" in k)
    save_file({k: v for k, v in state.items() if k != first}, torn / "adapter_model.safetensors")
    with pytest.raises(LoadError, match=rf"adapter_model\.safetensors: .*missing 1 tensor, first {first}"):
        load(torn, base=tmp_path / "base")


def test_quantized_directory_rebuilds_quantized_experts(tmp_path):
    model = tiny_mixtral()
    config = QuantConfig(bits=4, group_size=16)
    save_quantized(model, tmp_path, config, quantize_experts(model, config))
    loaded = load(tmp_path)
    assert loaded.kind == "quantized"
    assert isinstance(loaded.model.model.layers[0].mlp.experts, QuantizedExperts)
    torch.testing.assert_close(logits(loaded.model, token_ids()), logits(model, token_ids()))


def test_pruned_directory_has_fewer_experts_and_says_so(tmp_path):
    model = tiny_mixtral()
    model.save_pretrained(tmp_path / "model")
    prune_checkpoint(
        tmp_path / "model",
        None,
        tmp_path / "pruned",
        PruneConfig(keep_experts=2),
        calibration=[token_ids(4, 16)],
    )
    loaded = load(tmp_path / "pruned")
    assert loaded.kind == "pruned" and loaded.config.num_experts == 2
    assert json.loads((tmp_path / "pruned" / "pruning.json").read_text())["experts_after"] == 2
    assert logits(loaded.model, token_ids()).isfinite().all()


def test_hugging_face_checkpoint_is_converted_exactly(tmp_path):
    model = tiny_mixtral()
    to_hf(model, tmp_path / "hf", "mixtral")
    loaded = load(tmp_path / "hf", dtype=torch.float32)
    assert loaded.kind == "hf" and loaded.config.hf_origin
    torch.testing.assert_close(logits(loaded.model, token_ids()), logits(model, token_ids()))


def test_a_directory_with_no_checkpoint_names_the_path_and_what_it_found(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(LoadError) as err:
        load(tmp_path)
    assert str(tmp_path) in str(err.value) and "notes.txt, weights.bin" in str(err.value)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(LoadError, match="model_type 'llama'"):
        load(tmp_path)


def test_weights_that_do_not_cover_the_model_are_refused_naming_the_file_and_first_tensor(tmp_path):
    """Issue 30 §1: transformers would initialize the missing tensors at random with only a warning."""
    tiny_mixtral().save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    dropped = [k for k in state if ".mlp.experts." in k]
    save_file({k: v for k, v in state.items() if k not in dropped}, tmp_path / "model.safetensors")
    with pytest.raises(LoadError) as err:
        load(tmp_path)
    message = str(err.value)
    assert str(tmp_path / "model.safetensors") in message and "\n" not in message
    assert f"missing {len(dropped)} tensors, first model.layers.0.mlp.experts." in message
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(LoadError, match="no model.safetensors"):
        load(tmp_path)


def test_quantized_weights_without_or_with_a_torn_quantization_json_are_refused(tmp_path):
    """What `moe-lab quantize` killed before its last file used to leave: taken for a plain model, it loaded
    with random experts; killed while re-quantizing over a good output, it left a 0-byte quantization.json."""
    model = tiny_mixtral()
    config = QuantConfig()
    save_quantized(model, tmp_path / "q", config, quantize_experts(model, config))
    (tmp_path / "q" / "quantization.json").unlink()
    with pytest.raises(LoadError, match=r"no quantization\.json .*--overwrite") as err:
        load(tmp_path / "q")
    assert "missing" in str(err.value) and "unexpected" in str(err.value)
    (tmp_path / "q" / "quantization.json").write_text("")
    with pytest.raises(QuantizationError, match=r"quantization\.json: not valid JSON") as err:
        load(tmp_path / "q")
    assert "\n" not in str(err.value)


def test_a_tied_lm_head_is_not_missing(tmp_path):
    model = tiny_mixtral(tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    loaded = load(tmp_path, dtype=torch.float32)
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    torch.testing.assert_close(logits(loaded.model, token_ids()), logits(model, token_ids()), atol=0, rtol=0)
