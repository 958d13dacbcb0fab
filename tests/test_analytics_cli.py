"""`moe-lab analyze` and `moe-lab eval` end to end on a few prepared blocks of the built-in corpus."""

from __future__ import annotations

import argparse
import json

import pytest

from moe_core.analytics import cli as analytics_cli
from moe_core.analytics.profile import RouterProfile
from moe_core.data import prepare
from moe_core.eval import cli as eval_cli


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moe-lab")
    subparsers = parser.add_subparsers(dest="command", required=True)
    analytics_cli.add_cli(subparsers)
    eval_cli.add_cli(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "prepared"
    return prepare.prepare(
        prepare.PrepareConfig(max_documents=12, vocab_size=300, seq_len=32, validate=False), out
    )


@pytest.mark.slow
def test_analyze_writes_profile_plots_and_cost(data_dir, tmp_path, capsys):
    out = tmp_path / "analysis"
    assert (
        run(
            [
                "analyze",
                "--preset",
                "mixtral-tiny",
                "--data",
                str(data_dir),
                "--out",
                str(out),
                "--batch-size",
                "2",
                "--max-batches",
                "2",
                "--throughput-steps",
                "1",
                "--train-tokens",
                "1000",
                "--train-seconds",
                "36",
            ]
        )
        == 0
    )
    profile = RouterProfile.from_dir(out / "profile")
    assert profile.dataset["tokens"] == 2 * 2 * 32 and profile.dataset["split"] == "validation"
    assert profile.domain_names and "identifier" in profile.class_names
    assert all(layer.kept_E.sum() == layer.tokens * 2 for layer in profile.layers)  # dropless top-2
    assert sum(len(top) for top in profile.layers[0].top_tokens) > 0
    assert (out / "plots" / "expert_load.png").stat().st_size > 5_000
    assert (out / "plots" / "token_routing.html").is_file()
    cost = json.loads((out / "cost.json").read_text())
    assert cost["training"]["usd"] == pytest.approx(0.4 * 36 / 3600)  # documented cpu default, 0.01 h
    assert "cv" in capsys.readouterr().out


@pytest.mark.slow
def test_eval_writes_table_and_generations(data_dir, tmp_path, capsys):
    out = tmp_path / "eval"
    assert (
        run(
            [
                "eval",
                "--preset",
                "mixtral-tiny",
                "--data",
                str(data_dir),
                "--splits",
                "validation",
                "--max-batches",
                "1",
                "--batch-size",
                "2",
                "--generate",
                "--max-new-tokens",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads((out / "eval.json").read_text())
    assert report["splits"]["validation"]["tokens"] == 2 * 31
    assert report["generations"] == 2 * 8  # greedy + sampled for each project prompt
    assert "| model |" in (out / "comparison.md").read_text()
    assert len((out / "generations.jsonl").read_text().splitlines()) == 16
