"""A trained model behaves like a Hugging Face model: ``model.generate(**tokenizer(text, return_tensors="pt"))``
works (the tokenizer returns no token_type_ids) and config.json / generation_config.json carry the tokenizer's
BOS/EOS/PAD ids, through the Auto classes, `moe_core.load`, the `to-hf` export and the GGUF export; a model and
tokenizer saved before that was so get both fixed when loaded or exported."""

import json
import shutil

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from moe_core import load
from moe_core.cli import main
from moe_core.data.tokenizer import SPECIAL_TOKEN_FIELDS
from moe_core.train import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

BUILTIN_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # `train_tokenizer`'s PAD, BOS, EOS
GGUF_KEYS = {
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "pad_token_id": "padding_token_id",
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Two steps of mixtral-tiny on the built-in corpus (its own tokenizer: PAD 0, BOS 1, EOS 2)."""
    root = tmp_path_factory.mktemp("hf_generation")
    config = TrainConfig.build(
        {
            "model": {"preset": "mixtral-tiny"},
            "steps": 2,
            "batch_size": 2,
            "data": {
                "max_documents": 200,
                "vocab_size": 300,
                "seq_len": 32,
                "cache_dir": str(root / "cache"),
            },
            "log": {"progress": "off"},
        }
    )
    train(config, root / "run")
    return root / "run"


def special_ids(obj) -> dict:
    return {field: getattr(obj, field) for field in SPECIAL_TOKEN_FIELDS}


def assert_generates_from_tokenizer_output(model, tokenizer):
    inputs = tokenizer("hello", return_tensors="pt")
    assert set(inputs) == {"input_ids", "attention_mask"}
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    prompt_len = inputs["input_ids"].shape[1]
    assert out.shape[0] == 1 and prompt_len < out.shape[1] <= prompt_len + 4


def assert_saved_ids(directory, tokenizer):
    """config.json and generation_config.json of ``directory`` name the tokenizer's BOS, EOS and PAD."""
    expected = special_ids(tokenizer)
    assert None not in expected.values()
    for name in ("config.json", "generation_config.json"):
        saved = json.loads((directory / name).read_text())
        assert {field: saved.get(field) for field in SPECIAL_TOKEN_FIELDS} == expected, name


def test_auto_classes_load_the_export_and_generate_from_tokenizer_output(run_dir):
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert special_ids(tokenizer) == BUILTIN_IDS
    assert special_ids(model.config) == special_ids(model.generation_config) == special_ids(tokenizer)
    assert_saved_ids(run_dir / "final", tokenizer)
    assert_generates_from_tokenizer_output(model, tokenizer)


def test_moe_core_load_of_the_run_and_of_a_checkpoint_generates(run_dir):
    (checkpoint,) = (run_dir / "checkpoints").iterdir()
    assert json.loads((checkpoint / "config.json").read_text())["eos_token_id"] == 2
    for path in (run_dir, checkpoint):
        loaded = load(path)
        assert special_ids(loaded.config) == special_ids(loaded.tokenizer)
        assert special_ids(loaded.model.generation_config) == special_ids(loaded.tokenizer)
        assert_generates_from_tokenizer_output(loaded.model, loaded.tokenizer)


def test_to_hf_and_gguf_exports_carry_the_ids_and_the_tokenizer(run_dir, tmp_path, capsys):
    (checkpoint,) = (run_dir / "checkpoints").iterdir()  # keeps no tokenizer files: it names its data's
    hf = tmp_path / "hf"
    assert main(["convert", "to-hf", str(checkpoint), "--arch", "mixtral", "--out", str(hf)]) == 0
    tokenizer = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf)
    assert type(model).__name__ == "MixtralForCausalLM"
    assert_saved_ids(hf, tokenizer)
    assert_generates_from_tokenizer_output(model, tokenizer)

    assert main(["export", "gguf", str(hf), "--out", str(tmp_path / "model.gguf")]) == 0
    capsys.readouterr()
    assert gguf_ids(tmp_path / "model.gguf") == special_ids(tokenizer)


def gguf_ids(path) -> dict:
    reader = gguf.GGUFReader(path)
    found = {}
    for field, key in GGUF_KEYS.items():
        entry = reader.fields.get(f"tokenizer.ggml.{key}")
        found[field] = None if entry is None else int(entry.parts[entry.data[0]][0])
    return found


def make_old(directory) -> None:
    """What a model exported before this fix looks like: no special ids, the tokenizer's default inputs."""
    for name in ("config.json", "generation_config.json"):
        saved = json.loads((directory / name).read_text())
        for field in SPECIAL_TOKEN_FIELDS:
            saved.pop(field, None)
        (directory / name).write_text(json.dumps(saved))
    for tokenizer_config in directory.rglob("tokenizer_config.json"):
        saved = json.loads(tokenizer_config.read_text())
        saved.pop("model_input_names", None)
        tokenizer_config.write_text(json.dumps(saved))


def test_a_model_saved_before_the_ids_were_recorded_gets_them_from_its_tokenizer(run_dir, tmp_path, capsys):
    old = tmp_path / "old"
    shutil.copytree(run_dir / "final", old)
    make_old(old)
    # (what a user saw before, on transformers 4: token_type_ids from the tokenizer; transformers 5's tokenizers
    # no longer add them unasked, so the old files are what this test recreates)

    loaded = load(old)
    assert special_ids(loaded.config) == special_ids(loaded.tokenizer) == BUILTIN_IDS
    assert special_ids(loaded.model.generation_config) == special_ids(loaded.tokenizer)
    assert_generates_from_tokenizer_output(loaded.model, loaded.tokenizer)

    hf = tmp_path / "hf"
    assert main(["convert", "to-hf", str(old), "--arch", "mixtral", "--out", str(hf)]) == 0
    tokenizer = AutoTokenizer.from_pretrained(hf)
    assert_saved_ids(hf, tokenizer)
    assert_generates_from_tokenizer_output(AutoModelForCausalLM.from_pretrained(hf), tokenizer)

    make_old(hf)  # an older HF export: the GGUF export finds the ids in its tokenizer files
    assert main(["export", "gguf", str(hf), "--out", str(tmp_path / "model.gguf")]) == 0
    capsys.readouterr()
    assert gguf_ids(tmp_path / "model.gguf") == special_ids(tokenizer)


def test_quantizing_a_training_checkpoint_keeps_its_tokenizer_and_ids(run_dir, tmp_path):
    from moe_core.inference.quantize import QuantConfig, quantize_checkpoint

    (checkpoint,) = (run_dir / "checkpoints").iterdir()  # its tokenizer is the data's, not in the directory
    quantize_checkpoint(checkpoint, tmp_path / "q", QuantConfig(bits=8, group_size=16))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "q")
    assert special_ids(tokenizer) == BUILTIN_IDS
    loaded = load(tmp_path / "q")
    assert loaded.kind == "quantized" and special_ids(loaded.config) == BUILTIN_IDS
    assert_generates_from_tokenizer_output(loaded.model, tokenizer)
