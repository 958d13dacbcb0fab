"""The one place that talks to MLflow. Nothing in `moe_core` imports it; tasks call it with run ids.

    from tasks import tracking
    parent = tracking.start_run("lifecycle", tags={"prefect.flow_run_id": "..."})
    stage = tracking.start_run("pretrain", parent_run_id=parent)
    tracking.log_config(stage, config, prefix="train")          # flattened params + the full JSON artifact
    tracking.log_metrics(stage, {"val_loss": 3.1}, step=40)
    tracking.log_artifacts(stage, "runs/x/profile", "profile")
    tracking.end_run(stage)

Runs are addressed by id through `MlflowClient` (no fluent "active run" state shared between threads),
except around the model flavors' ``log_model``, which need one; those open the run by id for the call.

What may be recorded: params are configs (numbers, names, paths: never training text), metrics are numbers,
tags are ids and short reasons. Reports, profiles, plots, tokenizer and models are artifacts.

`MlflowSink` forwards training telemetry from a background thread, so a slow or unreachable server never
stalls training; when MLflow cannot be reached it goes offline, writes ``mlflow_run.json`` beside the event
file, and ``moe-lab sync RUN_DIR`` (`sync_events`) uploads the rest of ``metrics.jsonl`` later.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tasks import settings

MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value
RUN_FILE = "mlflow_run.json"  # beside metrics.jsonl: which MLflow run the events belong to
PIP_REQUIREMENTS = ["torch==2.13.0", "transformers==4.57.6", "safetensors"]  # skips MLflow's slow inference


# ------------------------------------------------------------------------------------------------ runs
def client():
    from mlflow import MlflowClient

    return MlflowClient()


def tracking_uri() -> str:
    import mlflow

    return mlflow.get_tracking_uri()


def experiment_id(name: str | None = None) -> str:
    """The experiment's id, created on first use (local stores put artifacts under the lab's mlartifacts)."""
    c, name = client(), name or settings.experiment_name()
    found = c.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    local = tracking_uri().startswith(("sqlite:", "file:")) or "://" not in tracking_uri()
    location = (settings.artifact_root() / name).as_uri() if local else None
    try:
        return c.create_experiment(name, artifact_location=location)
    except Exception:  # created meanwhile by another process
        return c.get_experiment_by_name(name).experiment_id


def start_run(name: str, parent_run_id: str | None = None, tags: Mapping[str, str] | None = None) -> str:
    """A new run (nested under ``parent_run_id`` when given); returns its id."""
    all_tags = {"mlflow.runName": name, **{k: str(v) for k, v in (tags or {}).items() if v is not None}}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    return client().create_run(experiment_id(), tags=all_tags, run_name=name).info.run_id


def end_run(run_id: str, status: str = "FINISHED", reason: str | None = None) -> None:
    """FINISHED, FAILED or KILLED; ``reason`` (one short line, no data) goes into the ``failure_reason`` tag."""
    if reason:
        set_tags(run_id, {"failure_reason" if status != "FINISHED" else "note": reason[:500]})
    client().set_terminated(run_id, status)


def set_tags(run_id: str, tags: Mapping[str, Any]) -> None:
    c = client()
    for key, value in tags.items():
        if value is not None:
            c.set_tag(run_id, key, str(value)[:5000])


def run_url(run_id: str) -> str:
    """A link to the run in the MLflow UI (``moe-lab ui`` for the embedded store)."""
    uri = tracking_uri()
    run = client().get_run(run_id)
    base = uri.rstrip("/") if uri.startswith("http") else "http://127.0.0.1:5000"
    return f"{base}/#/experiments/{run.info.experiment_id}/runs/{run_id}"


# ------------------------------------------------------------------------------------------------ params
def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    """``{"optim": {"lr": 1e-3}}`` -> ``{"optim.lr": "0.001"}``; lists and tuples stay one value."""
    out: dict[str, str] = {}
    if hasattr(data, "model_dump"):
        data = data.model_dump(mode="json")
    elif hasattr(data, "__dataclass_fields__"):
        import dataclasses

        data = dataclasses.asdict(data)
    if isinstance(data, Mapping):
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    text = json.dumps(data, default=str) if isinstance(data, list | tuple) else str(data)
    out[prefix or "value"] = text[:MAX_PARAM_CHARS]
    return out


def log_config(run_id: str, config: Any, prefix: str = "") -> None:
    """Every field of a (pydantic/dataclass/dict) config as params, and the whole config as JSON."""
    from mlflow.entities import Param

    params = flatten(config, prefix)
    c = client()
    items = [Param(k, v) for k, v in sorted(params.items())]
    for i in range(0, len(items), 100):
        c.log_batch(run_id, params=items[i:i + 100])
    data = config.model_dump(mode="json") if hasattr(config, "model_dump") else flatten(config)
    c.log_dict(run_id, data, f"config/{prefix or 'config'}.json")


# ------------------------------------------------------------------------------------------------ metrics
def _finite(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(float(value)):
            out[key] = float(value)
    return out


def log_metrics(run_id: str, metrics: Mapping[str, Any], step: int | None = None,
                timestamp_ms: int | None = None, mlflow_client=None) -> int:
    """Numbers only (other values are skipped); returns how many were logged."""
    from mlflow.entities import Metric

    values = _finite(metrics)
    ts = timestamp_ms or int(time.time() * 1000)
    batch = [Metric(k, v, ts, step or 0) for k, v in values.items()]
    c = mlflow_client or client()
    for i in range(0, len(batch), 1000):
        c.log_batch(run_id, metrics=batch[i:i + 1000])
    return len(batch)


def log_artifacts(run_id: str, local_path: str | Path, artifact_path: str | None = None) -> None:
    path = Path(local_path)
    if path.is_dir():
        client().log_artifacts(run_id, str(path), artifact_path)
    elif path.is_file():
        client().log_artifact(run_id, str(path), artifact_path)
    else:
        raise FileNotFoundError(f"{path}: nothing to record in MLflow run {run_id}")


def log_text(run_id: str, text: str, artifact_file: str) -> None:
    client().log_text(run_id, text, artifact_file)


def log_dataset(run_id: str, data_dir: str | Path, context: str = "training") -> None:
    """Record a prepared-data directory with `mlflow.data`: per-split counts and the fingerprint, no text."""
    import mlflow.data
    import pandas as pd
    from mlflow.entities import DatasetInput, InputTag

    manifest = json.loads((Path(data_dir) / "manifest.json").read_text())
    rows = [{"split": name, **{k: float(v) for k, v in split.items() if isinstance(v, int | float)}}
            for name, split in manifest.get("splits", {}).items()]
    dataset = mlflow.data.from_pandas(pd.DataFrame(rows), source=str(Path(data_dir).resolve()),
                                      name=f"{manifest['source']['name']}@{manifest['fingerprint'][:12]}",
                                      digest=manifest["fingerprint"][:36])
    client().log_inputs(run_id, datasets=[DatasetInput(dataset._to_mlflow_entity(),
                                                       tags=[InputTag("mlflow.data.context", context)])])


# ------------------------------------------------------------------------------------------------ models
def _in_run(run_id: str):
    import mlflow

    mlflow.set_experiment(experiment_id=client().get_run(run_id).info.experiment_id)
    return mlflow.start_run(run_id=run_id)  # ends (FINISHED) on exit: call on a stage run at its end


def log_model(run_id: str, model_dir: str | Path, flavors: Iterable[str] = ("transformers", "pytorch")) -> dict[str, str]:
    """Log a Hugging Face model directory in the given flavors; returns ``{flavor: model_uri}``. The run
    is finished afterwards (MLflow's log_model needs it active)."""
    import mlflow
    import torch

    import moe_core  # noqa: F401  (registers model_type "moe_lab" with the Auto classes)
    from moe_core import MoEForCausalLM

    model = MoEForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    uris: dict[str, str] = {}
    with _in_run(run_id):
        if "transformers" in flavors and (Path(model_dir) / "tokenizer_config.json").is_file():
            from moe_core.data.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(model_dir)
            info = mlflow.transformers.log_model({"model": model, "tokenizer": tokenizer}, name="transformers",
                                                 task="text-generation", pip_requirements=PIP_REQUIREMENTS)
            uris["transformers"] = info.model_uri
        if "pytorch" in flavors:
            info = mlflow.pytorch.log_model(model, name="pytorch", serialization_format="pickle",
                                            pip_requirements=PIP_REQUIREMENTS)
            uris["pytorch"] = info.model_uri
    return uris


def log_onnx_model(run_id: str, onnx_file: str | Path) -> str:
    import mlflow.onnx
    import onnx

    with _in_run(run_id):
        info = mlflow.onnx.log_model(onnx.load(str(onnx_file)), name="onnx", pip_requirements=["onnx", "onnxruntime"])
    return info.model_uri


# ------------------------------------------------------------------------------------------------ registry
def register(model_uri: str, name: str, tags: Mapping[str, Any] | None = None) -> str:
    """A new version of registered model `name`; returns the version number."""
    import mlflow

    version = mlflow.register_model(model_uri, name, tags={k: str(v) for k, v in (tags or {}).items()})
    return str(version.version)


def set_alias(name: str, alias: str, version: str) -> None:
    client().set_registered_model_alias(name, alias, str(version))


def alias_version(name: str, alias: str):
    """The ModelVersion holding `alias`, or None (no such model or alias yet)."""
    from mlflow.exceptions import MlflowException

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


def list_runs(uri: str | None = None, max_results: int = 200) -> list[dict]:
    """Read-only: the experiment's runs, newest first, as small dicts of ids, status and latest metrics
    (for the dashboard). ``uri`` is a tracking URI; default the configured one."""
    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri=uri) if uri else client()
    found = c.get_experiment_by_name(settings.experiment_name())
    if found is None:
        return []
    runs = c.search_runs([found.experiment_id], max_results=max_results, order_by=["attribute.start_time DESC"])
    return [{"run_id": r.info.run_id, "name": r.info.run_name, "status": r.info.status,
             "start_time": r.info.start_time, "metrics": _finite(r.data.metrics),
             "parent": r.data.tags.get("mlflow.parentRunId")} for r in runs]


# ------------------------------------------------------------------------------------------------ telemetry
class MlflowSink:
    """A `moe_core.train.telemetry.MetricsSink` that forwards to an MLflow run from a background thread.

    If MLflow fails (unreachable server, ...) the sink goes offline for the rest of the run: it writes
    ``offline_from_step`` into ``<run_dir>/mlflow_run.json``, and ``moe-lab sync`` uploads the events from
    that step on. Training never waits on MLflow; `close` waits at most ``close_timeout`` seconds."""

    def __init__(self, run_id: str, run_dir: str | Path, mlflow_client=None, close_timeout: float = 30.0) -> None:
        self.run_id, self.run_dir = run_id, Path(run_dir)
        self.offline_from_step: int | None = None
        self.error: str | None = None
        self._client = mlflow_client
        self._close_timeout = close_timeout
        self._queue: queue.Queue = queue.Queue()
        write_run_file(self.run_dir, run_id)
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
                log_metrics(self.run_id, metrics, step, ts, mlflow_client=self._client)
            except Exception as err:  # noqa: BLE001 - any failure: keep training, events stay in the JSONL
                self.offline_from_step = step
                self.error = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
                write_run_file(self.run_dir, self.run_id, offline_from_step=step, error=self.error)

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
        self.offset = self.events.stat().st_size if self.events.is_file() else 0  # earlier attempts: already sent
        self.offline_from_step: int | None = None
        write_run_file(self.run_dir, run_id)

    def poll(self) -> None:
        if self.offline_from_step is not None or not self.events.is_file():
            return
        with self.events.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        for line in chunk[:chunk.rfind(b"\n") + 1].splitlines(keepends=True):
            row = json.loads(line) if line.strip() else None
            if row is not None:
                try:
                    log_metrics(self.run_id, {k: v for k, v in row.items() if k not in ("step", "time")},
                                row.get("step"), int(row.get("time", time.time()) * 1000))
                except Exception as err:  # noqa: BLE001 - MLflow down: training goes on
                    self.offline_from_step = int(row.get("step", 0))
                    write_run_file(self.run_dir, self.run_id, offline_from_step=self.offline_from_step,
                                   error=f"{type(err).__name__}")
                    return
            self.offset += len(line)


def sync_events(run_dir: str | Path, run_id: str | None = None, everything: bool = False) -> tuple[str, int]:
    """`moe-lab sync`: upload a run directory's ``metrics.jsonl`` to MLflow, from the step where its sink
    went offline (or all of it with ``everything``, or when no run was ever recorded). Returns
    (run id, events uploaded)."""
    run_dir = Path(run_dir)
    events = run_dir / "metrics.jsonl"
    if not events.is_file():
        raise FileNotFoundError(f"{events} not found; pass a training output directory (it holds metrics.jsonl)")
    info = json.loads((run_dir / RUN_FILE).read_text()) if (run_dir / RUN_FILE).is_file() else {}
    run_id = run_id or info.get("run_id")
    if run_id is None:
        run_id = start_run(f"sync:{run_dir.name}", tags={"moe_lab.synced_from": str(run_dir.resolve())})
        everything = True
    start = 0 if everything else int(info.get("offline_from_step") or 0)
    uploaded = 0
    for line in events.read_text().splitlines():
        if line.strip() and (row := json.loads(line)).get("step", 0) >= start:
            log_metrics(run_id, {k: v for k, v in row.items() if k not in ("step", "time")}, row.get("step"),
                        int(row.get("time", time.time()) * 1000))
            uploaded += 1
    write_run_file(run_dir, run_id, synced_at=time.time())
    return run_id, uploaded
