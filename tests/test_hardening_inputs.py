"""Inputs that must not reach too far: a config naming a router never imports code by itself, and a typo in a
model field is refused (with the closest field) instead of being trained with silently."""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moe_core import MoEConfig, MoEForCausalLM, get_config, routing
from moe_core.cli import main
from moe_core.routing import ROUTER_MODULES_ENV, ROUTERS, allow_router_module
from moe_core.train.config import TrainConfig, TrainConfigError

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
REPO = Path(__file__).resolve().parents[1]

PLANTED = """
from pathlib import Path
Path({marker!r}).write_text("ran")   # the side effect: importing this module ran its code

import torch
from moe_core.routing import Router, register_router

@register_router({registered!r})
class {cls}(Router):
    def route(self, logits_TE):
        T, E = logits_TE.shape
        ids_TK = logits_TE.argmax(-1, keepdim=True)
        return self.record(logits_TE, logits_TE.softmax(-1), ids_TK, torch.ones_like(ids_TK, dtype=torch.float32))
"""


@pytest.fixture()
def planted(tmp_path, monkeypatch):
    """A module ``<name>.py`` in the working directory and on sys.path whose import leaves a marker file, and a
    saved model (with a tokenizer) whose config.json names a Router class in that module."""

    names = []

    def make(name: str, registered: str | None = None):
        code_dir = tmp_path / "code"
        code_dir.mkdir(exist_ok=True)
        marker = tmp_path / f"{name}.ran"
        (code_dir / f"{name}.py").write_text(
            PLANTED.format(marker=str(marker), registered=registered or name, cls="PlantedRouter")
        )
        monkeypatch.chdir(code_dir)
        monkeypatch.syspath_prepend(str(code_dir))
        monkeypatch.setenv(ROUTER_MODULES_ENV, "")
        names.append(name)
        model_dir = tmp_path / "model"
        torch.manual_seed(0)
        MoEForCausalLM(get_config("mixtral-tiny", vocab_size=64, num_experts_per_tok=1)).save_pretrained(
            model_dir
        )
        _char_tokenizer().save_pretrained(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        config["router"] = f"{name}.PlantedRouter"
        (model_dir / "config.json").write_text(json.dumps(config))
        return model_dir, marker

    yield make
    for name in names:
        sys.modules.pop(name, None)
        routing._ALLOWED_MODULES.discard(name)
    for key in [k for k, cls in ROUTERS.items() if cls.__name__ == "PlantedRouter"]:
        ROUTERS.pop(key)


def _char_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


# ------------------------------------------------------------------------------------------------ routers
def test_naming_a_module_does_not_import_it(capsys, monkeypatch):
    monkeypatch.delitem(sys.modules, "this", raising=False)
    with pytest.raises(ValueError, match="--router-module this"):
        get_config("mixtral-tiny", router="this.Router")
    assert "Beautiful is better" not in capsys.readouterr().out  # `import this` prints the Zen of Python
    assert "this" not in sys.modules


def test_model_folder_config_never_runs_planted_code(planted, capsys):
    model_dir, marker = planted("evilmod")
    with pytest.raises(ValueError, match="not allowed"):
        MoEForCausalLM.from_pretrained(model_dir)
    with pytest.raises(ValueError, match="not allowed"):
        MoEConfig.from_pretrained(model_dir)
    assert main(["generate", str(model_dir), "--prompt", "ab", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "evilmod.PlantedRouter" in err and "--router-module evilmod" in err and "Traceback" not in err
    assert main(["export", "onnx", str(model_dir), "--out", str(model_dir.parent / "onnx")]) == 2
    assert not marker.exists()
    assert "evilmod" not in sys.modules


def test_allowed_router_module_works(planted, capsys, monkeypatch):
    model_dir, marker = planted("mymod")
    assert (
        main(
            [
                "generate",
                str(model_dir),
                "--prompt",
                "ab",
                "--max-new-tokens",
                "2",
                "--no-stream",
                "--router-module",
                "mymod",
                "--json",
            ]
        )
        == 0
    )
    assert marker.exists()
    assert json.loads(capsys.readouterr().err.strip().splitlines()[-1])["new_tokens"] == 2
    assert os.environ[ROUTER_MODULES_ENV] == "mymod"  # torchrun workers and flows inherit the permission


def test_router_module_from_environment(planted, monkeypatch):
    model_dir, marker = planted("envmod", registered="planted_by_name")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "router": "planted_by_name"}))
    with pytest.raises(ValueError, match="unknown router 'planted_by_name'"):
        MoEForCausalLM.from_pretrained(model_dir)
    assert not marker.exists()
    monkeypatch.setenv(ROUTER_MODULES_ENV, "envmod")
    model = MoEForCausalLM.from_pretrained(model_dir)
    assert marker.exists() and type(model.model.layers[0].mlp.router).__name__ == "PlantedRouter"


def test_allow_router_module_refuses_non_module_names(capsys):
    with pytest.raises(ValueError, match="not a module name"):
        allow_router_module("os; print(1)")
    assert main(["generate", str(REPO), "--prompt", "a", "--router-module", "no_such_module_xyz"]) == 2
    assert "no_such_module_xyz" in capsys.readouterr().err  # refused as a module, not for the model path


def test_readme_registered_router_example_runs():
    readme = (REPO / "README.md").read_text()
    match = re.search(
        r"```python\n(from moe_core\.routing import Router, register_router\n.*?)```", readme, re.S
    )
    assert match, "README.md lost its router example"
    scope = {"torch": torch, "MoEForCausalLM": MoEForCausalLM, "get_config": get_config}
    try:
        exec(compile(textwrap.dedent(match.group(1)), "README.md", "exec"), scope)
        model = scope["model"]
        x = torch.randint(0, model.config.vocab_size, (2, 8))
        assert model(x, output_routing=True).routing[0].expert_ids_TK[:, 0].tolist() == [
            t % 8 for t in range(16)
        ]
    finally:
        ROUTERS.pop("hash", None)


# ------------------------------------------------------------------------------------------------ model fields
def test_unknown_model_field_is_refused_with_the_closest_name():
    with pytest.raises(ValueError, match="unknown field 'num_expert'; did you mean 'num_experts'"):
        get_config("switch-tiny", num_expert=2)
    with pytest.raises(ValueError, match="did you mean 'num_experts'"):
        MoEConfig(num_expert=2)
    with pytest.raises(TrainConfigError, match="model.overrides.*did you mean 'num_experts'"):
        TrainConfig.build({"model": {"overrides": {"num_expert": 2}}})
    with pytest.raises(TrainConfigError, match="did you mean 'num_experts'"):
        TrainConfig().with_overrides(["model.overrides.num_expert=2"])
    with pytest.raises(TrainConfigError, match="did you mean 'switch-tiny'"):
        TrainConfig.build({"model": {"preset": "switch-tiy"}}).model.build_config()
    with pytest.raises(TrainConfigError, match="did you mean 'lr'"):
        TrainConfig.build({"optim": {"lrr": 1e-3}})
    # standard transformers keys are still model fields
    assert get_config("switch-tiny", pad_token_id=0, torch_dtype="float32").pad_token_id == 0


def test_cli_refuses_a_model_typo_before_training(tmp_path, capsys):
    assert main(["train", "--set", "model.overrides.num_expert=2", "--out", str(tmp_path / "run")]) == 2
    assert "did you mean 'num_experts'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_saved_config_with_extra_keys_still_loads(tmp_path, caplog):
    """config.json files carry transformers' bookkeeping keys, and may carry a key this version does not know:
    loading keeps it (with a warning) instead of refusing the checkpoint."""
    MoEForCausalLM(get_config("switch-tiny", vocab_size=64)).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert {"transformers_version", "model_type", "architectures"} <= set(data)
    (tmp_path / "config.json").write_text(json.dumps({**data, "num_expert": 2}))
    model = MoEForCausalLM.from_pretrained(tmp_path)
    assert model.config.num_experts == 8 and model.config.num_expert == 2
    assert "num_expert" in caplog.text


# ------------------------------------------------------------------------------------------------ data caches
def test_no_copy_of_a_local_file_stays_in_any_cache(tmp_path, monkeypatch):
    """`datasets` kept an Arrow copy of every local file it read (also of files that failed validation) under
    ~/.cache/huggingface. Validate with every cache location in tmp_path, then look for the text."""
    import datasets

    from moe_core.data.errors import DataError
    from moe_core.data.validation import validate_source

    marker = "PLAINTEXT-MARKER-7f3a"
    src = tmp_path / "src"
    src.mkdir()
    (src / "dup.jsonl").write_text("".join(json.dumps({"text": f"{marker} same"}) + "\n" for _ in range(40)))
    (src / "broken.jsonl").write_text(
        "".join(json.dumps({"text": f"{marker} {i}"}) + "\n" for i in range(3000)) + "{not json\n"
    )
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MOE_LAB_DATA_CACHE", str(tmp_path / "lab"))
    # datasets reads HF_HOME / HF_DATASETS_CACHE when imported; point the values it uses at tmp_path
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    monkeypatch.setattr(datasets.config, "HF_CACHE_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(datasets.config, "DOWNLOADED_DATASETS_PATH", tmp_path / "hf-datasets" / "downloads")

    assert not validate_source(str(src / "dup.jsonl"), kind="text").success  # parses, fails the suite
    with pytest.raises(DataError, match="could not parse"):
        validate_source(str(src / "broken.jsonl"), kind="text")  # fails half way through the file
    copies = [
        p
        for p in tmp_path.rglob("*")
        if p.is_file() and src not in p.parents and marker.encode() in p.read_bytes()
    ]
    assert not copies, f"text of a local file left in {copies}"
    # validation streams the file (moe_core.data.stream): no `datasets` cache is written at all
    assert not any((tmp_path / "hf-datasets").rglob("*")) and not any((tmp_path / "hf").rglob("*"))
