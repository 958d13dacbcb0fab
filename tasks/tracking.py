"""The one place that talks to MLflow. Nothing in `moe_core` imports it; tasks call it with run ids.

    from tasks import tracking
    parent = tracking.start_run("lifecycle", tags={"prefect.flow_run_id": "..."})
    stage = tracking.start_run("pretrain", parent_run_id=parent)
    tracking.log_config(stage, config, prefix="train")          # flattened params + the full JSON artifact
    tracking.log_metrics(stage, {"val_loss": 3.1}, step=40)
    tracking.log_artifacts(stage, "runs/x/profile", "profile")
    tracking.end_run(stage)

Runs are addressed by id through `MlflowClient` (no fluent "active run" state shared between threads),
except around the ONNX flavor's ``log_model``, which needs one; it opens the run by id for the call. Models
in the transformers flavor are logged from their files (`tasks.mlflow_seam`: MLflow's own way to do that
fails under transformers 5), never loaded to be logged.

What may be recorded: params are configs (numbers, names, paths: never training text), metrics are numbers,
tags are ids and short reasons. Reports, profiles, plots, tokenizer and models are artifacts.

`MlflowSink` forwards training telemetry from a background thread, so a slow or unreachable server never
stalls training; when MLflow cannot be reached it goes offline, writes ``mlflow_run.json`` beside the event
file, and ``moe-lab sync RUN_DIR`` (`sync_events`) uploads the rest of ``metrics.jsonl`` later.

Imports: MLflow is imported inside the functions that talk to it (marked ``# lazy: mlflow``): it takes ~5 s
(``python -X importtime -c "import mlflow"``) and every task module imports this adapter, so importing a task
or a flow would pay for it before anything is sent. Likewise `parameter_counts` (transformers): ``moe-lab
sync`` imports this module and does not need it.

Outages: a flow probes the server first (`probe`, a few seconds at most) and opens its journal
(`tasks.pending.Journal`, the flow's own: nothing here remembers an outage between calls). From the moment MLflow is found
unreachable, every write here is kept in that journal instead, runs started meanwhile get local ids, and the
flow finishes; ``moe-lab sync <flow dir>`` sends the rest (`tasks.sync`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import queue
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import requests

from moe_core.quiet import MLFLOW_TRANSFORMERS_NOISE, quiet_loggers
from moe_core.train.telemetry import read_jsonl
from tasks import mlflow_seam, pending, settings
from tasks.storelock import store_lock

MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value
# MLflow 3's UI opens an experiment of kind "genai_development" (or one it infers as such) on its traces page;
# this kind opens it on the runs table. Tag and value as mlflow/server/js (ExperimentKind) spells them.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
# ... but MLflow 3.17's UI starts in its GenAI mode in a fresh browser whatever the tag says (checked in Chromium:
# the experiment opened on the traces overview); this query in a link opens the "Model training" view
UI_TRAINING_VIEW = "workflowType=machine_learning"
RUN_FILE = "mlflow_run.json"  # beside metrics.jsonl: which MLflow run the events belong to
MODEL_REQUIREMENTS = ("torch", "transformers", "safetensors")  # what a logged model needs, pinned when logged


# ------------------------------------------------------------------------------------------------ runs
def client():
    from mlflow import MlflowClient  # lazy: mlflow

    _initialize_store(tracking_uri())
    return MlflowClient()


@functools.cache  # once per store and process (a failed attempt is tried again)
def _initialize_store(uri: str) -> None:
    """Constructing the first client creates (migrates) a SQLite database: one process at a time. Both of
    MLflow's stores are built here, with public calls: the client builds the tracking store (whose migration
    creates every table in MLflow 3.17) and its first registry call the registry store (which creates the
    registry tables where they are missing). A tracking server creates its own (and a call would wait on
    it)."""
    from mlflow import MlflowClient  # lazy: mlflow

    if uri.startswith(("http://", "https://", "databricks")):
        return
    with store_lock(uri, "store initialization"):
        MlflowClient().search_registered_models(max_results=1)


def tracking_uri() -> str:
    import mlflow  # lazy: mlflow

    return mlflow.get_tracking_uri()


def experiment_id(name: str | None = None) -> str:
    """The experiment's id, created on first use (local stores put artifacts under the lab's mlartifacts)."""
    c, name = client(), name or settings.experiment_name()
    found = c.get_experiment_by_name(name)
    if found is not None:
        if found.tags.get(EXPERIMENT_KIND_TAG) is None:  # made by an earlier moe-lab: open on its runs too
            c.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return found.experiment_id
    local = tracking_uri().startswith(("sqlite:", "file:")) or "://" not in tracking_uri()
    location = (settings.artifact_root() / name).as_uri() if local else None
    try:
        return c.create_experiment(
            name, artifact_location=location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
        )
    except Exception:  # created meanwhile by another process
        return c.get_experiment_by_name(name).experiment_id


def probe(uri: str | None = None, timeout: float = 3.0) -> str | None:
    """None when the tracking store answers, else why not. One HTTP request with a short timeout (MLflow's
    own client would retry for minutes); local stores (SQLite, files) are always there."""
    uri = uri or tracking_uri()
    if not uri.startswith(("http://", "https://")):
        return None
    try:
        response = requests.get(uri.rstrip("/") + "/health", timeout=timeout)
    except requests.RequestException as err:
        return f"MLflow at {uri} is unreachable ({type(err).__name__})"
    if response.status_code >= 500:
        return f"MLflow at {uri} answered HTTP {response.status_code}"
    return None


def _send(
    op: str, run_id: str | None, payload: dict[str, Any], call: Callable[[], Any], pending_result: Any = None
):
    """``call()`` MLflow, or keep ``op`` in the current flow's journal when MLflow is (or just became)
    unreachable. An error while the server answers is a real error and is raised."""
    journal = pending.current()
    if not journal.deferral_allowed:
        return call()
    if not journal.offline(run_id):
        try:
            return call()
        except Exception:
            reason = probe()
            if reason is None:
                raise
            journal.go_offline(reason)
            warn_offline(reason, journal)
    journal.record(op, run_id, **payload)
    return pending_result


def warn_offline(reason: str, journal: pending.Journal) -> None:
    where = journal.path
    print(
        f"moe-lab: {reason}; going on without it. Records are kept in {where}; upload them with "
        f"`moe-lab sync {where.parent}` once MLflow is back.",
        file=sys.stderr,
        flush=True,
    )


def start_run(name: str, parent_run_id: str | None = None, tags: Mapping[str, str] | None = None) -> str:
    """A new run (nested under ``parent_run_id`` when given); returns its id (a local ``pending-...`` id
    while MLflow is unreachable)."""
    all_tags = {"mlflow.runName": name, **{k: str(v) for k, v in (tags or {}).items() if v is not None}}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    local = pending.new_local_id()  # used only if the run has to wait for MLflow (or its parent does)
    return _send(
        "start_run",
        parent_run_id,
        {"local": local, "name": name, "tags": all_tags},
        lambda: client().create_run(experiment_id(), tags=all_tags, run_name=name).info.run_id,
        pending_result=local,
    )


def end_run(run_id: str, status: str = "FINISHED", reason: str | None = None) -> None:
    """FINISHED, FAILED or KILLED; ``reason`` (one short line, no data) goes into the ``failure_reason`` tag."""
    if reason:
        set_tags(run_id, {"failure_reason" if status != "FINISHED" else "note": reason[:500]})
    _send("end_run", run_id, {"status": status}, lambda: client().set_terminated(run_id, status))


def set_tags(run_id: str, tags: Mapping[str, Any]) -> None:
    tags = {k: str(v)[:5000] for k, v in tags.items() if v is not None}

    def call() -> None:
        c = client()
        for key, value in tags.items():
            c.set_tag(run_id, key, value)

    _send("set_tags", run_id, {"tags": tags}, call)


def run_url(run_id: str) -> str:
    """A link to the run in the MLflow UI (``moe-lab ui`` for the embedded store)."""
    uri, journal = tracking_uri(), pending.current()
    if journal.offline(run_id):
        return f"(not in MLflow yet: `moe-lab sync {journal.directory}` once {uri} is back)"
    run = client().get_run(run_id)
    base = uri.rstrip("/") if uri.startswith("http") else "http://127.0.0.1:5000"
    return f"{base}/#/experiments/{run.info.experiment_id}/runs/{run_id}?{UI_TRAINING_VIEW}"


# ------------------------------------------------------------------------------------------------ params
def _tree(data: Any) -> Any:
    """A pydantic model or dataclass as plain dicts and lists (numbers stay numbers); anything else as is."""
    if hasattr(data, "model_dump"):
        return data.model_dump(mode="json")
    if hasattr(data, "__dataclass_fields__"):
        return dataclasses.asdict(data)
    return data


def _leaves(data: Any, prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 1e-3}}`` -> ``{"optim.lr": 1e-3}``; lists and tuples stay one value."""
    data = _tree(data)
    if isinstance(data, Mapping):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix or "value": data}


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    """``{"optim": {"lr": 1e-3}}`` -> ``{"optim.lr": "0.001"}`` (MLflow params are text); lists and tuples
    stay one value."""
    leaves = _leaves(data, prefix).items()
    text = {k: json.dumps(v, default=str) if isinstance(v, list | tuple) else str(v) for k, v in leaves}
    return {key: value[:MAX_PARAM_CHARS] for key, value in text.items()}


def numbers(data: Any, prefix: str = "") -> dict[str, float]:
    """The numeric leaves of a nested report as metrics, ``{"cost.train.usd": 1.5}``, kept as numbers
    (booleans, text and lists are not metrics)."""
    return {
        key: value
        for key, value in _leaves(data, prefix).items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }


def log_config(run_id: str, config: Any, prefix: str = "") -> None:
    """Every field of a (pydantic/dataclass/dict) config as params, and the whole config as JSON."""
    params = flatten(config, prefix)
    data = json.loads(json.dumps(_tree(config), default=str))  # numbers stay numbers; paths become text
    artifact_file = f"config/{prefix or 'config'}.json"
    _send(
        "log_params",
        run_id,
        {"params": params, "data": data, "artifact_file": artifact_file},
        lambda: _log_params_now(run_id, params, data, artifact_file),
    )


def _log_params_now(run_id: str, params: Mapping[str, str], data: Any, artifact_file: str) -> None:
    from mlflow.entities import Param  # lazy: mlflow

    c = client()
    items = [Param(k, v) for k, v in sorted(params.items())]
    for i in range(0, len(items), 100):
        c.log_batch(run_id, params=items[i : i + 100])
    c.log_dict(run_id, data, artifact_file)


def architecture_params(model_config) -> dict[str, str]:
    """What the runs table needs to tell models apart: experts, top-k, widths, layers, router, parameters."""
    from moe_core.config import parameter_counts  # lazy: imports transformers, see the module note

    c = model_config
    counts = parameter_counts(c)
    moe = bool(c.num_experts)
    return {
        k: str(v)
        for k, v in {
            "arch.num_experts": c.num_experts if moe else 0,
            "arch.top_k": c.num_experts_per_tok if moe else 0,
            "arch.shared_experts": c.num_shared_experts if moe else 0,
            "arch.hidden_size": c.hidden_size,
            "arch.expert_intermediate_size": c.expert_intermediate_size if moe else c.intermediate_size,
            "arch.num_layers": c.num_hidden_layers,
            "arch.moe_layers": len(c.moe_layer_ids),
            "arch.router": f"{c.router}/{c.router_score}" if moe else "dense",
            "arch.vocab_size": c.vocab_size,
            "arch.params_total": counts["total"],
            "arch.params_active": counts["active"],
        }.items()
    }


def log_architecture(run_id: str, model_config) -> None:
    """The model's architecture as ``arch.*`` params (and ``config/architecture.json``)."""
    params = architecture_params(model_config)
    artifact_file = "config/architecture.json"
    _send(
        "log_params",
        run_id,
        {"params": params, "data": params, "artifact_file": artifact_file},
        lambda: _log_params_now(run_id, params, params, artifact_file),
    )


# ------------------------------------------------------------------------------------------------ metrics
def _finite(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(float(value)):
            out[key] = float(value)
    return out


def log_metrics(
    run_id: str,
    metrics: Mapping[str, Any],
    step: int | None = None,
    timestamp_ms: int | None = None,
    mlflow_client=None,
) -> int:
    """Numbers only (other values are skipped); returns how many were logged (or kept pending)."""
    values = _finite(metrics)
    ts = timestamp_ms or int(time.time() * 1000)
    if (
        mlflow_client is not None
    ):  # the telemetry sink: its own offline handling, events stay in metrics.jsonl
        return send_metrics(run_id, values, step, ts, mlflow_client)
    _send(
        "log_metrics",
        run_id,
        {"metrics": values, "step": step, "timestamp_ms": ts},
        lambda: send_metrics(run_id, values, step, ts),
    )
    return len(values)


def send_metrics(
    run_id: str, values: Mapping[str, float], step: int | None, timestamp_ms: int, mlflow_client=None
) -> int:
    """Straight to MLflow (raises when it fails): the telemetry sink, the event follower and sync."""
    from mlflow.entities import Metric  # lazy: mlflow

    batch = [Metric(k, v, timestamp_ms, step or 0) for k, v in _finite(values).items()]
    c = mlflow_client or client()
    for i in range(0, len(batch), 1000):
        c.log_batch(run_id, metrics=batch[i : i + 1000])
    return len(batch)


def log_artifacts(run_id: str, local_path: str | Path, artifact_path: str | None = None) -> None:
    path = Path(local_path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: nothing to record in MLflow run {run_id}")

    def call() -> None:
        if path.is_dir():
            client().log_artifacts(run_id, str(path), artifact_path)
        else:
            client().log_artifact(run_id, str(path), artifact_path)

    _send("log_artifacts", run_id, {"path": str(path.resolve()), "artifact_path": artifact_path}, call)


def log_text(run_id: str, text: str, artifact_file: str) -> None:
    _send(
        "log_text",
        run_id,
        {"text": text, "artifact_file": artifact_file},
        lambda: client().log_text(run_id, text, artifact_file),
    )


def log_dataset(run_id: str, data_dir: str | Path, context: str = "training") -> None:
    """Record a prepared-data directory with `mlflow.data`: per-split counts and the fingerprint, no text."""
    _send(
        "log_dataset",
        run_id,
        {"data_dir": str(Path(data_dir).resolve()), "context": context},
        lambda: _log_dataset_now(run_id, data_dir, context),
    )


def _log_dataset_now(run_id: str, data_dir: str | Path, context: str) -> None:
    import mlflow.data  # lazy: mlflow
    import pandas as pd  # lazy: only for MLflow's dataset record
    from mlflow.entities import Dataset, DatasetInput, InputTag  # lazy: mlflow

    manifest = json.loads((Path(data_dir) / "manifest.json").read_text())
    rows = [
        {"split": name, **{k: float(v) for k, v in split.items() if isinstance(v, int | float)}}
        for name, split in manifest.get("splits", {}).items()
    ]
    with (
        warnings.catch_warnings()
    ):  # MLflow registers its local-artifact source twice, then warns it is ambiguous
        warnings.filterwarnings(
            "ignore", message="The specified dataset source can be interpreted in multiple ways"
        )
        dataset = mlflow.data.from_pandas(
            pd.DataFrame(rows),
            source=str(Path(data_dir).resolve()),
            name=f"{manifest['source']['name']}@{manifest['fingerprint'][:12]}",
            digest=manifest["fingerprint"][:36],
        )
    fields = dataset.to_dict()  # the public form of the dataset: name, digest, source, schema, profile
    entity = Dataset(
        **{k: fields.get(k) for k in ("name", "digest", "source_type", "source", "schema", "profile")}
    )
    client().log_inputs(
        run_id, datasets=[DatasetInput(entity, tags=[InputTag("mlflow.data.context", context)])]
    )


# ------------------------------------------------------------------------------------------------ models
def _in_run(run_id: str):
    import mlflow  # lazy: mlflow

    mlflow.set_experiment(experiment_id=client().get_run(run_id).info.experiment_id)
    return mlflow.start_run(run_id=run_id)  # ends (FINISHED) on exit: call on a stage run at its end


def log_model(run_id: str, model_dir: str | Path) -> dict[str, str]:
    """Log a Hugging Face model directory in MLflow's transformers flavor, from its files (safetensors
    weights, config and tokenizer, copied as they are: the model is not loaded, and loading it unpickles
    nothing); returns ``{"transformers": model_uri}``. ``mlflow.transformers.load_model(model_uri)`` gives a
    text-generation pipeline once ``moe_core.model`` is imported (it registers the lab's model class).
    A directory without a tokenizer is logged as plain files under ``model`` (``{"files": runs:/...}``).
    No pickled flavor is logged (MLflow's PyTorch flavor would be one). While MLflow is unreachable: ``{}``,
    and the model is pending."""
    return _send(
        "log_model",
        run_id,
        {"model_dir": str(Path(model_dir).resolve())},
        lambda: _log_model_now(run_id, model_dir),
        pending_result={},
    )


def _log_model_now(run_id: str, model_dir: str | Path) -> dict[str, str]:
    if not (Path(model_dir) / "tokenizer_config.json").is_file():
        client().log_artifacts(run_id, str(model_dir), "model")
        return {"files": f"runs:/{run_id}/model"}
    # from its files (tasks.mlflow_seam): mlflow.transformers.log_model(<directory>) raises under
    # transformers 5, and logging the loaded model read every weight into memory (as float32) to write it out
    with quiet_loggers(*MLFLOW_TRANSFORMERS_NOISE):
        uri = mlflow_seam.log_model(client(), run_id, model_dir, "transformers", pip_requirements())
    return {"transformers": uri}


def pip_requirements() -> list[str]:
    """`MODEL_REQUIREMENTS` pinned to the installed versions (without a local label: ``2.13.0``, not
    ``2.13.0+cpu``, which no package index serves)."""
    return [f"{name}=={metadata.version(name).split('+')[0]}" for name in MODEL_REQUIREMENTS]


def log_onnx_model(run_id: str, onnx_file: str | Path) -> str | None:
    return _send(
        "log_onnx_model",
        run_id,
        {"onnx_file": str(Path(onnx_file).resolve())},
        lambda: _log_onnx_model_now(run_id, onnx_file),
    )


def _log_onnx_model_now(run_id: str, onnx_file: str | Path) -> str:
    import mlflow.onnx  # lazy: mlflow
    import onnx  # lazy: optional heavy dependency, only for ONNX models

    with _in_run(run_id):
        info = mlflow.onnx.log_model(
            onnx.load(str(onnx_file)), name="onnx", pip_requirements=["onnx", "onnxruntime"]
        )
    return info.model_uri


# ------------------------------------------------------------------------------------------------ registry
def register(model_uri: str, name: str, tags: Mapping[str, Any] | None = None) -> str:
    """A new version of registered model `name`; returns the version number. ``model_uri``: a logged
    model (``models:/...``) or plain files of a run (``runs:/<run id>/<path>``, see `log_model`)."""
    import mlflow  # lazy: mlflow
    from mlflow.exceptions import MlflowException  # lazy: mlflow

    tags = {k: str(v) for k, v in (tags or {}).items()}
    if not model_uri.startswith("runs:/"):
        return str(mlflow.register_model(model_uri, name, tags=tags).version)
    c = client()
    try:
        c.create_registered_model(name)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    run_id = model_uri[len("runs:/") :].split("/")[0]
    return str(c.create_model_version(name, model_uri, run_id, tags=tags).version)


def set_alias(name: str, alias: str, version: str) -> None:
    client().set_registered_model_alias(name, alias, str(version))


def alias_version(name: str, alias: str):
    """The ModelVersion holding `alias`, or None (no such model or alias yet)."""
    from mlflow.exceptions import MlflowException  # lazy: mlflow

    try:
        return client().get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def set_version_tags(name: str, version: str, tags: Mapping[str, Any]) -> None:
    c = client()
    for key, value in tags.items():
        c.set_model_version_tag(name, str(version), key, str(value)[:5000])


def run_metric(run_id: str, key: str) -> float | None:
    return client().get_run(run_id).data.metrics.get(key)


# ------------------------------------------------------------------------------------------------ pending
def replay(entry: Mapping[str, Any], state: dict[str, Any]) -> str | None:
    """Send one operation of a pending manifest (`tasks.pending`) to MLflow, mapping local run ids to the
    runs created for them (``state["runs"]``, updated here, as are the logged models in ``state["models"]``).
    Returns a note when the operation could not be sent (a file that is gone), else None."""
    runs = state["runs"]

    def real(run_id: str | None) -> str | None:
        return runs.get(run_id, run_id) if run_id else run_id

    op, run = entry["op"], real(entry.get("run"))
    if op == "start_run":
        tags = {**entry["tags"], "moe_lab.synced": "true"}
        if "mlflow.parentRunId" in tags:
            tags["mlflow.parentRunId"] = real(tags["mlflow.parentRunId"])
        runs[entry["local"]] = (
            client().create_run(experiment_id(), tags=tags, run_name=entry["name"]).info.run_id
        )
    elif op == "log_params":
        _log_params_now(run, entry["params"], entry["data"], entry["artifact_file"])
    elif op == "log_metrics":
        send_metrics(run, entry["metrics"], entry["step"], entry["timestamp_ms"])
    elif op == "set_tags":
        for key, value in entry["tags"].items():
            client().set_tag(run, key, value)
    elif op == "end_run":
        client().set_terminated(run, entry["status"])
    elif op == "log_text":
        client().log_text(run, entry["text"], entry["artifact_file"])
    elif op in ("log_artifacts", "log_dataset", "log_model", "log_onnx_model"):
        path = Path(
            entry.get("path") or entry.get("data_dir") or entry.get("model_dir") or entry["onnx_file"]
        )
        if not path.exists():
            return f"{op}: {path} no longer exists; not uploaded"
        if op == "log_artifacts":
            (client().log_artifacts if path.is_dir() else client().log_artifact)(
                run, str(path), entry["artifact_path"]
            )
        elif op == "log_dataset":
            _log_dataset_now(run, path, entry["context"])
        elif op == "log_model":
            state["models"][run] = _log_model_now(run, path)
        else:
            _log_onnx_model_now(run, path)
    else:
        raise ValueError(f"pending manifest: unknown operation {op!r}")
    return None


# ------------------------------------------------------------------------------------------------ telemetry
class MlflowSink:
    """A `moe_core.train.telemetry.MetricsSink` that forwards to an MLflow run from a background thread.

    If MLflow fails (unreachable server, ...) the sink goes offline for the rest of the run: it writes
    ``offline_from_step`` into ``<run_dir>/mlflow_run.json``, and ``moe-lab sync`` uploads the events from
    that step on. Training never waits on MLflow; `close` waits at most ``close_timeout`` seconds."""

    def __init__(
        self, run_id: str, run_dir: str | Path, mlflow_client=None, close_timeout: float = 30.0
    ) -> None:
        self.run_id, self.run_dir = run_id, Path(run_dir)
        self.offline_from_step: int | None = None
        self.error: str | None = None
        self._client = mlflow_client
        self._close_timeout = close_timeout
        self._queue: queue.Queue = queue.Queue()
        self._journal = pending.current()  # the flow's: the sink's thread does not see the flow's context
        write_run_file(self.run_dir, run_id)
        if self._journal.offline(run_id):  # MLflow already known down
            self._go_offline(0, self._journal.offline_reason or "the MLflow run is pending")
        self._thread = threading.Thread(target=self._forward, name="mlflow-sink", daemon=True)
        self._thread.start()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.offline_from_step is None:
            self._queue.put((step, dict(metrics), int(time.time() * 1000)))

    def _forward(self) -> None:
        while (item := self._queue.get()) is not None:
            if self.offline_from_step is not None:
                continue
            step, metrics, ts = item
            try:
                send_metrics(self.run_id, metrics, step, ts, mlflow_client=self._client)
            except Exception as err:  # noqa: BLE001 - any failure: keep training, events stay in the JSONL
                self._go_offline(
                    step, f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
                )
                if self._client is None and (reason := probe()) is not None:
                    self._journal.go_offline(reason)  # the flow's next records go straight to its journal

    def _go_offline(self, step: int, error: str) -> None:
        self.offline_from_step, self.error = step, error
        write_run_file(self.run_dir, self.run_id, offline_from_step=step, error=error)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(self._close_timeout)
        if self._thread.is_alive() and self.offline_from_step is None:  # still stuck on a call
            self.offline_from_step = 0
            write_run_file(self.run_dir, self.run_id, offline_from_step=0, error="timed out")


def write_run_file(run_dir: Path, run_id: str, **extra: Any) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RUN_FILE
    data = {"run_id": run_id, "tracking_uri": tracking_uri(), **extra}
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


class EventFollower:
    """Forwards the lines a training process appends to ``metrics.jsonl`` (call `poll` now and then); like
    `MlflowSink`, it goes offline for good on the first failure and leaves the rest to ``moe-lab sync``."""

    def __init__(self, run_id: str, run_dir: str | Path) -> None:
        self.run_id, self.run_dir = run_id, Path(run_dir)
        self.events = self.run_dir / "metrics.jsonl"
        self.offset = (
            self.events.stat().st_size if self.events.is_file() else 0
        )  # earlier attempts: already sent
        # a resume rewrites the file without the rows past its checkpoint (JsonlSink): steps up to here are sent
        self.last_step = (
            max((int(r.get("step", -1)) for r in read_jsonl(self.events)), default=-1)
            if self.events.is_file()
            else -1
        )
        self.skip_upto = self.last_step  # rows up to this step are sent already
        self.offline_from_step: int | None = None
        write_run_file(self.run_dir, run_id)
        journal = pending.current()
        if journal.offline(run_id):
            self.offline_from_step = 0
            write_run_file(
                self.run_dir, run_id, offline_from_step=0, error=journal.offline_reason or "pending"
            )

    def poll(self) -> None:
        if self.offline_from_step is not None or not self.events.is_file():
            return
        if (
            self.events.stat().st_size < self.offset
        ):  # rewritten shorter by a resume: read again, skip sent steps
            self.offset, self.skip_upto = 0, self.last_step
        with self.events.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        if self.offset and chunk and not chunk.startswith(b"{"):  # shrunk and regrown between two polls
            self.offset, self.skip_upto = 0, self.last_step
            return self.poll()
        for line in chunk[: chunk.rfind(b"\n") + 1].splitlines(keepends=True):
            try:
                row = json.loads(line) if line.strip() else None
            except ValueError:  # a damaged line: the JSONL reader skips it too
                row = None
            if row is not None and int(row.get("step", 0)) <= self.skip_upto:
                row = None
            if row is not None:
                try:
                    send_metrics(
                        self.run_id,
                        {k: v for k, v in row.items() if k not in ("step", "time")},
                        row.get("step"),
                        int(row.get("time", time.time()) * 1000),
                    )
                except Exception as err:  # noqa: BLE001 - MLflow down: training goes on
                    self.offline_from_step = int(row.get("step", 0))
                    write_run_file(
                        self.run_dir,
                        self.run_id,
                        offline_from_step=self.offline_from_step,
                        error=f"{type(err).__name__}",
                    )
                    return
                self.last_step = int(row.get("step", self.last_step))
            self.offset += len(line)


def sync_events(run_dir: str | Path, run_id: str | None = None, everything: bool = False) -> tuple[str, int]:
    """`moe-lab sync`: upload a run directory's ``metrics.jsonl`` to MLflow, from the step where its sink
    went offline (or all of it with ``everything``, or when no run was ever recorded). What was uploaded is
    remembered (``synced_through_step`` in ``mlflow_run.json``), so a second sync sends only newer events.
    Returns (run id, events uploaded)."""

    run_dir = Path(run_dir)
    events = run_dir / "metrics.jsonl"
    if not events.is_file():
        raise FileNotFoundError(
            f"{events} not found; pass a training output directory (it holds metrics.jsonl)"
        )
    info = json.loads((run_dir / RUN_FILE).read_text()) if (run_dir / RUN_FILE).is_file() else {}
    recorded = info.get("run_id")
    run_id = run_id or (None if pending.is_local(recorded) else recorded)
    if run_id is None:
        run_id = start_run(f"sync:{run_dir.name}", tags={"moe_lab.synced_from": str(run_dir.resolve())})
        everything = True
    if everything:
        after = -1
    elif info.get("offline_from_step") is None:
        after = None  # the sink never went offline: MLflow has every event
    else:
        after = max(int(info["offline_from_step"]) - 1, int(info.get("synced_through_step", -1)))
    uploaded, last = 0, info.get("synced_through_step")
    if after is not None:
        for row in read_jsonl(events):
            if "step" in row and int(row["step"]) > after:
                send_metrics(
                    run_id,
                    {k: v for k, v in row.items() if k not in ("step", "time")},
                    row["step"],
                    int(row.get("time", time.time()) * 1000),
                )
                uploaded += 1
                last = max(int(row["step"]), last if last is not None else -1)
    extra = {k: v for k, v in info.items() if k not in ("run_id", "tracking_uri")}
    extra.update(synced_at=time.time(), synced_through_step=last)
    if everything and last is None:
        extra.pop("synced_through_step")
    write_run_file(run_dir, run_id, **extra)
    return run_id, uploaded
