"""Issue 30 §1: every command that writes a model or a report stages it (`moe_core.fileio.atomic_directory`,
`atomic_file`), so a command killed at any moment leaves the old result or nothing a later command trusts, and a
non-empty output is replaced only with --overwrite. (That the loader refuses what such a kill used to leave, and
never returns a model with random weights: tests/test_loading.py.)

The kills are real: the command runs in a fresh interpreter (``python -m moe_core`` equivalent) in which one
writer is wrapped to SIGKILL the process right after (or before) its n-th call."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moe_core import MoEForCausalLM, get_config, load
from moe_core.cli import main
from moe_core.data import prepare
from moe_core.data.tokenizer import train_tokenizer
from moe_core.fileio import staged_outputs

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

REPO = Path(__file__).resolve().parents[1]

KILLING_RUN = textwrap.dedent(
    """
    import importlib, os, signal, sys

    module, attr, nth, when = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    target = importlib.import_module(module)
    original = getattr(target, attr)
    calls = 0

    def killing(*args, **kwargs):
        global calls
        calls += 1
        if when == "before" and calls == nth:
            os.kill(os.getpid(), signal.SIGKILL)
        result = original(*args, **kwargs)
        if when == "after" and calls == nth:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(target, attr, killing)
    from moe_core.cli import main

    sys.exit(main(sys.argv[5:]))
    """
)


def run_killed(argv: list[str], module: str, attr: str, *, nth: int = 1, when: str = "after") -> None:
    """Run ``moe-lab ARGV`` in a fresh interpreter, SIGKILLed around the ``nth`` call of ``module.attr``."""
    done = subprocess.run(
        [sys.executable, "-c", KILLING_RUN, module, attr, str(nth), when, *map(str, argv)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == -9, f"not killed (exit {done.returncode}): {done.stderr[-2000:]}"


def contents(path: Path) -> dict[str, str]:
    """Every visible file under ``path`` (a directory or one file) with its hash: what a reader would see."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {
        str(p.relative_to(path.parent)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in files
        if not any(part.startswith(".") for part in p.relative_to(path.parent).parts)
    }


def visible(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Path:
    """A lab checkpoint (mixtral-tiny, 320 tokens) with its tokenizer."""
    directory = tmp_path_factory.mktemp("lab") / "model"
    torch.manual_seed(0)
    MoEForCausalLM(get_config("mixtral-tiny", vocab_size=320)).save_pretrained(directory)
    texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200)]
    train_tokenizer(texts, vocab_size=300, min_frequency=1).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "prepared"
    return prepare.prepare(
        prepare.PrepareConfig(max_documents=12, vocab_size=300, seq_len=32, validate=False), out
    )


@pytest.fixture(scope="module")
def quantized(lab, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("quantized") / "q"
    assert main(["quantize", str(lab), "--out", str(out)]) == 0
    return out


# ------------------------------------------------------------------------------------------------ quantize
# the moments of a quantize run: weights written, tokenizer copied, everything written but not yet renamed
QUANTIZE_MOMENTS = [
    ("moe_core.quantized", "save_file", "after"),
    ("moe_core.quantized", "copy_companion_files", "after"),
    ("moe_core.fileio", "replace_path", "before"),
]


@pytest.mark.slow
@pytest.mark.parametrize("module, attr, when", QUANTIZE_MOMENTS)
def test_quantize_killed_leaves_nothing_then_reruns_cleanly(lab, tmp_path, module, attr, when):
    out = tmp_path / "q"
    run_killed(["quantize", lab, "--out", out], module, attr, when=when)
    assert not out.exists()  # only a hidden temporary beside it, which nothing reads
    with pytest.raises(Exception, match=str(out.name)):
        load(out)
    assert main(["quantize", str(lab), "--out", str(out)]) == 0  # no --overwrite needed: nothing was there
    assert load(out).kind == "quantized"
    assert [p.name for p in tmp_path.iterdir()] == ["q"]  # the killed run's temporary is gone too


@pytest.mark.slow
@pytest.mark.parametrize("module, attr, when", QUANTIZE_MOMENTS)
def test_quantize_killed_while_overwriting_keeps_the_old_result(lab, quantized, tmp_path, module, attr, when):
    out = tmp_path / "q"
    subprocess.run(["cp", "-r", str(quantized), str(out)], check=True)
    before = contents(out)
    run_killed(["quantize", lab, "--out", out, "--overwrite", "--bits", "4"], module, attr, when=when)
    assert contents(out) == before
    loaded = load(out)
    assert loaded.kind == "quantized" and loaded.model.model.layers[0].mlp.experts.quant_config.bits == 8


def test_quantize_refuses_a_non_empty_out_without_overwrite(lab, quantized, tmp_path, capsys):
    out = tmp_path / "q"
    subprocess.run(["cp", "-r", str(quantized), str(out)], check=True)
    before = contents(out)
    assert main(["quantize", str(lab), "--out", str(out), "--bits", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not empty" in err and "--overwrite" in err and str(out) in err
    assert contents(out) == before
    assert main(["quantize", str(lab), "--out", str(out), "--bits", "4", "--overwrite"]) == 0
    assert load(out).model.model.layers[0].mlp.experts.quant_config.bits == 4
    assert [p.name for p in tmp_path.iterdir()] == ["q"]


def test_a_fault_between_writes_leaves_the_old_quantized_output(lab, quantized, tmp_path, monkeypatch):
    """The same in process: a writer that fails after the weights were written (a full disk, say)."""
    import moe_core.quantized as quantized_format

    out = tmp_path / "q"
    subprocess.run(["cp", "-r", str(quantized), str(out)], check=True)
    before = contents(out)

    def failing_copy(source, destination):
        raise OSError(5, "input/output error", str(destination))

    monkeypatch.setattr(quantized_format, "copy_companion_files", failing_copy)
    with pytest.raises(OSError):
        quantized_format.save_quantized(
            load(quantized).model, out, quantized_format.QuantConfig(), companions_from=lab, overwrite=True
        )
    assert contents(out) == before and [p.name for p in tmp_path.iterdir()] == ["q"]


# ------------------------------------------------------------------------------------------------ other commands
@pytest.mark.slow
def test_prune_killed_keeps_the_old_result_and_refuses_without_overwrite(lab, data_dir, tmp_path, capsys):
    out = tmp_path / "pruned"
    args = ["prune", str(lab), "--data", str(data_dir), "--calib-batches", "2", "--calib-batch-size", "2"]
    # the weights written, the tokenizer copied, pruning.json (the kind marker) not yet
    run_killed([*args, "--keep", "3", "--out", out], "moe_core.inference.prune", "copy_companion_files")
    assert not out.exists()
    assert main([*args, "--keep", "3", "--out", str(out)]) == 0
    before = contents(out)
    assert main([*args, "--keep", "2", "--out", str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err
    run_killed(
        [*args, "--keep", "2", "--out", out, "--overwrite"], "moe_core.fileio", "replace_path", when="before"
    )
    assert contents(out) == before
    assert load(out).kind == "pruned" and load(out).config.num_experts == 3


@pytest.mark.slow
def test_convert_and_gguf_export_killed_leave_nothing_or_the_old_file(lab, tmp_path, capsys):
    hf = tmp_path / "hf"
    to_hf = ["convert", "to-hf", lab, "--arch", "mixtral", "--out", hf]
    run_killed(to_hf, "moe_core.convert", "save_file", when="after")  # the weights written, not the config
    assert not hf.exists()
    assert main(list(map(str, to_hf))) == 0
    back = tmp_path / "back"
    run_killed(["convert", "from-hf", hf, "--out", back], "moe_core.fileio", "replace_path", when="before")
    assert not back.exists()

    gguf_file = tmp_path / "model.gguf"
    export = ["export", "gguf", hf, "--out", gguf_file]
    run_killed(export, "moe_core.fileio", "fsync_file", when="after")  # written and flushed, not renamed
    assert visible(tmp_path) == ["hf"]
    assert main(list(map(str, export))) == 0
    before = contents(gguf_file)
    assert main(list(map(str, export))) == 2
    assert "exists" in capsys.readouterr().err and contents(gguf_file) == before
    run_killed([*export, "--overwrite"], "moe_core.fileio", "fsync_file", when="after")
    assert contents(gguf_file) == before
    assert main([*map(str, export), "--overwrite"]) == 0
    assert visible(tmp_path) == ["hf", "model.gguf"]


@pytest.mark.slow
def test_analyze_and_eval_killed_keep_the_old_reports(lab, data_dir, tmp_path):
    analysis, evaluation = tmp_path / "analysis", tmp_path / "eval"
    common = ["--model", str(lab), "--data", str(data_dir), "--batch-size", "2", "--max-batches", "1"]
    analyze = ["analyze", *common, "--no-plots", "--throughput-steps", "1", "--out", str(analysis)]
    evaluate = ["eval", *common, "--splits", "validation", "--out", str(evaluation)]
    # analyze's profile is renamed into its staging directory first: the last rename is its second
    for argv, out, module, renames in (
        (analyze, analysis, "moe_core.analytics.cli", 2),
        (evaluate, evaluation, "moe_core.eval.cli", 1),
    ):
        run_killed(argv, module, "write_text", when="after")  # one report written, the others not
        assert not out.exists()
        assert main(argv) == 0
        before = contents(out)
        run_killed([*argv, "--overwrite"], "moe_core.fileio", "replace_path", nth=renames, when="before")
        assert contents(out) == before
        assert main(argv) == 2  # not empty, no --overwrite
        assert contents(out) == before


def test_data_validate_replaces_a_report_only_with_overwrite(tmp_path, capsys):
    source = tmp_path / "good.jsonl"
    source.write_text("\n".join(json.dumps({"text": f"line {i}"}) for i in range(5)) + "\n")
    report = tmp_path / "report.md"
    report.write_text("an earlier report\n")
    assert main(["data", "validate", str(source), "--report", str(report)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "exists" in err and "--overwrite" in err
    assert report.read_text() == "an earlier report\n"
    assert main(["data", "validate", str(source), "--report", str(report), "--overwrite"]) == 0
    assert "PASSED" in report.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.jsonl", "report.md"]


def test_export_onnx_refuses_a_non_empty_out_before_exporting(lab, quantized, tmp_path, capsys):
    out = tmp_path / "onnx"
    subprocess.run(["cp", "-r", str(quantized), str(out)], check=True)  # any earlier output
    before = contents(out)
    assert main(["export", "onnx", str(lab), "--out", str(out), "--no-validate"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not empty" in err and "--overwrite" in err
    assert contents(out) == before


def test_a_run_killed_among_its_staged_moves_leaves_a_staging_directory_the_next_run_removes(tmp_path):
    """`staged_outputs` (fine-tuning, the flows' reports) keeps its staging directory locked until every entry
    moved, so one left by a kill is removed by the next run, not left for a pid check a minute later."""
    out = tmp_path / "reports"
    script = textwrap.dedent(
        f"""
        import os, signal
        import moe_core.fileio as fileio

        original = fileio.replace_path

        def killing(src, dst):
            original(src, dst)
            os.kill(os.getpid(), signal.SIGKILL)  # after the first entry moved

        fileio.replace_path = killing
        with fileio.staged_outputs({str(out)!r}) as stage:
            (stage / "a.json").write_text("{{}}")
            (stage / "b.json").write_text("{{}}")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == -9, done.stderr[-2000:]
    assert len(list(out.glob(".staging.tmp-*"))) == 1
    with staged_outputs(out) as stage:
        (stage / "b.json").write_text("{}")
    assert sorted(p.name for p in out.iterdir()) == ["a.json", "b.json"]
