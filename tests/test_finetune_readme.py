"""The README's fine-tuning example runs exactly as printed, and so does `moe-lab finetune`."""

import json
import re
from pathlib import Path

import pytest

from tests.finetune_helpers import instruction_records, tiny_model, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
README_EXAMPLE = re.compile(
    r"```python\n((?:(?!```).)*?from moe_core\.finetune import(?:(?!```).)*)```", re.S
)


def readme_snippet() -> str:
    match = README_EXAMPLE.search((REPO / "README.md").read_text())
    assert match, "README.md lost its fine-tuning example"
    return match.group(1)


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture()
def base_and_data(tmp_path):
    base_dir = tmp_path / "base"
    tiny_model().save_pretrained(base_dir)
    tiny_tokenizer().save_pretrained(base_dir)
    data_file = tmp_path / "sft.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in instruction_records(16)))
    return str(base_dir), str(data_file)


def test_readme_snippet_runs_as_printed(tmp_path, base_and_data):
    snippet = readme_snippet()
    assert len(snippet.strip().splitlines()) < 10
    base_dir, data_file = base_and_data
    scope = {"base_dir": base_dir, "data_file": data_file, "out_dir": str(tmp_path / "ft")}
    exec(compile(snippet, "README.md", "exec"), scope)
    result = scope["result"]
    assert (result.adapter_dir / "adapter_config.json").is_file()
    assert (result.merged_dir / "model.safetensors").is_file()
    assert result.report.expert_adapters  # ESFT picked experts in every MoE layer
    assert set(result.report.expert_adapters) == {0, 1}
    assert (tmp_path / "ft" / "esft_selection.json").is_file()


def test_cli_finetune_from_a_config_file(tmp_path, base_and_data, capsys):
    from moe_core.cli import main

    base_dir, data_file = base_and_data
    config = tmp_path / "ft.yaml"
    config.write_text(
        f"model: {{path: {base_dir}}}\ndata: {{source: {data_file}}}\nmethod: full\n"
        "freeze: {router: true}\nsteps: 2\n"
    )
    assert (
        main(["finetune", "--config", str(config), "--set", "batch_size=2", "--out", str(tmp_path / "out")])
        == 0
    )
    assert "moe-lab finetune: full/sft, 2 steps" in capsys.readouterr().out
    assert (tmp_path / "out" / "merged" / "config.json").is_file()
    assert (
        main(["finetune", "--config", str(config), "--set", "lora.rank=2", "--out", str(tmp_path / "x")]) == 2
    )
