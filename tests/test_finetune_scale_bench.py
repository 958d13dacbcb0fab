"""benchmarks/finetune_scale.py cannot rot before the full-size runs: its --tiny mode (a shrunken OLMoE) runs
end to end here, a child per variant, and ends with the JSON line the README's figures come from; the
memory watch and the optional variants are checked on their own, without training."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_helpers import benchmark_path, load_benchmark, repo_env

_PATH = benchmark_path("finetune_scale")


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("finetune_scale")


@pytest.mark.slow
def test_the_tiny_run_measures_both_sides_and_ends_with_its_json_line(tmp_path):
    done = subprocess.run(
        [sys.executable, str(_PATH), "--tiny", "--cache-dir", str(tmp_path), "--warmup", "1", "--steps", "1"]
        + ["--threads", "1", "--max-rss-gib", "4", "--profile", str(tmp_path / "profile")],
        cwd=tmp_path,  # nothing depends on the working directory
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "finetune_scale" and result["tiny"] is True
    assert result["model"] == "olmoe-1b-7b" and result["layers"] == 2 and result["published_layers"] == 16
    assert result["dtype"] == "bfloat16" and result["batch"] == 1 and result["seq"] == 64
    assert {"cpus", "memory_gib", "torch", "transformers", "peft", "device"} <= set(result["machine"])
    assert set(result["results"]) == {"baseline", "lab"}
    for name, row in result["results"].items():
        assert row["status"] == "ok", (name, row)
        assert row["step_s"] > 0 and len(row["step_s_all"]) == 2 and len(row["losses"]) == 2
        assert 0 < row["rss_anon_gib_at_peak"] + row["rss_file_gib_at_peak"] <= row["peak_rss_gib"] + 1e-3
        assert row["rss_anon_gib_at_peak"] <= row["peak_anon_gib"] <= row["peak_rss_gib"] + 1e-3
        assert row["torch_threads"] == 1
        assert len(row["anon_gib_after_step"]) == 2 and min(row["anon_gib_after_step"]) > 0
    base, lab = result["results"]["baseline"], result["results"]["lab"]
    # the same LoRA on both sides: r 8 on q/k/v/o and on every expert's three projections; under transformers 5
    # the baseline adapts the fused gate_up_proj, whose one LoRA shares its A factor between gate and up
    # (stock PEFT cannot adapt half of a fused parameter): r x hidden fewer per expert and layer
    config = json.loads((Path(result["checkpoint"]) / "config.json").read_text())
    shared_a = 0
    if int(result["machine"]["transformers"].split(".")[0]) >= 5:
        shared_a = result["layers"] * config["num_experts"] * 8 * config["hidden_size"]
    assert base["trainable_params"] + shared_a == lab["trainable_params"] > 0
    assert set(result["lab_over_baseline"]) == {"step_time", "peak_rss", "peak_anon"}
    assert result["lab_over_baseline"]["step_time"] == pytest.approx(lab["step_s"] / base["step_s"], rel=1e-2)
    assert "baseline" in done.stdout and "lab" in done.stdout  # the table
    # --profile: each variant's last step, its operators by self time, with their call counts
    for name in ("baseline", "lab"):
        table = (tmp_path / "profile" / f"{name}.profile.txt").read_text()
        assert "Self CPU" in table and "# of Calls" in table and "aten::" in table, table[:500]
    assert not list((tmp_path / "profile").glob("*.tmp"))
    # the stand-in is cached: a second build of the same request is the same directory, untouched
    assert Path(result["checkpoint"]).parent == tmp_path


def test_a_child_past_the_memory_limit_is_stopped_and_reported(bench, tmp_path):
    spec = {"threads": 1, "warmup": 0, "batch": 1, "seq": 8}
    row = bench.run_child("baseline", "baseline", spec, tmp_path, sys.executable, max_rss_gib=0.03)
    assert row["status"].startswith("stopped: resident set over --max-rss-gib 0.03")
    assert row["peak_rss_gib"] >= 0.03


def test_a_lab_field_that_has_not_landed_reads_not_available(bench):
    from moe_core.finetune.config import FinetuneError

    spec = {
        "checkpoint": "unused",
        "dtype": "bfloat16",
        "seq": 64,
        "batch": 1,
        "warmup": 0,
        "steps": 1,
        "gradient_checkpointing": False,
        "seed": 0,
        "lab_sets": ["no_such_section.field=1"],
    }
    with pytest.raises(bench.NotAvailable):
        bench.child_lab({**spec, "optional": True})
    with pytest.raises(FinetuneError):  # the lab's own variant never hides a refusal
        bench.child_lab({**spec, "optional": False})


def test_the_baseline_targets_name_attention_and_every_expert(bench):
    import re

    olmoe = re.compile(bench.baseline_targets("olmoe"))
    mixtral = re.compile(bench.baseline_targets("mixtral"))
    qwen = re.compile(bench.baseline_targets("qwen2_moe"))
    assert olmoe.fullmatch("model.layers.3.self_attn.q_proj")
    assert olmoe.fullmatch("model.layers.3.mlp.experts.63.down_proj")
    assert not olmoe.fullmatch("model.layers.3.mlp.gate")
    assert mixtral.fullmatch("model.layers.0.block_sparse_moe.experts.7.w2")
    assert qwen.fullmatch("model.layers.0.mlp.experts.59.up_proj")
    assert not qwen.fullmatch("model.layers.0.mlp.shared_expert.up_proj")  # the lab's default leaves it out
