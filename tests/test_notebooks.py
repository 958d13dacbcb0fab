"""The tutorial notebooks (notebooks/*.ipynb) run top to bottom on tiny settings, and are committed without
outputs (what a reader sees is what the code makes, and diffs stay readable)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
REPO = Path(__file__).resolve().parents[1]


def test_there_are_tutorials():
    names = {p.stem for p in NOTEBOOKS}
    assert {
        "01_train_and_compare_with_dense",
        "02_inside_the_router",
        "03_finetune_hf_moe_with_expert_lora",
        "04_optimize_and_export",
    } <= names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_notebooks_have_no_outputs(path):
    import nbformat

    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name} cell {i}: strip outputs"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("NB_STEPS", "12")  # tiny: the whole set runs in about two minutes on 2 CPU cores
    monkeypatch.setenv("NB_WORK", str(tmp_path))
    monkeypatch.setenv("MOE_LAB_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError naming the cell and the traceback
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors
    stderr = "".join(o.get("text", "") for o in outputs if o.get("name") == "stderr")
    assert "IProgress not found" not in stderr  # progress bars are widgets, not a warning
    assert any("image/png" in o.get("data", {}) for o in outputs), "no figure was shown inline"
