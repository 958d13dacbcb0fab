"""The one place the lab reaches past MLflow's public API (MLflow 3.17.2, with transformers 5.24): a Hugging
Face model directory logged in MLflow's transformers flavor from its files, without loading the model.

Why: MLflow's own way to do that, ``mlflow.transformers.log_model("<a local directory>", task=...)`` (its
"local checkpoint" mode), fails under transformers 5: ``build_flavor_config_from_local_checkpoint``
(``mlflow/transformers/flavor_config.py``) reads ``pipelines.check_task(task)[1]["impl"].__name__``, and
transformers 5 keeps each pipeline's ``impl`` as a dotted-path string (``transformers/pipelines/__init__.py``,
resolved only when a pipeline is built), so every call raises ``AttributeError: 'str' object has no attribute
'__name__'``. The other way MLflow offers, a loaded model, reads every weight into memory (in float32 for the
lab's loader) and writes it out again.

What is public: `mlflow.models.Model.log` takes a ``flavor``, documented as "a module with a ``save_model``
function that persists the model as a valid MLflow model"; this module is that flavor (`save_model`), and
`log_model` calls it for a logged model created with ``MlflowClient.create_logged_model``. What is not: the
layout `save_model` writes, which is the transformers flavor's own (``mlflow/transformers/__init__.py``
``save_model``, ``flavor_config.py`` ``FlavorKey``, ``model_io.py`` ``_MODEL_BINARY_FILE_NAME`` and
``_COMPONENTS_BINARY_DIR_NAME``): the checkpoint's files under ``model/``, the tokenizer under
``components/tokenizer/``, the flavor's keys in ``MLmodel``, and the pyfunc flavor that loads it with
``mlflow.transformers``. It is the layout MLflow's local-checkpoint mode writes (a copy of the directory).
``tests/test_mlflow_seam.py`` holds it equal to what ``mlflow.transformers.save_model`` writes for the loaded
model, loads it back with ``mlflow.transformers.load_model``, and fails once MLflow's local-checkpoint mode
works again (then log with ``mlflow.transformers.log_model(path)`` and delete this module).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from importlib import metadata
from pathlib import Path

import yaml

from moe_core.data.tokenizer import load_tokenizer

UPSTREAM = "mlflow 3.17.2 (mlflow/transformers/__init__.py save_model, flavor_config.py, model_io.py)"

FLAVOR = "transformers"  # mlflow.transformers.FLAVOR_NAME
TASK = "text-generation"
PIPELINE = "TextGenerationPipeline"  # the pipeline class MLflow records for the task (its ``instance_type``)
# MLflow's loader takes the model class by this name from the `transformers` package (model_io._load_model).
# differs from MLflow: it records config.json's architecture, "MoEForCausalLM", which is not in `transformers`
# (and the lab writes no remote-code auto_map), so MLflow could not load the model back; the Auto class is
# there, and builds the lab's model once ``moe_core.model`` is imported (it registers model_type "moe_lab")
MODEL_CLASS = "AutoModelForCausalLM"
MODEL_DIR = "model"  # model_io._MODEL_BINARY_FILE_NAME: the checkpoint's files
COMPONENTS_DIR = "components"  # model_io._COMPONENTS_BINARY_DIR_NAME: <components>/tokenizer/
REQUIREMENTS, CONDA_ENV, PYTHON_ENV = "requirements.txt", "conda.yaml", "python_env.yaml"


def log_model(client, run_id: str, checkpoint_dir: str | Path, name: str, pip_requirements: list[str]) -> str:
    """Log ``checkpoint_dir`` (config.json, weights, tokenizer) as a transformers-flavor model of run
    ``run_id`` named ``name``, from its files; returns its ``models:/`` URI. ``client``: an `MlflowClient` of
    the current tracking URI (the one `Model.log` uses). The run is addressed by id: no active run is needed,
    and it stays as it is (running)."""
    from mlflow.models import Model  # lazy: mlflow (seconds to import, see tasks/tracking.py)

    check_checkpoint(checkpoint_dir)  # before anything is created in MLflow
    run = client.get_run(run_id)
    # created here, in the run's experiment: Model.log would put a model it creates for a run that is not the
    # active one into the default experiment (tracking.fluent._create_logged_model)
    logged = client.create_logged_model(
        run.info.experiment_id, name=name, source_run_id=run_id, params=dict(run.data.params)
    )
    info = Model.log(
        None,
        flavor=sys.modules[__name__],
        run_id=run_id,
        model_id=logged.model_id,
        checkpoint_dir=str(checkpoint_dir),
        pip_requirements=pip_requirements,
    )
    return info.model_uri


def check_checkpoint(checkpoint_dir: str | Path) -> dict:
    """The directory's config.json, after checking it is a model directory with a tokenizer."""
    directory = Path(checkpoint_dir)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: log_model takes a Hugging Face model directory")
    config = json.loads(config_file.read_text())
    if not config.get("architectures"):
        raise ValueError(f"{config_file}: no 'architectures' entry; save the model with save_pretrained")
    if not (directory / "tokenizer_config.json").is_file():
        raise FileNotFoundError(
            f"{directory / 'tokenizer_config.json'} not found: the transformers flavor needs the tokenizer "
            "beside the weights (log a directory without one as plain files)"
        )
    return config


def save_model(
    path: str | Path, mlflow_model, checkpoint_dir: str | Path, pip_requirements: list[str]
) -> None:
    """The flavor's ``save_model`` (`mlflow.models.Model.log` calls it with a fresh ``path``): the
    transformers flavor's layout, with the checkpoint's files linked (or copied) as they are; no weight is
    read."""
    import transformers  # lazy: transformers (the version recorded in the flavor)
    from mlflow.models import ModelSignature  # lazy: mlflow
    from mlflow.pyfunc import add_to_model  # lazy: mlflow
    from mlflow.types import ColSpec, Schema  # lazy: mlflow

    # lazy: the modeling stack (seconds to import). Registers model_type "moe_lab" with transformers' Auto
    # classes, which the tokenizer loader consults (config.json), as a loaded model's process has
    import moe_core.model  # noqa: F401

    path, source = Path(path), Path(checkpoint_dir).resolve()
    config = check_checkpoint(source)
    tokenizer = load_tokenizer(
        source
    )  # the lab's tokenizer loader: what the lab's own loader gives the model
    path.mkdir(parents=True, exist_ok=True)
    _link_or_copy_tree(source, path / MODEL_DIR)
    tokenizer.save_pretrained(path / COMPONENTS_DIR / "tokenizer")
    dtype = config.get("dtype") or config.get("torch_dtype")  # transformers 5 writes "dtype"
    # MLflow's default signature for text generation (transformers/signature.py): text in, text out
    mlflow_model.signature = ModelSignature(Schema([ColSpec("string")]), Schema([ColSpec("string")]))
    mlflow_model.add_flavor(
        FLAVOR,
        transformers_version=transformers.__version__,
        code=None,
        task=TASK,
        instance_type=PIPELINE,
        pipeline_model_type=MODEL_CLASS,
        source_model_name=str(source),
        model_binary=MODEL_DIR,
        components=["tokenizer"],
        tokenizer_type=type(tokenizer).__name__,
        torch_dtype=f"torch.{dtype}" if dtype else None,
    )
    add_to_model(
        mlflow_model, loader_module="mlflow.transformers", conda_env=CONDA_ENV, python_env=PYTHON_ENV
    )
    mlflow_model.model_size_bytes = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    mlflow_model.save(str(path / "MLmodel"))
    _write_environment(path, [f"mlflow=={metadata.version('mlflow')}", *pip_requirements])


def _link_or_copy_tree(source: Path, target: Path) -> None:
    """``target`` with ``source``'s files: hard links where the filesystem allows (the temporary directory
    MLflow uploads from; the upload copies them), else copies. Streams: nothing is read into memory whole."""

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:  # another filesystem, or links not allowed
            shutil.copy2(src, dst)

    shutil.copytree(source, target, copy_function=link_or_copy)


def _write_environment(path: Path, requirements: list[str]) -> None:
    """requirements.txt, python_env.yaml and conda.yaml, as mlflow/utils/environment.py writes them."""
    python = platform.python_version()
    (path / REQUIREMENTS).write_text("\n".join(requirements))
    build = [
        f"{name}=={_version(name)}" if _version(name) else name for name in ("pip", "setuptools", "wheel")
    ]
    python_env = {"python": python, "build_dependencies": build, "dependencies": [f"-r {REQUIREMENTS}"]}
    (path / PYTHON_ENV).write_text(yaml.safe_dump(python_env, sort_keys=False, default_flow_style=False))
    pip = _version("pip")
    conda = {
        "channels": ["conda-forge"],
        "dependencies": [f"python={python}", f"pip<={pip}" if pip else "pip", {"pip": requirements}],
        "name": "mlflow-env",
    }
    (path / CONDA_ENV).write_text(yaml.safe_dump(conda, default_flow_style=False))


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
