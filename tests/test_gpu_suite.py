"""benchmarks/gpu_suite.py cannot rot between the times a GPU is at hand: its --dry-run (the checks of
tests/test_gpu.py on the CPU, and every measurement at tiny shapes) runs here and ends with its JSON line.

The ``finetune`` section is left out: it is ``measure_finetune`` (which the ``qlora`` section runs) on the
baseline and lab variants, and that tiny run is tests/test_finetune_scale_bench.py's (about 40 s of CI each)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_suite_dry_run_exercises_every_section(tmp_path):
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_suite.py", "--dry-run", "--out", str(tmp_path)]
        + ["--only", "moe_layer,train,decode,qlora"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    checks = result["checks"]
    assert checks["failed"] == [] and checks["counts"]["passed"] >= 14 and not checks["skipped"]
    assert set(result["moe_layer"]["tiny"]["ratio_vs_dense_active"]) >= {
        "ours-sorted",
        "hf-mixtral",
        "dense-active",
    }
    assert (
        result["train"]["olmoe-tiny/moe"]["tokens_per_s"] > 0
        and "vs_dense_active" in result["train"]["olmoe-tiny/moe"]
    )
    assert {"batch1", "batch32"} <= set(result["decode"])
    assert result["qlora"]["results"]["lab-qlora-nf4"]["status"] == "ok" and "finetune" not in result
    assert len(list(tmp_path.glob("*-dry-run.json"))) == 1 and len(list(tmp_path.glob("*-dry-run.txt"))) == 1
    # the fine-tuning sections' profiled steps, one table per variant
    (profile,) = tmp_path.glob("*-dry-run-profiles/lab-qlora-nf4.profile.txt")
    assert "aten::" in profile.read_text()
