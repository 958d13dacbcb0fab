"""benchmarks/load_published.py cannot rot before the full-width runs: its --tiny mode (a shrunken GLM-4.5-Air,
whose dense first layer makes the script raise --layers) runs end to end here, a child per load, and ends with
the JSON line the README's figures come from; the stand-in request (layers, expert cap) is checked on its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_helpers import benchmark_path, load_benchmark, repo_env

_PATH = benchmark_path("load_published")


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("load_published")


@pytest.mark.slow
def test_the_tiny_run_loads_copied_and_mapped_and_ends_with_its_json_line(tmp_path):
    cache = tmp_path / "cache"
    done = subprocess.run(
        [sys.executable, str(_PATH), "--tiny", "--only", "glm-4.5-air", "--layers", "1", "--max-experts", "4"]
        + ["--cache-dir", str(cache), "--delete", "--max-rss-gib", "4"],
        cwd=tmp_path,  # nothing depends on the working directory
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "load_published" and result["tiny"] is True
    assert result["max_experts"] == 4 and result["forward_tokens"] == 8
    assert {"cpus", "memory_gib", "torch", "transformers"} <= set(result["machine"])
    assert set(result["families"]) == {"glm-4.5-air"}
    fam = result["families"]["glm-4.5-air"]
    # --layers 1 is only the dense layer: raised to take one MoE layer in, and said so
    assert fam["layers"] == 2 and fam["layers_raised_from"] == 1 and fam["published_layers"] == 46
    assert fam["experts"] == 4 and fam["experts_capped"] == {"published": 128, "kept": 4}
    assert fam["deleted"] is True and not Path(fam["checkpoint"]).exists()
    assert Path(fam["checkpoint"]).parent == cache
    children = fam["children"]
    assert set(children) == {"imports", "copy", "mmap"}
    for kind, row in children.items():
        assert row["status"] == "ok", (kind, row)
        assert 0 < row["rss_anon_gib_at_peak"] + row["rss_file_gib_at_peak"] <= row["peak_rss_gib"] + 1e-3
        assert row["rss_anon_gib_at_peak"] <= row["peak_anon_gib"] <= row["peak_rss_gib"] + 1e-3
    for kind in ("copy", "mmap"):
        row = children[kind]
        assert row["logits_finite"] is True and row["logits_shape"][:2] == [1, 8]
        # every stored tensor became the model's, in bf16 (plus a few bytes of buffers: the router's fp32 bias)
        assert 0 <= row["model_bytes"] - fam["checkpoint_bytes"] <= 0.01 * fam["checkpoint_bytes"]
        assert row["load_s"] > 0 and row["peak_over_bytes"] > 0
        expected = (
            (row["peak_rss_gib"] - children["imports"]["peak_rss_gib"]) * 2**30 / fam["checkpoint_bytes"]
        )
        assert row["peak_less_imports_over_bytes"] == pytest.approx(expected, rel=2e-3)  # of rounded GiB
    assert "glm-4.5-air" in done.stdout and "experts capped" in done.stdout  # the table and its note


def test_the_request_raises_layers_past_dense_ones_and_caps_experts(bench):
    layers, overrides, notes = bench.standin_request("deepseek-v2-lite", 1, None, tiny=False)
    assert (layers, overrides, notes) == (2, {}, {"layers_raised_from": 1})
    layers, overrides, notes = bench.standin_request(
        "mixtral-8x7b", 1, 8, tiny=False
    )  # cap at the count: none
    assert (layers, overrides, notes) == (1, {}, {})
    layers, overrides, notes = bench.standin_request("qwen3-30b-a3b", 2, 4, tiny=False)
    assert overrides == {"num_experts": 4, "num_experts_per_tok": 4}  # top-8 of 4 cannot be: top-k follows
    assert notes == {"experts_capped": {"published": 128, "kept": 4}}
    layers, overrides, _ = bench.standin_request("gpt-oss-20b", 2, 16, tiny=False)
    assert overrides == {"num_local_experts": 16}


def test_a_stand_in_over_max_gib_is_refused_before_anything_is_built(bench, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--only", "glm-4.5-air", "--max-gib", "1", "--cache-dir", str(tmp_path)])
    assert exit_.value.code == 2
    assert "glm-4.5-air: 2 layers are 7.13 GiB on disk, over --max-gib 1" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
