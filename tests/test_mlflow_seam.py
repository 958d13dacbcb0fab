"""tasks/mlflow_seam.py: a model directory logged in MLflow's transformers flavor from its files still has the
layout MLflow's own ``save_model`` writes and still loads back through ``mlflow.transformers.load_model``; the
reason the seam exists (MLflow's local-checkpoint mode failing under transformers 5) still holds. An MLflow
upgrade that changes either fails here, naming what to do. Also: the tracking adapter logs a model without
reading its weights, and creates a fresh store's registry tables through MLflow's public API."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlflow
import mlflow.transformers
import pytest
import torch
import transformers
from mlflow.entities import LoggedModelStatus
from mlflow.models import Model

from tasks import mlflow_seam
from tests.finetune_helpers import tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

REQUIREMENTS = ["torch", "transformers"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A lab model directory as training exports it (config.json, safetensors, tokenizer), and its model."""
    directory = tmp_path_factory.mktemp("checkpoint") / "final"
    model = tiny_model().eval()
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory, model


@pytest.fixture(scope="module")
def ours(checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("ours") / "model"
    mlflow_seam.save_model(path, Model(), checkpoint[0], REQUIREMENTS)
    return path


def test_the_seam_names_the_mlflow_it_was_written_against():
    assert mlflow.__version__.split(".")[0] == "3", (
        f"mlflow {mlflow.__version__}: tasks/mlflow_seam.py was written against {mlflow_seam.UPSTREAM}"
    )


def test_mlflows_local_checkpoint_mode_still_fails_under_transformers_5(checkpoint, tmp_path):
    try:
        mlflow.transformers.save_model(
            str(checkpoint[0]), path=str(tmp_path / "m"), task=mlflow_seam.TASK, pip_requirements=REQUIREMENTS
        )
    except AttributeError as err:
        assert "__name__" in str(err)  # pipelines.check_task's "impl" is a dotted-path string
    else:
        pytest.fail(
            "mlflow.transformers.save_model(<a model directory>) works now: log with "
            "mlflow.transformers.log_model(model_dir, task='text-generation') in tasks/tracking.py and "
            "delete tasks/mlflow_seam.py (see its docstring)"
        )


def test_the_flavor_written_from_files_has_mlflows_own_layout(checkpoint, ours, tmp_path, monkeypatch):
    from moe_core.data.tokenizer import load_tokenizer

    directory, model = checkpoint
    theirs = tmp_path / "theirs"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # MLflow looks for a model card on the hub
    mlflow.transformers.save_model(
        {"model": model, "tokenizer": load_tokenizer(directory)},
        path=str(theirs),
        task=mlflow_seam.TASK,
        pip_requirements=REQUIREMENTS,
    )
    our_model, their_model = Model.load(str(ours)), Model.load(str(theirs))
    assert set(our_model.flavors) == set(their_model.flavors) == {"transformers", "python_function"}
    assert our_model.flavors["python_function"] == their_model.flavors["python_function"]
    flavor, expected = our_model.flavors["transformers"], their_model.flavors["transformers"]
    assert set(flavor) == set(expected), (
        "MLflow's transformers flavor keys changed: update tasks/mlflow_seam.py"
    )
    deliberate = {"pipeline_model_type", "source_model_name"}  # see MODEL_CLASS; theirs names the model's
    assert {k: v for k, v in flavor.items() if k not in deliberate} == {
        k: v for k, v in expected.items() if k not in deliberate
    }
    assert our_model.signature == their_model.signature

    def files(root, under=""):
        return {p.relative_to(root / under).as_posix() for p in (root / under).rglob("*") if p.is_file()}

    assert files(ours, "components") == files(theirs, "components")
    assert files(theirs, mlflow_seam.MODEL_DIR) <= files(
        ours, mlflow_seam.MODEL_DIR
    )  # and the checkpoint's rest
    top = {p.name for p in theirs.iterdir()} - {"LICENSE.txt", "model_card.md", "model_card_data.yaml"}
    assert top == {p.name for p in ours.iterdir()}
    assert (ours / "requirements.txt").read_text().splitlines() == (
        theirs / "requirements.txt"
    ).read_text().splitlines()


def test_the_flavor_written_from_files_loads_back_through_mlflow(checkpoint, ours):
    directory, model = checkpoint
    pipeline = mlflow.transformers.load_model(str(ours))  # the lab's model class: moe_core.model is imported
    assert type(pipeline.model) is type(model) and pipeline.task == mlflow_seam.TASK
    loaded = pipeline.model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    out = pipeline("hello", max_new_tokens=2, do_sample=False)
    assert out[0]["generated_text"].startswith("hello")


def test_a_directory_that_is_not_a_model_is_refused_before_mlflow_is_called(checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        mlflow_seam.check_checkpoint(tmp_path)
    shutil.copy(checkpoint[0] / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json"):
        mlflow_seam.check_checkpoint(tmp_path)


def test_a_client_for_a_tracking_server_asks_it_nothing(tmp_path, monkeypatch):
    """A local store is created under the store lock (tasks/storelock.py); a server creates its own, and a
    call to a dead one would make MLflow retry (here: fail at once)."""
    from tasks import tracking

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    monkeypatch.setenv("MOE_LAB_HOME", str(tmp_path))
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri("http://127.0.0.1:9")  # the discard port: nothing answers
    try:
        assert tracking.client().tracking_uri == "http://127.0.0.1:9"
    finally:
        mlflow.set_tracking_uri(previous)


def test_the_adapter_logs_a_model_from_its_files_without_reading_the_weights(
    checkpoint, sqlite_store, tmp_path
):
    from mlflow import MlflowClient

    from tasks import tracking

    directory = tmp_path / "final"
    shutil.copytree(checkpoint[0], directory)
    (directory / "model.safetensors").write_bytes(b"not a safetensors file: never parsed")
    run_id = tracking.start_run("pretrain")
    uri = tracking.log_model(run_id, directory)["transformers"]

    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING" and mlflow.active_run() is None  # addressed by id, left as it was
    (logged,) = client.search_logged_models([run.info.experiment_id])
    assert uri == f"models:/{logged.model_id}" and logged.name == "transformers"
    assert logged.source_run_id == run_id and logged.status == LoggedModelStatus.READY
    weights = mlflow.artifacts.download_artifacts(
        artifact_uri=f"{logged.artifact_location}/model/model.safetensors", dst_path=str(tmp_path / "down")
    )
    assert Path(weights).read_bytes() == (directory / "model.safetensors").read_bytes()  # copied as it is
    requirements = mlflow.artifacts.load_text(f"{logged.artifact_location}/requirements.txt").splitlines()
    assert f"transformers=={transformers.__version__}" in requirements  # the installed one, pinned
    assert tracking.register(uri, "seam-lm") == "1"
    tracking.end_run(run_id)
